"""The master's questions (replay.protocol.ask): an Asker keeps one connection per server between
questions, and a kept connection the server closed while idle is asked again on a fresh one."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from replay.protocol.ask import Asker, Unanswered


class OneAnswerPerConnection(BaseHTTPRequestHandler):
    """HTTP/1.1 without `Connection: close`, yet the connection is closed after one answer: a
    server whose idle timeout ended the connection the client kept."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        asked = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.connections.add(self.client_address)  # type: ignore[attr-defined]
        answer = json.dumps({"echo": asked["n"]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)
        self.close_connection = True

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def closing_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), OneAnswerPerConnection)
    server.connections = set()  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_a_kept_connection_the_server_closed_is_asked_again_on_a_fresh_one(closing_server):
    url = f"http://127.0.0.1:{closing_server.server_address[1]}/tokenize"
    with Asker() as asker:
        answers = [asker.ask_json(url, {"n": n}) for n in range(3)]
    assert answers == [(200, {"echo": n}) for n in range(3)]
    assert len(closing_server.connections) == 3  # each question after the first found its kept one closed


def test_a_server_that_is_gone_is_unanswered(closing_server):
    url = f"http://127.0.0.1:{closing_server.server_address[1]}/tokenize"
    with Asker() as asker:
        assert asker.ask_json(url, {"n": 0}) == (200, {"echo": 0})
        closing_server.shutdown()
        closing_server.server_close()
        with pytest.raises(Unanswered, match="connection refused"):
            asker.ask_json(url, {"n": 1})

"""The client's stream body reader against a server that writes exact bytes, piece by piece.

The reader keeps each read's bytes and time and feeds the HTTP parser in bounded batches and when
the body may be over; these answers put the pieces where that could go wrong: a chunked body split at every
byte, an end that is a read of its own, trailers, a Content-Length body, a cut mid-chunk.
"""

from __future__ import annotations

import socket

import gevent
import orjson
import pytest
from gevent.server import StreamServer
from geventhttpclient.response import HTTPResponse

from replay.protocol.client import FEED_BATCH, Endpoint, send
from replay.protocol.table import get_api

API = get_api("openai-chat")
GAP_S = 0.02  # between the pieces of an answer: each arrives as a read of its own


def event(content: str | None = None, usage: dict | None = None) -> bytes:
    obj: dict = {"choices": [{"delta": {"content": content}}] if content is not None else []}
    if usage is not None:
        obj["usage"] = usage
    return b"data: " + orjson.dumps(obj) + b"\n\n"


TOKENS = ["a", "b", "c"]
EVENTS = [*(event(t) for t in TOKENS), event(usage={"prompt_tokens": 4, "completion_tokens": 3}),
          b"data: [DONE]\n\n"]
CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def chunked(events: list[bytes], trailers: bytes = b"") -> list[bytes]:
    """The answer's pieces: the head, each event's chunk, the last chunk (a piece of its own)."""
    return [CHUNKED_HEAD, *(chunk(e) for e in events), b"0\r\n" + trailers + b"\r\n"]


class Scripted:
    """A real HTTP/1.1 server on a real socket that answers each request on a connection with the
    next script: a list of byte pieces, written GAP_S apart (None: close the connection there)."""

    def __init__(self, scripts: list[list[bytes | None]]):
        self.scripts = list(scripts)
        self.connections = 0
        self.server = StreamServer(("127.0.0.1", 0), self._serve)
        self.server.start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def _serve(self, sock, _address) -> None:
        self.connections += 1
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = sock.makefile("rb")
        while self.scripts:
            length = 0
            while (line := reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            if not line:
                return
            reader.read(length)
            for piece in self.scripts.pop(0):
                if piece is None:
                    sock.close()
                    return
                sock.sendall(piece)
                gevent.sleep(GAP_S)

    def close(self) -> None:
        self.server.stop()


@pytest.fixture
def scripted():
    servers: list[Scripted] = []

    def start(*scripts: list[bytes | None]) -> Scripted:
        servers.append(Scripted(list(scripts)))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def ask(endpoint: Endpoint):
    return send(endpoint, API, b"{}", True, {"Content-Type": "application/json"})


def assert_whole(outcome) -> None:
    assert outcome.ok, outcome.error
    assert outcome.events_tokens == 3 and outcome.output_tokens == 3 and outcome.prompt_tokens == 4
    assert len(outcome.token_times) == 3


def timed_apart(outcome) -> bool:
    """The tokens' times are their own reads', not one time at the body's end: the pieces came
    GAP_S apart (a busy host may join some reads, not all of them)."""
    return any(gap > GAP_S * 1000 * 0.5 for gap in outcome.itl_ms)


def test_events_are_timed_by_their_own_reads_and_the_connection_is_kept(scripted):
    server = scripted(chunked(EVENTS), chunked(EVENTS))
    endpoint = Endpoint(server.url)
    for _ in range(2):  # the second answer comes on the same connection: the first ended cleanly
        outcome = ask(endpoint)
        assert_whole(outcome)
        assert timed_apart(outcome), outcome.itl_ms
    assert server.connections == 1 and endpoint.in_flight == 0 and endpoint.idle() == 1


def test_a_chunked_body_split_at_every_byte(scripted):
    whole = b"".join(chunked(EVENTS)[1:])
    server = scripted([CHUNKED_HEAD, *(whole[i:i + 1] for i in range(len(whole)))], chunked(EVENTS))
    endpoint = Endpoint(server.url)
    outcome = ask(endpoint)
    assert_whole(outcome)
    assert_whole(ask(endpoint))
    assert server.connections == 1


def test_the_end_in_the_same_read_as_the_last_event_and_with_trailers(scripted):
    together = [CHUNKED_HEAD, *(chunk(e) for e in EVENTS[:-1]), chunk(EVENTS[-1]) + b"0\r\n\r\n"]
    server = scripted(together, chunked(EVENTS, trailers=b"X-Trailer: 1\r\n"), chunked(EVENTS))
    endpoint = Endpoint(server.url)
    for _ in range(3):
        assert_whole(ask(endpoint))
    assert server.connections == 1


def test_an_event_whose_lines_end_in_crlf(scripted):
    crlf = [e.replace(b"\n", b"\r\n") for e in EVENTS]
    server = scripted(chunked(crlf))
    assert_whole(ask(Endpoint(server.url)))


def test_a_content_length_body_read_in_pieces(scripted):
    body = b"".join(EVENTS)
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n" % len(body)
    pieces = [head, *EVENTS]
    server = scripted(pieces, pieces)
    endpoint = Endpoint(server.url)
    for _ in range(2):
        outcome = ask(endpoint)
        assert_whole(outcome)
        assert timed_apart(outcome), outcome.itl_ms
    assert server.connections == 1


def test_a_connection_cut_mid_chunk_keeps_what_came_before(scripted):
    pieces = chunked(EVENTS)
    server = scripted([*pieces[:3], pieces[3][:10], None])
    endpoint = Endpoint(server.url)
    outcome = ask(endpoint)
    assert not outcome.ok and outcome.error == "connection closed before the end of the response"
    assert outcome.events_tokens == 2 and len(outcome.token_times) == 2
    assert endpoint.in_flight == 0 and endpoint.idle() == 0


def test_an_http_error_body(scripted):
    text = b'{"error": {"message": "no such model"}}'
    server = scripted([b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n" % len(text), text], chunked(EVENTS))
    endpoint = Endpoint(server.url)
    outcome = ask(endpoint)
    assert outcome.status == 404 and outcome.error == f"HTTP 404: {text.decode()}"
    assert_whole(ask(endpoint))


def test_the_parser_is_fed_in_bounded_batches_not_at_every_read(scripted, monkeypatch):
    """Per streamed token the reader does a recv and notes its time; the parser is fed the reads
    once FEED_BATCH of them wait, or the body looks over (here: at its last chunk), each read
    still on its own: never at every read, and never a whole stream's reads at once."""
    fed: list[bytes] = []
    feed = HTTPResponse.feed
    monkeypatch.setattr(HTTPResponse, "feed", lambda self, data: (fed.append(data), feed(self, data))[1])
    events = [event(str(i)) for i in range(20)] + EVENTS[-2:]
    server = scripted(chunked(events))
    endpoint = Endpoint(server.url)
    fed_at_reads: list[int] = []
    endpoint.on_read = lambda now: fed_at_reads.append(len(fed))
    outcome = ask(endpoint)
    assert outcome.ok and outcome.events_tokens == 20, outcome.error
    # the hook hears of each read before it is fed (a send due goes out first): at the k-th,
    # at most FEED_BATCH reads wait unfed (the head's is fed first), and some reads find none fed since the last
    assert all(k - (f - 1) <= FEED_BATCH for k, f in enumerate(fed_at_reads, 1)), fed_at_reads
    assert len(fed_at_reads) >= 2 and any(a == b for a, b in zip(fed_at_reads, fed_at_reads[1:])), fed_at_reads
    # each read fed once, as it came
    assert len(fed) == 1 + len(fed_at_reads) and b"".join(fed).endswith(b"".join(chunked(events)[1:])), fed


def test_a_body_that_ends_with_the_connection(scripted):
    """An answer with neither a Content-Length nor chunked framing (an HTTP/1.0-style server, some
    proxies) is over when the server closes the connection (RFC 9112, 6.3): a whole answer, not a
    cut one; the connection is not kept."""
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
    server = scripted([head, *EVENTS, None], [head, *EVENTS, None])
    endpoint = Endpoint(server.url)
    for _ in range(2):
        outcome = ask(endpoint)
        assert_whole(outcome)
        assert timed_apart(outcome), outcome.itl_ms
    assert server.connections == 2 and endpoint.in_flight == 0 and endpoint.idle() == 0


def test_a_body_that_ends_with_the_connection_cut_mid_event(scripted):
    """Such a body cut in the middle of an event: what came before counts, the half event is the
    stream's error."""
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
    server = scripted([head, *EVENTS[:2], EVENTS[2][:9], None])
    outcome = ask(Endpoint(server.url))
    assert not outcome.ok and outcome.events_tokens == 2, outcome


def test_an_unstreamed_answer_that_ends_with_the_connection(scripted):
    body = orjson.dumps({"choices": [{"message": {"content": "a b c"}}],
                         "usage": {"prompt_tokens": 4, "completion_tokens": 3}})
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n"
    server = scripted([head, body[:10], body[10:], None])
    outcome = send(Endpoint(server.url), API, b"{}", False, {"Content-Type": "application/json"})
    assert outcome.ok and outcome.output_tokens == 3 and outcome.prompt_tokens == 4, outcome

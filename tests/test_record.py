"""`replay record` over real sockets: a real proxy process in front of a real `replay sim`, real
HTTP clients and real replays through it (docs/record.md)."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
from test_disk_full import PAGE, fill, small_disk  # noqa: F401 (small_disk: its fixture, a real full disk)

from replay.results.compare import load_run
from replay.results.recorded_pair import recorded_pairs
from replay.results.records import read_records
from replay.sim.process import sim_process
from replay.synth.prompts import set_up
from replay.synth.tokenizer import ServerTokenizer
from replay.trace.reader import read_trace
from support.processes import replay_args, run_locust
from support.record import RecordProcess
from support.streams import first_token_lateness_ms
from support.traces import (
    BLOCK,
    bailian_trace,
    expected_shared,
    leading_common,
    mooncake_slice,
    mooncake_trace,
    write_jsonl,
)
from support.waiting import wait_for

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
SECRET = "Bearer sk-do-not-write-me"


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def chat(url: str, messages: list, **extra) -> requests.Response:
    return requests.post(url + CHAT, json={"model": "sim", "messages": messages, "max_tokens": 6, **extra},
                         headers={"Authorization": SECRET}, timeout=30)


def without_ids(answer: dict) -> dict:
    return {k: v for k, v in answer.items() if k not in ("id", "created")}


def test_answers_pass_unchanged_and_the_trace_holds_counts_not_text(sim, tmp_path):
    out = tmp_path / "trace.jsonl"
    words = "unmistakable marmalade sentence"
    with RecordProcess(sim.url, out) as proxy:
        direct = chat(sim.url, [{"role": "user", "content": words}], ignore_eos=True)
        proxied = chat(proxy.url, [{"role": "user", "content": words}], ignore_eos=True)
        assert proxied.status_code == direct.status_code == 200
        assert without_ids(proxied.json())["usage"]["prompt_tokens"] == direct.json()["usage"]["prompt_tokens"]
        assert without_ids(proxied.json())["choices"][0]["message"].keys() == direct.json()["choices"][0]["message"].keys()
        streamed = requests.post(proxy.url + CHAT, json={"model": "sim", "messages": [{"role": "user", "content": words}],
                                 "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True},
                                 "ignore_eos": True}, stream=True, timeout=30)
        events = [line for line in streamed.iter_lines() if line.startswith(b"data:")]
        assert events[-1] == b"data: [DONE]" and len(events) == 1 + 5 + 1 + 1  # role, 5 tokens, usage, DONE
        missing = requests.post(proxy.url + CHAT, json={"model": "nope", "messages": [{"role": "user", "content": "x"}]},
                                timeout=30)
        assert missing.status_code == 404  # the server's status, as it sent it
        completion = requests.post(proxy.url + COMPLETIONS, json={"model": "sim", "prompt": words, "max_tokens": 3},
                                   timeout=30)
        assert completion.status_code == 200
        assert requests.get(proxy.url + "/v1/models", timeout=30).json()["data"][0]["id"] == "sim"  # not recorded
    trace = rows(out)
    assert [r["status"] for r in trace] == [200, 200, 404, 200]
    first = trace[0]
    assert first["input_length"] == direct.json()["usage"]["prompt_tokens"]
    assert first["output_length"] == 6 and first["max_tokens"] == 6 and first["ignore_eos"] is True
    assert len(first["hash_ids"]) == -(-first["input_length"] // BLOCK) and first["block_size"] == BLOCK
    assert trace[1]["hash_ids"] == first["hash_ids"]  # the same prompt: the same ids
    assert trace[1]["stream"] is True and trace[1]["output_length"] == 5
    assert trace[3]["api"] == "openai-completions" and trace[3]["output_length"] == 3
    assert "error" in trace[2]
    written = out.read_text() + Path(f"{out}.meta.json").read_text() + proxy.errors()
    for secret in ("marmalade", "sk-do-not-write-me", "kogivu"):
        assert secret not in written
    meta = json.loads(Path(f"{out}.meta.json").read_text())
    assert meta["complete"] is True and meta["rows"] == 4 and meta["block_size"] == BLOCK
    assert meta["tokens"] == "server /tokenize" and meta["salt"] == "random, never written"
    check = subprocess.run([sys.executable, "-m", "replay", "trace", "validate", str(out)], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_chat_that_sends_its_answer_back_is_the_next_turn(sim, tmp_path):
    out = tmp_path / "trace.jsonl"
    with RecordProcess(sim.url, out) as proxy:
        first = [{"role": "user", "content": "tell me about blocks"}]
        answer = chat(proxy.url, first).json()["choices"][0]["message"]
        other = chat(proxy.url, [{"role": "user", "content": "something else"}])
        assert other.status_code == 200
        time.sleep(0.05)
        second = [*first, {"role": "assistant", "content": answer["content"]}, {"role": "user", "content": "more"}]
        chat(proxy.url, second)
        chat(proxy.url, [*first, {"role": "assistant", "content": "not what it said"}, {"role": "user", "content": "x"}])
    trace = rows(out)
    assert [(r["session_id"], r["turn"]) for r in trace] == [(0, 0), (1, 0), (0, 1), (2, 0)]
    assert trace[2]["gap_ms"] >= 50
    assert trace[2]["hash_ids"][0] == trace[0]["hash_ids"][0]


def test_a_salt_file_gives_two_recordings_the_same_ids(sim, tmp_path):
    salt = tmp_path / "salt"
    salt.write_bytes(b"0123456789abcdef0123456789abcdef")
    traces = []
    for name, args in (("a", ["--salt-file", str(salt)]), ("b", ["--salt-file", str(salt)]), ("c", [])):
        out = tmp_path / f"{name}.jsonl"
        with RecordProcess(sim.url, out, *args) as proxy:
            chat(proxy.url, [{"role": "user", "content": "hello"}])
            chat(proxy.url, [{"role": "user", "content": "hello again"}])
        traces.append([r["hash_ids"] for r in rows(out)])
    assert traces[0] == traces[1]
    assert traces[0] == traces[2]  # renumbered in order of first use: the same shape, salt or not
    assert traces[0][0][0] == 0


# -- faults -------------------------------------------------------------------------------------


def test_an_upstream_that_is_down_gets_a_502_and_a_marked_row(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    out = tmp_path / "trace.jsonl"
    with RecordProcess(dead, out, "--block-size", "16") as proxy:
        answer = chat(proxy.url, [{"role": "user", "content": "anyone?"}])
        assert answer.status_code == 502
        assert "connection refused" in answer.json()["error"]["message"]
    (row,) = rows(out)
    assert row["status"] == 502 and "the upstream did not answer: connection refused" in row["error"]


def test_malformed_json_is_forwarded_and_marked(sim, tmp_path):
    out = tmp_path / "trace.jsonl"
    with RecordProcess(sim.url, out) as proxy:
        answer = requests.post(proxy.url + CHAT, data=b'{"model": "sim", "messages": [', timeout=30,
                               headers={"Content-Type": "application/json"})
        assert answer.status_code == 400  # the server's own refusal, passed back
        assert "not valid JSON" in answer.json()["error"]["message"]
    (row,) = rows(out)
    assert row["status"] == 400 and row["error"].startswith("malformed JSON request")


def test_a_client_that_leaves_mid_stream_is_a_marked_row(toy_tokenizer_dir, tmp_path):
    out = tmp_path / "trace.jsonl"
    with sim_process(toy_tokenizer_dir, "--block-size", "16", "--ttft-ms", "5", "--itl-ms", "50") as slow, \
            RecordProcess(slow.url, out) as proxy:
        answer = requests.post(proxy.url + CHAT, json={"model": "sim", "messages": [{"role": "user", "content": "go"}],
                               "max_tokens": 200, "ignore_eos": True, "stream": True}, stream=True, timeout=30)
        lines = answer.iter_lines()
        next(line for line in lines if b"content" in line)
        answer.raw._fp.fp.raw._sock.shutdown(socket.SHUT_RDWR)  # the client is gone mid-answer
        answer.close()
        answered = chat(proxy.url, [{"role": "user", "content": "still there?"}])
        assert answered.status_code == 200  # forwarding goes on
    first, second = rows(out)
    assert first["error"] == "client disconnected before the end of the answer"
    assert first["output_length"] < 200
    assert "error" not in second


def test_sigterm_lets_requests_in_flight_finish_and_closes_the_trace(toy_tokenizer_dir, tmp_path):
    out = tmp_path / "trace.jsonl"
    with sim_process(toy_tokenizer_dir, "--block-size", "16", "--ttft-ms", "5", "--itl-ms", "20") as slow:
        proxy = RecordProcess(slow.url, out)
        answer = requests.post(proxy.url + CHAT, json={"model": "sim", "messages": [{"role": "user", "content": "go"}],
                               "max_tokens": 40, "ignore_eos": True, "stream": True}, stream=True, timeout=30)
        lines = answer.iter_lines()
        next(line for line in lines if b"content" in line)
        proxy.proc.send_signal(15)
        rest = [line for line in lines if line]
        assert rest[-1] == b"data: [DONE]"  # the answer in flight went on to its end
        assert proxy.stop() == 0
    (row,) = rows(out)
    assert row["output_length"] == 40 and "error" not in row
    assert json.loads(Path(f"{out}.meta.json").read_text())["complete"] is True


# -- the round trip -----------------------------------------------------------------------------


def paired(out: Path, rows_in_t: int) -> list[int]:
    """Which T row each T' row is (`--id-header X-Request-Id`: the replay's <run id>-<request id>):
    rows T sends at the same instant may reach the proxy either way round."""
    order = [int(json.loads(line)["client_request_id"].rsplit("-", 1)[1]) for line in out.read_text().splitlines()]
    assert sorted(order) == list(range(rows_in_t))
    return order


@pytest.mark.alone  # arrival gaps are held to the replay's drift: a starved proxy stamps arrivals late
@pytest.mark.parametrize("kind", ["bailian", "mooncake", "shared"])
def test_a_trace_replayed_through_the_proxy_is_recorded_as_itself(kind, sim, toy_tokenizer_dir, tmp_path):
    """Bailian: sessions; mooncake: two families of shared prefixes; shared: the first 40 rows
    of ../shared's Mooncake trace (rescaled to the sim's blocks, rows at the same instant)."""
    if kind == "bailian":
        trace = bailian_trace(tmp_path / "t.jsonl", sessions=4, turns=3, gap_s=0.1)
    elif kind == "mooncake":
        trace = mooncake_trace(tmp_path / "t.jsonl", rows=16, gap_ms=60)
    else:  # completions: some rows are shorter than any chat prompt the template allows
        trace = mooncake_slice(tmp_path, 40, BLOCK, time_scale=9, max_output=8)
    api = "openai-completions" if kind == "shared" else "openai-chat"
    out = tmp_path / "recorded.jsonl"
    with RecordProcess(sim.url, out, "--session-header", "X-Session-Id", "--id-header", "X-Request-Id") as proxy:
        run_locust(replay_args(trace, toy_tokenizer_dir, proxy.url, tmp_path / "run.jsonl",
                               "--session-header", "X-Session-Id", "--api", api), tmp_path)
    original = read_trace(trace, block_size=BLOCK).rows
    recorded = read_trace(out).rows  # no option: its format, block size and sessions are its own
    order = paired(out, len(original))
    of = {t: recorded[k] for k, t in enumerate(order)}  # T row -> its T' row
    assert [of[i].input_length for i in range(len(original))] == [r.input_length for r in original]
    assert [of[i].output_length for i in range(len(original))] == [r.output_length for r in original]
    drift = max(abs(r["drift_ms"]) for r in read_records(tmp_path / "run.jsonl")) / 1000.0
    for i, o in enumerate(original):  # arrival gaps within the replay's own drift (of both rows), and a hop
        assert abs((of[i].timestamp_s - recorded[0].timestamp_s) - (o.timestamp_s - original[order[0]].timestamp_s)) \
            <= 2 * drift + 0.02
    if kind == "bailian":
        sessions = {(o.session_id, of[i].session_id) for i, o in enumerate(original)}
        assert len(sessions) == len({o.session_id for o in original}) == len({r.session_id for r in recorded})
        turns = {t: json.loads(line)["turn"] for t, line in zip(order, out.read_text().splitlines())}
        assert [turns[i] for i in range(len(original))] == [o.turn - 1 for o in original]
    measured, _ = set_up(ServerTokenizer.load(toy_tokenizer_dir), api)
    before, overhead = len(measured.frame.before), measured.frame.overhead
    for i, ti in enumerate(original):
        for j, tj in enumerate(original[:i]):
            assert leading_common(of[i].hash_ids, of[j].hash_ids) == expected_shared(ti, tj, before, overhead), (i, j)
    stats = subprocess.run([sys.executable, "-m", "replay", "trace", "stats", str(out)], capture_output=True,
                           text=True, timeout=60)
    assert stats.returncode == 0, stats.stderr


def recorder_pid(proxy: RecordProcess) -> int:
    children = Path(f"/proc/{proxy.proc.pid}/task/{proxy.proc.pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


def test_forwarding_never_waits_for_the_recorder(sim, tmp_path):
    """The recorder stopped dead (SIGSTOP) while the pipe to it fills: every request is still
    answered, and the rows all come once it goes on."""
    out = tmp_path / "trace.jsonl"
    with RecordProcess(sim.url, out) as proxy:
        recorder = recorder_pid(proxy)
        os.kill(recorder, signal.SIGSTOP)
        try:
            long_words = "word " * 3000  # 15 kB a request: the pipe's 64 KiB are full after 5
            statuses = [chat(proxy.url, [{"role": "user", "content": f"{i} {long_words}"}]).status_code
                        for i in range(20)]
            assert statuses == [200] * 20
        finally:
            os.kill(recorder, signal.SIGCONT)
    assert len(rows(out)) == 20


def test_a_body_over_the_limit_is_forwarded_and_its_row_marked(sim, tmp_path):
    out = tmp_path / "trace.jsonl"
    with RecordProcess(sim.url, out, "--max-record-bytes", "2000") as proxy:
        assert chat(proxy.url, [{"role": "user", "content": "word " * 1000}]).status_code == 200
        assert chat(proxy.url, [{"role": "user", "content": "short"}]).status_code == 200
    big, small = rows(out)
    assert big["error"] == "request over 2000 bytes: forwarded, not counted" and "hash_ids" not in big
    assert "error" not in small and small["hash_ids"]


@pytest.mark.parametrize("on_write_error", ["continue", "stop"])
def test_a_full_disk_cuts_the_trace_at_a_whole_line(on_write_error, sim, small_disk, tmp_path):  # noqa: F811
    disk = small_disk(64)
    out = disk / "trace.jsonl"
    proxy = RecordProcess(sim.url, out, "--on-write-error", on_write_error, log=tmp_path / "proxy.log")
    try:
        wait_for(lambda: Path(f"{out}.meta.json").exists(), "the recorder's start")
        fill(disk, leave=PAGE)
        statuses = []
        for i in range(60):
            try:
                statuses.append(chat(proxy.url, [{"role": "user", "content": f"request {i}"}]).status_code)
            except requests.ConnectionError:
                break
        wait_for(lambda: "the trace is cut after line" in proxy.errors(), "the proxy saying the trace is cut")
        if on_write_error == "continue":
            assert statuses == [200] * 60  # forwarding went on
            assert "forwarding goes on, unrecorded" in proxy.errors()
        else:
            assert proxy.proc.wait(30) == 1
            assert 0 < len(statuses) < 60 and set(statuses) == {200}
            assert "forwarding stops" in proxy.errors()
    finally:
        code = proxy.stop()
    assert code == 1
    text = out.read_bytes()
    assert text.endswith(b"\n")
    kept = [json.loads(line) for line in text.splitlines()]  # every line whole
    assert 0 < len(kept) < 60


def test_an_upstream_too_slow_gets_a_504_and_a_marked_row(toy_tokenizer_dir, tmp_path):
    out = tmp_path / "trace.jsonl"
    with sim_process(toy_tokenizer_dir, "--block-size", "16", "--ttft-ms", "3000") as slow, \
            RecordProcess(slow.url, out, "--upstream-timeout", "0.5") as proxy:
        answer = chat(proxy.url, [{"role": "user", "content": "hurry"}])
        assert answer.status_code == 504 and "timed out" in answer.json()["error"]["message"]
    (row,) = rows(out)
    assert row["status"] == 504 and row["error"].startswith("the upstream did not answer: timed out")


class NaglingUpstream:
    """A streaming server as a plain socket server is by default (Nagle on, no TCP_NODELAY): each
    answer's head at once, its first event `ttft_s` later, then the end. Its first event leaves
    only once the head is acknowledged, so a receiver that delays its ACKs delays the event."""

    def __init__(self, ttft_s: float):
        self.ttft_s = ttft_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # the recorder's /tokenize calls too, cut when the proxy stops
            self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        data = b""
        while True:
            while b"\r\n\r\n" not in data:
                more = conn.recv(65536)
                if not more:
                    return
                data += more
            head, data = data.split(b"\r\n\r\n", 1)
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length"))
            while len(data) < length:
                data += conn.recv(65536)
            data = data[length:]
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            time.sleep(self.ttft_s)
            for event in (b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n', b"data: [DONE]\n\n"):
                conn.sendall(b"%x\r\n%b\r\n" % (len(event), event))
            conn.sendall(b"0\r\n\r\n")

    def close(self) -> None:
        self.listener.close()


class ClosingUpstream(NaglingUpstream):
    """A streaming server of the HTTP/1.0 kind: its answer has neither a length nor chunks, and
    ends when it closes the connection (RFC 9112, 6.3); it has no /tokenize. `cut`: it closes in
    the middle of its second event."""

    def __init__(self, cut: bool = False):
        super().__init__(ttft_s=0.0)
        self.cut = cut

    def _answer(self, conn: socket.socket) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            more = conn.recv(65536)
            if not more:
                return
            data += more
        if not data.startswith(b"POST /v1/chat/completions "):  # the recorder's /tokenize: not here
            conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            return
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        for word in (b"a", b"b"):
            event = b'data: {"choices": [{"index": 0, "delta": {"content": "%s"}}]}\n\n' % word
            conn.sendall(event[:20] if self.cut and word == b"b" else event)
            time.sleep(0.01)
        if not self.cut:
            conn.sendall(b"data: [DONE]\n\n")


@pytest.mark.parametrize("cut", [False, True])
def test_an_answer_that_ends_with_the_upstream_s_close_is_whole(cut, toy_tokenizer_dir, tmp_path):
    """An upstream answer with neither a length nor chunks is over when the upstream closes: the
    client gets it whole, and its row has no error. Closed in the middle of an event, it is whole
    to HTTP, but its row says the stream ended mid-event, its count not trusted silently."""
    upstream = ClosingUpstream(cut)
    out = tmp_path / "t.jsonl"
    try:
        with RecordProcess(upstream.url, out, "--tokenizer", str(toy_tokenizer_dir)) as proxy:
            answer = requests.post(proxy.url + CHAT, json={"model": "m", "stream": True,
                                   "messages": [{"role": "user", "content": "go"}]}, timeout=30)
    finally:
        upstream.close()
    assert answer.status_code == 200
    (row,) = rows(out)
    if cut:
        assert answer.content.endswith(b'data: {"choices": [{') and row["output_length"] == 1, row
        assert row["error"] == 'the answer\'s stream ended mid-event: {"choices": [{', row
    else:
        assert answer.content.endswith(b"data: [DONE]\n\n") and "error" not in row, row
        assert row["output_length"] == 2, row


@pytest.mark.alone  # times the first event to a few ms
def test_the_proxy_acknowledges_at_once_so_an_upstream_s_nagle_adds_nothing(tmp_path):
    """Requests one after another on one kept-alive connection, through the proxy to a server
    that streams with Nagle on: each first event arrives its TTFT after the request, not held
    until the proxy's delayed ACK of the answer's head (up to 40 ms later)."""
    upstream = NaglingUpstream(ttft_s=0.02)
    try:
        with RecordProcess(upstream.url, tmp_path / "t.jsonl", "--block-size", "16") as proxy, \
                requests.Session() as session:
            late = first_token_lateness_ms(session, proxy.url + COMPLETIONS,
                                           {"model": "m", "prompt": "x", "stream": True}, 0.02)
    finally:
        upstream.close()
    assert late[len(late) // 2] < 8.0, [round(x, 1) for x in late]  # held for an ACK: every one 20-24 ms late


# -- replay trace anonymize ---------------------------------------------------------------------


def anonymize(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replay", "trace", "anonymize", *map(str, args)], capture_output=True,
                          text=True, timeout=120)


def test_anonymize_of_the_raw_log_gives_the_recorded_trace(sim, toy_tokenizer_dir, tmp_path):
    """The same round trip, through the proxy's raw log: the trace anonymize makes from it, with
    the recording's salt, is the recorded trace line for line."""
    salt = tmp_path / "salt"
    salt.write_bytes(b"k" * 32)
    trace = bailian_trace(tmp_path / "t.jsonl", sessions=3, turns=3, gap_s=0.1)
    out, raw = tmp_path / "recorded.jsonl", tmp_path / "raw.jsonl"
    with RecordProcess(sim.url, out, "--session-header", "X-Session-Id", "--salt-file", str(salt),
                       "--raw-log", str(raw)) as proxy:
        run_locust(replay_args(trace, toy_tokenizer_dir, proxy.url, tmp_path / "run.jsonl",
                               "--session-header", "X-Session-Id"), tmp_path)
    assert oct(raw.stat().st_mode & 0o777) == "0o600"
    again = tmp_path / "anonymized.jsonl"
    done = anonymize(raw, again, "--tokenizer", toy_tokenizer_dir, "--salt-file", salt, "--session-names")
    assert done.returncode == 0, done.stderr
    assert again.read_text() == out.read_text()
    assert json.loads(Path(f"{again}.meta.json").read_text())["tokens"] == "tokenizer"


def test_anonymize_of_a_raw_log_of_chats_that_send_their_answers_back_keeps_their_sessions(real_tokenizer_dir,
                                                                                          tmp_path):
    """Sessions by continuation, no header: chats (one streamed, one not) that send each answer
    back, through the proxy in front of a sim with a real tokenizer and template; anonymize of
    the raw log, without --session-names, is the recorded trace line for line."""
    salt = tmp_path / "salt"
    salt.write_bytes(b"s" * 32)
    out, raw = tmp_path / "recorded.jsonl", tmp_path / "raw.jsonl"
    with sim_process(real_tokenizer_dir, "--block-size", str(BLOCK), "--ttft-ms", "5", "--itl-ms", "1") as server, \
            RecordProcess(server.url, out, "--salt-file", str(salt), "--raw-log", str(raw)) as proxy:
        conversations = [[{"role": "system", "content": f"You are helper {s}."}] for s in range(2)]
        for turn in range(3):
            for s, messages in enumerate(conversations):
                messages.append({"role": "user", "content": f"question {turn} of session {s}: llamas? " * (turn + 1)})
                if s == 0:
                    text = chat(proxy.url, messages).json()["choices"][0]["message"]["content"]
                else:
                    answer = chat(proxy.url, messages, stream=True, stream_options={"include_usage": True})
                    chunks = [json.loads(line[6:]) for line in answer.text.splitlines()
                              if line.startswith("data: {")]
                    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
                messages.append({"role": "assistant", "content": text})
    assert [(r["session_id"], r["turn"]) for r in rows(out)] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    again = tmp_path / "anonymized.jsonl"
    done = anonymize(raw, again, "--tokenizer", real_tokenizer_dir, "--salt-file", salt)
    assert done.returncode == 0, done.stderr
    assert again.read_text() == out.read_text()


def test_anonymize_reads_litellm_logs_in_any_order(toy_tokenizer_dir, tmp_path):
    tok = ServerTokenizer.load(toy_tokenizer_dir)
    first = [{"role": "user", "content": "the first question"}]
    answer = {"role": "assistant", "content": "an answer"}
    second = [*first, answer, {"role": "user", "content": "and then"}]

    def payload(messages, start, end, status="success"):
        return {"id": "x", "call_type": "acompletion", "model": "m", "messages": messages, "startTime": start,
                "endTime": end, "status": status, "prompt_tokens": tok.count_chat(messages), "completion_tokens": 2,
                "model_parameters": {"max_tokens": 2}, "error_str": None if status == "success" else "boom",
                "response": {"choices": [{"index": 0, "message": answer}]}}

    log = tmp_path / "litellm.jsonl"
    lines = [payload(second, 100.5, 101.0), payload(first, 100.0, 100.2), payload(first, 100.1, 100.3, "failure")]
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))  # logged as they ended
    out = tmp_path / "trace.jsonl"
    done = anonymize(log, out, "--tokenizer", toy_tokenizer_dir)
    assert done.returncode == 0, done.stderr
    trace = rows(out)
    assert [r["timestamp"] for r in trace] == [0.0, 100.0, 500.0]
    assert [r["input_length"] for r in trace] == [tok.count_chat(first), tok.count_chat(first), tok.count_chat(second)]
    assert [(r["session_id"], r["turn"]) for r in trace] == [(0, 0), (1, 0), (0, 1)]
    assert trace[2]["gap_ms"] == 300.0 and trace[1]["error"] == "boom"
    assert trace[0]["hash_ids"] == trace[1]["hash_ids"] != trace[2]["hash_ids"]
    assert "question" not in out.read_text()
    check = subprocess.run([sys.executable, "-m", "replay", "trace", "validate", str(out)], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout


def test_anonymize_refuses_a_log_it_cannot_read_naming_the_line(toy_tokenizer_dir, tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text('{"startTime": 1, "messages": "hi"}\n{"startTime": "soon"}\n')
    done = anonymize(log, tmp_path / "out.jsonl", "--tokenizer", toy_tokenizer_dir)
    assert done.returncode == 2
    assert done.stderr.strip() == f"replay trace anonymize: {log}:2: field 'startTime': expected unix seconds, got 'soon'"
    done = anonymize(log, tmp_path / "out.jsonl")
    assert done.returncode == 2 and "--tokenizer or --tokenize-url" in done.stderr


def test_anonymize_of_an_openai_batch_gives_the_recorded_trace_but_its_times(sim, tmp_path):
    """The same requests through the proxy, and as a Batch API job's input and output files (the
    answers the sim gave them, wrapped as the Batch API returns them, out of order, and a failed
    request as its error file has it): the same rows but for the arrival times, which a batch has
    only as each completion's `created`."""
    first = [{"role": "user", "content": "the first question " * 3}]
    bodies = {"c1": {"model": "sim", "messages": first, "max_tokens": 5},
              "c3": {"model": "sim", "prompt": "complete this " * 4, "max_tokens": 3}}
    salt = tmp_path / "salt"
    salt.write_bytes(b"b" * 32)
    recorded = tmp_path / "recorded.jsonl"
    answers = {}
    with RecordProcess(sim.url, recorded, "--salt-file", str(salt)) as proxy:
        answers["c1"] = chat(proxy.url, first, max_tokens=5).json()
        bodies["c2"] = {"model": "sim", "max_tokens": 4,
                        "messages": [*first, answers["c1"]["choices"][0]["message"], {"role": "user", "content": "so?"}]}
        answers["c2"] = chat(proxy.url, bodies["c2"]["messages"], max_tokens=4).json()
        answers["c3"] = requests.post(proxy.url + COMPLETIONS, json=bodies["c3"], timeout=30).json()
    batch_input = tmp_path / "batch_input.jsonl"
    bodies["c4"] = {"model": "sim", "messages": first, "max_tokens": 2}  # c1 again, which failed
    batch_input.write_text("".join(json.dumps({"custom_id": k, "method": "POST", "url": CHAT if k != "c3" else
                                               COMPLETIONS, "body": bodies[k]}) + "\n" for k in ("c1", "c2", "c3", "c4")))
    created = {"c1": 1_700_000_000, "c2": 1_700_000_002, "c3": 1_700_000_007}
    output = tmp_path / "batch_output.jsonl"
    lines = [{"id": f"batch_req_{k}", "custom_id": k, "error": None,
              "response": {"status_code": 200, "request_id": f"r{k}", "body": {**answers[k], "created": created[k]}}}
             for k in ("c3", "c1", "c2")]  # a batch's output is in no particular order
    lines.append({"id": "batch_req_c4", "custom_id": "c4", "response": None,
                  "error": {"code": "batch_expired", "message": "This request could not be executed"}})
    output.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "anonymized.jsonl"
    done = anonymize(output, out, "--batch-input", batch_input, "--tokenize-url", sim.url, "--salt-file", salt)
    assert done.returncode == 0, done.stderr
    made, seen = rows(out), rows(recorded)
    # c4 (failed: no `created`) at the batch's first, after c1 there by the input file's order
    assert [r["timestamp"] for r in made] == [0.0, 0.0, 2000.0, 7000.0]
    assert made[1]["error"] == "batch_expired: This request could not be executed" and made[1]["status"] == 500
    assert made[1]["hash_ids"] == made[0]["hash_ids"] and made[2]["gap_ms"] == 2000.0
    assert [{k: v for k, v in r.items() if k not in ("timestamp", "gap_ms", "session_id")} for r in made[::2] + made[3:]] \
        == [{k: v for k, v in r.items() if k not in ("timestamp", "gap_ms", "session_id")} for r in seen]
    assert [(r["session_id"], r["turn"]) for r in made] == [(0, 0), (1, 0), (0, 1), (2, 0)]
    assert json.loads(Path(f"{out}.meta.json").read_text())["log_format"] == "openai-batch"
    assert "question" not in out.read_text()


def test_anonymize_of_an_openai_batch_refuses_what_it_cannot_join(sim, tmp_path):
    batch_input, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    batch_input.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
                           '{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n')
    output.write_text('{"custom_id": "b", "response": null, "error": {"code": "x", "message": "y"}}\n')
    for extra, message in (
        ([], "give the batch's input file as --batch-input"),
        (["--batch-input", batch_input], f"{batch_input}:2: field 'custom_id': 'a' repeats line 1"),
    ):
        done = anonymize(output, tmp_path / "t.jsonl", "--tokenize-url", sim.url, *extra)
        assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1, \
            done.stderr
    batch_input.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n')
    done = anonymize(output, tmp_path / "t.jsonl", "--tokenize-url", sim.url, "--batch-input", batch_input)
    assert done.returncode == 2
    assert done.stderr.strip() == f"replay trace anonymize: {output}:1: field 'custom_id': 'b' is not in {batch_input}"
    done = anonymize(batch_input, tmp_path / "t.jsonl", "--tokenize-url", sim.url, "--batch-input", batch_input)
    assert done.returncode == 2 and "a batch's INPUT file" in done.stderr
    raw = tmp_path / "raw.jsonl"
    raw.write_text('{"arrival": 1, "answer": {}}\n')
    done = anonymize(raw, tmp_path / "t.jsonl", "--tokenize-url", sim.url, "--batch-input", batch_input)
    assert done.returncode == 2 and "--batch-input is for --from openai-batch" in done.stderr


# -- refusals and the edges of forwarding -------------------------------------------------------


def record_refused(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replay", "record", *args], capture_output=True, text=True, timeout=60)


def test_bad_options_are_refused_in_one_line_before_listening(tmp_path):
    short = tmp_path / "salt"
    short.write_bytes(b"tiny")
    for args, message in (
        (["--upstream", "127.0.0.1:8000"], "--upstream 127.0.0.1:8000: not a server URL"),
        (["--upstream", "http://127.0.0.1:9", "--salt-file", str(short), "--block-size", "16"],
         f"--salt-file {short}: holds 4 bytes; give 16 to 64"),
        (["--upstream", "http://127.0.0.1:9", "--block-size", "0"], "error: argument --block-size: must be 1 to"),
        (["--upstream", "http://127.0.0.1:9", "--block-size", "16", "--output", str(tmp_path)],
         f"--output {tmp_path}: {tmp_path} is a folder, not a regular file"),
    ):
        argv = args if "--output" in args else [*args, "--output", str(tmp_path / "t.jsonl")]
        done = record_refused(*argv)
        assert done.returncode == 2, (args, done.stderr)
        assert done.stderr.startswith(f"replay record: {message}"), done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = record_refused("--upstream", "http://127.0.0.1:9", "--block-size", "16", "--output",
                              str(tmp_path / "t.jsonl"), "--port", str(taken.getsockname()[1]))
    assert done.returncode == 2 and "Address already in use" in done.stderr


def test_upstream_credentials_are_sent_and_never_shown(toy_tokenizer_dir, tmp_path):
    out = tmp_path / "trace.jsonl"
    basic = "Basic " + base64.b64encode(b"me:hunter2").decode()
    with sim_process(toy_tokenizer_dir, "--block-size", "16", "--require-authorization", basic) as locked:
        upstream = locked.url.replace("http://", "http://me:hunter2@")
        with RecordProcess(upstream, out) as proxy:
            assert chat(proxy.url, [{"role": "user", "content": "hi"}]).status_code == 401  # the client's own, passed on
            answer = requests.post(proxy.url + CHAT, json={"model": "sim", "messages": [{"role": "user", "content": "hi"}],
                                   "max_tokens": 2}, timeout=30)
            assert answer.status_code == 200  # the URL's credentials, for a request that has none
    meta = Path(f"{out}.meta.json").read_text()
    assert "hunter2" not in meta + out.read_text() + proxy.errors() and "***@" in meta


def test_a_chunked_request_body_is_forwarded_whole(sim, tmp_path):
    out = tmp_path / "trace.jsonl"
    body = json.dumps({"model": "sim", "messages": [{"role": "user", "content": "in pieces"}], "max_tokens": 2}).encode()
    with RecordProcess(sim.url, out) as proxy:
        answer = requests.post(proxy.url + CHAT, data=iter([body[:10], body[10:]]), timeout=30,
                               headers={"Content-Type": "application/json"})  # Transfer-Encoding: chunked
        assert answer.status_code == 200, answer.text
    (row,) = rows(out)
    assert row["input_length"] == answer.json()["usage"]["prompt_tokens"] and "error" not in row


def test_a_client_that_leaves_mid_request_is_a_marked_row_and_holds_up_no_other(sim, tmp_path):
    out = tmp_path / "trace.jsonl"
    with RecordProcess(sim.url, out) as proxy:
        host, port = proxy.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as half:
            half.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"model\": \"sim\"")
            time.sleep(0.2)  # the proxy has numbered it and waits for the rest of its body
        assert chat(proxy.url, [{"role": "user", "content": "after it"}]).status_code == 200
        wait_for(lambda: out.exists() and len(out.read_text().splitlines()) == 2, "both rows written while it runs")
    first, second = rows(out)
    assert first["error"].startswith("the client's request broke off") and "error" not in second


def test_a_completions_prompt_that_extends_an_earlier_one_and_its_answer_is_its_next_turn(sim, tmp_path):
    out = tmp_path / "trace.jsonl"
    with RecordProcess(sim.url, out) as proxy:
        def complete(prompt: str) -> str:
            answer = requests.post(proxy.url + COMPLETIONS, json={"model": "sim", "prompt": prompt, "max_tokens": 3},
                                   timeout=30)
            return answer.json()["choices"][0]["text"]

        first = "once upon a time"
        said = complete(first)
        complete("something else entirely")
        complete(first + said + " and then")
        complete(first + " and then")  # extends the prompt, not the prompt and its answer
    assert [(r["session_id"], r["turn"]) for r in rows(out)] == [(0, 0), (1, 0), (0, 1), (2, 0)]


def test_sessions_named_by_the_client_win_over_continuation(sim, tmp_path):
    out = tmp_path / "trace.jsonl"
    with RecordProcess(sim.url, out, "--session-user") as proxy:
        chat(proxy.url, [{"role": "user", "content": "a"}], user="alice")
        chat(proxy.url, [{"role": "user", "content": "b"}], user="bob")
        chat(proxy.url, [{"role": "user", "content": "c"}], user="alice")
        chat(proxy.url, [{"role": "user", "content": "d"}])  # no name: continuation's rule
    assert [(r["session_id"], r["turn"]) for r in rows(out)] == [(0, 0), (1, 0), (0, 1), (2, 0)]
    assert "alice" not in out.read_text()


def compare_runs(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replay", "compare", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def test_compare_pairs_a_replay_of_the_recorded_trace_with_the_run_it_was_recorded_from(sim, toy_tokenizer_dir,
                                                                                           tmp_path):
    """T's rows are out of time order in its file, so T' (in arrival order) has them in another
    order: row k of T' is not row k of T. `replay compare` pairs the replay of T' with the replay
    of T through the recording's client_request_id, with no option, and only then."""
    rows_in_t = 12
    lengths = [40 + 9 * i for i in range(rows_in_t)]
    times = [60.0 * ((5 * i) % rows_in_t) for i in range(rows_in_t)]  # a permutation of 0, 60, ... ms
    trace = write_jsonl(tmp_path / "t.jsonl", [{"timestamp": times[i], "input_length": lengths[i], "output_length": 3,
                                                "hash_ids": [1000 * i + k for k in range(-(-lengths[i] // BLOCK))]}
                                               for i in range(rows_in_t)])
    runs = {}
    for name, extra in (("paired", ["--id-header", "X-Request-Id"]), ("unnamed", [])):
        recorded = tmp_path / f"{name}.jsonl"
        with RecordProcess(sim.url, recorded, *extra) as proxy:
            run_locust(replay_args(trace, toy_tokenizer_dir, proxy.url, tmp_path / f"run-t-{name}.jsonl", "--api",
                                   "openai-completions"), tmp_path)
        run_locust(replay_args(recorded, toy_tokenizer_dir, sim.url, tmp_path / f"run-t2-{name}.jsonl", "--api",
                               "openai-completions"), tmp_path)
        runs[name] = (tmp_path / f"run-t-{name}.jsonl", tmp_path / f"run-t2-{name}.jsonl")
    assert [json.loads(line)["input_length"] for line in (tmp_path / "paired.jsonl").read_text().splitlines()] \
        == [lengths[i] for i in sorted(range(rows_in_t), key=times.__getitem__)]  # T' is in another order
    done = compare_runs(*runs["paired"], "--json", tmp_path / "compare.json")
    assert done.returncode == 0, done.stderr
    assert f"{rows_in_t} rows matched" in done.stdout and "paired through the recording: " in done.stdout
    assert "differs" not in done.stdout
    # each pair is one request: its prompt tokens (the server's count) agree
    base, new = load_run(str(runs["paired"][0])), load_run(str(runs["paired"][1]))
    assert list(recorded_pairs([base, new])) == [1]
    assert sorted(zip(new.ids, new.prompt)) == sorted(zip(base.ids, base.prompt))
    # without the replay's ids in T' nothing says which row is which: refused, as any two traces
    done = compare_runs(*runs["unnamed"])
    assert done.returncode == 2 and "trace fingerprint (sha256)" in done.stderr, done.stderr
    # T' at another pace than the recording's is another experiment
    run_locust(replay_args(tmp_path / "paired.jsonl", toy_tokenizer_dir, sim.url, tmp_path / "run-t2-fast.jsonl",
                           "--api", "openai-completions", "--scale", "2"), tmp_path)
    done = compare_runs(runs["paired"][0], tmp_path / "run-t2-fast.jsonl")
    assert done.returncode == 2 and "at --scale 2.0: only 1 replays the recorded run's pace" in done.stderr, \
        done.stderr


def test_a_recorded_trace_replayed_after_answer_keeps_the_recorded_think_time(sim, toy_tokenizer_dir, tmp_path):
    """T' replayed by a real `replay run --turn-timing after-answer`: each later turn is due its
    row's `gap_ms` after its previous turn's answer ended (the arrival gap also holds the answer)."""
    trace = bailian_trace(tmp_path / "t.jsonl", sessions=3, turns=3, gap_s=0.1)
    out = tmp_path / "recorded.jsonl"
    with RecordProcess(sim.url, out, "--session-header", "X-Session-Id") as proxy:
        run_locust(replay_args(trace, toy_tokenizer_dir, proxy.url, tmp_path / "run-t.jsonl", "--session-header",
                               "X-Session-Id", "--api", "openai-chat"), tmp_path)
    recorded = rows(out)
    run_locust(replay_args(out, toy_tokenizer_dir, sim.url, tmp_path / "run-t2.jsonl", "--api", "openai-chat",
                           "--turn-timing", "after-answer", "--partition", "session"), tmp_path)
    records = {r["request_id"]: r for r in read_records(tmp_path / "run-t2.jsonl")}
    previous: dict[int, int] = {}
    checked = 0
    for i, row in enumerate(recorded):
        if row["session_id"] in previous:
            before = records[previous[row["session_id"]]]
            assert records[i]["due_at"] == pytest.approx(before["finished_at"] + row["gap_ms"] / 1000.0, abs=1e-6)
            checked += 1
        previous[row["session_id"]] = i
    assert checked == 6


def test_without_tokenize_the_tokenizer_counts_and_without_either_the_row_says_so(toy_tokenizer_dir, tmp_path):
    messages = [{"role": "user", "content": "count me " * 20}]
    traces = {}
    with sim_process(toy_tokenizer_dir, "--block-size", "16") as with_endpoint, \
            sim_process(toy_tokenizer_dir, "--block-size", "16", "--no-tokenize-endpoint") as without:
        salt = tmp_path / "salt"
        salt.write_bytes(b"z" * 16)
        for name, url, extra in (("server", with_endpoint.url, []),
                                 ("tokenizer", without.url, ["--tokenizer", str(toy_tokenizer_dir)]),
                                 ("neither", without.url, [])):
            out = tmp_path / f"{name}.jsonl"
            with RecordProcess(url, out, "--salt-file", str(salt), *extra) as proxy:
                assert chat(proxy.url, messages).status_code == 200
            traces[name] = (rows(out)[0], json.loads(Path(f"{out}.meta.json").read_text()))
    assert traces["tokenizer"][0]["hash_ids"] == traces["server"][0]["hash_ids"]
    assert traces["tokenizer"][1]["tokens"] == "tokenizer" and traces["tokenizer"][1]["tokenizer_fingerprint"]
    neither = traces["neither"][0]
    assert "hash_ids" not in neither and neither["input_length"] == traces["server"][0]["input_length"]
    assert neither["error"] == "no POST /tokenize to ask and no --tokenizer"


def test_keep_text_writes_the_prompts_for_an_internal_replay(sim, toy_tokenizer_dir, tmp_path):
    out = tmp_path / "trace.jsonl"
    messages = [{"role": "user", "content": "kept on purpose"}]
    with RecordProcess(sim.url, out, "--keep-text") as proxy:
        chat(proxy.url, messages)
    (row,) = rows(out)
    assert row["messages"] == messages
    assert "prompt text (--keep-text)" in json.loads(Path(f"{out}.meta.json").read_text())["kept"]
    run_locust(replay_args(out, toy_tokenizer_dir, sim.url, tmp_path / "run.jsonl"), tmp_path)


def test_ids_are_numbered_in_arrival_order_whatever_order_answers_end(toy_tokenizer_dir, tmp_path):
    """The first request's answer ends last: its blocks still get the first ids, as anonymize
    (which reads a log in arrival order) numbers them."""
    out, raw = tmp_path / "trace.jsonl", tmp_path / "raw.jsonl"
    salt = tmp_path / "salt"
    salt.write_bytes(b"q" * 16)
    with sim_process(toy_tokenizer_dir, "--block-size", "16", "--ttft-ms", "5", "--itl-ms", "20") as slow, \
            RecordProcess(slow.url, out, "--salt-file", str(salt), "--raw-log", str(raw)) as proxy:
        long = requests.post(proxy.url + CHAT, json={"model": "sim", "messages": [{"role": "user", "content": "slow " * 40}],
                             "max_tokens": 20, "ignore_eos": True, "stream": True}, stream=True, timeout=30)
        lines = long.iter_lines()
        next(line for line in lines if b"content" in line)
        assert chat(proxy.url, [{"role": "user", "content": "quick " * 40}]).status_code == 200
        assert [line for line in lines if line][-1] == b"data: [DONE]"
    first, second = rows(out)
    assert first["hash_ids"][0] == 0 and second["hash_ids"][0] == len(first["hash_ids"])
    again = tmp_path / "again.jsonl"
    assert anonymize(raw, again, "--tokenizer", toy_tokenizer_dir, "--salt-file", salt).returncode == 0
    assert again.read_text() == out.read_text()


def test_a_tokenizer_that_cannot_be_read_is_refused_before_listening(tmp_path):
    done = record_refused("--upstream", "http://127.0.0.1:9", "--block-size", "16", "--output",
                          str(tmp_path / "t.jsonl"), "--tokenizer", str(tmp_path / "nothing-here"))
    assert done.returncode == 2 and done.stderr.startswith(f"replay record: --tokenizer {tmp_path / 'nothing-here'}: ")
    assert len(done.stderr.strip().splitlines()) == 1 and "listening" not in done.stdout


def test_a_session_id_that_would_break_the_header_is_not_sent(sim, toy_tokenizer_dir, tmp_path):
    """`replay run --session-header`: a trace's session id holding a line break would have
    written a header of the trace's choosing; it is left out (the row goes without it)."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(row) + "\n" for row in (
        {"timestamp": 0, "input_length": 40, "output_length": 2, "session_id": "fine"},
        {"timestamp": 50, "input_length": 40, "output_length": 2, "session_id": "bad\r\nX-Injected: yes"})))
    out = tmp_path / "recorded.jsonl"
    with RecordProcess(sim.url, out, "--session-header", "X-Session-Id", "--id-header", "X-Injected") as proxy:
        run_locust(replay_args(trace, toy_tokenizer_dir, proxy.url, tmp_path / "run.jsonl",
                               "--session-header", "X-Session-Id"), tmp_path)
    fine, bad = rows(out)
    assert "client_request_id" not in bad and "client_request_id" not in fine
    assert fine["session_id"] != bad["session_id"]


def test_an_answer_still_running_past_the_drain_timeout_is_cut_and_its_row_says_why(toy_tokenizer_dir, tmp_path):
    out = tmp_path / "trace.jsonl"
    with sim_process(toy_tokenizer_dir, "--block-size", "16", "--ttft-ms", "5", "--itl-ms", "50") as slow:
        proxy = RecordProcess(slow.url, out, "--drain-timeout", "0.5")
        answer = requests.post(proxy.url + CHAT, json={"model": "sim", "messages": [{"role": "user", "content": "go"}],
                               "max_tokens": 400, "ignore_eos": True, "stream": True}, stream=True, timeout=30)
        lines = answer.iter_lines()
        next(line for line in lines if b"content" in line)
        started = time.monotonic()
        assert proxy.stop() == 0
        assert time.monotonic() - started < 10  # not the 20 s the answer had left
    (row,) = rows(out)
    assert row["error"] == "the proxy stopped before the end of the answer (--drain-timeout)"
    assert json.loads(Path(f"{out}.meta.json").read_text())["complete"] is True


def test_a_proxy_killed_mid_answer_leaves_whole_lines_and_a_meta_that_says_so(toy_tokenizer_dir, tmp_path):
    """SIGKILL: no drain, no goodbye. The recorder reads to the end of its pipe, writes the rows
    it has, and the meta says the recording is not complete and why (how many requests the
    proxy had not handed over is not known)."""
    out = tmp_path / "trace.jsonl"
    with sim_process(toy_tokenizer_dir, "--block-size", "16", "--ttft-ms", "5", "--itl-ms", "50") as slow:
        proxy = RecordProcess(slow.url, out)
        assert chat(proxy.url, [{"role": "user", "content": "before"}]).status_code == 200
        wait_for(lambda: out.exists() and out.read_text().count("\n") == 1, "the first row")
        answer = requests.post(proxy.url + CHAT, json={"model": "sim", "messages": [{"role": "user", "content": "go"}],
                               "max_tokens": 400, "ignore_eos": True, "stream": True}, stream=True, timeout=30)
        lines = answer.iter_lines()
        next(line for line in lines if b"content" in line)
        proxy.proc.kill()
        proxy.stop()
        meta_file = Path(f"{out}.meta.json")
        wait_for(lambda: "ended" in json.loads(meta_file.read_text()), "the recorder's last meta")
        answer.close()
    (row,) = rows(out)
    assert "error" not in row
    meta = json.loads(meta_file.read_text())
    assert meta["complete"] is False and meta["lost"] is None and "without closing the recording" in meta["ended"]
    assert meta["rows"] == 1


def test_a_recording_closed_in_order_lost_nothing(sim, tmp_path):
    out = tmp_path / "trace.jsonl"
    with RecordProcess(sim.url, out) as proxy:
        assert chat(proxy.url, [{"role": "user", "content": "one"}]).status_code == 200
    meta = json.loads(Path(f"{out}.meta.json").read_text())
    assert meta["complete"] is True and meta["lost"] == 0 and "ended" not in meta

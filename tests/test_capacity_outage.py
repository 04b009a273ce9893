"""A capacity search against a real `replay sim` that goes away, hangs, comes back or answers
errors that are not the load's (docs/capacity.md, "Servers gone or erroring"): none of them is
a capacity. The search ends with exit code 1 saying what happened (--on-outage stop), or repeats
the probe once the server answers again (--on-outage retry); overload, the SLO failing as the
load grows, is tests/test_capacity_sim.py's.

The sim is a real process, killed (SIGKILL), stopped (SIGSTOP) or restarted on its port while
the search runs, or a server of a few lines here that answers 200 with no event stream. A first probe that ends client-limited on a host too busy to send on time
skips the test (fails in CI), as in test_capacity_sim.py.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import orjson
import pytest

from replay.protocol.readiness import ready_problem
from replay.rules.run_files import capacity_path
from replay.sim.process import SimProcess
from support.browser import IN_CI
from support.ports import free_port
from support.processes import finish, replay_args, spawn_locust
from support.traces import BLOCK, mooncake_trace

pytestmark = pytest.mark.alone

ROWS, GAP_MS = 40, 50  # 2 s of trace at 20 requests a second: a fast sim serves it many times over
SEARCH = ("--slo", "e2e_ms=5000", "--verify-server", "off", "--capacity-search", "--goodput-target", "0.9",
          "--search-range", "0.5:2", "--probe-duration", str(ROWS * GAP_MS / 1000), "--cooldown", "2",
          "--drain-timeout", "3", "--server-metrics-interval", "0")
FAST = ("--block-size", str(BLOCK), "--ttft-ms", "2", "--itl-ms", "1", "--prefill-ms-per-1k", "0")


def start_search(tmp_path: Path, tokenizer: Path, url: str, *extra: str):
    trace = mooncake_trace(tmp_path / "trace.jsonl", ROWS + 1, GAP_MS, output_length=(4, 4))
    output = tmp_path / "search.jsonl"
    log = tmp_path / "search.log"
    proc = spawn_locust(replay_args(trace, tokenizer, url, output, *SEARCH, *extra), tmp_path, log)
    return proc, output, log


def client_limited() -> None:
    why = "a probe ended client-limited on this busy host"
    if IN_CI:
        pytest.fail(why + "; CI must run the `alone` tests on a quiet machine", pytrace=False)
    pytest.skip(why)


def wait_for(log: Path, text: str, proc, timeout: float = 60) -> None:
    """Until the search's log says `text`; a search that ended first or a client too busy to send
    on time ends the test."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        said = log.read_text(errors="replace")
        if text in said:
            return
        if "limited by the client" in said:
            client_limited()
        if proc.poll() is not None:
            pytest.fail(f"the search ended before its log said {text!r}:\n{said[-4000:]}")
        time.sleep(0.05)
    pytest.fail(f"the search's log did not say {text!r} in {timeout} s:\n{log.read_text()[-4000:]}")


def ended(proc, output: Path, log: Path, timeout: float = 120) -> tuple[dict, str]:
    finish([proc], timeout=timeout)
    said = log.read_text(errors="replace")
    assert "Traceback" not in said, said[-6000:]
    report = orjson.loads(capacity_path(output).read_bytes())
    if report["result"] == "client-limited":
        client_limited()
    return report, said


def test_a_sim_killed_after_the_first_probe_is_an_outage_not_a_capacity(tmp_path, toy_tokenizer_dir):
    sim = SimProcess(toy_tokenizer_dir, FAST)
    try:
        proc, output, log = start_search(tmp_path, toy_tokenizer_dir, sim.url)
        wait_for(log, "probe 0 at 1x: pass", proc)
        sim.proc.kill()
        report, said = ended(proc, output, log)
    finally:
        sim.stop()
    assert proc.returncode == 1, said[-3000:]
    assert [(p["factor"], p["verdict"]) for p in report["probes"]] == [(1.0, "pass"), (2.0, "outage")]
    assert report["result"] == "outage" and report["capacity"] is None and report["bracket"] == [1.0, None]
    assert report["probes"][1]["failed_by"].keys() == {"unanswered"}
    assert "Capacity: not measured: the servers stopped answering during the probe at 2x" in said
    assert "ConnectionRefusedError" in said and "Capacity: 1x" not in said


def test_a_sim_that_hangs_is_an_outage_once_the_drain_timeout_passes(tmp_path, toy_tokenizer_dir):
    """SIGSTOP: the kernel still takes the connections and the requests; nothing answers. Each
    request of the probe is cut off --drain-timeout after its last send, and the probe is an
    outage: a search never waits on a hung server for good."""
    sim = SimProcess(toy_tokenizer_dir, FAST)
    try:
        proc, output, log = start_search(tmp_path, toy_tokenizer_dir, sim.url)
        wait_for(log, "probe 0 at 1x: pass", proc)
        os.kill(sim.proc.pid, signal.SIGSTOP)
        report, said = ended(proc, output, log, timeout=60)
    finally:
        os.kill(sim.proc.pid, signal.SIGCONT)
        sim.stop()
    assert proc.returncode == 1, said[-3000:]
    assert [p["verdict"] for p in report["probes"]] == ["pass", "outage"]
    assert report["probes"][1]["not_load_reasons"] == {"no answer before drain timeout": report["probes"][1]["sent"]}
    assert report["result"] == "outage"


def test_on_outage_retry_repeats_the_probe_a_restart_cut_short(tmp_path, toy_tokenizer_dir):
    """The sim killed after the first probe and started again on its port once the second has
    failed for it: the second is repeated once the sim answers, and the search ends by itself."""
    sim = SimProcess(toy_tokenizer_dir, FAST)
    port = sim.port
    again = None
    try:
        proc, output, log = start_search(tmp_path, toy_tokenizer_dir, sim.url, "--on-outage", "retry")
        wait_for(log, "probe 0 at 1x: pass", proc)
        sim.proc.kill()
        wait_for(log, "probe 1 at 2x: outage", proc)
        again = SimProcess(toy_tokenizer_dir, [*FAST, "--port", str(port)])
        report, said = ended(proc, output, log)
    finally:
        sim.stop()
        if again is not None:
            again.stop()
    assert proc.returncode == 0, said[-3000:]
    assert [(p["factor"], p["verdict"], p["repeat_of"]) for p in report["probes"]] == \
        [(1.0, "pass", None), (2.0, "outage", None), (2.0, "pass", 1)]
    assert report["result"] == "at least HI" and report["capacity"] == 2.0


@pytest.mark.parametrize("status", ["500", "503"])
def test_a_sim_erroring_whatever_the_load_is_server_errors_not_a_capacity(tmp_path, toy_tokenizer_dir, status):
    """Half the requests answered HTTP 500 (503) at the trace's own load: not a capacity below
    it, but server errors (exit code 1)."""
    sim = SimProcess(toy_tokenizer_dir, [*FAST, "--error-rate", "0.5", "--error-status", status])
    try:
        proc, output, log = start_search(tmp_path, toy_tokenizer_dir, sim.url)
        report, said = ended(proc, output, log)
    finally:
        sim.stop()
    assert proc.returncode == 1, said[-3000:]
    assert [(p["factor"], p["verdict"]) for p in report["probes"]] == [(1.0, "server errors")]
    assert report["result"] == "server errors" and report["capacity"] is None
    assert f"HTTP {status}" in report["probes"][0]["not_load_reasons"]
    assert "the servers answered errors that are not the load's during the probe at 1x" in said


class GarbageHandler(BaseHTTPRequestHandler):
    """Serves model "sim" as /v1/models says it, and answers every generation 200 with bytes
    that are no event stream, at once."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def _answer(self, body: bytes, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._answer(json.dumps({"object": "list", "data": [{"id": "sim", "object": "model"}]}).encode(),
                     "application/json")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._answer(b"\x00garbage\xff not an event stream", "text/event-stream")


class QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        pass  # the replay closes its connections with a reset at the end


def test_a_server_answering_garbage_at_once_is_server_errors_not_at_least_hi(tmp_path, toy_tokenizer_dir):
    """Quick 200s without a token met an e2e limit at every load: "at least 2x", exit 0."""
    server = QuietServer(("127.0.0.1", 0), GarbageHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        proc, output, log = start_search(tmp_path, toy_tokenizer_dir, f"http://127.0.0.1:{server.server_port}")
        report, said = ended(proc, output, log)
    finally:
        server.shutdown()
        server.server_close()
    assert proc.returncode == 1, said[-3000:]
    assert [(p["factor"], p["verdict"]) for p in report["probes"]] == [(1.0, "server errors")]
    assert report["probes"][0]["not_load_reasons"].keys() == {"answered ok without an output token"}
    assert report["result"] == "server errors" and report["capacity"] is None


def test_on_outage_retry_waits_for_an_answered_request_not_the_model_list(tmp_path, toy_tokenizer_dir):
    """A sim shedding every generation with HTTP 503 still answers GET /v1/models 200: the retry
    took that for the servers being back and repeated the probe at once into the same 503s (the
    search ended "server errors"). It waits for a one-token request answered 200 instead: the
    repeat comes once the shedding sim is replaced by a healthy one on its port, and passes."""
    shedding = SimProcess(toy_tokenizer_dir, [*FAST, "--error-rate", "1", "--error-status", "503"])
    port = shedding.port
    again = None
    try:
        proc, output, log = start_search(tmp_path, toy_tokenizer_dir, shedding.url, "--on-outage", "retry",
                                         "--search-range", "0.5:1")  # its answer once the repeat passes at 1x
        wait_for(log, "probe 0 at 1x: server errors", proc)
        wait_for(log, "for the servers to answer a request again", proc)  # its own request was shed too
        time.sleep(6)  # past the cooldown and a repeat's lead: no repeat opens meanwhile
        assert "probe 1 at" not in log.read_text(errors="replace")
        shedding.stop()
        again = SimProcess(toy_tokenizer_dir, [*FAST, "--port", str(port)])
        report, said = ended(proc, output, log)
    finally:
        shedding.stop()
        if again is not None:
            again.stop()
    assert proc.returncode == 0, said[-3000:]
    assert [(p["factor"], p["verdict"], p["repeat_of"]) for p in report["probes"]] == \
        [(1.0, "server errors", None), (1.0, "pass", 0)]
    assert report["result"] == "at least HI"
    assert "the servers answer again" in said


def test_readiness_is_a_request_of_the_runs_kind_answered_200(toy_tokenizer_dir):
    """Each API's own one-token request: answered by a healthy sim (its key sent), refused by one
    shedding generations with 503 whose /v1/models still answers, and a dead port said as such."""
    key = {"Authorization": "Bearer k"}
    shedding = SimProcess(toy_tokenizer_dir, [*FAST, "--error-rate", "1", "--error-status", "503"])
    healthy = SimProcess(toy_tokenizer_dir, [*FAST, "--require-authorization", "Bearer k"])
    dead = f"http://127.0.0.1:{free_port()}"
    try:
        for api, path in [("openai-chat", "/v1/chat/completions"), ("openai-completions", "/v1/completions"),
                          ("tgi", "/generate")]:
            assert ready_problem(healthy.url, api, "sim", key) is None
            assert ready_problem(healthy.url, api, "sim") == f"{healthy.url}: POST {path} answered HTTP 401"
            assert ready_problem(shedding.url, api, "sim") == f"{shedding.url}: POST {path} answered HTTP 503"
        assert ready_problem(dead, "openai-chat", "sim") == \
            f"{dead}: POST /v1/chat/completions got no answer (connection refused)"
    finally:
        shedding.stop()
        healthy.stop()

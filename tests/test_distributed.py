"""Distributed replays that must never lose a row: a real master, real workers and a real sim.

Every run of completeness goes to the end (no --run-time) and asserts every row ok, recorded
once, by the worker it was assigned to, and received by the server exactly once (the sim's
count of X-Request-Id values). The traces are larger than every window of the row shipping
(8 unacknowledged chunks of 500 rows per worker), which once hid rows never sent past 4,000
per worker. Churn and signals end with one record per row, the meta file, the summary and an
exit code that tells the truth.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import orjson
import psutil
import pytest
import requests

from replay.engine.coordinator import CHUNK_ROWS
from replay.engine.transport import HOLD_ROWS
from replay.locust.plugin import MASTER_LOST_S
from replay.results.metadata import read_run_metadata
from replay.results.records import (
    MASTER_LOST,
    RUN_STOPPED,
    STOPPED_IN_FLIGHT,
    WORKER_LOST,
    WORKER_STOPPED,
    read_records,
)
from replay.rules.run_files import capacity_path, summary_path
from replay.sim.process import sim_process
from support.paths import REPO, shared_path
from support.ports import free_port
from support.processes import (
    finish,
    master_and_workers,
    replay_args,
    run_locust,
    spawn_locust,
    spawn_master,
    spawn_worker,
)
from support.records import check_records
from support.traces import BLOCK, bailian_trace, mooncake_trace, trace_ids
from support.waiting import wait_for, wait_for_text

SHIP_WINDOW_ROWS = 8 * CHUNK_ROWS  # what a worker holds before acks must flow


def received_ids(url: str) -> dict[str, int]:
    return requests.get(f"{url}/debug/requests", timeout=10).json()["ids"]


def assert_each_sent_once(output: Path, sim_url: str, request_ids) -> None:
    """The server received `<run id>-<id>` exactly once for each of `request_ids`, and nothing else."""
    run_id = read_run_metadata(output)["run_id"]
    assert run_id
    seen = received_ids(sim_url)
    expected = {f"{run_id}-{rid}" for rid in request_ids}
    twice = {k: v for k, v in seen.items() if v != 1}
    assert not twice, f"{len(twice)} ids received more than once, e.g. {list(twice.items())[:5]}"
    assert set(seen) == expected, (len(seen), len(expected), sorted(set(expected) - set(seen))[:5])


@pytest.mark.heavy
@pytest.mark.alone
def test_every_row_once_by_its_worker(tmp_path, toy_tokenizer_dir, fast_sim):
    """More rows per worker than the shipping window and than a worker holds ahead of its sends
    (it must ask for the rest as it goes); every row ok, sent once, by its own worker. Three
    workers here; two, in one process: tests/test_engine_pipeline.py."""
    workers = 3
    per_worker = max(SHIP_WINDOW_ROWS, HOLD_ROWS) + CHUNK_ROWS + 100  # the rest comes in 2 chunks
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=per_worker * workers, gap_ms=2, output_length=(1, 2))
    output = tmp_path / "run.jsonl"
    master, procs = master_and_workers(tmp_path, replay_args(trace, toy_tokenizer_dir, fast_sim.url, output,
                                                             "--scale", "4"), workers=workers)
    finish([master, *procs], timeout=240)
    log = (tmp_path / "master.log").read_text()
    assert master.returncode == 0, log[-3000:]
    records = check_records(output, trace)
    for r in records:  # round-robin over send order: row i goes to worker i % W
        assert r["worker"] == r["request_id"] % workers, r
    assert_each_sent_once(output, fast_sim.url, trace_ids(trace))
    assert "missing" not in log  # no worker was dropped for missing heartbeats


@pytest.mark.heavy
@pytest.mark.alone
def test_processes_partition_session_every_row_once(tmp_path, toy_tokenizer_dir, fast_sim):
    """--processes 2 --partition session over many sessions: whole sessions per worker, each row once."""
    trace = bailian_trace(tmp_path / "bailian.jsonl", sessions=1100, turns=8, gap_s=0.0006)  # 8,800 rows
    output = tmp_path / "run.jsonl"
    port = free_port()
    run_locust(["--headless", "--host", fast_sim.url, "--trace", str(trace), "--trace-format", "bailian",
                "--tokenizer", str(toy_tokenizer_dir), "--model", "sim", "--output", str(output),
                "--partition", "session", "--processes", "2", "--master-bind-host", "127.0.0.1",
                "--master-host", "127.0.0.1", "--master-bind-port", str(port), "--master-port", str(port)],
               tmp_path, timeout=240)
    records = check_records(output, trace)
    by_session: dict[str, set[int]] = {}
    for r in records:
        by_session.setdefault(r["session_id"], set()).add(r["worker"])
    assert len(by_session) == 1100 and all(len(w) == 1 for w in by_session.values())
    assert max(sum(r["worker"] == w for r in records) for w in (0, 1)) > SHIP_WINDOW_ROWS
    assert_each_sent_once(output, fast_sim.url, trace_ids(trace))


def signal_mid_run(targets: list, signum: int, log: Path, procs: list) -> float:
    """Send `signum` to `targets` 2 s into the replay (as `log` tells), wait for `procs` to exit;
    returns how long they took."""
    try:
        wait_for_text(log, "replay starts at", procs[0])
        time.sleep(2.0)  # the scenario: the run goes on 2 s before the signal
        for target in targets:
            target.send_signal(signum)
        signalled = time.monotonic()
        finish(procs, timeout=40)
        return time.monotonic() - signalled
    finally:
        finish(procs, timeout=5)


def finalized(output: Path, trace: Path, log: Path) -> list[dict]:
    """The end every run must reach: one record per row, the meta file, the summary."""
    records = list(read_records(output))
    assert sorted(r["request_id"] for r in records) == sorted(trace_ids(trace))
    assert read_run_metadata(output) is not None
    assert "Serving Benchmark Result" in log.read_text()
    assert any(r["ok"] for r in records)
    return records


def assert_worker_files_one_record_per_row(output: Path, workers: int = 2) -> None:
    """Each worker's own file: one record per row it recorded, and only requests not answered
    fail (a stop's label never stands beside the same request's answer)."""
    for i in range(workers):
        records = list(read_records(f"{output}.worker-{i}.jsonl"))
        ids = [r["request_id"] for r in records]
        twice = sorted({rid for rid in ids if ids.count(rid) > 1})
        assert not twice, f"worker {i}: {len(twice)} rows recorded twice, e.g. {twice[:5]}"


def assert_user_stop(records: list[dict]) -> None:
    """Answered rows ok, the rest run stopped (never sent) or cut off in flight (sent)."""
    for r in records:
        if not r["ok"]:
            assert r["error"] in (RUN_STOPPED, STOPPED_IN_FLIGHT), r
            assert (r["sent_at"] is None) == (r["error"] == RUN_STOPPED), r
    assert any(r["error"] == RUN_STOPPED for r in records)


def test_all_workers_killed_master_still_finalizes(tmp_path, toy_tokenizer_dir, fast_sim):
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=300, gap_ms=40)  # 12 s
    output = tmp_path / "run.jsonl"
    master, workers = master_and_workers(tmp_path, replay_args(trace, toy_tokenizer_dir, fast_sim.url, output))
    signal_mid_run(workers, signal.SIGKILL, tmp_path / "master.log", [master, *workers])
    assert master.returncode == 1, (tmp_path / "master.log").read_text()[-3000:]
    records = finalized(output, trace, tmp_path / "master.log")
    assert all(r["error"] == WORKER_LOST for r in records if not r["ok"])
    assert all(w["lost"] for w in read_run_metadata(output)["workers"])


def test_worker_joining_mid_run_idles(tmp_path, toy_tokenizer_dir, fast_sim):
    """A worker that joins (or a restarted one) gets no rows and disturbs no one."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=400, gap_ms=40)  # 16 s: the late worker starts well before the end
    output = tmp_path / "run.jsonl"
    port = free_port()
    master, procs = master_and_workers(tmp_path, replay_args(trace, toy_tokenizer_dir, fast_sim.url, output), port=port)
    try:
        wait_for_text(tmp_path / "master.log", "replay starts at", master)
        time.sleep(1.5)  # the scenario: a worker joins 1.5 s into the run
        procs.append(spawn_worker(tmp_path, port, "late"))
        finish([master, *procs], timeout=90)
    finally:
        finish([master, *procs], timeout=5)
    log = (tmp_path / "master.log").read_text()
    assert master.returncode == 0, log[-3000:]
    records = check_records(output, trace)
    assert {r["worker"] for r in records} == {0, 1}
    assert_each_sent_once(output, fast_sim.url, trace_ids(trace))
    assert "gets no rows" in log
    assert "this worker idles" in (tmp_path / "late.log").read_text()


def test_sigterm_to_single_process(tmp_path, toy_tokenizer_dir, fast_sim):
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=300, gap_ms=40)  # 12 s
    output = tmp_path / "run.jsonl"
    proc = spawn_locust(replay_args(trace, toy_tokenizer_dir, fast_sim.url, output), tmp_path, tmp_path / "local.log")
    signal_mid_run([proc], signal.SIGTERM, tmp_path / "local.log", [proc])
    assert proc.returncode == 0, (tmp_path / "local.log").read_text()[-3000:]  # the user's own stop
    assert_user_stop(finalized(output, trace, tmp_path / "local.log"))


@pytest.mark.alone
def test_sigterm_to_master(tmp_path, toy_tokenizer_dir, fast_sim):
    """Most rows were never shipped (a worker holds HOLD_ROWS ahead of its sends): the master
    records them itself, the held ones come from the workers, each row once."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=3 * HOLD_ROWS, gap_ms=40)  # 16 min
    output = tmp_path / "run.jsonl"
    master, workers = master_and_workers(tmp_path, replay_args(trace, toy_tokenizer_dir, fast_sim.url, output))
    took = signal_mid_run([master], signal.SIGTERM, tmp_path / "master.log", [master, *workers])
    assert took < 20  # the workers quit with the master, not 60 s later
    assert master.returncode == 0, (tmp_path / "master.log").read_text()[-3000:]
    records = finalized(output, trace, tmp_path / "master.log")
    assert_user_stop(records)
    assert_worker_files_one_record_per_row(output)
    sent = [r["request_id"] for r in records if r["sent_at"] is not None]
    assert_each_sent_once(output, fast_sim.url, sent)  # nothing was sent after the stop


@pytest.mark.alone
def test_workers_stop_sending_when_the_master_dies(tmp_path, toy_tokenizer_dir, fast_sim):
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=500, gap_ms=40)  # 20 s
    output = tmp_path / "run.jsonl"
    master, workers = master_and_workers(tmp_path, replay_args(trace, toy_tokenizer_dir, fast_sim.url, output))
    took = signal_mid_run([master], signal.SIGKILL, tmp_path / "master.log", [master, *workers])
    assert took < 15
    assert all(p.returncode == 1 for p in workers), [p.returncode for p in workers]
    received = sum(received_ids(fast_sim.url).values())
    assert received < 350, received  # of 500: about 2 s of sends, and the few seconds it takes to notice
    for i in range(2):  # each worker recorded what it held: answers, and "master lost" for the rest
        records = list(read_records(f"{output}.worker-{i}.jsonl"))
        assert any(r["ok"] for r in records)
        assert all(r["ok"] or r["error"] == MASTER_LOST for r in records), {r["error"] for r in records}
        assert any(r["error"] == MASTER_LOST for r in records)
    assert_worker_files_one_record_per_row(output)


def test_failed_rows_make_exit_code_1(tmp_path, toy_tokenizer_dir):
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=60, gap_ms=10)
    output = tmp_path / "run.jsonl"
    with sim_process(toy_tokenizer_dir, "--block-size", str(BLOCK), "--ttft-ms", "2", "--error-rate", "0.2") as server:
        proc = run_locust(replay_args(trace, toy_tokenizer_dir, server.url, output), tmp_path, exit_code=1)
    records = list(read_records(output))
    assert len(records) == 60 and any(r["status"] == 500 for r in records)
    assert "rows failed: exit code 1" in proc.stderr


def test_no_request_id_header(tmp_path, toy_tokenizer_dir, fast_sim):
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=10, gap_ms=10)
    output = tmp_path / "run.jsonl"
    run_locust(replay_args(trace, toy_tokenizer_dir, fast_sim.url, output, "--no-request-id-header"), tmp_path)
    check_records(output, trace)
    seen = orjson.loads(requests.get(f"{fast_sim.url}/debug/requests", timeout=10).content)
    assert seen["total"] == 0 and seen["without_id"] == 10


def test_slow_worker_set_up_keeps_heartbeats(tmp_path):
    """A real tokenizer's set-up (seconds of CPU for the safe vocabulary and the template) runs
    off the event loop: no worker is dropped as missing, and every row is ok."""
    tokenizer = shared_path("tokenizers", "qwen2")
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=40, gap_ms=20)
    output = tmp_path / "run.jsonl"
    with sim_process(tokenizer, "--block-size", str(BLOCK), "--ttft-ms", "2", "--itl-ms", "0",
                     "--max-num-seqs", "10000") as server:
        master, procs = master_and_workers(tmp_path, replay_args(trace, tokenizer, server.url, output), workers=1)
        finish([master, *procs], timeout=180)
    log = (tmp_path / "master.log").read_text()
    assert master.returncode == 0, log[-3000:]
    assert "missing" not in log, log[-3000:]
    check_records(output, trace)


@pytest.mark.parametrize("off_loop", [True, False], ids=["thread", "inline"])
def test_worker_set_up_leaves_the_event_loop_running(off_loop, tmp_path, monkeypatch):
    """The gap a real tokenizer's set-up leaves in a worker's event loop: inline it is the whole
    set-up (seconds on a loaded machine: missed heartbeats), in a thread a few ms at a time.
    Cold (an empty set-up cache of its own): that is the costly set-up."""
    import gevent

    monkeypatch.setenv("TRACEREPLAY_CACHE_DIR", str(tmp_path / "cache"))
    from replay.engine.dispatcher import BodyBuilder, build_off_loop
    from replay.engine.options import ReplayOptions

    options = ReplayOptions(trace="unused", tokenizer=str(shared_path("tokenizers", "qwen2")), model="m")
    ticks: list[float] = []

    def tick() -> None:
        while True:
            ticks.append(time.monotonic())
            gevent.sleep(0.01)

    ticker = gevent.spawn(tick)
    gevent.sleep(0.05)
    started = time.monotonic()
    builder = build_off_loop(options, 512) if off_loop else BodyBuilder(options, 512)
    took = time.monotonic() - started
    gevent.sleep(0.05)
    ticker.kill()
    assert builder.body(mooncake_row()) is not None
    longest = max(b - a for a, b in zip(ticks, ticks[1:]))
    if off_loop:  # the tokenizer's own load holds the GIL for a while (0.45 s of 1.6 s here)
        assert longest < 0.6 * took, (longest, took)
    else:  # the measurement can see a blocked loop: the set-up is one long gap
        assert longest > 0.8 * took, (longest, took)


def mooncake_row():
    from replay.trace.record import TraceRow

    return TraceRow(request_id=0, timestamp_s=0.0, input_length=600, output_length=4, hash_ids=(1, 2))


# -- stops before the first send, a plan that must not be dropped, a worker stopped on its own --------


class BlackHole:
    """A server that accepts connections and never answers, but, with `serves`, what it serves
    (GET /v1/models) and, once, that it has no /metrics (the preflight's question): whatever the
    replay asks it first (what it serves; else the server check, the /metrics scrape) blocks, so a
    signal can land there."""

    def __init__(self, serves: str | None = None):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.serves = serves
        self.held: list = []
        self.metrics_answered = False
        self.asked = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            try:
                asked = conn.recv(65536) if self.serves is not None else b""
            except OSError:  # reset before it asked anything
                conn.close()
                continue
            if asked.startswith(b"GET /v1/models "):
                body = orjson.dumps({"object": "list", "data": [{"id": self.serves}]})
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                conn.close()
                continue
            if asked.startswith(b"GET /metrics ") and not self.metrics_answered:
                # the preflight's question of its cache size (none here); the scraper's are held
                self.metrics_answered = True
                conn.sendall(b"HTTP/1.1 404 Not Found\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
                conn.close()
                continue
            self.held.append(conn)
            self.asked.set()

    def wait_asked(self, proc) -> None:
        """Until the replay's first question it holds is in (the replay blocks on it from then on)."""
        assert self.asked.wait(60)
        assert proc.poll() is None

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


def all_run_stopped(output: Path, trace: Path) -> list[dict]:
    """A stop before the first send: one never-sent "run stopped" record per row, meta, summary."""
    records = list(read_records(output))
    assert sorted(r["request_id"] for r in records) == sorted(trace_ids(trace))
    assert all(r["error"] == RUN_STOPPED and r["sent_at"] is None and r["worker"] is None for r in records)
    assert read_run_metadata(output) is not None and summary_path(output).exists()
    return records


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_while_waiting_for_workers(tmp_path, toy_tokenizer_dir, fast_sim, signum):
    """Locust's --expect-workers wait has no guard of its own (a KeyboardInterrupt traceback,
    exit 130, nothing written): the stop records every row, writes meta and summary, exits 0 as a
    user's stop does, and the worker already connected quits with it."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=50, gap_ms=40)
    output = tmp_path / "run.jsonl"
    port = free_port()
    master = spawn_master(tmp_path, replay_args(trace, toy_tokenizer_dir, fast_sim.url, output), port)
    worker = spawn_worker(tmp_path, port, "worker0")
    try:
        wait_for_text(tmp_path / "master.log", "1 workers connected", master)
        # and the master's own set-up done (the server check ends it): on a loaded machine the
        # worker can connect first, and a signal then comes "before the trace was read"
        wait_for_text(tmp_path / "master.log", "--verify-server:", master)
        master.send_signal(signum)
        finish([master, worker], timeout=40)
    finally:
        finish([master, worker], timeout=5)
    log = (tmp_path / "master.log").read_text()
    assert master.returncode == 0, log[-3000:]
    assert "Traceback" not in log and "before the run began" in log
    all_run_stopped(output, trace)
    assert worker.returncode == 0  # told to quit by the master, not left waiting
    assert received_ids(fast_sim.url) == {}


@pytest.mark.parametrize("mode", ["local", "master"])
def test_signal_during_the_server_check(tmp_path, toy_tokenizer_dir, mode):
    """The trace is read, the server check blocks on a server that never answers it (but said
    what it serves): a SIGTERM then records every row, as any stop before the first send."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=50, gap_ms=40)
    output = tmp_path / "run.jsonl"
    server = BlackHole(serves="sim")
    args = [*replay_args(trace, toy_tokenizer_dir, server.url, output), "--max-prompt-tokens", "4096"]
    if mode == "master":
        args += ["--master", "--expect-workers", "1", "--master-bind-host", "127.0.0.1", "--master-bind-port",
                 str(free_port())]
    proc = spawn_locust(args, tmp_path, tmp_path / "run.log")
    try:
        server.wait_asked(proc)
        proc.send_signal(signal.SIGTERM)
        finish([proc], timeout=40)
    finally:
        finish([proc], timeout=5)
        server.close()
    log = (tmp_path / "run.log").read_text()
    assert proc.returncode == 0, log[-3000:]
    assert "Traceback" not in log
    assert read_run_metadata(output)["server_check"]["skipped"] == "not checked"
    all_run_stopped(output, trace)


@pytest.mark.parametrize("mode", ["local", "master"])
def test_signal_before_the_trace_is_read(tmp_path, toy_tokenizer_dir, mode):
    """Asking the server what it serves (its max_model_len) comes before the trace is read: a SIGTERM there has
    nothing to record; one line, no traceback, exit 128 + 15, no output; a worker already
    connected is told to quit (not left for Locust's 60 s check on a master that is gone)."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=50, gap_ms=40)
    output = tmp_path / "run.jsonl"
    server = BlackHole()
    args = replay_args(trace, toy_tokenizer_dir, server.url, output)
    port = free_port()
    if mode == "master":
        args += ["--master", "--expect-workers", "1", "--master-bind-host", "127.0.0.1", "--master-bind-port",
                 str(port)]
    procs = []
    try:
        if mode == "master":  # the worker first, started and waiting, so it connects as the master binds
            procs.append(spawn_worker(tmp_path, port, "worker0"))
            wait_for_text(tmp_path / "worker0.log", "Starting Locust", procs[0])
        proc = spawn_locust(args, tmp_path, tmp_path / "run.log")
        procs.insert(0, proc)
        server.wait_asked(proc)
        if mode == "master":
            wait_for_text(tmp_path / "run.log", "1 workers connected", proc)
        proc.send_signal(signal.SIGTERM)
        finish(procs, timeout=20)  # the worker too: it quits with the master, within seconds
    finally:
        finish(procs, timeout=5)
        server.close()
    log = (tmp_path / "run.log").read_text()
    assert proc.returncode == 128 + signal.SIGTERM, log[-3000:]
    assert "Traceback" not in log and "SIGTERM before the trace was read: nothing was sent or recorded" in log
    assert not output.exists()


def test_a_worker_whose_master_vanishes_before_the_plan_quits(tmp_path, toy_tokenizer_dir, fast_sim):
    """A master killed (SIGKILL: no quit message) while it waits for a second worker: the one
    connected, with no plan, exits 1 within seconds, not after Locust's 60 s check."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=20, gap_ms=40)
    port = free_port()
    master = spawn_master(tmp_path, replay_args(trace, toy_tokenizer_dir, fast_sim.url, tmp_path / "run.jsonl"), port,
                          log="run.log")
    worker = spawn_worker(tmp_path, port, "worker0")
    try:
        wait_for_text(tmp_path / "run.log", "1 workers connected", master)
        time.sleep(1.5)  # heartbeats have flowed both ways
        master.kill()
        started = time.monotonic()
        finish([worker], timeout=20)
        took = time.monotonic() - started
    finally:
        finish([master, worker], timeout=5)
    log = (tmp_path / "worker0.log").read_text()
    assert worker.returncode == 1, log[-3000:]
    assert "no run from it: this worker quits" in log and "Traceback" not in log
    assert took < 15, took


@pytest.mark.parametrize("mode", ["local", "master"])
def test_signal_between_plan_and_go(tmp_path, toy_tokenizer_dir, mode):
    """The plan is out, and the go waits for the first round of the server's /metrics, which a
    server that never answers it (but said what it serves) holds back for the scrape's timeout:
    a SIGTERM then stops the run as a user's stop, every row "run stopped", exit 0."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=50, gap_ms=40)
    output = tmp_path / "run.jsonl"
    server = BlackHole(serves="sim")
    args = [*replay_args(trace, toy_tokenizer_dir, server.url, output), "--verify-server", "off",
            "--max-prompt-tokens", "4096", "--server-metrics-interval", "5"]
    procs = []
    try:
        if mode == "local":
            procs.append(spawn_locust(args, tmp_path, tmp_path / "master.log"))
        else:
            port = free_port()
            procs.append(spawn_locust([*args, "--master", "--expect-workers", "1", "--master-bind-host", "127.0.0.1",
                                       "--master-bind-port", str(port)], tmp_path, tmp_path / "master.log"))
            procs.append(spawn_worker(tmp_path, port, "worker0"))
        wait_for_text(tmp_path / "master.log", "rows across 1 worker", procs[0])
        procs[0].send_signal(signal.SIGTERM)
        finish(procs, timeout=60)
    finally:
        finish(procs, timeout=5)
        server.close()
    log = (tmp_path / "master.log").read_text()
    assert procs[0].returncode == 0, log[-3000:]
    assert "replay starts at" not in log  # the moment was before the go
    assert "Traceback" not in log
    records = list(read_records(output))
    assert sorted(r["request_id"] for r in records) == sorted(trace_ids(trace))
    assert all(r["error"] == RUN_STOPPED and r["sent_at"] is None for r in records)
    assert summary_path(output).exists()


def test_second_signal_during_the_final_write(tmp_path, toy_tokenizer_dir, fast_sim):
    """A second SIGTERM while the records are written does not cut them off."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=60_000, gap_ms=20)  # 20 min: nearly all never sent
    output = tmp_path / "run.jsonl"
    master, workers = master_and_workers(tmp_path, replay_args(trace, toy_tokenizer_dir, fast_sim.url, output))
    try:
        wait_for_text(tmp_path / "master.log", "replay starts at", master)
        time.sleep(2.0)  # the scenario: 2 s into the run
        master.send_signal(signal.SIGTERM)
        wait_for_text(tmp_path / "master.log", "the run ends", master)
        master.send_signal(signal.SIGTERM)
        finish([master, *workers], timeout=90)
    finally:
        finish([master, *workers], timeout=5)
    log = (tmp_path / "master.log").read_text()
    assert master.returncode == 0, log[-3000:]
    assert "SIGTERM received while the run's records are being written" in log
    assert_user_stop(finalized(output, trace, tmp_path / "master.log"))


SLOW_INIT = '''
import time
from locust import events

@events.init.add_listener
def _slow(environment, **kwargs):
    time.sleep(3)  # before the replay's own init: its messages are not registered yet
'''


def test_plan_waits_until_the_worker_can_hear(tmp_path, toy_tokenizer_dir, fast_sim):
    """Locust acks a worker's connection before the worker registers the replay's messages; a
    plan sent then was dropped ("Unknown message type received: replay_plan") and the run never
    started. Here each worker registers them 3 s after it connected: every row ok all the same."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=100, gap_ms=10)
    output = tmp_path / "run.jsonl"
    slow = tmp_path / "slow_init.py"
    slow.write_text(SLOW_INIT)
    port = free_port()
    master = spawn_master(tmp_path, replay_args(trace, toy_tokenizer_dir, fast_sim.url, output), port)
    command = [sys.executable, "-m", "locust", "-f", f"{slow},{REPO / 'locustfile.py'}"]
    workers = [spawn_worker(tmp_path, port, f"worker{i}", locustfile=command) for i in range(2)]
    finish([master, *workers], timeout=90)
    log = (tmp_path / "master.log").read_text()
    assert master.returncode == 0, log[-3000:]
    check_records(output, trace)
    for i in range(2):
        assert "Unknown message type" not in (tmp_path / f"worker{i}.log").read_text()


@pytest.mark.alone  # the other worker must be heard within Locust's heartbeat (3 s): docs/testing.md
@pytest.mark.parametrize("moment", ["before the go", "mid-run"])
def test_sigterm_to_one_worker(tmp_path, toy_tokenizer_dir, fast_sim, moment):
    """A worker stopped by a signal of its own (another terminal, an operator, an eviction) is not
    the user stopping the run: its unanswered rows fail as "worker stopped", the master exits 1;
    the other worker's rows are all ok."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=250, gap_ms=40)  # 10 s: rows are left after the signal
    output = tmp_path / "run.jsonl"
    port = free_port()
    master = spawn_master(tmp_path, replay_args(trace, toy_tokenizer_dir, fast_sim.url, output), port)
    workers = [spawn_worker(tmp_path, port, f"worker{i}", new_session=True) for i in range(2)]
    try:
        if moment == "before the go":
            wait_for_text(tmp_path / "master.log", "rows across 2 worker", master)
            # a signal before the worker's replay is set up is the OS's to handle (a lost worker)
            wait_for_text(tmp_path / "worker0.log", "waiting for its part of the run", workers[0])
        else:
            wait_for_text(tmp_path / "master.log", "replay starts at", master)
            time.sleep(2.0)  # the scenario: 2 s into the run
        workers[0].send_signal(signal.SIGTERM)
        finish([master, *workers], timeout=90)
    finally:
        finish([master, *workers], timeout=5)
    log = (tmp_path / "master.log").read_text()
    assert master.returncode == 1, log[-3000:]
    assert workers[0].returncode == 1
    records = list(read_records(output))
    assert sorted(r["request_id"] for r in records) == sorted(trace_ids(trace))
    index = {w["client_id"]: w["index"] for w in read_run_metadata(output)["workers"]}
    stopped = {r["worker"] for r in records if not r["ok"]}
    assert len(stopped) == 1, {r["error"] for r in records}
    assert all(r["error"] == WORKER_STOPPED for r in records if not r["ok"])
    assert all(r["ok"] for r in records if r["worker"] not in stopped)
    assert len(index) == 2
    for i in range(2):  # every worker file: one record per row it recorded
        path = Path(f"{output}.worker-{i}.jsonl")
        if path.exists():
            ids = [r["request_id"] for r in read_records(path)]
            assert len(ids) == len(set(ids))


@pytest.mark.parametrize("signals", [[signal.SIGTERM, signal.SIGTERM], [signal.SIGHUP]], ids=["SIGTERM twice", "SIGHUP"])
def test_more_stop_signals_to_single_process(tmp_path, toy_tokenizer_dir, fast_sim, signals):
    """A second signal while the run stops landed in Locust's own stop (a traceback, exit 130, the
    records cut off); SIGHUP (the terminal closed) killed the process with nothing written."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=300, gap_ms=40)  # 12 s
    output = tmp_path / "run.jsonl"
    proc = spawn_locust(replay_args(trace, toy_tokenizer_dir, fast_sim.url, output), tmp_path, tmp_path / "local.log")
    try:
        wait_for_text(tmp_path / "local.log", "replay starts at", proc)
        time.sleep(2.0)  # the scenario: 2 s into the run
        for signum in signals:
            proc.send_signal(signum)
            wait_for_text(tmp_path / "local.log", "Exiting due to CTRL+C interruption", proc)  # the stop is under way
        finish([proc], timeout=40)
    finally:
        finish([proc], timeout=5)
    log = (tmp_path / "local.log").read_text()
    assert proc.returncode == 0, log[-3000:]
    assert "Traceback" not in log
    assert_user_stop(finalized(output, trace, tmp_path / "local.log"))


def spawn_processes(tmp_path: Path, args: list[str]):
    """`replay run ARGS --processes 2` in a session of its own, as from a terminal (its workers,
    forked by Locust, in its process group); log master.log."""
    port = free_port()
    return spawn_locust([*args, "--processes", "2", "--master-bind-host", "127.0.0.1", "--master-host", "127.0.0.1",
                         "--master-bind-port", str(port), "--master-port", str(port)], tmp_path,
                        tmp_path / "master.log", new_session=True)


def worker_pids(proc) -> list[int]:
    """The --processes workers of `proc`: its children forked as itself (not its other children,
    such as the cache section's)."""
    master = psutil.Process(proc.pid)
    return [child.pid for child in master.children() if child.cmdline() == master.cmdline()]


def end_group(proc) -> None:
    """Wait a little for `proc`, then kill what is left of its process group (its workers too)."""
    try:
        finish([proc], timeout=5)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.alone  # the other worker must be heard within Locust's heartbeat (3 s): docs/testing.md
def test_sigterm_to_one_worker_of_processes(tmp_path, toy_tokenizer_dir, fast_sim):
    """`kill PID` of one worker of --processes: the worker is in the master's process group, but
    the master got no signal, so it is not the user's stop: the worker's unanswered rows fail as
    "worker stopped" and the master exits 1 (they were "run stopped", exit 0)."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=300, gap_ms=40)  # 12 s: rows are left after the signal
    output = tmp_path / "run.jsonl"
    proc = spawn_processes(tmp_path, replay_args(trace, toy_tokenizer_dir, fast_sim.url, output))
    try:
        wait_for_text(tmp_path / "master.log", "replay starts at", proc)
        time.sleep(2.0)  # the scenario: 2 s into the run
        pids = worker_pids(proc)
        assert len(pids) == 2, pids
        os.kill(pids[0], signal.SIGTERM)
        finish([proc], timeout=60)
    finally:
        end_group(proc)
    log = (tmp_path / "master.log").read_text()
    assert proc.returncode == 1, log[-3000:]
    assert "Traceback" not in log
    records = finalized(output, trace, tmp_path / "master.log")
    failed = [r for r in records if not r["ok"]]
    assert failed and all(r["error"] == WORKER_STOPPED for r in failed), {r["error"] for r in failed}
    stopped = {r["worker"] for r in failed}
    assert len(stopped) == 1
    assert all(r["ok"] for r in records if r["worker"] not in stopped)
    assert_worker_files_one_record_per_row(output)


@pytest.mark.parametrize("signals", [[signal.SIGINT], [signal.SIGTERM], [signal.SIGHUP], [signal.SIGINT, signal.SIGINT]],
                         ids=["SIGINT", "SIGTERM", "SIGHUP", "SIGINT twice"])
def test_stop_signal_to_the_process_group_is_the_users_stop(tmp_path, toy_tokenizer_dir, fast_sim, signals):
    """A signal to the whole process group (a terminal's Ctrl-C or hang-up, `kill -TERM -PGID`)
    reaches the master and its --processes workers at once: the master got it, so it is the
    user's stop: every row answered or "run stopped", exit 0, one record per row in every file.
    The child that computes the cache section as the run goes is not the group's: the signal
    ended it, and a second Ctrl-C as the records are written (which the run ignores) took the
    section away."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=300, gap_ms=40)  # 12 s
    output = tmp_path / "run.jsonl"
    proc = spawn_processes(tmp_path, replay_args(trace, toy_tokenizer_dir, fast_sim.url, output))
    try:
        wait_for_text(tmp_path / "master.log", "replay starts at", proc)
        time.sleep(2.0)  # the scenario: 2 s into the run
        os.killpg(proc.pid, signals[0])
        for signum in signals[1:]:
            wait_for_text(tmp_path / "master.log", "the run ends", proc)
            os.killpg(proc.pid, signum)
        finish([proc], timeout=60)
    finally:
        end_group(proc)
    log = (tmp_path / "master.log").read_text()
    assert proc.returncode == 0, log[-3000:]
    assert "Traceback" not in log
    assert "cache fidelity computed while the run replayed" in log, log[-3000:]
    assert_user_stop(finalized(output, trace, tmp_path / "master.log"))
    assert_worker_files_one_record_per_row(output)


def test_a_worker_frozen_past_the_heartbeat_is_lost_not_its_master(tmp_path, toy_tokenizer_dir, fast_sim):
    """SIGSTOP to one worker for longer than the master waits for its heartbeat, then SIGCONT: the
    master counted it lost; the worker, running again, took the silence for its master's and
    recorded its rows "master lost" (or sent them all at once, late). Now they are "worker
    lost" in every file, and the master exits 1."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=300, gap_ms=40)  # 12 s
    output = tmp_path / "run.jsonl"
    proc = spawn_processes(tmp_path, replay_args(trace, toy_tokenizer_dir, fast_sim.url, output))
    try:
        wait_for_text(tmp_path / "master.log", "replay starts at", proc)
        time.sleep(2.0)  # the scenario: 2 s into the run
        frozen = worker_pids(proc)[0]
        os.kill(frozen, signal.SIGSTOP)
        wait_for_text(tmp_path / "master.log", "lost:", proc, timeout=30)
        time.sleep(MASTER_LOST_S - 3.0)  # frozen for longer than the worker's own watch on its master
        os.kill(frozen, signal.SIGCONT)
        finish([proc], timeout=60)
    finally:
        end_group(proc)
    log = (tmp_path / "master.log").read_text()
    assert proc.returncode == 1, log[-3000:]
    assert "did not run for" in log and "Traceback" not in log
    records = finalized(output, trace, tmp_path / "master.log")
    failed = [r for r in records if not r["ok"]]
    assert failed and all(r["error"] == WORKER_LOST for r in failed), Counter(r["error"] for r in failed)
    assert_worker_files_one_record_per_row(output)


SEARCH = ("--capacity-search", "--slo", "e2e_ms=5000", "--search-range", "0.5:2", "--probe-duration", "1")


@pytest.mark.parametrize(("signum", "extra"), [(signal.SIGTERM, ()), (signal.SIGKILL, ()), (signal.SIGTERM, SEARCH)],
                         ids=["SIGTERM", "SIGKILL", "SIGTERM, a capacity search"])
def test_a_worker_gone_before_its_plan_ends_the_run(tmp_path, toy_tokenizer_dir, fast_sim, signum, extra):
    """A worker that connected, then got a signal of its own (or died) while the master still
    waited for --expect-workers: nothing will replace it (--processes forks its workers once), and
    the master waited forever. It ends the run: one line naming the worker, every row recorded once
    as that worker's loss (nothing was sent), exit 1."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=50, gap_ms=40)
    output = tmp_path / "run.jsonl"
    port = free_port()
    master = spawn_master(tmp_path, replay_args(trace, toy_tokenizer_dir, fast_sim.url, output, *extra), port)
    worker = spawn_worker(tmp_path, port, "worker0", new_session=True)
    try:
        wait_for_text(tmp_path / "master.log", "1 workers connected", master)
        wait_for_text(tmp_path / "master.log", "--verify-server:", master)  # the preflight is over: it waits
        worker.send_signal(signum)
        finish([master, worker], timeout=40)
    finally:
        finish([master, worker], timeout=5)
    log = (tmp_path / "master.log").read_text()
    assert master.returncode == 1, log[-3000:]
    assert "Traceback" not in log
    label = WORKER_STOPPED if signum == signal.SIGTERM else WORKER_LOST
    lines = [line for line in log.splitlines() if "before the run began" in line]
    assert len(lines) == 1 and "worker" in lines[0] and label in lines[0], lines
    records = list(read_records(output))
    if extra:  # a search owes the rows of the probes it opened: none
        assert records == []
        report = orjson.loads(capacity_path(output).read_bytes())
        assert report["capacity"] is None and report["probes"] == []
    else:
        assert sorted(r["request_id"] for r in records) == sorted(trace_ids(trace))
        assert all(r["error"] == label and r["sent_at"] is None for r in records)
    assert summary_path(output).exists()
    assert received_ids(fast_sim.url) == {}


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_worker_of_processes_stopped_before_its_plan_ends_the_run(tmp_path, toy_tokenizer_dir, fast_sim, signum):
    """`kill PID` of one --processes worker as soon as it connected, while the master's preflight
    runs (or SIGKILL): the master waited forever for a second worker that never comes back. It
    ends the run (or, when the plan was out already, the run goes on without it): every row
    recorded once, the stopped worker's "worker stopped" (killed, or signalled before it could
    say so: "worker lost"), exit 1; a worker killed before it connected too (Locust never knew it)."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=50, gap_ms=40)
    output = tmp_path / "run.jsonl"
    proc = spawn_processes(tmp_path, replay_args(trace, toy_tokenizer_dir, fast_sim.url, output))
    try:
        if signum == signal.SIGKILL:  # as soon as it is forked: most often before it connected
            pids = wait_for(lambda: len(found := worker_pids(proc)) == 2 and found, "2 workers forked", every=0.005)
        else:
            wait_for_text(tmp_path / "master.log", "1 workers connected", proc)
            pids = worker_pids(proc)
        assert len(pids) == 2, pids
        os.kill(pids[0], signum)
        finish([proc], timeout=60)
    finally:
        end_group(proc)
    log = (tmp_path / "master.log").read_text()
    assert proc.returncode == 1, log[-3000:]
    assert "Traceback" not in log
    records = list(read_records(output))
    assert sorted(r["request_id"] for r in records) == sorted(trace_ids(trace))
    # a SIGTERM before the worker set up its handler ends it as a kill would: nothing told the master
    labels = [{WORKER_STOPPED}, {WORKER_LOST}] if signum == signal.SIGTERM else [{WORKER_LOST}]
    assert {r["error"] for r in records if not r["ok"]} in labels, log[-3000:]


def test_too_few_workers_within_the_max_wait_records_every_row(tmp_path, toy_tokenizer_dir, fast_sim):
    """--expect-workers-max-wait passed with too few workers: Locust gave up with exit 1 and no
    record, meta or summary. Every row is recorded as refused before the first send, saying how
    many workers came, the files written, exit 1; the worker that came quits."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=20, gap_ms=40)
    output = tmp_path / "run.jsonl"
    port = free_port()
    master = spawn_locust([*replay_args(trace, toy_tokenizer_dir, fast_sim.url, output), "--master",
                           "--expect-workers", "2", "--expect-workers-max-wait", "3", "--master-bind-host",
                           "127.0.0.1", "--master-bind-port", str(port)], tmp_path, tmp_path / "master.log")
    worker = spawn_worker(tmp_path, port, "worker0")
    finish([master, worker], timeout=60)
    log = (tmp_path / "master.log").read_text()
    assert master.returncode == 1, log[-3000:]
    assert "Traceback" not in log
    label = "run refused before the first send: 1 of 2 workers connected within --expect-workers-max-wait 3 s"
    records = list(read_records(output))
    assert sorted(r["request_id"] for r in records) == sorted(trace_ids(trace))
    assert all(r["error"] == label and r["sent_at"] is None for r in records), {r["error"] for r in records}
    assert read_run_metadata(output) is not None and summary_path(output).exists()
    assert worker.returncode == 0  # told to quit by the master

"""Distributed replays that must never lose a row: a real master, real workers and a real sim.

Every run of completeness goes to the end (no --run-time) and asserts every row ok, recorded
once, by the worker it was assigned to, and received by the server exactly once (the sim's
count of X-Request-Id values). The traces are larger than every window of the row shipping
(8 unacknowledged chunks of 500 rows per worker), which once hid rows never sent past 4,000
per worker. Churn and signals end with one record per row, the meta file, the summary and an
exit code that tells the truth.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import orjson
import pytest
import requests

from conftest import (BLOCK, bailian_trace, check_records, finish, free_port, master_and_workers, mooncake_trace,
                      replay_args, run_locust, shared_path, spawn_locust, spawn_worker, trace_ids, wait_for_text)
from replay.engine.coordinator import CHUNK_ROWS
from replay.engine.transport import HOLD_ROWS
from replay.results.metadata import read_run_metadata
from replay.results.records import MASTER_LOST, RUN_STOPPED, STOPPED_IN_FLIGHT, WORKER_LOST, read_records
from replay.sim.process import sim_process

SHIP_WINDOW_ROWS = 8 * CHUNK_ROWS  # what a worker holds before acks must flow


@pytest.fixture
def fast_sim(toy_tokenizer_dir):
    """Answers in a few ms with no cap on concurrent requests: the replay, not the server, is on trial."""
    with sim_process(toy_tokenizer_dir, "--block-size", str(BLOCK), "--ttft-ms", "2", "--itl-ms", "0",
                     "--prefill-ms-per-1k", "0", "--max-num-seqs", "100000") as server:
        yield server


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


@pytest.mark.parametrize("workers", [2, 3])
def test_every_row_once_by_its_worker(tmp_path, toy_tokenizer_dir, fast_sim, workers):
    """More rows per worker than the shipping window and than a worker holds ahead of its sends
    (it must ask for the rest as it goes); every row ok, sent once, by its own worker."""
    per_worker = max(SHIP_WINDOW_ROWS, HOLD_ROWS) + 1100
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=per_worker * workers, gap_ms=2, output_length=(1, 2))
    output = tmp_path / "run.jsonl"
    master, procs = master_and_workers(tmp_path, replay_args(trace, toy_tokenizer_dir, fast_sim.url, output,
                                                             "--scale", "1.3"), workers=workers)
    finish([master, *procs], timeout=240)
    log = (tmp_path / "master.log").read_text()
    assert master.returncode == 0, log[-3000:]
    records = check_records(output, trace)
    for r in records:  # round-robin over send order: row i goes to worker i % W
        assert r["worker"] == r["request_id"] % workers, r
    assert_each_sent_once(output, fast_sim.url, trace_ids(trace))
    assert "missing" not in log  # no worker was dropped for missing heartbeats


def test_processes_partition_session_every_row_once(tmp_path, toy_tokenizer_dir, fast_sim):
    """--processes 2 --partition session over many sessions: whole sessions per worker, each row once."""
    trace = bailian_trace(tmp_path / "bailian.jsonl", sessions=1100, turns=8, gap_s=0.0012)  # 8,800 rows
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
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=200, gap_ms=40)  # 8 s
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
    sent = [r["request_id"] for r in records if r["sent_at"] is not None]
    assert_each_sent_once(output, fast_sim.url, sent)  # nothing was sent after the stop


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
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=100, gap_ms=20)
    output = tmp_path / "run.jsonl"
    with sim_process(tokenizer, "--block-size", str(BLOCK), "--ttft-ms", "2", "--itl-ms", "0",
                     "--max-num-seqs", "10000") as server:
        master, procs = master_and_workers(tmp_path, replay_args(trace, tokenizer, server.url, output))
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
    from replay.engine.options import ReplayOptions
    from replay.engine.dispatcher import BodyBuilder, build_off_loop

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

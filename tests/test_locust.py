"""End-to-end replays: real `locust` processes against a real `replay sim` on 127.0.0.1.

Each run is a few seconds of trace; every test checks the merged JSONL accounts for every
scheduled row exactly once.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from conftest import REPO, free_port
from replay.results.records import RECORD_FIELDS, read_records
from replay.results.summary import percentile
from replay.sim.process import sim_process

LOCUST = [sys.executable, "-m", "locust", "-f", str(REPO / "locustfile.py")]
BLOCK = 16


def mooncake_trace(path: Path, rows: int, gap_ms: float, output_length=(4, 12), seed: int = 0) -> Path:
    """Mooncake rows whose hash ids share prefixes (two families of common prefixes)."""
    import random

    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(rows):
            shared = [0, 1, 2] if i % 2 == 0 else [7, 8]
            hashes = shared + [1000 + 10 * i + k for k in range(rng.randint(0, 2))]
            input_length = len(hashes) * BLOCK - rng.randint(0, BLOCK - 1)
            row = {"timestamp": round(i * gap_ms, 3), "input_length": input_length,
                   "output_length": rng.randint(*output_length), "hash_ids": hashes}
            f.write(json.dumps(row) + "\n")
    return path


def replay_args(trace: Path, tokenizer: Path, url: str, output: Path, *extra: str) -> list[str]:
    return ["--headless", "--host", url, "--trace", str(trace), "--block-size", str(BLOCK), "--tokenizer",
            str(tokenizer), "--model", "sim", "--output", str(output), "--loglevel", "INFO", *extra]


def run_locust(args: list[str], cwd: Path, timeout: float = 90) -> subprocess.CompletedProcess:
    proc = subprocess.run([*LOCUST, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"locust exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def trace_ids(trace: Path) -> set[int]:
    return set(range(sum(1 for line in open(trace) if line.strip())))


def check_records(output: Path, trace: Path, exact_prompt: bool = True) -> list[dict]:
    records = list(read_records(output))
    ids = [r["request_id"] for r in records]
    assert len(ids) == len(set(ids)), "a row has two records"
    assert set(ids) == trace_ids(trace)
    for r in records:
        assert tuple(r) == RECORD_FIELDS
        assert r["ok"], r
        assert r["status"] == 200
        assert r["output_tokens"] == r["output_length"]
        if exact_prompt:
            assert r["prompt_tokens"] == r["input_length"], r
        assert r["sent_at"] >= r["scheduled_at"] - 0.005
        assert r["finished_at"] >= r["sent_at"]
    return records


@pytest.fixture
def sim(toy_tokenizer_dir):
    with sim_process(toy_tokenizer_dir, "--block-size", str(BLOCK), "--ttft-ms", "30", "--itl-ms", "2",
                     "--prefill-ms-per-1k", "0") as server:
        yield server


def test_single_process_headless(tmp_path, toy_tokenizer_dir, sim):
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=40, gap_ms=50)
    output = tmp_path / "out" / "run.jsonl"
    proc = run_locust(replay_args(trace, toy_tokenizer_dir, sim.url, output), tmp_path)
    records = check_records(output, trace)
    assert {r["worker"] for r in records} == {0}
    assert all(r["ttft_ms"] >= 25 and r["itl_ms"] for r in records)
    assert sum(r["cached_tokens"] for r in records) > 0  # shared prefixes hit the sim's cache
    assert "Serving Benchmark Result" in proc.stdout
    assert "Successful requests:                     40 " in proc.stdout
    assert "Failed requests:                         0 " in proc.stdout
    assert (output.parent / "run.jsonl.meta.json").exists()  # metadata written beside the records
    assert len(list(read_records(f"{output}.worker-0.jsonl"))) == 40
    # Locust's own stats: one row per endpoint, each request counted once
    assert f"openai-chat  {sim.url}" in proc.stderr


def test_processes_two_workers(tmp_path, toy_tokenizer_dir, sim):
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=60, gap_ms=40)
    output = tmp_path / "run.jsonl"
    port = free_port()
    run_locust(replay_args(trace, toy_tokenizer_dir, sim.url, output, "--processes", "2",
                           "--master-bind-host", "127.0.0.1", "--master-host", "127.0.0.1",
                           "--master-bind-port", str(port), "--master-port", str(port)), tmp_path)
    records = check_records(output, trace)
    by_worker = {w: sum(r["worker"] == w for r in records) for w in (0, 1)}
    assert by_worker == {0: 30, 1: 30}  # round-robin
    assert percentile(sorted(r["drift_ms"] for r in records), 99) < 20


def _spawn(args: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen([*LOCUST, *args], cwd=cwd, stdout=open(log, "w"), stderr=subprocess.STDOUT, text=True)


def _master_and_workers(tmp_path, master_args, workers=2):
    port = free_port()
    master = _spawn([*master_args, "--master", "--expect-workers", str(workers), "--master-bind-host", "127.0.0.1",
                     "--master-bind-port", str(port)], tmp_path, tmp_path / "master.log")
    procs = [_spawn(["--worker", "--master-host", "127.0.0.1", "--master-port", str(port)], tmp_path,
                    tmp_path / f"worker{i}.log") for i in range(workers)]
    return master, procs


def _finish(procs: list[subprocess.Popen], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_master_and_two_workers(tmp_path, toy_tokenizer_dir, sim):
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=60, gap_ms=40)
    output = tmp_path / "run.jsonl"
    master, workers = _master_and_workers(tmp_path, replay_args(trace, toy_tokenizer_dir, sim.url, output))
    _finish([master, *workers])
    log = (tmp_path / "master.log").read_text()
    assert master.returncode == 0, log[-3000:]
    records = check_records(output, trace)
    assert {r["worker"] for r in records} == {0, 1}
    assert "clock offset" in log


def test_open_loop_slow_server(tmp_path, toy_tokenizer_dir):
    """A 2 s TTFT never delays later sends: drift stays small and TTFT is the server's, not queued."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=100, gap_ms=20, output_length=(2, 3))
    output = tmp_path / "run.jsonl"
    with sim_process(toy_tokenizer_dir, "--block-size", str(BLOCK), "--ttft-ms", "2000", "--itl-ms", "1",
                     "--prefill-ms-per-1k", "0", "--max-num-seqs", "1000") as server:
        run_locust(replay_args(trace, toy_tokenizer_dir, server.url, output), tmp_path)
    records = check_records(output, trace)
    drift = sorted(r["drift_ms"] for r in records)
    ttft = sorted(r["ttft_ms"] for r in records)
    assert percentile(drift, 99) < 5, drift[-5:]
    assert 1950 < percentile(ttft, 50) < 2300 and ttft[-1] < 2600, (ttft[:3], ttft[-3:])


def test_500_concurrent_streams_one_worker(tmp_path, toy_tokenizer_dir):
    """500 requests in flight at once on one worker: no client-side queueing (pool sized to demand)."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=500, gap_ms=1, output_length=(3, 5))
    output = tmp_path / "run.jsonl"
    with sim_process(toy_tokenizer_dir, "--block-size", str(BLOCK), "--ttft-ms", "1500", "--itl-ms", "5",
                     "--prefill-ms-per-1k", "0", "--max-num-seqs", "1000") as server:
        run_locust(replay_args(trace, toy_tokenizer_dir, server.url, output), tmp_path, timeout=120)
    records = check_records(output, trace)
    ttft = sorted(r["ttft_ms"] for r in records)
    # every request was sent before the first answer began: all 500 were in flight together
    assert max(r["sent_at"] for r in records) < min(r["sent_at"] + r["ttft_ms"] / 1000 for r in records)
    assert 1350 < percentile(ttft, 50) < 1650, percentile(ttft, 50)
    assert percentile(ttft, 90) < 1650, percentile(ttft, 90)


def _peak_in_flight(records: list[dict]) -> int:
    events = sorted([(r["sent_at"], 1) for r in records] + [(r["finished_at"], -1) for r in records])
    peak = now = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


def _time_wait_to(port: int) -> int:
    """Sockets in TIME_WAIT whose peer is `port`: connections this host closed first, each
    holding an ephemeral port for a minute."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return sum(1 for r in rows if r[3] == "06" and int(r[2].rsplit(":", 1)[1], 16) == port)


def test_connections_opened_follow_in_flight_demand(tmp_path, toy_tokenizer_dir):
    """A worker opens about as many connections as it has requests in flight, plus the sends
    due within WARM_S: not a multiple of it (a rate measured over 20 ms ticks overshot it, and
    the first warm-up opened a whole second of sends), and leaves none in TIME_WAIT. The sim
    receives every row exactly once."""
    from replay.locust.worker import MIN_SPARE, WARM_S

    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=300, gap_ms=5, output_length=(2, 3))  # 200 req/s
    output = tmp_path / "run.jsonl"
    with sim_process(toy_tokenizer_dir, "--block-size", str(BLOCK), "--ttft-ms", "500", "--itl-ms", "1",
                     "--prefill-ms-per-1k", "0", "--max-num-seqs", "1000") as server:
        run_locust(replay_args(trace, toy_tokenizer_dir, server.url, output), tmp_path)
        time.sleep(0.2)
        lingering = _time_wait_to(server.port)
        metrics = requests.get(server.url + "/metrics", timeout=5).text
        seen = requests.get(server.url + "/debug/requests", timeout=5).json()
    records = check_records(output, trace)
    opened = next(int(float(line.rsplit(" ", 1)[1])) for line in metrics.splitlines()
                  if line.startswith("sim:connections_accepted_total"))
    peak = _peak_in_flight(records)
    due_within_warm = int(WARM_S / 0.005) + 1
    assert 90 <= peak <= 130, peak  # 200 req/s x 0.5 s
    assert opened <= peak + due_within_warm + MIN_SPARE + 20, (opened, peak)  # before: 202 for 102
    assert lingering == 0, lingering
    assert seen["total"] + seen["without_id"] == 300 and set(seen["ids"].values()) <= {1}


def bailian_trace(path: Path, sessions: int = 8, turns: int = 3, gap_s: float = 0.1) -> Path:
    """Bailian rows: follow-up turns reference their parent chat and extend its hash ids."""
    rows = []
    chat = 0
    for s in range(sessions):
        parent, hashes = -1, []
        for turn in range(1, turns + 1):
            hashes = hashes + [10_000 * (s + 1) + 100 * turn + k for k in range(2)]
            rows.append({"chat_id": chat, "parent_chat_id": parent, "timestamp": round((s + turn * sessions) * gap_s, 3),
                         "input_length": len(hashes) * 16 - 3, "output_length": 4, "type": "text", "turn": turn,
                         "hash_ids": hashes})
            parent, chat = chat, chat + 1
    rows.sort(key=lambda r: r["timestamp"])
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def test_partition_session_keeps_sessions_on_one_worker(tmp_path, toy_tokenizer_dir, sim):
    trace = bailian_trace(tmp_path / "bailian.jsonl")
    output = tmp_path / "run.jsonl"
    port = free_port()
    run_locust(["--headless", "--host", sim.url, "--trace", str(trace), "--trace-format", "bailian",
                "--tokenizer", str(toy_tokenizer_dir), "--model", "sim", "--output", str(output),
                "--partition", "session", "--processes", "2", "--master-bind-host", "127.0.0.1",
                "--master-host", "127.0.0.1", "--master-bind-port", str(port), "--master-port", str(port)], tmp_path)
    records = check_records(output, trace)
    rows = [json.loads(line) for line in open(trace)]
    sessions: dict[str, list[dict]] = {}
    for r in records:
        assert r["session_id"] is not None
        sessions.setdefault(r["session_id"], []).append(r)
    assert len(sessions) == 8
    for recs in sessions.values():
        assert len({r["worker"] for r in recs}) == 1
        by_send = sorted(recs, key=lambda r: r["sent_at"])
        assert [rows[r["request_id"]]["turn"] for r in by_send] == [1, 2, 3]
    assert {r["worker"] for r in records} == {0, 1}


def test_killed_worker_rows_are_accounted_for(tmp_path, toy_tokenizer_dir, sim):
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=120, gap_ms=50)  # 6 s
    output = tmp_path / "run.jsonl"
    master, workers = _master_and_workers(tmp_path, replay_args(trace, toy_tokenizer_dir, sim.url, output))
    try:
        deadline = time.monotonic() + 60
        while "replay starts at" not in (tmp_path / "master.log").read_text():
            assert time.monotonic() < deadline and master.poll() is None, (tmp_path / "master.log").read_text()
            time.sleep(0.1)
        time.sleep(2.0)
        victim = workers[1]
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        _finish([master, workers[0]])
    finally:
        _finish([master, *workers], timeout=5)
    log = (tmp_path / "master.log").read_text()
    assert master.returncode == 0, log[-3000:]
    assert "lost" in log
    records = list(read_records(output))
    assert sorted(r["request_id"] for r in records) == sorted(trace_ids(trace))
    lost = [r for r in records if not r["ok"]]
    assert lost and all(r["error"] == "worker lost" for r in lost)
    (dead,) = {r["worker"] for r in lost}
    survivor = [r for r in records if r["worker"] == 1 - dead]
    assert len(survivor) == 60 and all(r["ok"] for r in survivor)
    assert 0 < len(lost) < 60  # the dead worker's rows answered before the kill kept their real records


@pytest.mark.parametrize("stream", ["--stream", "--no-stream"])
def test_tgi_adapter(tmp_path, toy_tokenizer_dir, sim, stream):
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=20, gap_ms=30)
    output = tmp_path / "run.jsonl"
    run_locust(replay_args(trace, toy_tokenizer_dir, sim.url, output, "--api", "tgi", stream), tmp_path)
    records = check_records(output, trace, exact_prompt=stream == "--stream")
    if stream == "--stream":
        assert all(r["ttft_ms"] is not None and len(r["itl_ms"]) == r["output_tokens"] - 1 for r in records)
    else:
        assert all(r["ttft_ms"] is None and r["itl_ms"] is None for r in records)


def test_run_time_stop_accounts_for_every_row(tmp_path, toy_tokenizer_dir, sim):
    """--run-time ends a replay early; rows it never sent are still in the merged file."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=100, gap_ms=100)  # 10 s
    output = tmp_path / "run.jsonl"
    run_locust(replay_args(trace, toy_tokenizer_dir, sim.url, output, "--run-time", "3s"), tmp_path)
    records = list(read_records(output))
    assert sorted(r["request_id"] for r in records) == sorted(trace_ids(trace))
    ok = [r for r in records if r["ok"]]
    stopped = [r for r in records if not r["ok"]]
    assert 5 < len(ok) < 60 and stopped
    assert all(r["error"] == "run stopped" and r["sent_at"] is None for r in stopped)
    assert min(r["request_id"] for r in stopped) > max(r["request_id"] for r in ok) - 3


def test_drain_timeout_fails_what_is_still_open(tmp_path, toy_tokenizer_dir):
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=5, gap_ms=50)
    output = tmp_path / "run.jsonl"
    with sim_process(toy_tokenizer_dir, "--block-size", str(BLOCK), "--ttft-ms", "20000") as server:
        started = time.monotonic()
        run_locust(replay_args(trace, toy_tokenizer_dir, server.url, output, "--drain-timeout", "1"), tmp_path)
        assert time.monotonic() - started < 15
    records = list(read_records(output))
    assert sorted(r["request_id"] for r in records) == sorted(trace_ids(trace))
    assert all(not r["ok"] and r["error"] == "drain timeout" for r in records)


def test_endpoints_fleet_round_robin(tmp_path, toy_tokenizer_dir, sim):
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=20, gap_ms=20)
    output = tmp_path / "run.jsonl"
    with sim_process(toy_tokenizer_dir, "--block-size", str(BLOCK), "--ttft-ms", "10") as other:
        args = replay_args(trace, toy_tokenizer_dir, sim.url, output, "--endpoints", f"{sim.url},{other.url}")
        run_locust(args, tmp_path)
    records = check_records(output, trace)
    by_time = sorted(records, key=lambda r: r["scheduled_at"])
    assert [r["endpoint"] for r in by_time[:4]] == [sim.url, other.url, sim.url, other.url]
    assert sum(r["endpoint"] == other.url for r in records) == 10


def test_bad_input_is_a_clear_error(tmp_path, toy_tokenizer_dir):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 20, "output_length": 3, "hash_ids": [1, 2]}\n'
                     '{"timestamp": 5, "input_length": -4, "output_length": 3, "hash_ids": [1]}\n')
    base = [*LOCUST, "--headless", "--host", "http://127.0.0.1:9", "--tokenizer", str(toy_tokenizer_dir)]
    proc = subprocess.run([*base, "--trace", str(trace), "--block-size", "16"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert f"{trace}:2: field 'input_length'" in proc.stderr
    proc = subprocess.run(base, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--trace is required" in proc.stderr

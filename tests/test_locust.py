"""End-to-end replays: real `locust` processes against a real `replay sim` on 127.0.0.1.

Each run is a few seconds of trace; every test checks the merged JSONL accounts for every
scheduled row exactly once.
"""

from __future__ import annotations

import gzip
import json
import signal
import subprocess
import time

import pytest
import requests

from replay.results.metadata import read_run_metadata
from replay.results.records import DRAIN_TIMEOUT, OVERSIZED, RUN_STOPPED, STOPPED_IN_FLIGHT, read_records
from replay.results.summary import percentile
from replay.sim.process import sim_process
from support.ports import free_port
from support.processes import LOCUST, finish, master_and_workers, replay_args, run_locust, run_replay
from support.records import check_records
from support.traces import BLOCK, bailian_trace, mooncake_trace, trace_ids
from support.waiting import wait_for, wait_for_text


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


@pytest.mark.alone
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
    # on schedule (precise drift: bench/dispatch.py); a worker that sent late, e.g. after its
    # set-up or behind the other's rows, would be hundreds of ms late
    assert percentile(sorted(r["drift_ms"] for r in records), 99) < 100


def test_master_and_two_workers(tmp_path, toy_tokenizer_dir, sim):
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=60, gap_ms=40)
    output = tmp_path / "run.jsonl"
    master, workers = master_and_workers(tmp_path, replay_args(trace, toy_tokenizer_dir, sim.url, output))
    finish([master, *workers])
    log = (tmp_path / "master.log").read_text()
    assert master.returncode == 0, log[-3000:]
    records = check_records(output, trace)
    assert {r["worker"] for r in records} == {0, 1}
    assert "clock offset" in log


@pytest.mark.alone
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
    # Open loop: a send waiting on an earlier answer would be >= 2000 ms late (precise drift,
    # p99 ~1-2 ms: bench/dispatch.py). 500 ms is what a loaded 2-core machine stays under.
    assert percentile(drift, 99) < 500, drift[-5:]
    # TTFT is the server's 2 s from the send, never a wait for a connection (>= 4 s)
    assert 1950 < percentile(ttft, 50) < 2500 and ttft[-1] < 3500, (ttft[:3], ttft[-3:])


@pytest.mark.alone
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
    # TTFT is the server's 1.5 s: a request queued behind another would wait a second 1.5 s
    assert 1350 < percentile(ttft, 50) < 2000, percentile(ttft, 50)
    assert percentile(ttft, 90) < 2500, percentile(ttft, 90)


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


@pytest.mark.alone
def test_connections_opened_follow_in_flight_demand(tmp_path, toy_tokenizer_dir):
    """A worker opens about as many connections as it has requests in flight, plus the sends
    due within WARM_S: not a multiple of it (a rate measured over 20 ms ticks overshot it, and
    the first warm-up opened a whole second of sends), and leaves none in TIME_WAIT. The sim
    receives every row exactly once."""
    from replay.engine.dispatcher import MIN_SPARE, WARM_S

    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=300, gap_ms=5, output_length=(2, 3))  # 200 req/s
    output = tmp_path / "run.jsonl"
    with sim_process(toy_tokenizer_dir, "--block-size", str(BLOCK), "--ttft-ms", "500", "--itl-ms", "1",
                     "--prefill-ms-per-1k", "0", "--max-num-seqs", "1000") as server:
        run_locust(replay_args(trace, toy_tokenizer_dir, server.url, output), tmp_path)
        # a connection closed with a FIN stays in TIME_WAIT for 60 s: a few seconds' polling hides none
        wait_for(lambda: _time_wait_to(server.port) == 0, "no connection to the sim left in TIME_WAIT", 5)
        metrics = requests.get(server.url + "/metrics", timeout=5).text
        seen = requests.get(server.url + "/debug/requests", timeout=5).json()
    records = check_records(output, trace)
    opened = next(int(float(line.rsplit(" ", 1)[1])) for line in metrics.splitlines()
                  if line.startswith("sim:connections_accepted_total"))
    peak = _peak_in_flight(records)
    due_within_warm = int(WARM_S / 0.005) + 1
    assert 90 <= peak <= 130, peak  # 200 req/s x 0.5 s
    assert opened <= peak + due_within_warm + MIN_SPARE + 20, (opened, peak)  # before: 202 for 102
    assert seen["total"] == 300 and seen["without_id"] == 0 and set(seen["ids"].values()) == {1}


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
    master, workers = master_and_workers(tmp_path, replay_args(trace, toy_tokenizer_dir, sim.url, output))
    try:
        wait_for_text(tmp_path / "master.log", "replay starts at", master)
        time.sleep(2.0)  # the scenario: a worker lost 2 s into a 6 s run
        victim = workers[1]
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        finish([master, workers[0]])
    finally:
        finish([master, *workers], timeout=5)
    log = (tmp_path / "master.log").read_text()
    assert master.returncode == 1, log[-3000:]  # rows were lost: the exit code says so
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
    never_sent = [r for r in stopped if r["error"] == RUN_STOPPED]
    cut_off = [r for r in stopped if r["error"] == STOPPED_IN_FLIGHT]
    assert len(never_sent) + len(cut_off) == len(stopped)
    assert never_sent and all(r["sent_at"] is None and r["endpoint"] is None for r in never_sent)
    assert all(r["sent_at"] is not None and r["endpoint"] == sim.url for r in cut_off)  # they loaded the server
    assert min(r["request_id"] for r in never_sent) > max(r["request_id"] for r in ok) - 3


def test_drain_timeout_fails_what_is_still_open(tmp_path, toy_tokenizer_dir):
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=5, gap_ms=50)
    output = tmp_path / "run.jsonl"
    with sim_process(toy_tokenizer_dir, "--block-size", str(BLOCK), "--ttft-ms", "20000") as server:
        started = time.monotonic()
        proc = run_locust(replay_args(trace, toy_tokenizer_dir, server.url, output, "--drain-timeout", "1"), tmp_path,
                          exit_code=1)
        assert time.monotonic() - started < 15
    records = list(read_records(output))
    assert sorted(r["request_id"] for r in records) == sorted(trace_ids(trace))
    assert all(not r["ok"] and r["error"] == DRAIN_TIMEOUT for r in records)
    # sent requests keep when and where they went: they did load the server
    assert all(r["sent_at"] is not None and r["endpoint"] == server.url and r["drift_ms"] is not None for r in records)
    assert f"5 x {DRAIN_TIMEOUT}" in proc.stdout


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
    cut = tmp_path / "cut.jsonl.gz"  # a download that stopped before the gzip trailer
    cut.write_bytes(gzip.compress(trace.read_bytes())[:-8])
    proc = subprocess.run([*base, "--trace", str(cut)], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"{cut}:3: field '(gzip)': truncated gzip file: ended after line 2" in proc.stderr
    proc = subprocess.run(base, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--trace is required" in proc.stderr


def test_a_row_beyond_any_replay_is_refused_on_the_master(tmp_path, toy_tokenizer_dir):
    """A row at 10^300 ms after one at 0 was accepted, and the worker's timer, given a send
    time it cannot hold, spun a core until stopped. The readers' span rule (what `replay trace
    validate` says too) refuses it before anything starts."""
    trace = tmp_path / "far.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 20, "output_length": 3}\n'
                     '{"timestamp": 1e300, "input_length": 20, "output_length": 3}\n')
    args = replay_args(trace, toy_tokenizer_dir, "http://127.0.0.1:9", tmp_path / "run.jsonl")
    proc = run_replay(args, tmp_path, 60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (f"replay: {trace}:2: field 'timestamp': 1e+297 s is past any trace's time (at most 1e+13 s from 0, in "
            "either direction)") in proc.stderr, proc.stderr[-2000:]


B = "(a block is never longer than the longest prompt)"


@pytest.mark.parametrize("flags, message", [
    (["--header", "Authorization Bearer x"], "--header 'Authorization Bearer x': expected 'Name: value'"),
    (["--header", "X-Token: a\r\nX-Evil: 1"], "--header 'X-Token': the value holds a line break or NUL"),
    (["--header", "Authorization: Bearer $REPLAY_TEST_UNSET"], "--header Authorization: $REPLAY_TEST_UNSET is not set on this host"),
    (["--header", "X-Price: 5$"], "--header X-Price: the '$' at character 2 of the value starts no $VAR"),
    (["--endpoints", "http://127.0.0.1:notaport"], "--endpoints http://127.0.0.1:notaport: the port is not a number"),
    (["--endpoints", "ftp://127.0.0.1:21"], "only http:// and https:// servers"),
    (["--scale", "nan"], "argument --scale: must be 0.001 to 10000, got nan"),
    (["--drain-timeout", "-5"], "argument --drain-timeout: must be 0 to 604800 seconds, got -5"),
    (["--duration", "nan"], "argument --duration: must be 0.001 to 315576000 trace seconds, got nan"),
    (["--max-requests", "0"], "no rows to replay in the window"),
    (["--start", "3600"], "no rows to replay in the window"),
    (["--server-metrics-interval", "-1"], "argument --server-metrics-interval: must be 0 (off) or 0.1 to 3600 "
                                          "seconds, got -1"),
    (["--server-metrics-interval", "1e-300"], "argument --server-metrics-interval: must be 0 (off) or 0.1 to 3600"),
    (["--server-metrics-interval", "nan"], "argument --server-metrics-interval: must be 0 (off) or 0.1 to 3600"),
    (["--server-block-size", "0"], "argument --server-block-size: must be 1 to 1048576 tokens"),
    (["--endpoints", "foo"], "--endpoints foo: not a server URL: give http://HOST[:PORT] or https://HOST[:PORT]"),
    (["--host", "notaurl"], "--host notaurl: not a server URL"),
    (["--endpoints", "localhost:8000"], "--endpoints localhost:8000: not a server URL"),
    (["--block-size", str(10**12)], f"argument --block-size: must be 1 to 1048576 tokens {B}, got 1000000000000"),
    (["--block-size", str(2**62)], f"argument --block-size: must be 1 to 1048576 tokens {B}, got {2**62}"),
    (["--block-size", "0"], f"argument --block-size: must be 1 to 1048576 tokens {B}, got 0"),
    (["--block-size", "-16"], f"argument --block-size: must be 1 to 1048576 tokens {B}, got -16"),
    (["--server-block-size", str(2**62)], f"argument --server-block-size: must be 1 to 1048576 tokens {B}, got {2**62}"),
    (["--slo", "ttft_ms=nan"], "--slo 'ttft_ms=nan': ttft_ms must be a finite number > 0, got nan"),
    (["--slo", "tpot_ms=inf"], "--slo 'tpot_ms=inf': tpot_ms must be a finite number > 0, got inf"),
    (["--slo", "e2e_ms=-5"], "--slo 'e2e_ms=-5': e2e_ms must be a finite number > 0, got -5"),
    (["--slo", "e2e_ms=0"], "--slo 'e2e_ms=0': e2e_ms must be a finite number > 0, got 0"),
    (["--scale", "1e-308"], "argument --scale: must be 0.001 to 10000, got 1e-308"),
    (["--scale", "1e-12"], "argument --scale: must be 0.001 to 10000, got 1e-12"),
    (["--scale", "inf"], "argument --scale: must be 0.001 to 10000, got inf"),
    (["--scale", "0"], "argument --scale: must be 0.001 to 10000, got 0"),
    (["--web-user", "admin"], "--web-user: expected USER:PASSWORD"),
    (["--header", "Content-Length: 5"], "--header 'Content-Length': set by the client itself (Content-Length, "
                                        "Transfer-Encoding, Host, Connection are)"),
    (["--header", "host: example.com"], "--header 'host': set by the client itself"),
    (["--header", "Transfer-Encoding: chunked"], "--header 'Transfer-Encoding': set by the client itself"),
    (["--header", "connection: close"], "--header 'connection': set by the client itself"),
    (["--seed", str(10**30)], f"argument --seed: must be 0 to {2**63 - 1}, got {10**30}"),
    (["--max-requests", str(2**64)], f"argument --max-requests: must be 0 to {2**63 - 1}, got {2**64}"),
    (["--max-prompt-tokens", str(10**30)], f"argument --max-prompt-tokens: must be 0 to {2**63 - 1} tokens, got {10**30}"),
    (["--start=-1e300"], "argument --start: must be -10000000000000 to 10000000000000 trace seconds, got -1e300"),
    (["--start=-1e13"], "--scale 1: the window's 1e+13 trace seconds (from --start -1e+13) would take 1e+13 s"),
])  # fmt: skip
def test_bad_options_refused_on_the_master(tmp_path, toy_tokenizer_dir, flags, message):
    """Checked once, before any worker starts or anything is sent (they used to fail on every
    worker, or hang, with exit 0): one line naming the option, exit 2."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=3, gap_ms=10)
    args = replay_args(trace, toy_tokenizer_dir, "http://127.0.0.1:9", tmp_path / "run.jsonl", *flags)
    proc = run_replay(args, tmp_path, 60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run.jsonl").exists()


def test_rows_over_the_served_context_are_recorded_not_sent(tmp_path, toy_tokenizer_dir):
    """A row longer than the served model's max_model_len (from /v1/models) is recorded as
    oversized without being synthesized (before: a 1e9-token row ate gigabytes and nothing was
    sent); --max-prompt-tokens overrides the server's figure. Warnings name the row's real line."""
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": i * 20, "input_length": 40, "output_length": 2} for i in range(6)]
    rows[2]["input_length"] = 1_000_000_000
    rows[4]["input_length"] = 3_000
    rows[5]["input_length"] = 1  # below the chat frame: a warning that names line 6
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    output = tmp_path / "run.jsonl"
    with sim_process(toy_tokenizer_dir, "--block-size", str(BLOCK), "--max-model-len", "2048") as server:
        proc = run_locust(replay_args(trace, toy_tokenizer_dir, server.url, output), tmp_path, exit_code=1)
        records = {r["request_id"]: r for r in read_records(output)}
        assert sorted(records) == list(range(6))
        assert {i for i, r in records.items() if not r["ok"]} == {2, 4}
        for i in (2, 4):
            assert records[i]["error"] == f"{OVERSIZED} (2048)" and records[i]["sent_at"] is None
        assert "trace rows over --max-prompt-tokens 2048, never sent: 2" in proc.stdout
        assert "(line 6)" in proc.stderr, proc.stderr[-3000:]
        assert read_run_metadata(output)["trace"]["rows_over_max_prompt_tokens"] == 2

        output = tmp_path / "run2.jsonl"
        run_locust(replay_args(trace, toy_tokenizer_dir, server.url, output, "--max-prompt-tokens", "5000"),
                   tmp_path, exit_code=1)
        records = {r["request_id"]: r for r in read_records(output)}
        assert {i for i, r in records.items() if not r["ok"]} == {2, 4}  # 4 sent now; the sim refuses it
        assert records[2]["error"] == f"{OVERSIZED} (5000)" and records[4]["status"] == 400


def test_skipped_bad_lines_are_counted_in_meta_and_summary(tmp_path, toy_tokenizer_dir, sim):
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=10, gap_ms=10)
    lines = trace.read_text().splitlines()
    lines[3] = '{"timestamp": 30, "input_length": "many"}'
    lines[7] = "not json"
    trace.write_text("\n".join(lines) + "\n")
    output = tmp_path / "run.jsonl"
    proc = run_locust(replay_args(trace, toy_tokenizer_dir, sim.url, output, "--on-bad-line", "skip"), tmp_path)
    assert "trace rows skipped as bad lines (--on-bad-line skip): 2" in proc.stdout
    meta = read_run_metadata(output)["trace"]
    assert meta["rows_skipped"] == 2 and meta["rows_in_file"] == 8 and meta["rows"] == 8
    assert [s.split(":")[1] for s in meta["skipped"]] == ["4", "8"]
    assert sum(1 for r in read_records(output) if r["ok"]) == 8


def test_a_workers_cpu_figure_is_not_known_before_locust_sampled_it():
    """Locust reports 0 until its first sample, and its first psutil reading is 0.0 by design:
    a probe's CPU figure is then not known (None), never a false 0%."""
    from types import SimpleNamespace

    from locust.runners import WorkerNode

    from replay.locust.plugin import _worker_cpu

    node = WorkerNode("w1")  # as the master holds a worker before its first sample
    master = SimpleNamespace(clients={"w1": node})
    assert _worker_cpu(master, "w1") is None
    node.cpu_usage = 37.5
    assert _worker_cpu(master, "w1") == 37.5
    assert _worker_cpu(SimpleNamespace(current_cpu_usage=0), "local") is None

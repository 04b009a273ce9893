"""The Replay view's data: a real master + 2 workers with Locust's web UI on loopback, started
through the HTTP API the Start button uses, read back from /replay/stats and checked against
the merged JSONL the run wrote; and, in one process, what the Host field shows and which Starts are
refused."""

from __future__ import annotations

import signal
from collections import Counter
from types import SimpleNamespace

import pytest
import requests
from engine_support import make_rows, spec_of
from locust.runners import STATE_INIT, STATE_RUNNING, STATE_STOPPED

from replay.locust.webui import start_refusal
from replay.results.records import RUN_STOPPED, STOPPED_IN_FLIGHT, read_records
from replay.trace import read_trace
from replay.trace.prefix import hit_tokens, prefix_hits
from support.ports import free_port
from support.processes import finish, replay_args, run_locust, start_web_locust, web_args
from support.traces import BLOCK, mooncake_trace
from support.waiting import wait_for


def test_the_host_field_shows_every_endpoint_as_shown(tmp_path):
    """--endpoints (a fleet): the field shows them all, credentials hidden; the run keeps them."""
    from replay.locust.plugin import _hide_host_credentials, _show_endpoints  # its listeners, only when asked

    environment = SimpleNamespace(host="http://u:secret@a:1")
    assert _hide_host_credentials(environment) == "http://u:secret@a:1" and "secret" not in environment.host
    spec = spec_of(make_rows(2), tmp_path, endpoints="http://a:1,http://u:secret@b:2")
    _show_endpoints(environment, spec)
    assert environment.host == "http://a:1,http://***@b:2"
    assert spec.endpoint_urls() == ["http://a:1", "http://u:secret@b:2"]
    spec.schedule.close()


def test_a_start_naming_another_host_is_refused():
    """The form's own value (or none) starts the run; another host, a second Start, a Start while running do not."""
    environment = SimpleNamespace(host="http://a:1,http://b:2", runner=SimpleNamespace(state=STATE_INIT))
    coordinator = SimpleNamespace(started_at=None, output="run.jsonl")
    assert start_refusal(coordinator, environment, "http://a:1,http://b:2") is None
    assert start_refusal(coordinator, environment, None) is None
    refused = start_refusal(coordinator, environment, "http://u:secret@c:3")
    assert "sends to http://a:1,http://b:2" in refused and "restart locust with --host" in refused
    assert "secret" not in refused and "http://***@c:3" in refused
    assert start_refusal(coordinator, SimpleNamespace(host=None, runner=environment.runner), "") is None
    coordinator.started_at = 1.0
    environment.runner.state = STATE_RUNNING
    assert "running" in start_refusal(coordinator, environment, "http://a:1,http://b:2")
    environment.runner.state = STATE_STOPPED
    assert "already run" in start_refusal(coordinator, environment, None)


def start_swarm(base: str, host: str) -> dict:
    """What Locust's form posts for a shape that hides the user count: the disabled fields' zeros."""
    return requests.post(f"{base}/swarm", data={"user_count": "0", "spawn_rate": "0", "host": host}, timeout=10).json()


@pytest.mark.parametrize("workers", [2, 0], ids=["master-2-workers", "local"])
def test_live_stats_match_the_records(tmp_path, toy_tokenizer_dir, sim, workers):
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=90, gap_ms=40)  # 3.6 s
    output = tmp_path / "run.jsonl"
    web_port = free_port()
    base = f"http://127.0.0.1:{web_port}"
    procs = start_web_locust(tmp_path, web_args(trace, toy_tokenizer_dir, sim.url, output, web_port), workers)
    master = procs[0]
    parts = max(workers, 1)
    try:
        wait_for(lambda: requests.get(f"{base}/worker-count", timeout=2).json()["worker_count"] == workers, "workers")
        index = requests.get(base, timeout=5).text
        assert '"hide_common_options": true' in index  # no user count to fill in: the shape drives
        assert 'id="replay-view-link"' in index and 'href="/replay"' in index
        page = requests.get(f"{base}/replay", timeout=5)
        assert page.status_code == 200 and "replay/stats" in page.text
        before = requests.get(f"{base}/replay/stats", timeout=5).json()
        assert before["run"]["state"] == "waiting" and before["progress"]["rows_total"] == 90

        started = start_swarm(base, sim.url)
        assert started["success"], started
        during = start_swarm(base, sim.url)  # what the UI's "Edit" posts while running
        assert not during["success"] and "running" in during["message"]

        seen_running = []

        def finished():
            s = requests.get(f"{base}/replay/stats", timeout=5).json()
            if s["run"]["state"] == "running" and 0 < s["progress"]["rows_sent"] < 90:
                seen_running.append(s)
            return s if s["run"]["state"] == "finished" else None

        final = wait_for(finished, "the replay to finish", timeout=60, every=0.3)
        assert seen_running, "never saw the run in progress"
        mid = seen_running[-1]
        assert [w["index"] for w in mid["workers"]] == list(range(parts))
        assert all(w["rows_assigned"] == 90 // parts and w["clock_offset_ms"] is not None for w in mid["workers"])

        # Locust's own stats count each request once (the workers' request events, merged on the
        # master). A worker reports them every few seconds (Locust's stats report interval), so
        # its last report may still be on its way when the replay has finished: waited for.
        def locust_counted_every_send():
            stats = requests.get(f"{base}/stats/requests", timeout=5).json()
            (total,) = [s for s in stats["stats"] if s["name"] == "Aggregated"]
            return stats if total["num_requests"] >= final["progress"]["rows_sent"] else None

        locust_stats = wait_for(locust_counted_every_send, "Locust's stats of every send", timeout=15, every=0.5)
        (aggregated,) = [s for s in locust_stats["stats"] if s["name"] == "Aggregated"]
        (tab,) = locust_stats["extended_stats"]
        assert tab["key"] == "replay" and [row["worker"] for row in tab["data"]] == [*map(str, range(parts)), "all"]

        again = start_swarm(base, sim.url)
        assert not again["success"] and "already run" in again["message"] and str(output) in again["message"]
        history = requests.get(f"{base}/replay/stats", params={"since": final["history"][-2]["t"]}, timeout=5).json()
        assert len(history["history"]) == 1
    finally:
        master.send_signal(signal.SIGTERM)
        finish(procs, timeout=20)
    log = (tmp_path / "master.log").read_text()
    assert "Unknown message" not in log and "Traceback" not in log, log[-3000:]

    records = list(read_records(output))
    assert len(records) == 90
    progress = final["progress"]
    assert progress == {"rows_total": 90, "rows_sent": sum(r["sent_at"] is not None for r in records), "rows_done": 90,
                        "trace_time_s": progress["trace_duration_s"], "trace_duration_s": 3.56}  # fmt: skip
    assert aggregated["num_requests"] == sum(r["sent_at"] is not None for r in records) == 90
    assert aggregated["num_failures"] == sum(not r["ok"] for r in records)
    for w in final["workers"]:
        mine = [r for r in records if r["worker"] == w["index"]]
        assert w["rows_assigned"] == len(mine) == 90 // parts
        assert w["rows_sent"] == sum(r["sent_at"] is not None for r in mine)
        assert w["failed"] == sum(not r["ok"] for r in mine)
        assert w["in_flight"] == 0 and not w["lost"]
        assert w["host"] and w["drift_p99_ms"] is not None
    failures = Counter(f"HTTP {r['status']}" if r["status"] and not 200 <= r["status"] < 300 else r["error"]
                       for r in records if not r["ok"])
    assert final["errors"] == dict(failures)

    latest = final["latest"]
    ok = [r for r in records if r["ok"]]
    observed = sum(r["cached_tokens"] for r in ok) / sum(r["prompt_tokens"] for r in ok)
    assert latest["cache_hit_ratio"] == pytest.approx(observed, abs=1e-4)
    rows = read_trace(trace, None, BLOCK).rows
    ideal_tokens = sum(hit_tokens(row, hits, BLOCK) for row, hits in zip(rows, prefix_hits(rows)))
    ideal = ideal_tokens / sum(r.input_length for r in rows)
    assert latest["ideal_cache_hit_ratio"] == pytest.approx(ideal, abs=1e-4)
    assert observed > 0 and ideal > 0
    assert latest["in_flight"] == 0
    # the endpoint's own side: the master's /metrics scrapes, beside the clients' view
    assert final["servers"] == [{"endpoint": sim.url, "scraped": True, "metrics": True}]
    (server,) = latest["servers"]
    assert server["cache_hit_ratio"] == latest["cache_hit_ratio"]
    assert server["ideal_cache_hit_ratio"] == latest["ideal_cache_hit_ratio"]
    assert server["server_hit_ratio"] == pytest.approx(observed, abs=1e-4)  # the sim counts as it reports
    assert server["running"] == server["waiting"] == 0 and server["kv_cache_usage"] == 0
    points = final["history"]
    assert any(p["servers"][0]["running"] is not None for p in points)
    assert len(points) >= 3 and all(p["t"] > q["t"] for p, q in zip(points[1:], points))
    assert any(p["ttft_p50_ms"] and p["ttft_p99_ms"] >= p["ttft_p50_ms"] >= 25 for p in points)
    assert any(p["output_tokens_per_s"] > 0 and p["input_tokens_per_s"] > p["output_tokens_per_s"] for p in points)


def test_headless_serves_no_view_and_workers_report_quietly(tmp_path, toy_tokenizer_dir, sim):
    """Headless master + 2 workers, --no-progress: the workers' live reports, which no progress
    line reads, are accepted without a word, and no line is printed (tests/test_progress.py's
    run has it)."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=30, gap_ms=40)
    output = tmp_path / "run.jsonl"
    port = free_port()
    proc = run_locust(replay_args(trace, toy_tokenizer_dir, sim.url, output, "--processes", "2",
                                  "--master-bind-host", "127.0.0.1", "--master-host", "127.0.0.1",
                                  "--master-bind-port", str(port), "--master-port", str(port), "--no-progress"),
                     tmp_path)  # fmt: skip
    assert "Unknown message" not in proc.stderr and "Traceback" not in proc.stderr
    assert "progress:" not in proc.stderr and "Serving Benchmark Result" in proc.stdout
    assert len(list(read_records(output))) == 30


def test_stop_button_mid_run_gives_exact_final_figures(tmp_path, toy_tokenizer_dir, sim):
    """Stopped from the UI: the rows never sent show up as 'run stopped' errors, all rows done."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=100, gap_ms=60)  # 6 s
    output = tmp_path / "run.jsonl"
    web_port = free_port()
    base = f"http://127.0.0.1:{web_port}"
    procs = start_web_locust(tmp_path, web_args(trace, toy_tokenizer_dir, sim.url, output, web_port), workers=0)
    try:
        wait_for(lambda: requests.get(base, timeout=2).ok, "the web UI")
        assert start_swarm(base, sim.url)["success"]
        wait_for(lambda: requests.get(f"{base}/replay/stats", timeout=2).json()["progress"]["rows_done"] >= 15,
                 "15 rows done")  # fmt: skip
        requests.post(f"{base}/stop", timeout=10)
        final = wait_for(lambda: (s := requests.get(f"{base}/replay/stats", timeout=2).json())["run"]["state"]
                         == "finished" and s, "the final figures")  # fmt: skip
    finally:
        procs[0].send_signal(signal.SIGTERM)
        finish(procs, timeout=20)
    records = list(read_records(output))
    never_sent = [r for r in records if r["error"] == RUN_STOPPED]
    cut_off = [r for r in records if r["error"] == STOPPED_IN_FLIGHT]  # in flight at the stop, if any
    # rows_done >= 15 when the stop was sent: at most 85 rows were unfinished then
    assert len(records) == 100 and never_sent and len(never_sent) + len(cut_off) <= 85
    assert all(r["ok"] for r in records if r not in never_sent and r not in cut_off)
    assert final["progress"]["rows_done"] == 100
    assert final["progress"]["rows_sent"] == sum(r["sent_at"] is not None for r in records)
    assert final["errors"] == {k: n for k, n in ((RUN_STOPPED, len(never_sent)), (STOPPED_IN_FLIGHT, len(cut_off))) if n}
    (worker,) = final["workers"]
    assert worker["failed"] == len(never_sent) + len(cut_off) and worker["in_flight"] == 0

"""The Replay view's model (replay.engine.live.LiveStats) in one process: a Coordinator on a
fake clock with a fake worker (tests/engine_support.py), no Locust process, no server. What the
view shows while the run goes (the last WINDOW_S seconds) and once it has ended (the whole
run, the summary's own figures), that the Replay tab's "all" row agrees with its workers', and
that the rows a stopped run's end records cost the master no memory each. The view in a real
browser is tests/test_browser_webui.py's."""

from __future__ import annotations

import json
import tracemalloc

import gevent
from engine_support import FakeClock, FakeWorker, make_rows, spec_of

from replay.engine import live, transport
from replay.engine.coordinator import CHUNK_ROWS
from replay.engine.live import SUMMARY_FIGURES, LiveStats
from replay.engine.transport import LOCAL_CLIENT, LocalLink
from replay.locust.webui import tab_rows
from replay.results.records import RUN_STOPPED
from replay.results.summary import percentile
from replay.rules.run_files import capacity_path, summary_path
from replay.run import driver

ROWS = 40
HELD = 50  # rows the fake worker takes ahead of its answers (its records are this process's too)


class VariedWorker(FakeWorker):
    """The fake endpoint with latencies that grow with the row, so a window and the whole run differ."""

    def _ship(self, records: list[dict]) -> None:
        for r in records:
            if r["ok"]:
                i = r["request_id"]
                r.update(ttft_ms=5.0 + i, tpot_ms=1.0 + i / 10, e2e_ms=10.0 + 2 * i, finished_at=r["sent_at"] + 0.01 * i,
                         server_queue_ms=i / 2, server_prefill_ms=3.0, server_decode_ms=4.0, server_ttft_ms=i / 2 + 3.0,
                         server_timing_source="answer")  # the server's own queue grows with the row too
        super()._ship(records)


def test_the_finished_view_shows_the_whole_run_as_the_summary(tmp_path):
    link, clock = LocalLink(), FakeClock()
    spec = spec_of(make_rows(ROWS, gap_s=0.05), tmp_path)
    coordinator = driver.start(spec, link, clock)
    stats = LiveStats(coordinator)
    VariedWorker(link, clock=clock).hello()
    gevent.sleep(0.001)
    coordinator.begin([(LOCAL_CLIENT, 0)])
    clock.drive(lambda: coordinator.recorded == ROWS)

    # the first half answered a minute ago: the live figures are the last WINDOW_S seconds' (the second half)
    stats.recent = type(stats.recent)((t - 60 if r["request_id"] < ROWS // 2 else t, r) for t, r in stats.recent)
    stats.tick()
    window_ttft = [5.0 + i for i in range(ROWS // 2, ROWS)]
    assert stats.latest["ttft_p99_ms"] == round(percentile(window_ttft, 99), 3)
    assert stats.latest["server_queue_p99_ms"] == round(percentile([i / 2 for i in range(ROWS // 2, ROWS)], 99), 3)
    live = stats.snapshot()
    assert live["run"]["latest_over"] == "window"
    (worker, everyone) = tab_rows(live)
    assert everyone["worker"] == "all" and everyone["drift_p99_ms"] == worker["drift_p99_ms"] != ""

    clock.drive(coordinator.finished.is_set)
    ending = gevent.spawn(coordinator.end)
    clock.drive(lambda: ending.dead)
    stats.on_stop()  # as the web UI's test_stop listener, after the coordinator's end
    final = stats.snapshot()
    summary = json.loads(summary_path(spec.output).read_text())
    assert final["run"]["state"] == "finished" and final["run"]["latest_over"] == "run"
    for key, path in SUMMARY_FIGURES.items():
        value = summary
        for part in path:
            value = value[part]
        assert final["latest"][key] == round(value, 3), key
    assert final["latest"]["ttft_p99_ms"] == round(percentile([5.0 + i for i in range(ROWS)], 99), 3)
    assert final["latest"]["ttft_p99_ms"] != round(percentile(window_ttft, 99), 3)
    assert final["latest"]["in_flight"] == 0
    assert final["latest"]["server_queue_p50_ms"] == round(percentile([i / 2 for i in range(ROWS)], 50), 3)
    (worker, everyone) = tab_rows(final)
    assert everyone["drift_p99_ms"] == worker["drift_p99_ms"] == final["latest"]["drift_p99_ms"]
    assert everyone["failed"] == worker["failed"] == 0 and everyone["rows_sent"] == worker["rows_sent"] == ROWS


def test_a_capacity_search_shows_its_probe_under_way_and_those_judged(tmp_path):
    link, clock = LocalLink(), FakeClock()
    spec = spec_of(make_rows(ROWS, gap_s=1.0 / ROWS), tmp_path, capacity_search=True, slo="ttft_ms=100",
                   probe_duration=1.0, cooldown=1.0, search_range="0.5:4", search_precision=0.1)
    coordinator = driver.start(spec, link, clock)
    stats = LiveStats(coordinator)
    assert LiveStats(driver.start(spec_of(make_rows(2), tmp_path / "plain"), LocalLink(), clock)).snapshot()["capacity"] is None
    fake = FakeWorker(link, clock=clock, answer_first=ROWS + 50).hello()  # probe 0 (1x), then 50 of probe 1's 80 rows
    gevent.sleep(0.001)
    coordinator.begin([(LOCAL_CLIENT, 0)])
    clock.drive(lambda: fake.answered == ROWS + 50 and coordinator.recorded == ROWS + 50)

    capacity = stats.snapshot()["capacity"]
    assert capacity["current"] == {"probe": 1, "factor": 2.0, "rows": 2 * ROWS, "recorded": 50, "good": 50,
                                   "goodput_so_far": 1.0, "can_pass": True, "repeat_of": None}
    assert [(p["probe"], p["factor"], p["verdict"]) for p in capacity["probes"]] == [(0, 1.0, "pass")]
    assert capacity["bracket"] == [1.0, None] and capacity["result"] is None

    fake.release(10_000)
    clock.drive(coordinator.finished.is_set)
    ending = gevent.spawn(coordinator.end)
    clock.drive(lambda: ending.dead)
    stats.on_stop()
    final = stats.snapshot()["capacity"]
    report = json.loads(capacity_path(spec.output).read_text())
    assert final["current"] is None and final["result"] == report["result"] == "at least HI"
    assert [(p["factor"], p["verdict"], p["rows"]) for p in final["probes"]] == \
        [(p["factor"], p["verdict"], p["rows"]) for p in report["probes"]]


def test_a_stopped_runs_end_grows_the_master_by_no_record_a_row(tmp_path, monkeypatch):
    """The end of a run stopped early records every row left (millions, on a big trace), in
    batches of CHUNK_ROWS, with the views a real master has attached (the progress line's and
    the Replay view's): what the master holds meanwhile grows by a few bytes a row left, never by
    a record (some 700 bytes). Two sizes past what is bounded whatever the rows (the rows sent
    ahead to a worker, transport.HOLD_ROWS; the views' history), so that only what grows with
    them is counted."""
    monkeypatch.setattr(live, "HISTORY", 10)
    small = 2 * transport.HOLD_ROWS
    large = small + 40 * CHUNK_ROWS
    grown = _end_peak(tmp_path / "large", large) - _end_peak(tmp_path / "small", small)
    print(f"{large - small:,} more rows left: the end's peak grew {grown:,} bytes")
    assert grown < 100 * (large - small), f"{large - small:,} more rows left: the end's peak grew {grown:,} bytes"


def _end_peak(folder, rows: int) -> int:
    """The traced memory's peak over its start while a run of `rows`, stopped after 10
    answers, ends."""
    link, clock = LocalLink(), FakeClock()
    coordinator = driver.start(spec_of(make_rows(rows), folder), link, clock)
    views = [LiveStats(coordinator, view=False), LiveStats(coordinator)]
    FakeWorker(link, answer_first=10, hold=HELD, clock=clock).hello()
    gevent.sleep(0.001)
    coordinator.begin([(LOCAL_CLIENT, 0)])
    clock.drive(lambda: coordinator.recorded >= 10)
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        ending = gevent.spawn(coordinator.end)
        clock.drive(lambda: ending.dead)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert coordinator.recorded == rows
    for view in views:  # the rows left are counted, and kept out of the window: they have no latency
        assert len(view.recent) == sum(view.sent.values()) == 10 and view.errors[RUN_STOPPED] == rows - 10
    return peak - before

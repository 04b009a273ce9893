"""The progress line of a headless run (replay.engine.progress): its wording, a pure function;
its timing and its figures over a Coordinator in one process on a fake clock
(tests/engine_support.py); and one real `locust --headless` run against `replay sim`, where
the line comes at least every 5 s and is finished before the summary (`--no-progress`, which has
none: tests/test_webui.py's headless master and workers)."""

from __future__ import annotations

import io
import logging
import re
from datetime import datetime

import gevent
from engine_support import FakeClock, FakeWorker, make_rows, spec_of

from replay.engine.coordinator import Coordinator
from replay.engine.live import LiveStats
from replay.engine.progress import ERASE, LOG_INTERVAL_S, TTY_INTERVAL_S, ProgressLine, progress_line
from replay.engine.transport import LOCAL_CLIENT, LocalLink
from replay.run import driver
from support.processes import replay_args, run_replay
from support.traces import mooncake_trace

FIGURES = {
    "state": "running", "rows_sent": 1234, "rows_total": 5000, "ok": 1200, "failed": 3,
    "trace_time_s": 725.4, "trace_duration_s": 3600.0, "elapsed_s": 726.0, "eta_s": 2875.0,
    "drift_p99_ms": 1.234, "in_flight": 34,
}  # fmt: skip
LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\] (progress: .*)$", re.M)


def test_the_line_words_the_figures():
    assert progress_line(FIGURES) == (
        "progress: running | sent 1234/5000 (24.7%) | ok 1200 failed 3 | trace 12:05/1:00:00 | elapsed 12:06"
        " | ETA 47:55 | drift p99 1.2 ms | in flight 34")
    before = {**FIGURES, "state": "preparing", "rows_sent": 0, "ok": 0, "failed": 0, "trace_time_s": 0.0,
              "elapsed_s": None, "eta_s": None, "drift_p99_ms": None, "in_flight": 0}
    assert progress_line(before) == ("progress: preparing | sent 0/5000 (0.0%) | ok 0 failed 0 | trace 0:00/1:00:00"
                                     " | elapsed - | ETA - | drift p99 - | in flight 0")
    assert "sent 0/0 |" in progress_line({**before, "rows_total": 0})  # an empty window: no share
    assert "drift p99 1234 ms" in progress_line({**FIGURES, "drift_p99_ms": 1234.4})


def _run(tmp_path, stream: io.StringIO, tty: bool):
    """50 rows, the fake worker answers 30 (every tenth HTTP 500) and holds the rest; the progress
    line of the live figures on `stream`, started with the run as the plugin starts it."""
    clock, link = FakeClock(), LocalLink()
    coordinator = driver.start(spec_of(make_rows(50, gap_s=1.0), tmp_path), link, clock)
    FakeWorker(link, answer=lambda row: 500 if row.request_id % 10 == 0 else 200, answer_first=30).hello()
    printer = ProgressLine(LiveStats(coordinator, view=False), stream, clock, tty=tty)
    gevent.sleep(0.001)
    coordinator.begin([(LOCAL_CLIENT, 0)])
    printer.start()
    clock.drive(lambda: coordinator.recorded == 30)
    return clock, coordinator, printer


def _end(clock: FakeClock, coordinator: Coordinator) -> None:
    """The run's end (the held rows recorded, the files written), driven on the clock."""
    ending = gevent.spawn(coordinator.end)
    clock.drive(lambda: ending.dead)
    ending.get()


def test_plain_lines_every_interval_with_the_live_figures(tmp_path):
    stream = io.StringIO()
    clock, coordinator, printer = _run(tmp_path, stream, tty=False)
    start = clock.now()
    clock.drive(lambda: clock.now() >= start + 3 * LOG_INTERVAL_S)
    printer.stop()
    printer.stop()  # test_stop, then quitting: the last line once
    lines = LINE.findall(stream.getvalue())
    assert len(lines) == len(stream.getvalue().splitlines())  # nothing else, each a whole line
    stamps = [datetime.strptime(s, "%Y-%m-%d %H:%M:%S,%f").timestamp() for s, _ in lines]
    assert all(b - a <= LOG_INTERVAL_S + 0.25 for a, b in zip(stamps, stamps[1:]))  # the clock moves by 0.25 s
    assert lines[0][1].startswith("progress: preparing | sent 0/50 (0.0%) | ok 0 failed 0 | trace 0:00/0:49")
    assert lines[-1][1].startswith("progress: running | sent 30/50 (60.0%) | ok 27 failed 3 | trace 0:")
    _end(clock, coordinator)


def test_on_a_terminal_one_line_redrawn_erased_for_log_records_finished_at_stop(tmp_path):
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    log = logging.getLogger("test_progress")
    log.addHandler(handler)
    try:
        clock, coordinator, printer = _run(tmp_path, stream, tty=True)
        assert printer.interval == TTY_INTERVAL_S
        clock.drive(lambda: stream.getvalue().count("progress:") >= 3)
        log.warning("a log record")
        printer.stop()
    finally:
        log.removeHandler(handler)
    text = stream.getvalue()
    assert "\n" not in text.split("a log record")[0]  # the line was redrawn in place, not scrolled
    assert text.split("a log record")[0].endswith(ERASE)  # erased before the record was written
    assert text.endswith("\n") and text.count("\n") == 2  # the record's, and the last line's
    last = text.rsplit(ERASE, 1)[1]
    assert last.startswith("progress: running | sent 30/50 (60.0%) | ok 27 failed 3")
    assert len(last) <= 80  # cut to the terminal's width (80 where it cannot be read)
    assert not handler.filters  # the filter goes with the line
    _end(clock, coordinator)


def test_a_headless_run_prints_the_line_at_least_every_5_s(tmp_path, toy_tokenizer_dir, fast_sim):
    """With --only-summary, as `make demo` runs: Locust prints nothing else while it runs."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=34, gap_ms=300)  # about 10 s: lines at 0, 4, 8 s and the last
    args = replay_args(trace, toy_tokenizer_dir, fast_sim.url, tmp_path / "run.jsonl", "--only-summary")
    proc = run_replay(args, tmp_path, 90, stderr_to_stdout=True)  # both streams in one, in the order they were written
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:]
    lines = LINE.findall(out)
    stamps = [datetime.strptime(s, "%Y-%m-%d %H:%M:%S,%f").timestamp() for s, _ in lines]
    assert stamps[-1] - stamps[0] >= 9 and len(lines) >= 4, out[-4000:]
    assert max(b - a for a, b in zip(stamps, stamps[1:])) <= 5.0, out[-4000:]
    assert lines[-1][1].startswith("progress: done | sent 34/34 (100.0%) | ok 34 failed 0 | trace 0:10/0:10")
    assert out.index(lines[-1][1]) < out.index("Serving Benchmark Result")  # finished before the summary

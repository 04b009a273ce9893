"""The Coordinator in one process, on a fake clock, with fake workers (tests/engine_support.py):
no trace file, no tokenizer, no server, no Locust. What a run's rows are labelled with, how
workers coming and going are handled, how rows are shipped (chunks, windows, acks), and the exit
code. The real Dispatcher against a real server is tests/test_engine.py's; real Locust
processes are tests/test_distributed.py's."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import replace

import gevent
import pytest
from engine_support import FakeClock, FakeWorker, Hub, failed_record, make_rows, spec_of

from replay.engine import coordinator as coordinator_module
from replay.engine import transport
from replay.engine.coordinator import CHUNK_ROWS, READY_TIMEOUT_S, listen_for_hellos
from replay.engine.error_rate import DEFAULT_MAX_ERROR_RATE, MIN_ANSWERS, WINDOW_S
from replay.engine.transport import LOCAL_CLIENT, LocalLink
from replay.results.metadata import read_run_metadata
from replay.results.records import (
    DRAIN_TIMEOUT,
    NO_RECORD,
    OUTPUT_ERROR,
    OVERSIZED,
    REFUSED,
    RUN_STOPPED,
    WORKER_FAILED,
    WORKER_LOST,
    WORKER_STOPPED,
    error_rate_label,
    read_records,
)
from replay.rules.run_files import meta_path, summary_path
from replay.run import driver


class Run:
    """A Coordinator for `spec` on a fake clock, its exit codes and lost workers noted."""

    def __init__(self, spec, link: transport.Link, clock: FakeClock | None = None, **kwargs):
        self.spec, self.link = spec, link
        self.clock = clock or FakeClock()
        self.exit_codes: list[int] = []
        self.gone: set[str] = set()
        self.coordinator = driver.start(spec, link, self.clock, worker_gone=self.gone.__contains__,
                                       on_exit_code=self.exit_codes.append, **kwargs)

    def begin(self, workers=((LOCAL_CLIENT, 0),)) -> Run:
        gevent.sleep(0.001)  # the workers' HELLO is in
        self.coordinator.begin(list(workers))
        return self

    def until(self, condition) -> None:
        self.clock.drive(condition)

    def finish(self) -> dict[int, dict]:
        """Until the run ends by itself, then its end; the merged records by request id."""
        self.until(self.coordinator.finished.is_set)
        return self.end()

    def end(self) -> dict[int, dict]:
        """The end (a user's stop when the run has not ended by itself), driven on the clock."""
        ending = gevent.spawn(self.coordinator.end)
        self.until(lambda: ending.dead)
        ending.get()
        records = list(read_records(self.spec.output))
        assert [r["request_id"] for r in records] == sorted(r["request_id"] for r in records)
        return {r["request_id"]: r for r in records}


def labels(records: dict[int, dict]) -> Counter:
    return Counter("ok" if r["ok"] else r["error"] for r in records.values())


# -- the start: built from values, no I/O -----------------------------------------------------------

def test_a_coordinator_is_built_without_a_trace_a_tokenizer_or_a_server(tmp_path):
    spec = spec_of(make_rows(10), tmp_path, server_metrics_interval=1.0)
    c = driver.start(spec, LocalLink(), FakeClock())
    assert list(tmp_path.iterdir()) == []  # nothing written, nothing asked: the files come with `begin`
    assert c.scraper is None and c.total == 10 and c.store is None


def test_the_engine_hands_its_outcome_to_its_driver_and_writes_no_end_of_its_own(tmp_path):
    """The engine ends a run by handing its Outcome to the `on_end` it was given (the driver's:
    replay.run.driver), and sets the exit code that returns; alone, it writes the records and
    the first meta, never the run's end (the summary)."""
    spec = spec_of(make_rows(6), tmp_path)
    outcomes, codes = [], []
    c = coordinator_module.Coordinator(spec, LocalLink(), FakeClock(), on_exit_code=codes.append,
                                       on_end=lambda outcome: outcomes.append(outcome) or 7)
    c.cancel()  # every row recorded as never sent
    [outcome] = outcomes
    assert c.end() is outcome and outcome.store.count == 6 and outcome.spec is spec
    assert outcome.least_code == 0 and outcome.capacity is None and outcome.incomplete == {}
    assert codes == [7] and not summary_path(spec.output).exists()
    driven = driver.start(spec_of(make_rows(6), tmp_path / "driven"), LocalLink(), FakeClock())
    driven.cancel()
    assert summary_path(driven.spec.output).exists()  # the driver's end: finish


def test_every_row_ok_exit_code_0(tmp_path):
    rows = 2 * CHUNK_ROWS + 234  # three ROWS chunks
    spec = spec_of(make_rows(rows), tmp_path)
    link = LocalLink()
    run = Run(spec, link)
    worker = FakeWorker(link).hello()
    run.begin()
    records = run.finish()
    assert labels(records) == {"ok": rows}
    assert run.coordinator.end_reason == "complete" and run.exit_codes == []
    assert worker.applied == [0, 1, 2] and run.coordinator.workers[LOCAL_CLIENT].acked == {0, 1, 2}
    assert worker.chunks_seen == [0, 1, 2]  # each once: every chunk was acked in time
    meta = read_run_metadata(spec.output)
    assert meta["complete"] and meta["run_id"] == "testrun" and meta["trace"]["rows"] == rows
    assert meta["epoch"] == run.coordinator.epoch and meta["workers"][0]["rows_assigned"] == rows
    assert summary_path(spec.output).exists()


def test_a_hello_during_the_preflight_is_kept(tmp_path):
    """A worker that connects while the preflight loads says HELLO before the Coordinator
    exists: listen_for_hellos keeps it, and the plan goes to that worker at the start."""
    link = LocalLink()
    heard = listen_for_hellos(link)
    worker = FakeWorker(link).hello()
    gevent.sleep(0.001)
    run = Run(spec_of(make_rows(20), tmp_path), link, heard=heard).begin()
    assert labels(run.finish()) == {"ok": 20} and worker.plan is not None


def test_the_scraper_is_made_as_the_run_begins(tmp_path):
    spec = spec_of(make_rows(5), tmp_path, server_metrics_interval=0.5)
    link = LocalLink()
    run = Run(spec, link)
    FakeWorker(link).hello()
    assert run.coordinator.scraper is None
    run.begin()
    assert run.coordinator.scraper is not None and run.coordinator.scraper.endpoints == [spec.endpoint_urls()[0]]
    assert labels(run.finish()) == {"ok": 5}


# -- labels and exit codes ---------------------------------------------------------------------------

def test_a_failed_row_makes_exit_code_1(tmp_path):
    link = LocalLink()
    run = Run(spec_of(make_rows(70), tmp_path), link)
    FakeWorker(link, answer=lambda row: 500 if row.request_id % 7 == 0 else 200).hello()
    run.begin()
    assert labels(run.finish()) == {"ok": 60, "HTTP 500": 10}
    assert run.exit_codes == [1]


def test_a_user_stop_labels_the_rest_run_stopped_exit_code_untouched(tmp_path):
    link = LocalLink()
    run = Run(spec_of(make_rows(600), tmp_path), link)
    worker = FakeWorker(link, answer_first=100).hello()
    run.begin()
    run.until(lambda: run.coordinator.recorded >= 100)
    records = run.end()
    assert labels(records) == {"ok": 100, RUN_STOPPED: 500}
    assert worker.aborted == RUN_STOPPED and run.coordinator.end_reason is None and run.exit_codes == []


def test_held_rows_the_worker_never_returns_are_no_record_exit_code_1(tmp_path):
    """At a user's stop, a worker that does not answer the abort: the rows it confirmed holding
    are "no record from worker" (a failure, whoever stopped the run)."""
    link = LocalLink()
    run = Run(spec_of(make_rows(50), tmp_path), link)
    FakeWorker(link, answer_first=10, hears_abort=False).hello()
    run.begin()
    run.until(lambda: run.coordinator.recorded >= 10)
    assert labels(run.end()) == {"ok": 10, NO_RECORD: 40}
    assert run.exit_codes == [1]


def test_a_stop_before_the_start_records_every_row_run_stopped(tmp_path):
    spec = spec_of(make_rows(30), tmp_path)
    run = Run(spec, LocalLink())
    run.coordinator.cancel()
    assert labels({r["request_id"]: r for r in read_records(spec.output)}) == {RUN_STOPPED: 30}
    assert run.exit_codes == [] and meta_path(spec.output).exists() and summary_path(spec.output).exists()


def test_the_drain_timeout_ends_the_run(tmp_path):
    """Rows still unanswered --drain-timeout (+ DRAIN_GRACE_S) after the last send: the run
    ends by itself, the worker records its held rows with the drain's label."""
    link = LocalLink()
    run = Run(spec_of(make_rows(50), tmp_path, drain_timeout=30.0), link)
    FakeWorker(link, answer_first=10).hello()
    run.begin()
    records = run.finish()
    assert run.coordinator.end_reason == DRAIN_TIMEOUT and run.clock.t > run.coordinator.last_due + 30.0
    assert labels(records) == {"ok": 10, DRAIN_TIMEOUT: 40} and run.exit_codes == [1]


def test_the_supervisor_ticks_once_a_second_after_the_go_of_a_plain_run(tmp_path):
    """Once the rows went out, what the supervisor watches (a lost worker, the drain's deadline)
    needs no quarter-second tick: an idle run wakes it once a second, and the drain still ends
    the run within a tick of its deadline."""
    link = LocalLink()
    run = Run(spec_of(make_rows(50), tmp_path, drain_timeout=30.0), link)
    FakeWorker(link, answer_first=10).hello()
    sleeps: list[float] = []
    sleep = run.clock.sleep
    run.clock.sleep = lambda seconds: (sleeps.append(seconds), sleep(seconds))[1]
    run.begin()
    run.until(lambda: run.coordinator.last_due is not None and run.clock.t > run.coordinator.last_due)
    before = len(sleeps)
    run.finish()
    assert run.coordinator.end_reason == DRAIN_TIMEOUT
    deadline = run.coordinator.last_due + 30.0 + coordinator_module.DRAIN_GRACE_S
    assert run.clock.t <= deadline + coordinator_module.QUIET_TICK_S + 0.5
    assert len(sleeps) - before <= 30.0 + coordinator_module.DRAIN_GRACE_S + 3, sleeps[before:]


def test_oversized_rows_are_recorded_never_sent(tmp_path):
    rows = [r if r.request_id % 5 else replace(r, input_length=500) for r in make_rows(25)]
    link = LocalLink()
    run = Run(spec_of(rows, tmp_path, max_prompt_tokens=100), link)
    worker = FakeWorker(link).hello()
    run.begin()
    records = run.finish()
    assert labels(records) == {"ok": 20, f"{OVERSIZED} (100)": 5}
    assert {row.request_id for row in worker.rows} == {i for i in range(25) if i % 5}  # never shipped
    assert run.exit_codes == [1] and read_run_metadata(run.spec.output)["trace"]["rows_over_max_prompt_tokens"] == 5


def test_a_worker_that_cannot_write_its_file_stops_the_run(tmp_path):
    link = LocalLink()
    run = Run(spec_of(make_rows(40), tmp_path), link)
    worker = FakeWorker(link, answer_first=10).hello()
    run.begin()
    run.until(lambda: run.coordinator.recorded >= 10)
    worker.fault("run.jsonl.worker-0.jsonl", "No space left on device")
    records = run.finish()
    assert run.coordinator.end_reason == OUTPUT_ERROR
    assert labels(records) == {"ok": 10, OUTPUT_ERROR: 30} and run.exit_codes == [1]
    meta = read_run_metadata(run.spec.output)
    assert not meta["complete"] and meta["incomplete"] == [{"file": "run.jsonl.worker-0.jsonl",
                                                             "error": "No space left on device"}]


def test_a_worker_that_cannot_replay_fails_its_rows(tmp_path):
    hub = Hub()
    run = Run(spec_of(make_rows(40), tmp_path), hub.master)
    FakeWorker(hub.worker("w0")).hello()
    FakeWorker(hub.worker("w1"), error="tokenizer mismatch: this worker's differs").hello()
    run.begin([("w0", 0), ("w1", 1)])
    records = run.finish()
    assert labels(records) == {"ok": 20, f"{WORKER_FAILED}: tokenizer mismatch: this worker's differs": 20}
    assert run.exit_codes == [1]


# -- churn: workers lost, late, slow --------------------------------------------------------------

def test_a_worker_lost_mid_run(tmp_path):
    hub = Hub()
    run = Run(spec_of(make_rows(40), tmp_path), hub.master)
    FakeWorker(hub.worker("w0")).hello()
    FakeWorker(hub.worker("w1"), answer_first=5).hello()
    run.begin([("w0", 0), ("w1", 1)])
    run.until(lambda: run.coordinator.recorded >= 25)
    hub.cut.add("w1")
    run.gone.add("w1")
    records = run.finish()
    assert labels(records) == {"ok": 25, WORKER_LOST: 15}
    assert {r["worker"] for r in records.values() if r["error"] == WORKER_LOST} == {1}
    assert run.exit_codes == [1]
    assert [w["lost"] for w in read_run_metadata(run.spec.output)["workers"]] == [False, True]


def test_every_worker_lost_ends_the_run(tmp_path):
    hub = Hub()
    run = Run(spec_of(make_rows(10), tmp_path), hub.master)
    FakeWorker(hub.worker("w0"), answer_first=3).hello()
    run.begin([("w0", 0)])
    run.until(lambda: run.coordinator.recorded >= 3)
    run.gone.add("w0")
    assert labels(run.finish()) == {"ok": 3, WORKER_LOST: 7} and run.exit_codes == [1]


def test_a_worker_stopped_by_its_own_signal(tmp_path):
    hub = Hub()
    run = Run(spec_of(make_rows(20), tmp_path), hub.master)
    FakeWorker(hub.worker("w0")).hello()
    w1 = FakeWorker(hub.worker("w1"), answer_first=2).hello()
    run.begin([("w0", 0), ("w1", 1)])
    run.until(lambda: run.coordinator.recorded >= 12)
    w1.stopped()
    gevent.sleep(0.001)
    hub.cut.add("w1")
    run.gone.add("w1")
    assert labels(run.finish()) == {"ok": 12, WORKER_STOPPED: 8} and run.exit_codes == [1]


@pytest.mark.parametrize("master_signalled", [None, "before", "within the grace"])
def test_a_signal_in_the_masters_process_group(tmp_path, master_signalled):
    """A worker in the master's process group reports a stop signal: the master's own stop if the
    master got one too (before, or within SHARED_SIGNAL_GRACE_S after: a group's signal reaches
    both, handled in either order), its rows "run stopped", exit 0; else the worker's own, which
    the master's abort tells it: "worker stopped", exit 1, the other worker's rows all answered."""
    hub = Hub()
    run = Run(spec_of(make_rows(20), tmp_path), hub.master)
    FakeWorker(hub.worker("w0")).hello()
    w1 = FakeWorker(hub.worker("w1"), answer_first=2).hello()
    run.begin([("w0", 0), ("w1", 1)])
    run.until(lambda: run.coordinator.recorded >= 12)
    if master_signalled == "before":
        run.coordinator.stop_signal_received()
    w1.stopped(shared=True)
    gevent.sleep(0.001)
    if master_signalled == "within the grace":
        run.clock.advance(coordinator_module.SHARED_SIGNAL_GRACE_S * 0.9)
        gevent.sleep(0.001)
        run.coordinator.stop_signal_received()
    if master_signalled is None:
        run.until(lambda: w1.aborted is not None)
        assert w1.aborted == WORKER_STOPPED
        hub.cut.add("w1")
        run.gone.add("w1")
        assert labels(run.finish()) == {"ok": 12, WORKER_STOPPED: 8} and run.exit_codes == [1]
    else:
        run.clock.advance(coordinator_module.SHARED_SIGNAL_GRACE_S * 2)
        gevent.sleep(0.001)
        assert w1.aborted is None  # no verdict: the master's stop decides
        assert labels(run.end()) == {"ok": 12, RUN_STOPPED: 8} and run.exit_codes == []


def test_a_late_worker_gets_no_rows(tmp_path):
    hub = Hub()
    run = Run(spec_of(make_rows(20), tmp_path), hub.master)
    FakeWorker(hub.worker("w0")).hello()
    run.begin([("w0", 0)])
    late = FakeWorker(hub.worker("w1")).hello()
    records = run.finish()
    assert late.idle is not None and "connected after the replay began" in late.idle and late.plan is None
    assert labels(records) == {"ok": 20} and run.exit_codes == []


def test_a_worker_never_ready_is_started_anyway(tmp_path, caplog):
    hub = Hub()
    run = Run(spec_of(make_rows(20), tmp_path), hub.master)
    FakeWorker(hub.worker("w0")).hello()
    slow = FakeWorker(hub.worker("w1"), ready=False).hello()
    run.begin([("w0", 0), ("w1", 1)])
    with caplog.at_level(logging.WARNING, logger=coordinator_module.__name__):
        run.until(lambda: run.coordinator.epoch is not None)
    assert run.clock.t - run.coordinator.started_at > READY_TIMEOUT_S
    assert "not every worker got ready" in caplog.text
    assert labels(run.finish()) == {"ok": 20} and slow.go is not None


# -- shipping rows: chunks and windows ----------------------------------------------------------------

@pytest.mark.parametrize("partition", ["round-robin", "session"])
def test_rows_are_split_across_workers(tmp_path, partition):
    hub = Hub()
    spec = spec_of(make_rows(90, sessions=9), tmp_path, partition=partition)
    run = Run(spec, hub.master)
    workers = [FakeWorker(hub.worker(f"w{i}")).hello() for i in range(3)]
    records = run.begin([(f"w{i}", i) for i in range(3)]).finish()
    assert labels(records) == {"ok": 90}
    got = [{row.request_id for row in w.rows} for w in workers]
    assert sorted(rid for part in got for rid in part) == list(range(90))  # each row to one worker
    for w in workers:
        assert {records[row.request_id]["worker"] for row in w.rows} == {w.index}
    if partition == "session":  # a session's turns go out from one worker
        assert all(len({row.session_id for row in w.rows} & {row.session_id for row in v.rows}) == 0
                   for w in workers for v in workers if v is not w)


def test_real_sizes_every_row_once_by_its_worker(tmp_path):
    """At the code's own sizes (no monkeypatch): each of two workers' parts is longer than it
    holds ahead (transport.HOLD_ROWS) and than the shipping window, so each must ask for the
    rest as it answers; every row ok, once, by its round-robin worker. The same with real
    Locust processes and three workers: tests/test_distributed.py."""
    hub = Hub()
    per_worker = transport.HOLD_ROWS + 1100
    run = Run(spec_of(make_rows(2 * per_worker, gap_s=0.001), tmp_path), hub.master)
    workers = [FakeWorker(hub.worker(f"w{i}"), hold=transport.HOLD_ROWS).hello() for i in range(2)]
    records = run.begin([(f"w{i}", i) for i in range(2)]).finish()
    assert labels(records) == {"ok": 2 * per_worker}
    assert all(r["worker"] == rid % 2 for rid, r in records.items())
    for w in workers:
        assert len(w.rows) == per_worker and w.most_held <= transport.HOLD_ROWS


def test_a_worker_holds_a_bounded_window_of_rows(tmp_path, monkeypatch):
    """A worker is shipped only as far ahead as it asks (RowsAck.want): its memory stays flat
    however long its part; the rest comes as it answers."""
    monkeypatch.setattr(transport, "HOLD_ROWS", 2 * CHUNK_ROWS)
    link = LocalLink()
    run = Run(spec_of(make_rows(6 * CHUNK_ROWS), tmp_path), link)
    worker = FakeWorker(link, hold=2 * CHUNK_ROWS).hello()
    run.begin()
    assert labels(run.finish()) == {"ok": 6 * CHUNK_ROWS}
    assert worker.most_held <= 2 * CHUNK_ROWS and worker.applied == list(range(6))
    assert run.coordinator.workers[LOCAL_CLIENT].acked == set(range(6))


# -- --max-error-rate: servers that fail most answers stop the run (replay.engine.error_rate) ----------

def failing(row) -> int:
    return 500


def test_servers_failing_most_answers_stop_the_run(tmp_path):
    """Every answer failed: the run stops once MIN_ANSWERS came, the rows left get the error
    rate's label, exit code 1, and the files are written as at any end."""
    link = LocalLink()
    run = Run(spec_of(make_rows(100), tmp_path), link)
    worker = FakeWorker(link, answer=failing, answer_first=MIN_ANSWERS).hello()
    run.begin()
    records = run.finish()
    label = error_rate_label(DEFAULT_MAX_ERROR_RATE)
    assert label == "run aborted: error rate over 0.5"
    assert labels(records) == {"HTTP 500": MIN_ANSWERS, label: 100 - MIN_ANSWERS}
    assert run.coordinator.end_reason == label and worker.aborted == label and run.exit_codes == [1]
    assert meta_path(run.spec.output).exists() and summary_path(run.spec.output).exists()


def test_the_error_rate_is_judged_over_every_workers_answers(tmp_path):
    """The master decides from what all workers report: one worker failing every answer beside
    one answering every one is half, not over 0.5; one more failure is over."""
    hub = Hub()
    run = Run(spec_of(make_rows(200), tmp_path), hub.master)
    good = FakeWorker(hub.worker("w0"), answer_first=MIN_ANSWERS).hello()
    bad = FakeWorker(hub.worker("w1"), answer=failing, answer_first=0).hello()
    run.begin([("w0", 0), ("w1", 1)])
    run.until(lambda: run.coordinator.recorded == MIN_ANSWERS)
    bad.release(MIN_ANSWERS)
    run.until(lambda: run.coordinator.recorded == 2 * MIN_ANSWERS)
    gevent.sleep(0.01)
    assert not run.coordinator.finished.is_set()
    bad.release(1)
    records = run.finish()
    label = error_rate_label(0.5)
    assert labels(records) == {"ok": MIN_ANSWERS, "HTTP 500": MIN_ANSWERS + 1, label: 200 - 2 * MIN_ANSWERS - 1}
    assert good.aborted == bad.aborted == label and run.exit_codes == [1]


def test_max_error_rate_0_stops_at_one_failure_and_1_never(tmp_path):
    rows = 60
    zero = LocalLink()
    run = Run(spec_of(make_rows(rows), tmp_path / "zero", max_error_rate=0.0), zero)
    FakeWorker(zero, answer=lambda row: 503 if row.request_id == 3 else 200, answer_first=MIN_ANSWERS).hello()
    run.begin()
    assert labels(run.finish()) == {"ok": MIN_ANSWERS - 1, "HTTP 503": 1, "run aborted: error rate over 0": rows - MIN_ANSWERS}
    one = LocalLink()
    run = Run(spec_of(make_rows(rows), tmp_path / "one", max_error_rate=1.0), one)
    worker = FakeWorker(one, answer=failing, answer_first=2 * MIN_ANSWERS).hello()
    run.begin()
    run.until(lambda: run.coordinator.recorded == 2 * MIN_ANSWERS)
    worker.release(rows)
    records = run.finish()  # every answer failed, and the run went to its end
    assert labels(records) == {"HTTP 500": rows} and run.coordinator.end_reason == "complete"


def test_fewer_answers_than_the_minimum_never_stop_the_run(tmp_path):
    link = LocalLink()
    run = Run(spec_of(make_rows(100), tmp_path), link)
    worker = FakeWorker(link, answer=failing, answer_first=MIN_ANSWERS - 1).hello()
    run.begin()
    run.until(lambda: run.coordinator.recorded == MIN_ANSWERS - 1)
    run.clock.advance(2 * WINDOW_S)
    gevent.sleep(0.01)
    assert not run.coordinator.finished.is_set()
    worker.release(1)  # the minimum reached: judged now
    assert labels(run.finish()) == {"HTTP 500": MIN_ANSWERS, error_rate_label(0.5): 100 - MIN_ANSWERS}


class FailsAtTheStop(FakeWorker):
    """A stop's ABORT finds its held requests answered by the server, every one failed."""

    def on_abort(self, data, sender) -> None:
        if self.aborted is None:
            self.aborted = data["reason"]
            held, self.answered = self.rows[self.answered:], len(self.rows)
            self._ship([failed_record(row, self.index, self._scheduled(row), self.clock.now(), 502) for row in held])


def test_failures_that_arrive_as_the_run_ends_change_nothing(tmp_path, caplog):
    """Answers that come in while the run ends (a user's stop here) are recorded as they are;
    they stop nothing and relabel nothing, however many failed."""
    link = LocalLink()
    run = Run(spec_of(make_rows(80), tmp_path), link)
    FailsAtTheStop(link, answer_first=10).hello()
    run.begin()
    run.until(lambda: run.coordinator.recorded == 10)
    with caplog.at_level(logging.ERROR):
        records = run.end()
    assert labels(records) == {"ok": 10, "HTTP 502": 70}
    assert run.coordinator.end_reason is None and run.coordinator.fault_label is None
    assert "max-error-rate" not in caplog.text


def test_a_refused_run_records_every_row(tmp_path):
    """Servers the preflight refuses (replay.run.preflight.check_servers): every row recorded
    with the reason, the files written, exit code 2 (as replay.locust.plugin's own exit)."""
    spec = spec_of(make_rows(30), tmp_path)
    run = Run(spec, LocalLink())
    run.coordinator.refuse("http://127.0.0.1:9 did not answer GET /v1/models (connection refused)")
    records = {r["request_id"]: r for r in read_records(spec.output)}
    assert labels(records) == {f"{REFUSED}: http://127.0.0.1:9 did not answer GET /v1/models (connection refused)": 30}
    assert meta_path(spec.output).exists() and summary_path(spec.output).exists() and run.exit_codes == [2]


def test_failures_after_the_run_ended_by_itself_relabel_nothing(tmp_path):
    """Ended by its drain timeout, the run then hears failed answers before its end is written:
    it stays a drain timeout's end, nothing is labelled as the error rate's."""
    link = LocalLink()
    run = Run(spec_of(make_rows(80), tmp_path, drain_timeout=30.0), link)
    worker = FakeWorker(link, answer_first=10).hello()
    run.begin()
    run.until(run.coordinator.finished.is_set)
    worker.answer = failing
    worker.release(60)
    run.until(lambda: run.coordinator.recorded == 70)
    records = run.end()
    assert run.coordinator.end_reason == DRAIN_TIMEOUT and run.coordinator.fault_label is None
    assert labels(records) == {"ok": 10, "HTTP 500": 60, DRAIN_TIMEOUT: 10}

"""The replay engine in-process, without Locust: a Coordinator and a local Dispatcher wired by
LocalLink, against a real `replay sim`. What the Locust adapter (replay.locust.plugin) would
hand in is given here as plain callbacks."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import gevent
import orjson
import pytest
from gevent.monkey import get_original

from replay.engine import messages
from replay.engine.dispatcher import Dispatcher
from replay.engine.options import ReplayOptions
from replay.engine.transport import LOCAL_CLIENT, LocalLink
from replay.results.metadata import read_run_metadata
from replay.results.records import RUN_STOPPED, STOPPED_IN_FLIGHT, WORKER_FAILED, read_records
from replay.rules.run_files import meta_path, summary_path, worker_path
from replay.run import driver, preflight
from support.records import check_records
from support.traces import BLOCK, mooncake_trace


def _local_run(tmp_path, sim_url: str, tokenizer_dir, rows: int, gap_ms: float):
    """(coordinator, its local part, the output) of a `rows`-row trace `gap_ms` apart, started in
    this process against `sim_url` (not begun)."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=rows, gap_ms=gap_ms)
    output = tmp_path / "run.jsonl"
    options = ReplayOptions(trace=str(trace), block_size=BLOCK, tokenizer=str(tokenizer_dir), model="sim",
                            output=str(output), server_metrics_interval=0)
    link = LocalLink()
    part = Dispatcher(link, local=True)
    return driver.start(preflight.load(options, sim_url), link, local_part=part), part, output


@contextlib.contextmanager
def _wakes(events: tuple[str, ...], counting: Callable[[], bool]) -> Iterator[dict[str, int]]:
    """How often the body builder's and the connection keeper's greenlets are switched into (or
    have a timed wait's expiry thrown into them: `events`) while `counting()` holds."""
    import greenlet

    woken = {"_build_ahead": 0, "_keep_connections": 0}

    def count(event: str, args) -> None:
        name = getattr(getattr(args[1], "_run", None), "__name__", None)
        if event in events and name in woken and counting():
            woken[name] += 1

    previous = greenlet.settrace(count)
    try:
        yield woken
    finally:
        greenlet.settrace(previous)


def test_engine_imports_without_locust():
    code = ("import sys, replay.engine.coordinator, replay.engine.dispatcher, replay.engine.live, "
            "replay.engine.progress; "
            "assert 'locust' not in sys.modules, 'the engine imported locust'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_coordinator_and_dispatcher_in_process(tmp_path, sim, toy_tokenizer_dir):
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=30, gap_ms=20)
    output = tmp_path / "run.jsonl"
    options = ReplayOptions(trace=str(trace), block_size=BLOCK, tokenizer=str(toy_tokenizer_dir), model="sim",
                            output=str(output))
    link = LocalLink()
    answered: list[dict] = []
    exit_codes: list[int] = []
    part = Dispatcher(link, local=True, on_request=answered.append)
    coordinator = driver.start(preflight.load(options, sim.url), link, local_part=part,
                              on_exit_code=exit_codes.append)

    coordinator.begin([(LOCAL_CLIENT, 0)])  # the dispatcher's greenlets start on the plan and the go
    assert coordinator.finished.wait(timeout=60), f"{coordinator.recorded} of {coordinator.total} rows recorded"
    gevent.spawn(coordinator.end).join(timeout=60)

    records = check_records(output, trace)  # one ok record per row, prompt_tokens == input_length
    assert len(records) == 30 and coordinator.end_reason == "complete"
    assert {r["worker"] for r in records} == {0} and {r["endpoint"] for r in records} == {sim.url}
    assert sorted(r["request_id"] for r in answered) == list(range(30))  # on_request: once per answer
    assert exit_codes == []  # no failed row: the exit code is left alone
    meta = read_run_metadata(output)
    assert meta_path(output).exists() and summary_path(output).exists()
    assert meta["trace"]["rows"] == 30 and meta["endpoints"] == [sim.url]
    assert [(w["index"], w["client_id"], w["rows_assigned"]) for w in meta["workers"]] == [(0, LOCAL_CLIENT, 30)]


def test_the_masters_own_part_takes_its_tokenizer_unchecked(tmp_path, sim, toy_tokenizer_dir, monkeypatch):
    """A part in the master's process has the master's options and files: fingerprinting them
    again (reading and hashing tokenizer.json, compiling the template) would prove nothing."""
    def no_fingerprint(*args, **kwargs):
        raise AssertionError("the local part fingerprinted its tokenizer")

    monkeypatch.setattr("replay.engine.same_tokenizer.tokenizer_fingerprint", no_fingerprint)
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=5, gap_ms=20)
    output = tmp_path / "run.jsonl"
    options = ReplayOptions(trace=str(trace), block_size=BLOCK, tokenizer=str(toy_tokenizer_dir), model="sim",
                            output=str(output))
    link = LocalLink()
    part = Dispatcher(link, local=True)
    coordinator = driver.start(preflight.load(options, sim.url), link, local_part=part)
    coordinator.begin([(LOCAL_CLIENT, 0)])
    assert coordinator.finished.wait(timeout=60), f"{coordinator.recorded} of {coordinator.total} rows recorded"
    gevent.spawn(coordinator.end).join(timeout=60)
    assert len(check_records(output, trace)) == 5


blocking_sleep = get_original("time", "sleep")


def test_a_stop_records_each_request_once(tmp_path, fast_sim, toy_tokenizer_dir):
    """A stop cancels the requests in flight while some answers are already in: the readers of
    those may run before their kill lands, and recorded the answer beside the stop's record (50 of
    400 rows twice). Here the stop comes from the first answer's record, while the other answers
    arrive: every row once in the worker's file and in the merged one."""
    rows = 400
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(orjson.dumps({"timestamp": 0, "input_length": 30, "output_length": 4,
                                           "hash_ids": [2 * i, 2 * i + 1]}).decode() + "\n" for i in range(rows)))
    output = tmp_path / "run.jsonl"
    options = ReplayOptions(trace=str(trace), block_size=BLOCK, tokenizer=str(toy_tokenizer_dir), model="sim",
                            output=str(output))
    link = LocalLink()

    stopped: list[dict] = []

    def stop_at_first_answer(record: dict) -> None:
        if not stopped:
            stopped.append(record)
            blocking_sleep(0.5)  # the event loop held: every other answer arrives meanwhile
            part.abort(RUN_STOPPED)

    part = Dispatcher(link, local=True, on_request=stop_at_first_answer)
    coordinator = driver.start(preflight.load(options, fast_sim.url), link, local_part=part)
    coordinator.begin([(LOCAL_CLIENT, 0)])
    assert coordinator.finished.wait(timeout=60), f"{coordinator.recorded} of {coordinator.total} rows recorded"
    gevent.spawn(coordinator.end).join(timeout=60)
    part.replay.sends.join(timeout=60)  # every reader has ended; what they recorded goes to the file now
    part.replay.take_records()

    own = list(read_records(worker_path(output, 0)))
    assert sorted(r["request_id"] for r in own) == list(range(rows))
    merged = {r["request_id"]: r for r in read_records(output)}
    assert len(merged) == rows
    for r in own:  # the same record in both files: an answer is ok in each, a cancel fails in each
        assert merged[r["request_id"]]["error"] == r["error"]
        assert r["ok"] or r["error"] == STOPPED_IN_FLIGHT


class LosesFirst(LocalLink):
    """LocalLink that loses the first master->worker message of one type (as ZeroMQ drops a
    message to a worker that has not registered its type yet, or past its high-water mark)."""

    def __init__(self, msg_type: str):
        super().__init__()
        self.lose = msg_type

    def to_worker(self, client_id: str, msg_type: str, data) -> None:
        if msg_type == self.lose:
            self.lose = ""
            return
        super().to_worker(client_id, msg_type, data)


@pytest.mark.parametrize("lost", [messages.PLAN, messages.GO])
def test_a_lost_start_message_is_sent_again(tmp_path, sim, toy_tokenizer_dir, lost):
    """The run depends on the plan and on the go: each was sent once, and a lost one left the
    worker idle (the run never started; without the go its rows waited for the drain timeout).
    Each is resent until the worker acknowledges it: every row ok."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=20, gap_ms=20)
    output = tmp_path / "run.jsonl"
    options = ReplayOptions(trace=str(trace), block_size=BLOCK, tokenizer=str(toy_tokenizer_dir), model="sim",
                            output=str(output))
    link = LosesFirst(lost)
    part = Dispatcher(link, local=True)
    coordinator = driver.start(preflight.load(options, sim.url), link, local_part=part)
    coordinator.begin([(LOCAL_CLIENT, 0)])
    assert coordinator.finished.wait(timeout=30), f"{coordinator.recorded} of {coordinator.total} rows recorded"
    gevent.spawn(coordinator.end).join(timeout=60)
    assert link.lose == ""  # the message was lost once
    check_records(output, trace)


class PlanTwice(LocalLink):
    """LocalLink that delivers each PLAN twice (as when its ack was lost: the master sends it again)."""

    def to_worker(self, client_id: str, msg_type: str, data) -> None:
        super().to_worker(client_id, msg_type, data)
        if msg_type == messages.PLAN:
            super().to_worker(client_id, msg_type, data)


def test_a_worker_that_cannot_take_its_plan_fails_its_rows(tmp_path, sim, toy_tokenizer_dir, monkeypatch):
    """A --header variable the master's host has and a worker's has not: the worker's replay is
    built from the plan, and cannot be. It says why (READY), once, though the plan comes twice:
    the master records its rows as the worker's failure, with that line, and does not wait for it."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=10, gap_ms=20)
    output = tmp_path / "run.jsonl"
    monkeypatch.setenv("REPLAY_TEST_WORKER_TOKEN", "t")
    options = ReplayOptions(trace=str(trace), block_size=BLOCK, tokenizer=str(toy_tokenizer_dir), model="sim",
                            output=str(output), header=["X-Token: $REPLAY_TEST_WORKER_TOKEN"])
    link = PlanTwice()
    readies: list[messages.Ready] = []
    part = Dispatcher(link, local=True)
    coordinator = driver.start(preflight.load(options, sim.url), link, local_part=part)
    on_ready = link.handlers[messages.READY]
    link.on(messages.READY, lambda data, sender: (readies.append(data), on_ready(data, sender)))
    monkeypatch.delenv("REPLAY_TEST_WORKER_TOKEN")  # the worker's host
    coordinator.begin([(LOCAL_CLIENT, 0)])
    assert coordinator.finished.wait(timeout=30), f"{coordinator.recorded} of {coordinator.total} rows recorded"
    gevent.spawn(coordinator.end).join(timeout=60)
    assert part.replay is None
    error = "--header X-Token: $REPLAY_TEST_WORKER_TOKEN is not set on this host"
    assert readies == [{"worker": 0, "error": error}]
    assert {r["error"] for r in read_records(output)} == {f"{WORKER_FAILED}: {error}"}


def test_a_lost_abort_is_sent_again(tmp_path, sim, toy_tokenizer_dir):
    """A stop asks a worker (not the master's own part: its link can lose messages) for the
    records of the rows it holds. Sent once, a lost abort left every one of them "no record from
    worker" (a failure); resent while they are awaited, they come back as the user's stop."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=200, gap_ms=50)  # 10 s: the stop comes long before
    output = tmp_path / "run.jsonl"
    options = ReplayOptions(trace=str(trace), block_size=BLOCK, tokenizer=str(toy_tokenizer_dir), model="sim",
                            output=str(output), server_metrics_interval=0)
    link = LosesFirst(messages.ABORT)
    Dispatcher(link)  # a worker of its own: pings for its clock, says HELLO, gets its plan over the link
    coordinator = driver.start(preflight.load(options, sim.url), link)
    link.to_master(messages.HELLO, messages.Hello())
    coordinator.begin([(LOCAL_CLIENT, 0)])
    deadline = time.time() + 30
    while coordinator.recorded < 5 and time.time() < deadline:  # mid-run
        gevent.sleep(0.05)
    assert coordinator.recorded >= 5, "the run did not start"
    gevent.spawn(coordinator.end).join(timeout=60)  # the user's stop
    assert link.lose == ""  # the abort was lost once
    records = list(read_records(output))
    assert len(records) == 200
    labels = {r["error"] for r in records if not r["ok"]}
    assert labels <= {RUN_STOPPED, STOPPED_IN_FLIGHT}, labels


def test_a_builder_makes_its_bodies_in_batches_not_one_at_each_rows_turn(tmp_path, sim, toy_tokenizer_dir,
                                                                         monkeypatch):
    """Rows 0.1 s apart with a window of 1 s: the builder sleeps until the next row is
    BUILD_WAKE of the window from its send and then builds every row within the window, back to
    back while the tables are in the CPU's caches; it used to sleep until each row came within the
    window and make each body alone, after sends had evicted them."""
    import sys

    from replay.engine import dispatcher

    sleeps = []  # the builder's sleeps until a row is near enough

    class CountedEvent(dispatcher.Event):
        def wait(self, timeout=None):
            if sys._getframe(1).f_code.co_name == "_build_ahead":
                sleeps.append(timeout)
            return super().wait(timeout)

    monkeypatch.setattr(dispatcher, "Event", CountedEvent)
    monkeypatch.setattr(dispatcher, "AHEAD_S", 1.0)
    coordinator, _, output = _local_run(tmp_path, sim.url, toy_tokenizer_dir, rows=40, gap_ms=100)
    coordinator.begin([(LOCAL_CLIENT, 0)])
    assert coordinator.finished.wait(timeout=60), f"{coordinator.recorded} of {coordinator.total} rows recorded"
    gevent.spawn(coordinator.end).join(timeout=30)
    records = list(read_records(output))
    assert len(records) == 40 and all(r["ok"] for r in records)
    # 30 rows come within the window after the go: a sleep each before, one each half window now
    assert 0 < len(sleeps) <= 12, sleeps


def test_an_idle_worker_wakes_its_builder_and_connection_keeper_only_when_there_is_work(tmp_path, sim,
                                                                                        toy_tokenizer_dir):
    """Between two sends 14 s apart nothing is due: the body builder sleeps until the second row
    is AHEAD_S from its send, the connection keeper until it comes within WARM_S. (They woke two
    and one times a second: an idle run's CPU is mostly its wake-ups.) Then a stop ends both."""
    coordinator, part, output = _local_run(tmp_path, sim.url, toy_tokenizer_dir, rows=2, gap_ms=14_000)
    counting = False
    with _wakes(("switch", "throw"), lambda: counting) as woken:
        coordinator.begin([(LOCAL_CLIENT, 0)])
        deadline = time.monotonic() + 30
        while coordinator.recorded < 1:
            assert time.monotonic() < deadline, "the first row was not answered"
            gevent.sleep(0.05)
        counting = True
        gevent.sleep(3.0)  # the second row is 10 s or more from its send all along
        counting = False
    part.abort(RUN_STOPPED)
    assert coordinator.finished.wait(timeout=30)
    gevent.spawn(coordinator.end).join(timeout=30)
    assert woken == {"_build_ahead": 0, "_keep_connections": 0}, woken
    assert {r["request_id"] for r in read_records(output)} == {0, 1}


def test_a_steady_run_wakes_its_builder_and_connection_keeper_once_for_several_rows(tmp_path, sim, toy_tokenizer_dir,
                                                                                     monkeypatch):
    """Rows 200 ms apart: the builder builds every row up to AHEAD_S when it wakes (BUILD_WAKE),
    and the connection keeper, holding MIN_SPARE spare connections, wakes only when a few
    more rows come within WARM_S; each woke once a row (a timed wait's expiry is thrown into the
    waiting greenlet: it costs more than the row's own look). The window is made 1 s here, so that rows are built while the
    run sends. Every row is still sent and recorded."""
    from replay.engine import dispatcher

    monkeypatch.setattr(dispatcher, "AHEAD_S", 1.0)
    rows = 30
    coordinator, part, output = _local_run(tmp_path, sim.url, toy_tokenizer_dir, rows=rows, gap_ms=200)
    with _wakes(("throw",), part.go.is_set) as woken:  # a timed wait's expiry
        coordinator.begin([(LOCAL_CLIENT, 0)])
        assert coordinator.finished.wait(timeout=60), f"{coordinator.recorded} of {coordinator.total} rows recorded"
    gevent.spawn(coordinator.end).join(timeout=30)
    assert {r["request_id"] for r in read_records(output)} == set(range(rows))
    assert woken["_build_ahead"] <= rows // 3 and woken["_keep_connections"] <= rows // 3, woken

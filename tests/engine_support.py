"""The engine in one process, without a trace file, a tokenizer or a server: what
tests/test_engine_pipeline.py runs the Coordinator with.

- `spec_of(rows, folder)`: a RunSpec (replay.engine.spec) of rows built in memory, as
  replay.run.preflight would make it from a trace (the Schedule spools them to a temporary file).
- `FakeClock`: a clock whose time moves only when the test says so (`advance`, `drive`), so a
  5-minute timeout takes a step, and nothing times out while the test looks.
- `FakeWorker`: the worker's side of the protocol (replay.engine.messages) as the Dispatcher
  speaks it, with a fake endpoint (`answer`: a row's HTTP status) instead of HTTP, and knobs for
  the ways a worker misbehaves (never ready, refuses its part, holds rows, ignores the abort).
- `Hub`: several workers and a master in one process (LocalLink carries one worker only).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import gevent
from gevent.event import Event

from replay.engine import messages, transport
from replay.engine.clock import Clock
from replay.engine.options import ReplayOptions
from replay.engine.plan import Schedule, decode_row
from replay.engine.spec import RunSpec, TraceFacts
from replay.results.records import unsent_record
from replay.trace.record import TraceRow

T0 = 1_700_000_000.0
URL = "http://127.0.0.1:9"  # never asked: the fake worker answers for it


def make_rows(count: int, gap_s: float = 0.01, input_length: int = 20, output_length: int = 4,
              sessions: int = 0) -> list[TraceRow]:
    """`count` rows `gap_s` apart; with `sessions`, row i belongs to session i % sessions."""
    return [TraceRow(request_id=i, timestamp_s=i * gap_s, input_length=input_length, output_length=output_length,
                     session_id=f"s{i % sessions}" if sessions else None, line=i + 1)
            for i in range(count)]


class MemoryTrace:
    """What Schedule reads of a TraceStream: its rows, then the sessions later rows re-rooted (none)."""

    def __init__(self, rows: Iterable[TraceRow]):
        self.rows = list(rows)
        self.sessions: dict = {}

    def __iter__(self):
        return iter(self.rows)


def spec_of(rows: list[TraceRow], folder: Path, *, max_prompt_tokens: int | None = None,
            **options: Any) -> RunSpec:
    """A run of `rows` into folder/run.jsonl, as the preflight would make it (no scraping unless asked;
    the folder made, as the output's claim makes it)."""
    folder.mkdir(parents=True, exist_ok=True)
    options = {"trace": "(in memory)", "tokenizer": "(none)", "model": "fake", "endpoints": URL,
               "output": str(folder / "run.jsonl"), "server_metrics_interval": 0, **options}
    opts = ReplayOptions(**options)
    schedule = Schedule(MemoryTrace(rows), opts.start, opts.duration, opts.max_requests, max_prompt_tokens)
    return RunSpec(options=opts, output=opts.output, run_id="testrun", schedule=schedule,
                   trace=TraceFacts(path="(in memory)", format="mooncake", block_size=16, sha256="0" * 64),
                   max_prompt_tokens=max_prompt_tokens, tokenizer_fingerprint="f" * 64)


class FakeClock(Clock):
    """Time that moves only by `advance`: a `sleep` returns once the time passed its end."""

    def __init__(self, t: float = T0):
        self.t = t
        self._moved = Event()

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        end = self.t + seconds
        while self.t < end:
            self._moved.wait()

    def advance(self, seconds: float) -> None:
        self.t += seconds
        moved, self._moved = self._moved, Event()
        moved.set()

    def drive(self, until: Callable[[], bool], step: float = 0.25, limit_s: float = 3600.0) -> None:
        """Advance `step` at a time, letting the greenlets run between steps, until `until()`
        (an AssertionError past `limit_s` of fake time)."""
        start = self.t
        while not until():
            assert self.t - start < limit_s, f"not reached in {limit_s} s of the fake clock"
            self.advance(step)
            gevent.sleep(0.0005)


class Hub:
    """A master and several workers in one process: each message is handled in a greenlet of
    its own, in order (as LocalLink does); a worker's messages come from its client id, and
    a worker `cut` off hears and says nothing more."""

    def __init__(self):
        self.master = _MasterEnd(self)
        self.workers: dict[str, _WorkerEnd] = {}
        self.cut: set[str] = set()

    def worker(self, client_id: str) -> transport.Link:
        self.workers[client_id] = _WorkerEnd(self, client_id)
        return self.workers[client_id]


class _MasterEnd(transport.Link):
    def __init__(self, hub: Hub):
        self.hub, self.handlers = hub, {}

    def on(self, msg_type: str, handler) -> None:
        self.handlers[msg_type] = handler

    def to_worker(self, client_id: str, msg_type: str, data) -> None:
        if client_id not in self.hub.cut:
            end = self.hub.workers[client_id]
            gevent.spawn(end.handlers[msg_type], data, "master")


class _WorkerEnd(transport.Link):
    def __init__(self, hub: Hub, client_id: str):
        self.hub, self.client_id, self.handlers = hub, client_id, {}

    def on(self, msg_type: str, handler) -> None:
        self.handlers[msg_type] = handler

    def to_master(self, msg_type: str, data) -> None:
        if self.client_id not in self.hub.cut:
            gevent.spawn(self.hub.master.handlers[msg_type], data, self.client_id)


def ok_record(row: TraceRow, worker: int, scheduled: float, sent_at: float) -> dict:
    """What a worker records for an answered request (a fake endpoint's: 10 ms, every token)."""
    record = unsent_record(row, worker=worker, api="openai-chat", scheduled_at=scheduled, reason="",
                           endpoint=URL, sent_at=sent_at)
    record.update(ok=True, status=200, error=None, finished_at=sent_at + 0.01, ttft_ms=5.0, tpot_ms=1.0,
                  e2e_ms=10.0, itl_ms=[1.0] * (row.output_length - 1), prompt_tokens=row.input_length,
                  output_tokens=row.output_length, cached_tokens=0, received_tokens=row.output_length)
    return record


REFUSED_TEXT = "ConnectionRefusedError: [Errno 111] Connection refused"


def failed_record(row: TraceRow, worker: int, scheduled: float, sent_at: float, status: int) -> dict:
    """What a worker records for a request the server answered with an HTTP error; status 0: one
    it never answered (its connection refused, as by a server that is gone)."""
    record = unsent_record(row, worker=worker, api="openai-chat", scheduled_at=scheduled,
                           reason=f"HTTP {status}" if status else REFUSED_TEXT, endpoint=URL, sent_at=sent_at)
    record.update(status=status, finished_at=sent_at + 0.01, e2e_ms=10.0 if status else None)
    return record


class FakeWorker:
    """The worker side of the protocol, as replay.engine.dispatcher.Dispatcher speaks it, with
    every row answered at once on the GO by a fake endpoint: `answer(row)` is its HTTP status
    (200: ok; 0: no answer, the connection refused; else a failed record "HTTP <status>").

    Knobs: `ready` False never says READY; `error` refuses the part (READY with an error);
    `answer_first` answers only that many rows and holds the rest (`release` answers more); `hears_abort` False ignores a
    stop's ABORT (its held rows come back from no one); `hold` caps the rows it takes ahead
    of its answers (its RowsAck.want, transport.HOLD_ROWS for the Dispatcher); `late(row)` is
    how many seconds after its scheduled time the row is sent (a client that cannot keep up;
    default: sent at once, early).
    """

    def __init__(self, link: transport.Link, *, answer: Callable[[TraceRow], int] = lambda row: 200,
                 ready: bool = True, error: str | None = None, answer_first: int | None = None,
                 hears_abort: bool = True, hold: int | None = None, clock: Clock | None = None,
                 late: Callable[[TraceRow], float] | None = None):
        self.link, self.answer, self.ready, self.error = link, answer, ready, error
        self.answer_first, self.hears_abort, self.hold = answer_first, hears_abort, hold
        self.clock = clock or Clock()
        self.late = late
        self.plan: dict | None = None
        self.rows: list[TraceRow] = []
        self.chunks_seen: list[int] = []  # every ROWS seq received, resends included
        self.applied: list[int] = []  # the ROWS seqs applied, in order
        self._pending: dict[int, list] = {}
        self.answered = 0  # rows with a record (answered or aborted)
        self.most_held = 0  # the most rows held at once without a record
        self.go: dict | None = None
        self.idle: str | None = None
        self.aborted: str | None = None
        self.total = 0  # its part's rows so far (the plan's, then a search's ROUND's)
        self.more = False  # a search: more rounds may follow
        self.skip_to, self.skip_reason = 0, ""  # a probe cut short: rows below it recorded, never sent
        self.rounds_seen: list[dict] = []
        self.wanted = 0  # the rows it last said it takes
        self.records = transport.Window(lambda payload: link.to_master(messages.RECORDS, payload))
        link.on(messages.PLAN, self.on_plan)
        link.on(messages.ROWS, self.on_rows)
        link.on(messages.GO, self.on_go)
        link.on(messages.RECORDS_ACK, lambda data, sender: self.records.ack(data["seq"]))
        link.on(messages.ABORT, self.on_abort)
        link.on(messages.IDLE, self.on_idle)
        link.on(messages.PONG, lambda data, sender: None)
        link.on(messages.ROUND, self.on_round)

    def hello(self) -> FakeWorker:
        self.link.to_master(messages.HELLO, messages.Hello())
        return self

    @property
    def index(self) -> int:
        return self.plan["worker"]

    def _want(self) -> int:
        self.wanted = self.total if self.hold is None else self.answered + self.hold
        return self.wanted

    def on_plan(self, data: messages.Plan, sender: str) -> None:
        self.link.to_master(messages.PLAN_ACK, messages.PlanAck(seq=data["seq"]))
        if self.plan is not None:
            return
        self.plan = data
        self.total, self.more = data["rows"], data.get("more", False)
        if self.error is not None:
            self.link.to_master(messages.READY, messages.Ready(worker=self.index, error=self.error))
        elif self.ready:
            self.link.to_master(messages.READY, messages.Ready(worker=self.index, clock_offset_ms=0.0, rtt_ms=0.1))

    def on_rows(self, data: messages.Rows, sender: str) -> None:
        self.chunks_seen.append(data["seq"])
        if data["seq"] >= len(self.applied):  # each applied once, in order (a resend may come twice)
            self._pending[data["seq"]] = data["rows"]
        while len(self.applied) in self._pending:
            self.applied.append(len(self.applied))
            self.rows.extend(decode_row(r) for r in self._pending.pop(self.applied[-1]))
        self.most_held = max(self.most_held, len(self.rows) - self.answered)
        self.link.to_master(messages.ROWS_ACK, messages.RowsAck(seq=data["seq"], want=self._want()))
        self._answer()

    def on_go(self, data: messages.Go, sender: str) -> None:
        self.link.to_master(messages.GO_ACK, messages.GoAck(seq=data["seq"]))
        if self.go is None:
            self.go = data
            self._answer()

    def on_round(self, data: messages.Round, sender: str) -> None:
        """As the Dispatcher: a search's part grew, a probe was cut short, or no more rounds follow."""
        self.link.to_master(messages.ROUND_ACK, messages.RoundAck(seq=data["seq"]))
        if data["seq"] < len(self.rounds_seen):
            return
        self.rounds_seen.append(data)
        self.total, self.more = data["rows"], data["more"]
        if "skip_to" in data:
            self.skip_to, self.skip_reason = data["skip_to"], data["skip_reason"]
        if self.wanted < self.total:  # as the Dispatcher: asks again only when it wanted fewer than it has now
            self.link.to_master(messages.ROWS_ACK, messages.RowsAck(seq=None, want=self._want()))
        self._answer()

    def _scheduled(self, row: TraceRow) -> float:
        return self.go["epoch"] + (row.timestamp_s - self.plan["origin"]) / self.plan["options"]["scale"]

    def _answer(self) -> None:
        """Every row held, answered now (up to `answer_first`); then more rows are asked for."""
        if self.go is None or self.aborted is not None:
            return
        end = len(self.rows) if self.answer_first is None else min(len(self.rows), self.answer_first)
        batch = []
        for i, row in enumerate(self.rows[self.answered:end], self.answered):
            scheduled = self._scheduled(row)
            if i < self.skip_to:
                batch.append(unsent_record(row, worker=self.index, api="openai-chat", scheduled_at=scheduled,
                                           reason=self.skip_reason))
                continue
            status = self.answer(row)
            sent_at = self.clock.now() if self.late is None else scheduled + self.late(row)
            if status == 200:
                batch.append(ok_record(row, self.index, scheduled, sent_at))
            else:
                batch.append(failed_record(row, self.index, scheduled, sent_at, status))
        self.answered = max(self.answered, end)
        self._ship(batch)
        if batch and self.answered < self.total:
            self.link.to_master(messages.ROWS_ACK, messages.RowsAck(seq=None, want=self._want()))

    def release(self, count: int) -> None:
        """Answer `count` more of the rows it holds, now (with `answer_first`: answers come in steps)."""
        self.answer_first = (self.answer_first or 0) + count
        self._answer()

    def _ship(self, records: list[dict]) -> None:
        for i in range(0, len(records), 500):
            self.records.put({"worker": self.index, "records": records[i : i + 500]})

    def on_abort(self, data: messages.Abort, sender: str) -> None:
        """As the Dispatcher: every row held without a record gets the stop's reason."""
        if not self.hears_abort or self.aborted is not None or self.plan is None:
            return
        self.aborted = data["reason"]
        held = self.rows[self.answered:]
        self.answered = len(self.rows)
        self._ship([unsent_record(row, worker=self.index, api="openai-chat", reason=data["reason"],
                                  scheduled_at=self._scheduled(row) if self.go else None) for row in held])

    def on_idle(self, data: messages.Idle, sender: str) -> None:
        self.idle = data["reason"]

    def fault(self, file: str, reason: str) -> None:
        """Its own records file cannot be written (a full disk)."""
        self.link.to_master(messages.FAULT, messages.Fault(worker=self.index, file=file, reason=reason))

    def stopped(self, shared: bool = False) -> None:
        """It got a signal of its own; `shared`: in the master's process group, one the master
        may have got too (the master's abort says which)."""
        self.link.to_master(messages.STOPPED, messages.Stopped(shared=True) if shared else messages.Stopped())

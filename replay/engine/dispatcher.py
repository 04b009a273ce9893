"""A worker's part of the replay: receive rows, build bodies ahead, send each row on time,
record every outcome.

Timing: nothing heavy is on the dispatch path. Bodies are built ahead by a lookahead
greenlet, which builds in the gaps between sends. Idle connections are kept open ahead of
demand, so a due request is written at once without connecting or yielding, and its answer
is read by a greenlet of its own: a slow server never delays a later send. The dispatcher
wakes on a high-priority timer (replay.engine.timing), and every stream reader checks after
each read whether a send has fallen due and if so wakes it there and then, so sends are not
held back behind a busy turn of the event loop.
"""

from __future__ import annotations

import gc
import logging
import os
import platform
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import gevent
from gevent.event import Event
from gevent.pool import Group

from replay.engine import messages, transport
from replay.engine.clock import ClockSync
from replay.engine.lookahead import Bodies, BuildSteps
from replay.engine.options import ReplayOptions
from replay.engine.plan import decode_row
from replay.engine.routing import make_router
from replay.engine.same_tokenizer import check_worker_tokenizer
from replay.engine.threads import off_loop
from replay.engine.timing import Alarm, QuietCollector
from replay.engine.turns import Turns
from replay.errors import OptionError, OutputError
from replay.protocol.client import Endpoint, Sent, read, send, write
from replay.protocol.headers import parse_headers
from replay.protocol.table import get_api, sends_token_ids
from replay.results.records import (
    DRAIN_TIMEOUT,
    RUN_STOPPED,
    SESSION_STOPPED,
    STOPPED_IN_FLIGHT,
    TURN_NEVER_DUE,
    Record,
    RecordWriter,
    sent_record,
    unsent_record,
)
from replay.rules.run_files import worker_path
from replay.rules.send_time import send_offset_s, send_time
from replay.synth.chat_template import ChatTemplateError
from replay.trace.fields import DEFAULT_BLOCK_SIZE
from replay.trace.record import TraceRow

if TYPE_CHECKING:
    from replay.synth.prompts import PromptSynthesizer

logger = logging.getLogger(__name__)

AHEAD_S = 10.0  # build bodies up to this far (wall seconds) ahead of their send
BUILD_IDLE_S = 0.5  # the builder's longest sleep AHEAD_S ahead, before the go or in a search (a check costs CPU)
AHEAD_ROWS = 2000  # and at most this many rows ahead
# A sleeping builder wakes when the next row is this share of AHEAD_S from its send and builds
# every row up to AHEAD_S: the bodies of a batch are made back to back, with the words' tables
# still in the CPU's caches (a body made alone, after sends evicted them, costs about 3 times more)
BUILD_WAKE = 0.5
FLUSH_S = 0.2  # records are written and shipped in batches this often
FLUSH_GAP_S = 0.004  # each batch waits for this long a gap before the next send
FLUSH_GAP_TRIES = 50  # for up to about this many ms
BATCH = 500
WARM_S = 0.25  # idle connections kept for the sends due within this much time
# How often the idle connections are sized to the sends due within WARM_S: well inside WARM_S, and
# no more often, since an idle process's CPU is these ticks (docs/bench/2026-11-28-figures.md)
WARM_TICK_S = 0.1
WARM_AGAIN_S = 1.0  # the longest tick after connections were made ready (they are kept IDLE_MAX_S)
QUIET_TICK_S = 1.0  # in a search, the longest tick when no send is due within WARM_S of the next tick
MAX_SPARE = 512  # at most this many idle per endpoint (sends beyond it connect as they go)
MIN_SPARE = 8  # and this many more per endpoint


class RowBuffer:
    """A worker's rows by position in its part, holding only those not yet sent: the master
    ships them a bounded distance ahead (transport.HOLD_ROWS), and sent ones are let go."""

    def __init__(self) -> None:
        self._rows: list[TraceRow] = []
        self._base = 0  # position of self._rows[0]

    def __len__(self) -> int:
        """Rows received so far (sent ones included)."""
        return self._base + len(self._rows)

    def __getitem__(self, position: int) -> TraceRow:
        return self._rows[position - self._base]

    def extend(self, rows: Iterable[TraceRow]) -> None:
        self._rows.extend(rows)

    def tail(self, position: int) -> list[TraceRow]:
        return self._rows[max(position - self._base, 0):]

    def release(self, position: int) -> None:
        """Rows before `position` are no longer needed (dropped in batches: a list's front is
        costly to trim one at a time)."""
        drop = position - self._base
        if drop >= 1024 and drop * 2 >= len(self._rows):
            del self._rows[:drop]
            self._base = position


class BodyBuilder:
    """Turns trace rows into request bodies (prompt synthesis + serialization).

    Its set-up comes from the disk cache when this host has one for the tokenizer
    (replay/synth/setup_cache.py); the tokenizer itself is then loaded only if a prompt needs
    encoding (rows with their own messages, templates that touch the content).
    """

    def __init__(self, options: ReplayOptions, block_size: int | None, tokenizer_path: str | Path | None = None):
        """`tokenizer_path`: --tokenizer as this host resolved it (None: resolved here)."""
        from replay.synth.bodies import build_body
        from replay.synth.prompts import BREAK_BLOCK_ENV, PromptSynthesizer
        from replay.synth.tokenizer import ServerTokenizer
        from replay.synth.tokenizer_source import resolve_tokenizer

        if tokenizer_path is None:
            assert options.tokenizer is not None  # options.check() refused a run without
            tokenizer_path = resolve_tokenizer(options.tokenizer)
        tokenizer = ServerTokenizer.load(tokenizer_path, options.chat_template, lazy=True, compiled=False)
        self._build_body = build_body
        self.synth = PromptSynthesizer(tokenizer, api=options.api, block_size=block_size or DEFAULT_BLOCK_SIZE, seed=options.seed,
                                       token_ids=sends_token_ids(options.prompt_format))
        if self.synth.verified:  # every prompt is encoded: load the tokenizer now, off the loop
            _ = tokenizer.tokenizer  # the attribute loads it
        if broken := os.environ.get(BREAK_BLOCK_ENV):  # test only (docs/testing.md): read once, here
            if not broken.isdigit():
                raise OptionError(f"${BREAK_BLOCK_ENV} {broken!r}: expected a hash id (a whole number)")
            self.synth.break_block(int(broken))
        self.options = options
        self.fingerprints: dict[int, list | None] = {}  # request id -> its prompt's fingerprint, until its record takes it

    def body(self, row: TraceRow, pause: Callable[[], None] | None = None) -> bytes:
        """`pause`: called between the steps of a long prompt (replay.engine.lookahead.BuildSteps)."""
        tokenizer = self.synth.tokenizer
        if row.messages is not None and not tokenizer.loaded:  # counted by encoding: load it, off the loop
            off_loop(lambda: tokenizer.tokenizer)
        prompt = self.synth.prompt(row, pause)
        self.fingerprints[row.request_id] = prompt.fingerprint
        return self._build_body(
            self.options.api,
            prompt,
            model=self.options.model or "",
            output_length=row.output_length,
            stream=self.options.stream,
            ignore_eos=not self.options.no_ignore_eos,
        )


def _checked_builder(options: ReplayOptions, block_size: int | None, fingerprint: str | None,
                     tokenizer_path: str | Path | None) -> BodyBuilder:
    if tokenizer_path is None:  # resolved on this host, proved the master's before the set-up
        assert options.tokenizer is not None  # options.check() refused a run without
        tokenizer_path = check_worker_tokenizer(options.tokenizer, options.chat_template, fingerprint)
    return BodyBuilder(options, block_size, tokenizer_path)


def build_off_loop(options: ReplayOptions, block_size: int | None, fingerprint: str | None = None,
                   tokenizer_path: str | None = None) -> BodyBuilder:
    """A BodyBuilder made in a thread, after resolving this host's --tokenizer and checking it
    against the master's `fingerprint` (None: no check); `tokenizer_path`: resolved already
    (the master's preflight), then no check. Cold, it costs seconds of CPU for a real tokenizer (safe
    vocabulary, template measurement); from the set-up cache tens of ms, still file reads and
    hashing. Meanwhile this process must keep answering Locust's heartbeats, or the master
    drops it as missing. The GIL still passes to the event loop every few ms."""
    return off_loop(_checked_builder, options, block_size, fingerprint, tokenizer_path)


def untrack_greenlet_tree() -> None:
    """Stop gevent recording each greenlet's spawner for its debugging tree, from a worker's start
    on: each spawn would otherwise keep its spawner's stack (ten frame objects per request), which
    fills the collector's young generation and lengthens its pauses. Read by gevent at each spawn,
    so setting it before the first send is enough; set here, not at import, so importing the
    engine changes no process-wide setting."""
    gevent.config.track_greenlet_tree = False


def _cannot_start(link: transport.Link, index: int, error: Exception) -> None:
    """Tell the master this worker cannot replay its part, or it would wait for it forever."""
    if isinstance(error, OutputError):  # its own file cannot be made: one line says it all
        logger.error("worker %s cannot start: %s", index, error)
    else:
        logger.exception("worker %s cannot start", index)
    reason = str(error) if isinstance(error, (OptionError, OutputError)) else f"{type(error).__name__}: {error}"  # one line
    link.to_master(messages.READY, messages.Ready(worker=index, error=reason))


class Dispatcher:
    """The worker side: answers the master's messages, and from its plan on replays its part of
    the trace (PartReplay, built whole from the plan). Before the plan it holds nothing of a run:
    a stop then has nothing to record."""

    def __init__(self, link: transport.Link, local: bool = False,
                 on_request: Callable[[Record], None] | None = None):
        """`on_request` is called with each answered request's record, as it is recorded (the
        Locust adapter feeds Locust's own request statistics with it)."""
        untrack_greenlet_tree()
        self.on_request = on_request
        self.link = link
        self.local = local
        self.clock = ClockSync(link)
        self.go = Event()  # the master's go reached its replay
        self.finished = Event()  # its replay is over: drained, or stopped
        self.planned = False  # a plan came (its replay may still have been refused: READY said why)
        self.replay: PartReplay | None = None  # this worker's part of the run, from the master's plan on
        link.on(messages.PLAN, self.on_plan)
        link.on(messages.ROWS, self.on_rows)
        link.on(messages.PONG, self.clock.on_pong)
        link.on(messages.GO, self.on_go)
        link.on(messages.RECORDS_ACK, self.on_records_ack)
        link.on(messages.ABORT, self.on_abort)
        link.on(messages.IDLE, self.on_idle)
        link.on(messages.ROUND, self.on_round)

    # -- messages from the master: the plan builds the replay, which takes the rest ----------------

    def on_plan(self, data: messages.Plan, sender: str) -> None:
        self.link.to_master(messages.PLAN_ACK, messages.PlanAck(seq=data["seq"]))
        if self.planned:  # resent: the ack was lost or late
            return
        self.planned = True
        try:
            replay = PartReplay(data, self.link, self.clock, self.go, self.finished, local=self.local,
                                on_request=self.on_request)
        except Exception as e:  # this host cannot take the plan (a --header's variable unset here)
            _cannot_start(self.link, data["worker"], e)
            return
        self.replay = replay
        gevent.spawn(replay.prepare)

    def on_rows(self, data: messages.Rows, sender: str) -> None:
        if self.replay is not None:  # else left unacknowledged: the master records them as never sent
            self.replay.on_rows(data)

    def on_go(self, data: messages.Go, sender: str) -> None:
        if self.replay is not None:
            self.replay.on_go(data)

    def on_round(self, data: messages.Round, sender: str) -> None:
        if self.replay is not None:
            self.replay.on_round(data)

    def on_records_ack(self, data: messages.RecordsAck, sender: str) -> None:
        if self.replay is not None:
            self.replay.record_window.ack(data["seq"])

    def on_abort(self, data: messages.Abort, sender: str) -> None:
        self.abort(data["reason"])

    def on_idle(self, data: messages.Idle, sender: str) -> None:
        logger.warning("this worker idles: %s", data["reason"])

    # -- what its runner reads and does ---------------------------------------------------------

    def abort(self, reason: str) -> None:
        """The run is being stopped (PartReplay.abort); before a plan there is nothing to record."""
        if self.replay is not None:
            self.replay.abort(reason)

    @property
    def stopping(self) -> bool:
        """A stop reached this worker (abort): it sends nothing more."""
        return self.replay is not None and self.replay.stopping

    @property
    def stop_reason(self) -> str | None:
        """The label of its unanswered rows, once stopped."""
        return None if self.replay is None else self.replay.stop_reason

    @property
    def with_master(self) -> bool:
        """In the master's process group on its host: a signal here may have reached it too."""
        return self.replay is not None and self.replay.with_master

    @property
    def synth(self) -> PromptSynthesizer | None:
        """Its body builder's prompt synthesizer, once set up: a single-process run's end makes
        the cache section's prompts again from its blocks (replay.run.driver)."""
        return None if self.replay is None else self.replay.synth


class PartReplay:
    """One worker's replay of its part, built whole from the master's plan: receives the rows,
    builds bodies ahead, sends each row on time, records every outcome. The send loop (`run`)
    starts on the master's go, in a greenlet of its own: no Locust user owns it, so a rebalance
    that moves or stops users never stops a replay."""

    def __init__(self, plan: messages.Plan, link: transport.Link, clock: ClockSync, go: Event, finished: Event, *,
                 local: bool, on_request: Callable[[Record], None] | None):
        """`go` and `finished`: its Dispatcher's, set here. Raises what this host cannot take of
        the plan (OptionError: a --header's variable unset here)."""
        self.on_request = on_request
        self.link = link
        self.local = local
        self.options = options = ReplayOptions.from_dict(plan["options"])
        self.index = plan["worker"]
        self.rows = RowBuffer()
        self._wanted = 0  # rows asked of the master so far (its flow control)
        self.total = plan["rows"]
        self.more = plan.get("more", False)  # a capacity search: more rounds of rows may follow `total` (messages.Round)
        self.skip_to = 0  # rows numbered below it not yet sent are recorded as `skip_reason`, never sent
        self.skip_reason = ""
        self._next_round = 0  # the next ROUND's seq: each applied once, in order
        self.origin = plan["origin"]
        self.block_size = plan["block_size"]
        self.output = plan["output"]
        self.master_fingerprint = plan["tokenizer_fingerprint"]  # checked in _set_up
        self.with_master = plan["master_node"] == platform.node() and plan["master_pgid"] == os.getpgrp()
        self.run_id = plan["run_id"] if options.request_id_header else None  # None: no X-Request-Id header
        self.api = get_api(options.api)
        self.headers = {"Content-Type": "application/json", **parse_headers(options.header)}
        self.endpoints = [Endpoint(url) for url in plan["endpoints"]]  # resolved on the master: --host may not have reached us yet
        self.route = make_router(options.routing, self.endpoints)
        # a closed-loop --turn-timing's sessions; None: every row at its trace time
        self.turns = (None if options.turn_timing == "trace" else
                      Turns(options.turn_timing, options.scale, options.on_turn_failure == "stop-session",
                            self._record_unsent_turn))
        self.epoch = 0.0
        self.offset = 0.0  # master clock - local clock, seconds
        self.bodies = Bodies()  # by position; a row that could not be built: why
        # request id -> its prompt's fingerprint, until its record takes it: the body builder's, once set up
        self.fingerprints: dict[int, list | None] = {}
        self.synth: PromptSynthesizer | None = None  # the body builder's, once set up
        self.dispatch_pos = 0  # index (in self.rows) of the next row to send
        self.next_due = float("inf")  # local time of the next send, for the builder to keep clear of
        # request id -> (row, scheduled, due, endpoint url, sent_at, reader)
        self.in_flight: dict[int, tuple[TraceRow, float, float, str, float, gevent.Greenlet]] = {}
        self.last_send = 0.0  # local time of the latest send
        self.sends = Group()
        self.outbox: list[Record] = []
        self.sent = 0
        self.failed = 0
        # its own file, opened by the set-up; None before (records made meanwhile, by a stop, are shipped only)
        self.writer: RecordWriter | None = None
        self.write_fault: OutputError | None = None  # its own file could not be written (said once)
        self.primed = Event()
        self.warmed = Event()
        self.go = go
        self.finished = finished
        self._to_flush = Event()  # set by a record or a send: the flush loop has work (records, rows to ask for)
        self._stopped = False
        self.stop_reason: str | None = None  # the label of its unanswered rows, once stopped (abort)
        self._chunks: dict[int, list] = {}
        self._next_chunk = 0
        self.alarm = Alarm()  # the dispatcher's wake-up, rung early by stream readers
        self.clock = clock
        self.record_window = transport.Window(lambda payload: link.to_master(messages.RECORDS, payload))

    # -- messages from the master (through its Dispatcher) ---------------------------------------

    def on_rows(self, data: messages.Rows) -> None:
        # Chunks may come twice (resent) or out of order (one resent after later ones): apply
        # each once, in sequence order.
        seq = data["seq"]
        if self._stopped:  # left unacknowledged: the master records these rows as never sent
            return
        if seq >= self._next_chunk:
            self._chunks[seq] = data["rows"]
            while self._next_chunk in self._chunks:
                self.rows.extend(decode_row(r) for r in self._chunks.pop(self._next_chunk))
                self._next_chunk += 1
        self.link.to_master(messages.ROWS_ACK, messages.RowsAck(seq=seq, want=self._want()))

    def _want(self) -> int:
        """How many of its rows this worker takes so far: a bounded distance past its sends."""
        self._wanted = self.dispatch_pos + transport.HOLD_ROWS
        return self._wanted

    def _ask_for_rows(self) -> None:
        """Sends moved on: ask for the rows that now fit (a chunk's worth at least, or all the rest)."""
        self.rows.release(self.dispatch_pos)
        if self._stopped or self._wanted >= self.total:
            return
        if self.dispatch_pos + transport.HOLD_ROWS - self._wanted >= transport.HOLD_ROWS // 8:
            self.link.to_master(messages.ROWS_ACK, messages.RowsAck(seq=None, want=self._want()))

    def on_go(self, data: messages.Go) -> None:
        self.link.to_master(messages.GO_ACK, messages.GoAck(seq=data["seq"]))
        if self.go.is_set():  # resent: the ack was lost or late
            return
        self.epoch = data["epoch"]
        self.go.set()
        gevent.spawn(self.run)

    def on_round(self, data: messages.Round) -> None:
        """A capacity search's news: the part grew (its rows follow as ROWS), a probe was cut
        short (`skip_to`), or no more rounds follow."""
        self.link.to_master(messages.ROUND_ACK, messages.RoundAck(seq=data["seq"]))
        if data["seq"] < self._next_round:  # resent: the ack was lost or late
            return
        self._next_round = data["seq"] + 1
        self.total, self.more = data["rows"], data["more"]
        if "skip_to" in data:
            self.skip_to, self.skip_reason = data["skip_to"], data["skip_reason"]
            if self.turns is not None:
                self.turns.cut(self.skip_to)
        gevent.get_hub().loop.run_callback(self.alarm.ring)  # a message's greenlet: the hub wakes the sender
        self._to_flush.set()  # asks for the new rows

    # -- preparation ------------------------------------------------------------------------------

    def prepare(self) -> None:
        try:
            builder = self._set_up()
        except Exception as e:  # tell the master, or it would wait for this worker forever
            _cannot_start(self.link, self.index, e)
            return
        gevent.spawn(self._build_ahead, builder)
        gevent.spawn(self._flush_loop)
        gevent.spawn(self._keep_connections)
        self.primed.wait()
        self.warmed.wait(10.0)
        # Everything built so far (tokenizer, vocabulary, rows) lives for the whole run: keep it
        # out of the collector's way, or one full collection stalls dispatch for tens of ms.
        # The young generations' garbage goes first; the old one's is little, and collecting it
        # means a walk over every object Locust and Flask made.
        gc.collect(1)
        gc.freeze()
        rtt_s = self.clock.best_rtt if self.clock.best_rtt != float("inf") else 0.0  # inf: a local run does not ping
        ready = messages.Ready(worker=self.index, clock_offset_ms=self.offset * 1000.0, rtt_ms=rtt_s * 1000.0)
        self.link.to_master(messages.READY, ready)

    def _set_up(self) -> BodyBuilder:
        """The body builder, this worker's file and its clock's offset: what takes time or may fail."""
        # in a thread: the tokenizer check against the master's (none in the master's own process:
        # its options and files are the master's), then the set-up
        builder = build_off_loop(self.options, self.block_size, None if self.local else self.master_fingerprint)
        self.fingerprints = builder.fingerprints
        self.synth = builder.synth  # a single-process run's end makes the cache section's prompts from its blocks
        # open for the process's life (records come until a stop is over); each batch is flushed
        self.writer = RecordWriter(worker_path(self.output, self.index), self.output)
        if not self.local:
            self.offset = self.clock.measure()
        return builder

    def due(self, row: TraceRow) -> float:
        """Scheduled time in master clock (unix seconds)."""
        return send_time(self.epoch, row.timestamp_s, self.origin, self.options.scale)

    def _row(self, pos: int) -> TraceRow | None:
        """Row `pos` once it has arrived; None when the part has fewer rows."""
        while pos >= len(self.rows):
            if self._stopped or (pos >= self.total and not self.more):
                return None
            if pos >= self.total:  # a search's next round is not decided yet: all there is, is built
                self.primed.set()
            gevent.sleep(0.001)
        return self.rows[pos]

    def _build_ahead(self, builder: BodyBuilder) -> None:
        pos = 0
        steps = BuildSteps(lambda: self.next_due, lambda: self.dispatch_pos)
        scale = self.options.scale
        while True:
            row = self._row(pos)
            if row is None:
                self.primed.set()
                return
            if pos < self.skip_to:  # a probe cut short: never sent, nothing to build
                pos += 1
                continue
            while True:
                if self._stopped:
                    return
                ahead_rows = pos - self.dispatch_pos
                if self.go.is_set():
                    ahead_s = self.due(row) - self.offset - time.time()
                else:
                    ahead_s = send_offset_s(row.timestamp_s, self.origin, scale)
                if ahead_rows < AHEAD_ROWS and ahead_s < AHEAD_S and not self.bodies.full:
                    gap = self.next_due - time.time()
                    # Near a send: let it go out first. "Near" is a few steps of a build
                    # (replay.engine.lookahead), so dense traces still get built.
                    if steps.clear(gap) or self.dispatch_pos == pos:
                        break
                    gevent.sleep(max(gap, 0.0) + 0.0002)
                    continue
                self.primed.set()
                if ahead_rows >= AHEAD_ROWS or self.bodies.full:  # held back: sends free them at the trace's rate
                    gevent.sleep(0.05)
                elif self.go.is_set() and not self.more:
                    # held back by time, its send time fixed: nothing to build until the next row is
                    # BUILD_WAKE of AHEAD_S from its send, then a batch (an idle run's CPU is mostly
                    # wake-ups); the run's end wakes it
                    self.finished.wait(max(ahead_s - AHEAD_S * BUILD_WAKE, 0.001))
                else:  # before the go, or in a search (a round may be cut short): looked at again soon
                    gevent.sleep(min(BUILD_IDLE_S, max(ahead_s - AHEAD_S, 0.001)))
            steps.start(pos)
            try:
                self.bodies[pos] = builder.body(row, steps)
            except ChatTemplateError as e:  # the row's own messages and the template disagree: say so, no traceback
                logger.error("cannot build the request: %s", e.about(f"row {row.request_id} (trace line {row.line})"))
                self.bodies[pos] = e
            except Exception as e:  # a row that cannot be built is a failed request, not a dead worker
                logger.exception("row %d: cannot build the request", row.request_id)
                self.bodies[pos] = e
            steps.done()
            pos += 1
            gevent.sleep(0)

    # -- the run ----------------------------------------------------------------------------------

    def run(self) -> None:
        for endpoint in self.endpoints:
            endpoint.on_read = self._on_read
        with QuietCollector() as collector:
            while not self._stopped:
                pos = self.dispatch_pos
                if pos >= self.total:
                    if self.turns:  # session turns parked: they go when due, or wait for answers
                        self._wait_for_turns(collector)
                        continue
                    if not self.more:
                        break
                    if self.in_flight and time.time() >= self.last_send + self.options.drain_timeout:
                        self._cancel_in_flight(DRAIN_TIMEOUT)  # a search's probe is judged once each row has a record
                    collector.idle(0.0)
                    gevent.sleep(0.005)  # a search's next round is not decided yet
                    continue
                if pos >= len(self.rows):  # its rows have not all arrived yet
                    collector.idle(0.0)
                    gevent.sleep(0.001)
                    continue
                deadline = self._fire_due()
                if self.dispatch_pos == pos and pos not in self.bodies:  # only when the builder fell behind
                    collector.idle(0.0)
                    gevent.sleep(0.0005)
                    continue
                if deadline != float("inf"):
                    collector.idle(deadline - time.time())
                    self.alarm.wait_until(deadline)
        self._drain()
        self.finished.set()

    def _wait_for_turns(self, collector: QuietCollector) -> None:
        """Every row was reached; session turns are parked: send those due, else wait for the
        next one's time or an answer, up to --drain-timeout after the last send (then what is in
        flight is cut off, and the turns still waiting for it are recorded as never due, or as their
        session stopped under --on-turn-failure stop-session: the cut-off turn failed)."""
        deadline = self._fire_due()
        if not self.turns:  # the last parked turns went out: the loop goes on (or ends) as without turns
            return
        if deadline == float("inf"):  # nothing in the heap: turns wait for answers
            deadline = self.last_send + self.options.drain_timeout
            if time.time() >= deadline:
                self._cancel_in_flight(DRAIN_TIMEOUT)
                reason = SESSION_STOPPED if self.turns.stop_on_failure else TURN_NEVER_DUE
                for _, _, row, _, scheduled in self.turns.parked():
                    self._record_unsent_turn(row, scheduled, reason)
                return
        collector.idle(deadline - time.time())
        self.alarm.wait_until(deadline)

    def _record_unsent_turn(self, row: TraceRow, scheduled: float, reason: str = SESSION_STOPPED) -> None:
        """A session turn never sent: its session stopped (Turns' on_stopped), or it waited past --drain-timeout."""
        self._record(unsent_record(row, worker=self.index, api=self.options.api, scheduled_at=scheduled,
                                   reason=reason))

    def _on_read(self, now: float) -> None:
        """Called in the event loop after every read of a stream: a send that fell due meanwhile
        goes out now, instead of after the rest of this event-loop turn."""
        if now >= self.next_due:
            self.alarm.ring()

    def _fire_due(self) -> float:
        """Send every row that is due and return the local time the next one is due.

        Never yields when a connection is idle (the usual case, see _keep_connections): the
        request is written here and its answer read by a new greenlet.
        """
        now = time.time()
        turns = self.turns
        while not self._stopped:
            if turns and turns.next_due() - self.offset <= now:  # a parked session turn fell due
                due, pos, row, body, scheduled = turns.pop()
                if pos < self.skip_to:  # of a probe cut short: recorded, never sent; its session moves on
                    self._record(unsent_record(row, worker=self.index, api=self.options.api, scheduled_at=scheduled,
                                               reason=self.skip_reason))
                    self._turn_ended(turns, row, now + self.offset, True)
                else:
                    self._go(row, body, scheduled, due)
                continue
            if self.dispatch_pos >= len(self.rows):
                break
            pos = self.dispatch_pos
            row = self.rows[pos]
            scheduled = self.due(row)
            if pos < self.skip_to:  # a probe cut short: recorded, never sent
                self.bodies.pop(pos, None)
                self.dispatch_pos = pos + 1
                self._record(unsent_record(row, worker=self.index, api=self.options.api, scheduled_at=scheduled,
                                           reason=self.skip_reason))
                continue
            deadline = scheduled - self.offset
            if deadline > now or pos not in self.bodies:
                if turns:
                    deadline = min(deadline, turns.next_due() - self.offset)
                self.next_due = deadline
                return deadline
            body = self.bodies.pop(pos)
            self.dispatch_pos = pos + 1
            due = scheduled
            if turns is not None and row.session_id is not None:
                held = turns.hold(pos, row, body, scheduled, now + self.offset)
                if held is None:  # parked until its previous turn's answer (or stopped)
                    continue
                due = held
            self._go(row, body, scheduled, due)
        self.next_due = turns.next_due() - self.offset if turns else float("inf")
        return self.next_due

    def _go(self, row: TraceRow, body, scheduled: float, due: float) -> None:
        """Send row `row` now (`due`: when its timing let it go, in the master's clock)."""
        if isinstance(body, Exception):
            self._record(unsent_record(row, worker=self.index, api=self.options.api, scheduled_at=scheduled,
                                       due_at=due, reason=f"cannot build request: {body}"))
            if self.turns is not None and row.session_id is not None:  # a failed turn
                self._turn_ended(self.turns, row, time.time() + self.offset, False)
            return
        endpoint = self.route(row)
        request_id = None if self.run_id is None else f"{self.run_id}-{row.request_id}"
        headers = self.headers
        if self.options.session_header and row.session_id is not None and row.session_id.isprintable():  # for a recording proxy
            headers = {**headers, self.options.session_header: row.session_id}
        sent = write(endpoint, self.api, body, self.options.stream, headers, request_id)
        self.sent += 1
        if sent is not None:  # written already; the answer is read in its own greenlet
            sent_at = sent.outcome.sent_at
            greenlet = self.sends.spawn(self._read, row, scheduled, due, endpoint, sent)
        else:  # no idle connection: connecting would block, so the send gets a greenlet of its own
            sent_at = time.time()
            greenlet = self.sends.spawn(self._send, row, body, scheduled, due, endpoint, request_id, headers)
        self.last_send = sent_at
        self.in_flight[row.request_id] = (row, scheduled, due, endpoint.url, sent_at, greenlet)
        self._to_flush.set()  # the sends moved on: the flush loop asks for the rows that now fit

    def _turn_ended(self, turns: Turns, row: TraceRow, at: float, ok: bool) -> None:
        """A session's turn was answered or failed at `at` (master clock): its next turn may be
        released; the send loop is woken for it (from the hub, where the alarm may be rung)."""
        due = turns.ended(row, at, ok, self.skip_to)
        if due is not None and due - self.offset < self.next_due:
            self.next_due = due - self.offset
            gevent.get_hub().loop.run_callback(self.alarm.ring)

    def _send(self, row: TraceRow, body: bytes, scheduled: float, due: float, endpoint: Endpoint,
              request_id: str | None, headers: dict[str, str]) -> None:
        outcome = send(endpoint, self.api, body, self.options.stream, headers, request_id)
        self._done(row, scheduled, due, endpoint, outcome)

    def _read(self, row: TraceRow, scheduled: float, due: float, endpoint: Endpoint, sent: Sent) -> None:
        self._done(row, scheduled, due, endpoint, read(endpoint, self.api, self.options.stream, sent))

    def _done(self, row: TraceRow, scheduled: float, due: float, endpoint: Endpoint, outcome) -> None:
        if self.in_flight.pop(row.request_id, None) is None:  # a stop recorded it already: one record a row
            return
        if self.offset:  # stamped by this host's clock: records are in the master's, as scheduled_at is
            outcome.sent_at += self.offset
            outcome.finished_at += self.offset if outcome.finished_at else 0.0
            outcome.token_times = [t + self.offset for t in outcome.token_times]
        record = sent_record(row, worker=self.index, endpoint=endpoint.url, api=self.options.api,
                             scheduled_at=scheduled, due_at=due, outcome=outcome,
                             prompt_fingerprint=self.fingerprints.pop(row.request_id, None))
        self._record(record)
        if self.turns is not None and row.session_id is not None:
            self._turn_ended(self.turns, row, outcome.finished_at or time.time() + self.offset, outcome.ok)
        if self.on_request is not None:
            self.on_request(record)

    def _keep_connections(self) -> None:
        """Keep idle connections open for the sends due within the next WARM_S, read off the
        schedule itself: a burst finds its connections ready, a quiet spell opens none. With the
        connections held by requests in flight (each answered one comes back to the pool), a
        worker opens no more than its in-flight demand plus this margin; a rate measured over a
        few ticks overshot it several times over, with every idle connection kept to the end.
        Once the run is over or stopped, the idle connections are closed without leaving TIME_WAIT."""
        scale = self.options.scale
        while not self._stopped and not self.finished.is_set():
            tick = WARM_TICK_S
            if self.dispatch_pos < self.total:
                # schedule time reached (master clock), then the rows due before it + WARM_S
                now_s = time.time() + self.offset - self.epoch if self.go.is_set() else 0.0
                end = min(len(self.rows), self.dispatch_pos + MAX_SPARE * len(self.endpoints))
                pos = self.dispatch_pos
                while pos < end and send_offset_s(self.rows[pos].timestamp_s, self.origin, scale) < now_s + WARM_S:
                    pos += 1
                # the next row comes within WARM_S in `enters_s`: nothing changes before then, so
                # the keeper sleeps until then (WARM_TICK_S at least; aged connections are replaced
                # by then, and never used meanwhile: the pool retires them when taken or pruned)
                enters_s = 0.0
                if self.go.is_set() and pos < len(self.rows):
                    enters_s = send_offset_s(self.rows[pos].timestamp_s, self.origin, scale) - WARM_S - now_s
                    # a plain run's schedule is fixed: nothing to do until then (a search's next
                    # round may move its rows: looked at again within QUIET_TICK_S)
                    tick = max(WARM_TICK_S, min(QUIET_TICK_S, enters_s) if self.more else enters_s)
                if pos > self.dispatch_pos or enters_s <= WARM_TICK_S:
                    # sends due soon (else a quiet spell: no connection is opened, nor reopened
                    # as the idle ones age out)
                    per_endpoint = min(MAX_SPARE, -(-(pos - self.dispatch_pos) // len(self.endpoints)) + MIN_SPARE)
                    for endpoint in self.endpoints:
                        try:
                            endpoint.warm(per_endpoint)
                        except Exception as e:  # the endpoint backs off; the sends will report it
                            logger.debug("cannot open a connection to %s: %s", endpoint.url, e)
                    if self.go.is_set() and (pos < len(self.rows) or len(self.rows) >= self.total and not self.more):
                        # the MIN_SPARE spare connections just made ready serve the next few rows
                        # (or the last ones, all due within WARM_S): looked at again once a few
                        # more came, or after WARM_AGAIN_S (its spares are then still well within
                        # IDLE_MAX_S)
                        later_s = WARM_AGAIN_S
                        if pos < len(self.rows):
                            later = self.rows[min(pos + MIN_SPARE // 2, len(self.rows) - 1)]
                            later_s = send_offset_s(later.timestamp_s, self.origin, scale) - WARM_S - now_s
                        tick = max(tick, min(later_s, WARM_AGAIN_S))
            self.warmed.set()
            self.finished.wait(tick)
        for endpoint in self.endpoints:  # nothing is in flight any more (drained, or cancelled)
            endpoint.close()

    def _record(self, record: Record) -> None:
        if record["prompt_fingerprint"] is None:
            self.fingerprints.pop(record["request_id"], None)  # never answered: built for nothing
        self.outbox.append(record)
        self._to_flush.set()
        if not record["ok"]:
            self.failed += 1

    def _drain(self) -> None:
        """Wait for answers up to --drain-timeout after the last send; what is still open then
        becomes a failed record."""
        if not self.sends.join(timeout=self.options.drain_timeout):
            self._cancel_in_flight(DRAIN_TIMEOUT)
        self._flush()

    def _cancel_in_flight(self, reason: str) -> None:
        """Requests still unanswered get `reason`, keeping when and where they were sent. Without
        yielding (a stop's records are made at once): each reader is told to end, but one whose
        answer is already in may run before the kill lands; `_done` then finds its request gone
        from `in_flight` and records nothing, so the row keeps this one record."""
        for row, scheduled, due, url, sent_at, greenlet in list(self.in_flight.values()):
            greenlet.kill(block=False)
            sent_at += self.offset  # records are in the master's clock
            record = unsent_record(row, worker=self.index, api=self.options.api, scheduled_at=scheduled,
                                   due_at=due, reason=reason, endpoint=url, sent_at=sent_at)
            self._record(record)
        self.in_flight.clear()

    @property
    def stopping(self) -> bool:
        """A stop reached this worker (abort): it sends nothing more."""
        return self._stopped

    def abort(self, reason: str) -> None:
        """The run is being stopped: every row not yet answered gets its record now: `reason`
        for rows never sent, and for requests in flight the same, or `STOPPED_IN_FLIGHT` when
        the user stopped the run."""
        if self._stopped:
            return
        self._stopped, self.stop_reason = True, reason
        self.next_due = float("inf")
        self._cancel_in_flight(STOPPED_IN_FLIGHT if reason == RUN_STOPPED else reason)
        started = self.go.is_set()  # before the go nothing was sent and nothing is scheduled yet
        held = self.rows.tail(self.dispatch_pos)
        for seq in sorted(self._chunks):  # arrived out of order, not yet applied: held all the same
            held += [decode_row(r) for r in self._chunks.pop(seq)]
        if self.turns is not None:  # session turns reached but parked: never sent
            held[:0] = [row for _, _, row, _, _ in self.turns.parked()]
        for row in held:
            self._record(unsent_record(row, worker=self.index, api=self.options.api,
                                       scheduled_at=self.due(row) if started else None, reason=reason))
        self.dispatch_pos = len(self.rows)
        self._flush()

    # -- records ----------------------------------------------------------------------------------

    def _flush(self) -> None:
        batch = self.take_records()
        for i in range(0, len(batch), BATCH):  # RECORDS payloads (messages.Records): the window adds the seq
            self.record_window.put({"worker": self.index, "records": batch[i : i + BATCH]})

    def _flush_loop(self) -> None:
        while True:
            self._to_flush.wait()  # nothing recorded and nothing sent: no wake-ups
            gevent.sleep(FLUSH_S)
            self._to_flush.clear()
            # A batch takes a few ms to write and ship, and nothing yields meanwhile: start it
            # in a gap between sends when one comes soon enough.
            for _ in range(FLUSH_GAP_TRIES):
                if self.next_due - time.time() >= FLUSH_GAP_S:
                    break
                gevent.sleep(0.001)
            self._flush()
            self._ask_for_rows()

    def take_records(self) -> list[Record]:
        """Records not yet shipped, written to this worker's file (a local run hands them over
        directly). A batch its file cannot take is still shipped: the master keeps it."""
        batch, self.outbox = self.outbox, []
        if batch and self.writer is not None:
            try:
                self.writer.write(batch)
            except OutputError as e:
                self._write_failed(e)
        return batch

    def _write_failed(self, error: OutputError) -> None:
        """Tell the master, which stops the run (once; later batches are still tried, and the
        file keeps whole lines only). A worker process says it in its own log too."""
        if self.write_fault is not None:
            return
        self.write_fault = error
        if not self.local:
            logger.error("replay: worker %s: %s: stopping the run", self.index, error)
        self.link.to_master(messages.FAULT, messages.Fault(worker=self.index, file=str(error.path),
                                                           reason=error.reason))


"""The master's side of the replay (also the local runner's): split the run's rows across
workers, ship them, set the shared start, collect the records, and account for every row.

It is given a run as values (replay.engine.spec's RunSpec, made by replay.run.preflight: the
trace read and spooled, the tokenizer's fingerprint, the prompt limit) and does no I/O until
`begin`; the run's end past the accounting (the merged file, the summary, the last meta) is
its driver's (replay.run.driver): `end` hands it the run's `Outcome`, and the driver's
listeners are all the engine knows of it. Its time is read and waited for on the clock it is given
(replay.engine.clock), so a test can run it on a clock of its own.

The master knows what it assigned, what each worker acknowledged holding, and what came back,
so it can always write a complete merged file with labels that tell why a row has no answer
(replay.results.records): a worker that went missing leaves "worker lost" rows; rows a stop
kept from ever being sent are "run stopped" only when the user stopped the run; rows a live
worker held but never reported are "no record from worker".

A file of the run that cannot be written (a full disk, replay.errors.OutputError: the
master's own files, or a worker's, told by FAULT) stops the run as a fault: one line in the log,
the rows left recorded as "output error", exit code 1, and the file named in the meta's
`incomplete`. Servers that fail more than --max-error-rate of their answers
(replay.engine.error_rate) stop it the same way, the rows left recorded as "run aborted: error
rate over R"; servers the preflight refuses (`refuse`) leave every row recorded as "run refused
before the first send: why". The meta is written, with its room reserved, as the run begins, so that at the
end it can still say what is missing when the disk has filled since.
"""

from __future__ import annotations

import logging
import os
import platform
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import islice
from typing import Protocol

import gevent
from gevent.event import Event

from replay.engine import messages, transport
from replay.engine.clock import SYSTEM_CLOCK, Clock, answer_ping
from replay.engine.error_rate import MIN_ANSWERS, WINDOW_S, ErrorRate
from replay.engine.rounds import Part, Round
from replay.engine.scraper import Scraper
from replay.engine.spec import Outcome, RunFacts, RunSpec
from replay.errors import OutputError
from replay.results import host_load
from replay.results.metadata import write_run_metadata
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
    Record,
    error_rate_label,
    unsent_record,
)
from replay.results.store import REAL, RecordStore
from replay.rules.send_time import send_time
from replay.synth.server_check import Verdict

logger = logging.getLogger(__name__)

CHUNK_ROWS = 500  # rows per message
GO_LEAD_S = 0.5  # from the go message to the first send: enough for it to reach every worker
READY_TIMEOUT_S = 300.0  # workers that are not ready by then are started anyway
DRAIN_GRACE_S = 10.0  # beyond --drain-timeout, for the workers' last records to arrive
ABORT_WAIT_S = 5.0  # at a stop, how long workers get to send what they still hold
PLAN_RESEND_S = 2.0  # a plan not acked by then is sent again
GO_RESEND_S = GO_LEAD_S / 2  # a go not acked by then is sent again, most often before the first send is due
ABORT_RESEND_S = 1.0  # at a stop, the abort is sent again this often while the workers' records are awaited
# A worker in the master's process group that got a stop signal: how long the master waits for
# its own (a process group's signal reaches both at once, and either may be handled first)
SHARED_SIGNAL_GRACE_S = 2.0
TICK_S = 0.25
# The supervisor's tick once the go is given, in a run with no rounds to open: a lost worker
# (Locust's heartbeats are a second apart) and the drain's deadline (DRAIN_GRACE_S beyond
# --drain-timeout) need no finer one, and an idle run's CPU is mostly its wake-ups.
QUIET_TICK_S = 1.0
REFUSED_EXIT_CODE = 2  # a run refused before the first send (`refuse`), as any refusal of its input
# The meta written as the run begins keeps this much room (spaces) for the end's, plus some per
# worker: their clock figures and the incomplete files are only known later.
META_ROOM = 8192
META_ROOM_PER_WORKER = 1024
NOT_ENDED = "the run has not ended, or its master stopped before writing its end"  # the first meta's word


@dataclass
class WorkerState:
    client_id: str
    index: int
    positions: array  # its rows' places in the schedule, in send order
    part: Part  # its rows, once per round (a run without a search: one round)
    window: transport.Window  # its ROWS, started once the plan is acked
    plan: messages.Plan
    plan_window: transport.Window  # the PLAN, put in once the worker said HELLO, resent until acked
    go_window: transport.Window  # the GO, resent until acked
    round_window: transport.Window  # a search's ROUND messages, resent until acked
    plan_sent: bool = False
    plan_acked: bool = False
    ready: bool = False
    lost: bool = False
    stopped: bool = False  # it got a signal of its own (STOPPED): its unrecorded rows are "worker stopped"
    signal_at: float | None = None  # when it reported a signal shared with the master's group, not yet judged
    clock_offset_ms: float | None = None
    rtt_ms: float | None = None
    failed: int = 0
    acked: set[int] = field(default_factory=set)  # ROWS chunks the worker confirmed holding
    want: int = 0  # the rows it takes (at first HOLD_ROWS, then its RowsAck.want): granted again as rounds are added

    def holds(self, i: int) -> bool:
        """Whether the worker confirmed receiving its `i`-th row."""
        return self.part.chunk_of(i) in self.acked

    def close(self) -> None:
        """Nothing more is sent to this worker (it is lost or failed)."""
        self.window.close()
        self.plan_window.close()
        self.go_window.close()
        self.round_window.close()

    def unrecorded_label(self) -> str:
        """Why its rows without a record of its own have none, once it is gone."""
        return WORKER_STOPPED if self.stopped else WORKER_LOST


def listen_for_hellos(link: transport.Link) -> set[str]:
    """The workers that say HELLO while the preflight runs (its loads yield to the event loop,
    and a message no handler takes is dropped): hand the set to the Coordinator as `heard`."""
    heard: set[str] = set()
    link.on(messages.HELLO, lambda data, sender: heard.add(sender))
    return heard


def _never_gone(client_id: str) -> bool:
    return False


def _no_hostname(client_id: str) -> str | None:
    return None


def _ignore_exit_code(code: int) -> None:
    pass


class RunPolicy(Protocol):
    """What decides a run's rounds of rows and when it has its answer: a plain run's one round
    (PlainRun, below) or a capacity search's probes (replay.engine.probes.Probes, which acts on
    the run through the Coordinator's SearchRun methods). The Coordinator tells it what happens."""

    rounds: list[Round | None]  # the rounds so far, which every worker's Part reads (None: the trace's rows as they are)
    more_rounds: bool  # rounds may follow the first: the workers wait for them, or to hear none will

    @property
    def between(self) -> bool:
        """No row is owed an answer now (a search between probes): no drain timeout runs."""
        ...

    def begin(self) -> None:
        """The run begins: its first round, if not known from the start, is opened."""

    def label(self, records: list[Record]) -> None:
        """Records about to be stored: what the policy writes into them."""

    def tally(self, fresh: list[Record]) -> None:
        """Records new to the store while the run goes on: the policy may end or stop it."""

    def tick(self) -> None:
        """The supervisor's turn (every TICK_S)."""

    def worker_lost(self, state: WorkerState) -> None:
        """A worker was lost, before its rows get their records."""

    def worker_stopped(self, index: int) -> None:
        """A worker got a stop signal of its own."""

    def stop(self, fault: str | None) -> None:
        """The run ends (by itself or stopped); `fault`: the label of the fault that stopped it
        (a refusal before the first send, an output error), None for its own end or the user's stop."""

    def report(self) -> dict | None:
        """The run's capacity result (OUTPUT.capacity.json); None: not a search."""

    def live(self) -> dict | None:
        """The Replay view's capacity panel; None: not a search."""


class PlainRun:
    """A run without a capacity search: one round, the trace's rows as they are, known from the
    start. It ends once every row has a record, and stops when the servers fail more than
    --max-error-rate of their answers (replay.engine.error_rate)."""

    more_rounds = False
    between = False

    def __init__(self, run: Coordinator):
        self.run = run
        self.rounds: list[Round | None] = [None]
        self.error_rate = ErrorRate(run.options.max_error_rate, run.clock)

    def begin(self) -> None:
        pass

    def label(self, records: list[Record]) -> None:
        pass

    def tally(self, fresh: list[Record]) -> None:
        run = self.run
        if run.records.count >= run.total:
            run._end_by_itself("complete")
        elif not run.finished.is_set() and self.error_rate.add(fresh):  # once it ended, nothing stops it
            label = error_rate_label(self.error_rate.limit)
            logger.error("replay: %d of the last %d answers failed, more than --max-error-rate %g (over the last "
                         "%g s and at least %d answers): stopping the run; the rows left are recorded as %r",
                         self.error_rate.failed, self.error_rate.answers, self.error_rate.limit, WINDOW_S,
                         MIN_ANSWERS, label)
            run._stop_for(label)

    def tick(self) -> None:
        if self.run.records.count >= self.run.total:  # rows recorded by the master (a lost worker's, say)
            self.run._end_by_itself("complete")

    def worker_lost(self, state: WorkerState) -> None:
        pass

    def worker_stopped(self, index: int) -> None:
        pass

    def stop(self, fault: str | None) -> None:
        pass

    def report(self) -> None:
        return None

    def live(self) -> None:
        return None


def _policy(coordinator: Coordinator) -> RunPolicy:
    """A capacity search's probes (imported here: a run without a search never pays for the
    search's modules, its probes and their rounds' amplification), or a plain run's one round."""
    if not coordinator.options.capacity_search:
        return PlainRun(coordinator)
    from replay.engine.probes import Probes

    return Probes(coordinator)


def _no_cpu(client_id: str) -> float | None:
    return None


def _no_end(outcome: Outcome) -> int:
    return 0


class Coordinator:
    """The master's side, for the run `spec`. What it needs of the runner it is given, not
    looked up: `worker_gone` (whether the runner lost a worker, by client id), `worker_host` (a
    worker's host name, for the metadata; None: this host's), `on_exit_code` (called with 1
    when any row failed) and `worker_cpu` (a worker's last reported CPU use, percent of a core;
    None: not known; a capacity search's probes read it once they have sent for `cpu_lag_s`, the
    runner's sampling interval: a figure read earlier covers the time before the probe). The runner's target host is the spec's. `local_part` is a local run's
    own Dispatcher; `heard` the workers that said HELLO before it was built (listen_for_hellos).
    `on_end` ends the run once every row has a record: given its Outcome, it writes the run's
    files and returns the exit code (replay.run.driver's; the default writes nothing more)."""

    def __init__(self, spec: RunSpec, link: transport.Link, clock: Clock = SYSTEM_CLOCK, *, local_part=None,
                 heard: Iterable[str] = (), worker_gone: Callable[[str], bool] = _never_gone,
                 worker_host: Callable[[str], str | None] = _no_hostname,
                 on_exit_code: Callable[[int], None] = _ignore_exit_code,
                 worker_cpu: Callable[[str], float | None] = _no_cpu, cpu_lag_s: float = 0.0,
                 on_end: Callable[[Outcome], int] = _no_end):
        self.spec = spec
        self.worker_cpu, self.cpu_lag_s = worker_cpu, cpu_lag_s
        self.clock = clock
        self.worker_gone = worker_gone
        self.worker_host = worker_host
        self.on_exit_code = on_exit_code
        self.on_end = on_end
        self.link = link
        self.local_part = local_part
        # the spec's, by the names the live view and the web UI read them by
        self.options, self.output, self.schedule, self.trace = spec.options, spec.output, spec.schedule, spec.trace
        self.origin = spec.schedule.origin
        self.total = spec.total  # rows the run must record
        self.end_reason: str | None = None  # why the master ended the run itself; None: it was stopped
        # the label of the rows left when the master stopped the run for a fault (an output error,
        # the error rate, a refusal); None: it ended by itself, or the user stopped it
        self.fault_label: str | None = None
        self.refused = False  # the servers could not take the run (`refuse`): nothing was sent
        self.signalled_at: float | None = None  # when this process got a stop signal (`stop_signal_received`)
        self.incomplete: dict[str, str] = {}  # file -> why it is not whole (a write that failed)
        self.workers: dict[str, WorkerState] = {}
        # Workers that said HELLO: they can hear replay messages. The local part hears from the start.
        self.heard: set[str] = set(heard) | ({transport.LOCAL_CLIENT} if local_part is not None else set())
        self.stopped_before_begin: set[str] = set()  # workers whose own signal stopped them before the run began
        self.store: RecordStore | None = None  # every record, on disk; made at the start
        self.epoch: float | None = None
        self.host_at_go: host_load.HostSample | None = None  # the host at the go (the certificate's schedule line)
        self.last_due: float | None = None
        self.started_at: float | None = None
        self.finished = Event()
        self._ending: gevent.Greenlet | None = None
        self._supervisor: gevent.Greenlet | None = None
        # the servers' /metrics, scraped by the master from the start of the run to its end (made by `begin`)
        self.scraper: Scraper | None = None
        self.scrape_listeners: list = []  # handed to the scraper: called with each round (the live Replay view)
        self.exporter_listeners: list = []  # the same, with the --metrics-endpoint exporters' samples
        self.listeners: list = []  # called with each batch of new records (the live Replay view)
        # called at the go with the facts so far and the first request id (the driver's cache
        # section follower)
        self.go_listeners: list[Callable[[RunFacts, int], None]] = []
        self.final_listeners: list = []  # called with every record of the merged file, at the end
        self.summary_listeners: list = []  # called with the run's summary (OUTPUT.summary.json's), at the end
        self.server_check = Verdict(skipped="not checked").to_dict()  # the preflight's verdict, for the meta file
        # A capacity search (docs/capacity.md): its probes, run as rounds of the window's rows; a
        # run without one is one round of the rows as the trace has them.
        self.policy = _policy(self)
        # every row of the window, for the rows no worker was given (no worker at all)
        self.whole = Part(self.schedule, array("q", range(len(self.schedule))), self.policy.rounds, CHUNK_ROWS)
        link.on(messages.ROWS_ACK, self.on_rows_ack)
        link.on(messages.PING, lambda data, sender: answer_ping(link, data, sender, clock))
        link.on(messages.READY, self.on_ready)
        link.on(messages.HELLO, self.on_hello)
        link.on(messages.PLAN_ACK, self.on_plan_ack)
        link.on(messages.GO_ACK, self.on_go_ack)
        link.on(messages.STOPPED, self.on_stopped)
        link.on(messages.RECORDS, self.on_records)
        link.on(messages.FAULT, self.on_fault)
        link.on(messages.ROUND_ACK, self.on_round_ack)

    @property
    def scrapes(self) -> bool:
        """Whether the run scrapes the servers' /metrics (--server-metrics-interval)."""
        return self.options.server_metrics_interval > 0

    def endpoint_urls(self) -> list[str]:
        """The servers this run sends to: --endpoints, or the runner's host."""
        return self.spec.endpoint_urls()

    def window_seconds(self) -> float:
        return self.spec.window_seconds

    @property
    def records(self) -> RecordStore:
        """The run's record store, made by `begin` (or `cancel`): every caller runs after either."""
        assert self.store is not None, "the run has not begun"
        return self.store

    @property
    def recorded(self) -> int:
        """Rows with a record so far."""
        return self.records.count if self.store is not None else 0

    # -- start --------------------------------------------------------------------------------------

    def _open_records(self, workers: int) -> None:
        """The first meta (for `workers` workers), then the merged file, with the rows no one sends
        (over --max-prompt-tokens) recorded."""
        self._write_first_meta(workers)
        first, last = self.schedule.request_id_range()
        # a search's probes take room for their request ids as they open (Probes._open)
        self.store = RecordStore(self.output, first, last, on_fault=self.on_output_error)
        self._record_oversized()

    def begin(self, workers: list[tuple[str, int]]) -> None:
        """Split the rows across `workers` [(client id, index)] and send each its plan, once it
        has said HELLO (`on_hello` sends it to those that have not yet)."""
        if self.store is not None:  # begun, or cancelled
            return
        self.started_at = self.clock.now()
        self._open_records(len(workers))
        if self.fault_label is not None:  # nothing is planned: every row is recorded as not sent
            logger.info("replay: %d rows, output %s: nothing sent", len(self.schedule), self.output)
            return
        if self.scrapes:
            self.scraper = Scraper(self.endpoint_urls(), self.output, self.options.server_metrics_interval,
                                   self.options.server_metric, on_fault=self.on_output_error,
                                   exporters=self.options.metrics_endpoint)
            self.scraper.listeners.extend(self.scrape_listeners)
            self.scraper.exporter_listeners.extend(self.exporter_listeners)
            self.scraper.start()
        self.policy.begin()
        parts = self.schedule.partition(len(workers), self.options.partition)
        for (client_id, index), positions in zip(sorted(workers, key=lambda w: w[1]), parts):
            part = Part(self.schedule, positions, self.policy.rounds, CHUNK_ROWS)
            window = transport.Window(self._sender(client_id, messages.ROWS), source=part.round_chunks(0),
                                      limit=part.chunks_below(transport.HOLD_ROWS))
            plan_window = transport.Window(self._sender(client_id, messages.PLAN), size=1, resend_s=PLAN_RESEND_S)
            plan = messages.Plan(  # type: ignore[typeddict-item]  # the window adds the seq
                worker=index,
                rows=len(part),
                origin=self.origin,
                block_size=self.trace.block_size,
                output=self.output,
                run_id=self.spec.run_id,
                endpoints=self.endpoint_urls(),
                options=self.options.to_dict(),
                tokenizer_fingerprint=self.spec.tokenizer_fingerprint,
                master_node=platform.node(),
                master_pgid=os.getpgrp(),
                more=self.policy.more_rounds,
            )
            go_window = transport.Window(self._sender(client_id, messages.GO), size=1, resend_s=GO_RESEND_S)
            round_window = transport.Window(self._sender(client_id, messages.ROUND), size=1, resend_s=PLAN_RESEND_S)
            state = self.workers[client_id] = WorkerState(client_id, index, positions, part, window, plan,
                                                          plan_window, go_window, round_window,
                                                          want=transport.HOLD_ROWS)
            if client_id in self.heard:
                self._send_plan(state)
        logger.info("replay: %d rows across %d worker(s), output %s", len(self.schedule), len(workers), self.output)
        self._supervisor = gevent.spawn(self._supervise)

    def _sender(self, client_id: str, msg_type: str) -> Callable[[dict], None]:
        """What a worker's window sends with: its payloads to that worker, as `msg_type`."""
        return lambda payload: self.link.to_worker(client_id, msg_type, payload)

    def _write_first_meta(self, workers: int) -> None:
        """The meta as the run begins: it says the run has not ended (so does a master that is
        killed), and reserves the room the end's meta is written into when the disk is full by then."""
        try:
            write_run_metadata(self.output, self.metadata({str(self.output): NOT_ENDED}),
                               reserve=META_ROOM + META_ROOM_PER_WORKER * workers)
        except OutputError as e:
            self.on_output_error(e)

    def _record_oversized(self) -> None:
        reason = f"{OVERSIZED} ({self.spec.max_prompt_tokens})"
        records = (unsent_record(row, worker=None, api=self.options.api, scheduled_at=None, reason=reason)
                   for row in self.schedule.oversized_rows())
        self.ingest(list(records))

    def on_rows_ack(self, data: messages.RowsAck, sender: str) -> None:
        """A worker holds chunk `seq`, and takes rows up to `want` (its flow control: it holds a
        bounded number of rows ahead of its sends, so a huge part does not fill its memory)."""
        state = self.workers.get(sender)
        if state is not None:
            seq = data["seq"]
            if seq is not None:
                state.acked.add(seq)
                state.window.ack(seq)
            state.want = max(state.want, data["want"])
            state.window.grant(state.part.chunks_below(state.want))

    def on_round_ack(self, data: messages.RoundAck, sender: str) -> None:
        state = self.workers.get(sender)
        if state is not None:
            state.round_window.ack(data["seq"])

    def live_workers(self) -> list[WorkerState]:
        return [w for w in self.workers.values() if not w.lost]

    def new_round(self, round_: Round) -> None:
        """A search's next probe, the last of its rounds: its rows are shipped to every live
        worker, each told its part grew."""
        r = len(self.policy.rounds) - 1
        assert self.epoch is not None  # a search opens its next probe after the go
        self.last_due = self.epoch + round_.offset_s + self.window_seconds() / round_.speedup
        for w in self.workers.values():
            if w.lost:
                self._fill(w.part, w.part.round_range(r), w.index, w.unrecorded_label())
                continue
            w.round_window.put(messages.Round(rows=len(w.part), more=True))  # type: ignore[typeddict-item]
            w.window.feed(w.part.round_chunks(r))
            w.window.grant(w.part.chunks_below(w.want))  # a worker that wants rows past the last round's takes the new
        if not self.workers:  # no worker at all: nobody sends them
            self._fill(self.whole, self.whole.round_range(r), None, NO_RECORD)

    def cut_round(self, reason: str) -> None:
        """The current probe can no longer meet its target: its rows not yet sent are recorded
        as `reason` by their workers, and never sent. A worker whose shared signal is not yet
        judged is not cut: if the signal is its own, its rows are "worker stopped", which is
        stronger than the probe's failure."""
        for w in self.live_workers():
            if w.signal_at is not None:
                continue
            w.round_window.put(messages.Round(rows=len(w.part), more=True, skip_to=len(w.part),  # type: ignore[typeddict-item]
                                              skip_reason=reason))

    def hand_over(self, state: WorkerState) -> None:
        """A lost worker's rows of the rounds to come go to the live worker with the fewest (a
        search goes on with the workers left)."""
        if heirs := self.live_workers():
            state.part.hand_over(min(heirs, key=lambda w: len(w.part.positions)).part)

    def owe(self, total: int, last_request_id: int) -> None:
        """A search's probe opened: the run now owes `total` records, of request ids up to
        `last_request_id` (the store makes room for them)."""
        self.total = total
        if self.store is not None:
            self.store.grow(last_request_id)

    def stop_search(self, label: str) -> None:
        """The search ends without an answer: the rows left get `label`."""
        self._stop_for(label)

    def search_over(self) -> None:
        """The search has its answer: no more rounds, and the run ends by itself."""
        self.end_rounds()
        self._end_by_itself("complete")

    def end_rounds(self) -> None:
        """The search is over: no more rounds; each worker ends once its rows are done."""
        for w in self.live_workers():
            w.round_window.put(messages.Round(rows=len(w.part), more=False))  # type: ignore[typeddict-item]

    def _send_plan(self, state: WorkerState) -> None:
        if not state.plan_sent and not state.lost:
            state.plan_sent = True
            state.plan_window.put(state.plan)

    def on_plan_ack(self, data: messages.PlanAck, sender: str) -> None:
        """The worker holds its plan: its rows follow."""
        state = self.workers.get(sender)
        if state is None:
            return
        state.plan_window.ack(data["seq"])
        if not state.plan_acked and not state.lost:
            state.plan_acked = True
            state.window.start()

    def on_go_ack(self, data: messages.GoAck, sender: str) -> None:
        state = self.workers.get(sender)
        if state is not None:
            state.go_window.ack(data["seq"])

    def stop_signal_received(self) -> None:
        """This process got a stop signal (SIGTERM, SIGINT, SIGHUP): the user's stop. A worker in
        its process group that reports the same signal (`on_stopped`, shared) is stopped by it."""
        if self.signalled_at is None:
            self.signalled_at = self.clock.now()

    def on_stopped(self, data: messages.Stopped, sender: str) -> None:
        """The worker got a stop signal. Its own: what it does not record is labelled for that.
        Shared with this process's group: the user's stop if this process got one too, within
        SHARED_SIGNAL_GRACE_S (its abort labels the rows), else the worker's own, and the worker
        is told so by an abort that labels them."""
        state = self.workers.get(sender)
        if state is None and self.store is None and not data.get("shared"):
            self.stopped_before_begin.add(sender)  # the plugin ends the run once the worker is gone (`abandon`)
        if state is None or state.stopped:
            return
        if data.get("shared"):
            state.signal_at = self.clock.now()
            gevent.spawn(self._judge_shared_signal, state)
        else:
            self._worker_stopped(state)

    def _judge_shared_signal(self, state: WorkerState) -> None:
        if self.signalled_at is None:
            self.clock.sleep(SHARED_SIGNAL_GRACE_S)
        if self.signalled_at is not None or self._ending is not None or state.stopped:
            return  # the user's stop (or the run is over): its abort labels the worker's rows
        self._own_signal(state)

    def _own_signal(self, state: WorkerState) -> None:
        """The worker's shared signal was its own: it is told so by an abort that labels its rows."""
        self.link.to_worker(state.client_id, messages.ABORT, messages.Abort(reason=WORKER_STOPPED))
        self._worker_stopped(state, " (the master got none)")

    def _judge_pending_signals(self) -> None:
        """The run ends (a search that failed meanwhile, say) while a worker's shared signal is
        not yet judged: its grace is waited out here, so that a worker's own stop is never lost
        to that end (it invalidates what its probe measured)."""
        for state in self.workers.values():
            if state.signal_at is None or state.stopped or self.signalled_at is not None:
                continue
            self.clock.sleep(max(0.0, state.signal_at + SHARED_SIGNAL_GRACE_S - self.clock.now()))
            if self.signalled_at is None and not state.stopped:
                self._own_signal(state)

    def _worker_stopped(self, state: WorkerState, why: str = "") -> None:
        logger.error("worker %d was stopped by a signal of its own%s: its unanswered rows fail as %r",
                     state.index, why, WORKER_STOPPED)
        state.stopped = True
        self.policy.worker_stopped(state.index)

    def on_hello(self, data: messages.Hello, sender: str) -> None:
        """The worker can hear replay messages now (Locust acks its connection before it has
        registered them, and a message sent then is dropped): its plan goes now if the run has
        begun. A worker that connects once the replay has begun gets no rows: its part of the
        trace would have to be taken from workers already sending it. It is told so, and idles."""
        self.heard.add(sender)
        if self.store is None:
            return
        if sender in self.workers:
            self._send_plan(self.workers[sender])
            return
        reason = "it connected after the replay began; the trace is split only among the workers present at the start"
        logger.warning("worker %s gets no rows: %s", sender, reason)
        self.link.to_worker(sender, messages.IDLE, messages.Idle(reason=reason))

    def on_ready(self, data: messages.Ready, sender: str) -> None:
        state = self.workers.get(sender)
        if state is None:
            return
        error = data.get("error")
        if error:
            logger.error("worker %d cannot replay: %s", state.index, error)
            state.lost = True
            state.close()
            self._fill(state.part, range(len(state.part)), state.index, f"{WORKER_FAILED}: {error}")
            self._maybe_go()
            return
        state.ready = True
        state.clock_offset_ms = data.get("clock_offset_ms")
        state.rtt_ms = data.get("rtt_ms")
        logger.info("worker %d ready (clock offset %.3f ms, rtt %.3f ms)", state.index, state.clock_offset_ms or 0.0, state.rtt_ms or 0.0)
        self._maybe_go()

    def _maybe_go(self, force: bool = False) -> None:
        if self.epoch is not None or self.fault_label is not None:
            return
        live = [w for w in self.workers.values() if not w.lost]
        if not force and not all(w.ready for w in live):
            return
        if not force and self.scraper is not None and not self.scraper.first_round.is_set():
            return  # the servers' counters are read once before the first send
        self.epoch = self.clock.now() + GO_LEAD_S
        first = self.policy.rounds[0]
        speedup = first.speedup if first is not None else 1.0  # a search's first probe; a plain run's trace
        self.last_due = self.epoch + self.window_seconds() / speedup
        for w in live:
            w.go_window.put(messages.Go(epoch=self.epoch))  # type: ignore[typeddict-item]  # the window adds the seq
        logger.info("replay starts at %.3f; last send due in %.1f s", self.epoch, self.last_due - self.clock.now())
        self.host_at_go = host_load.sample()
        for listener in self.go_listeners:
            listener(self.facts(), self.records.first)

    # -- records ------------------------------------------------------------------------------------

    def on_records(self, data: messages.Records, sender: str) -> None:
        self.link.to_worker(sender, messages.RECORDS_ACK, messages.RecordsAck(seq=data["seq"]))
        self.ingest(data["records"])

    # -- faults: a file of the run that cannot be written ----------------------------------------

    def on_output_error(self, error: OutputError) -> None:
        """One of the master's own files (the records, the server metrics, the meta, ...)."""
        self._fault(str(error.path), error.reason)

    def on_fault(self, data: messages.Fault, sender: str) -> None:
        """A worker's own file (its records come all the same)."""
        self._fault(data["file"], data["reason"], None if self.local_part is not None else data["worker"])

    def _fault(self, file: str, reason: str, worker: int | None = None) -> None:
        """Said once per file, in one line; the first one that comes while the run goes on stops it."""
        if file in self.incomplete:
            return
        first = not self.incomplete
        self.incomplete[file] = reason
        who = f"worker {worker}: " if worker is not None else ""
        if self._ending is None:
            if first:
                logger.error("replay: %scannot write %s: %s: stopping the run", who, file, reason)
            self._stop_for(OUTPUT_ERROR, over_any=True)  # the rows left are recorded as its
        elif first:  # the end of the run: the rest are said with this one in the meta and the last line
            logger.error("replay: %scannot write %s: %s", who, file, reason)

    def _stop_for(self, label: str, over_any: bool = False) -> None:
        """The master stops the run for a fault: the rows left unanswered get `label`. The first
        fault names the end, unless this one is to win `over_any` other (an output error: the
        rows left can no longer be written as anything else)."""
        if self.fault_label is None or over_any:
            self.fault_label = self.end_reason = label
        self.finished.set()

    def ingest(self, records: list[Record], placeholder: bool = False) -> None:
        self.policy.label(records)
        fresh = self.records.add(records, placeholder)
        by_index: dict[int | None, WorkerState] = {w.index: w for w in self.workers.values()}
        for record in fresh:
            state = by_index.get(record["worker"])
            if state is not None and not record["ok"]:
                state.failed += 1
        for listener in self.listeners:
            listener(fresh)
        if self._ending is not None:
            return  # answers that arrive while the run ends change nothing of how it ended
        self.policy.tally(fresh)  # a probe's failures are the search's, never an error-rate stop

    def _fill(self, part: Part, indices: Iterable[int], worker: int | None, reason: str,
              placeholder: bool = False) -> int:
        """Records for the rows of `part` numbered `indices` that have none yet, made and stored
        a batch at a time (a stop may leave millions); returns how many."""
        store, scale, filled = self.records, self.options.scale, 0
        todo = (i for i in indices if i < len(part) and not store.has(part.request_id(i)))
        while batch := list(islice(todo, CHUNK_ROWS)):
            records = []
            for row in part.rows(batch):
                scheduled = send_time(self.epoch, row.timestamp_s, self.origin, scale) if self.epoch else None
                records.append(unsent_record(row, worker=worker, api=self.options.api, scheduled_at=scheduled,
                                             reason=reason))
            self.ingest(records, placeholder)
            filled += len(records)
        return filled

    # -- supervision --------------------------------------------------------------------------------

    def _check_workers(self) -> None:
        for state in self.workers.values():
            if not state.lost and self.worker_gone(state.client_id):
                state.lost = True
                state.close()
                self.policy.worker_lost(state)  # a search's probe under way is invalid
                # placeholders: replaced if the worker's own records still arrive
                label = state.unrecorded_label()
                lost = self._fill(state.part, range(len(state.part)), state.index, label, placeholder=True)
                logger.warning("worker %d lost: %d of its rows recorded as %r", state.index, lost, label)
        if self.workers and all(w.lost for w in self.workers.values()) and self.end_reason is None:
            logger.error("every worker is lost; ending the run")
            self._end_by_itself(WORKER_LOST)

    def _supervise(self) -> None:
        while not self.finished.is_set():
            self.clock.sleep(TICK_S if self.epoch is None or self.policy.more_rounds else QUIET_TICK_S)
            self._check_workers()
            if self.epoch is None and self.clock.now() - (self.started_at or 0.0) > READY_TIMEOUT_S:  # set by begin
                logger.warning("not every worker got ready in %.0f s; starting anyway", READY_TIMEOUT_S)
                self._maybe_go(force=True)
            self._maybe_go()
            self.policy.tick()
            if (self.last_due is not None and self.clock.now() > self.last_due + self.options.drain_timeout + DRAIN_GRACE_S
                    and not self.policy.between):  # a search waiting to open its next probe
                logger.warning("drain timeout: ending the run with %d rows unanswered", self.total - self.records.count)
                self._end_by_itself(DRAIN_TIMEOUT)

    def _end_by_itself(self, reason: str) -> None:
        if self.end_reason is None:
            self.end_reason = reason
        self.finished.set()

    # -- end ----------------------------------------------------------------------------------------

    @property
    def ending(self) -> bool:
        return self._ending is not None

    def end(self) -> Outcome | None:
        """Finalize once, in a greenlet of its own, and wait for it; the run's Outcome (None: it
        never began).

        Locust may end a run from one of its runner's greenlets (the heartbeat checker when the
        last worker is lost) and kill them right after: the records must not die with them. Every
        way out (test_stop, quitting) calls this; the first starts it, the others wait for it.
        """
        if self.store is None:
            return None
        if self._ending is None:
            self._ending = gevent.spawn(self._finalize)
        return self._ending.get()

    def cancel(self) -> None:
        """Stop a run that has not begun (a signal while the servers are checked or the master
        waits for its workers): every row is recorded as never sent ("run stopped"), and the meta
        file and the summary are written, as at any stop. No worker was sent anything."""
        if self.store is None:
            self._open_records(0)
        self.end()

    def refuse(self, reason: str) -> None:
        """End a run that has not begun because its servers cannot take it (a dead endpoint, a
        model it does not serve: replay.run.preflight.check_servers): every row is recorded as
        "run refused before the first send: `reason`", the files written as at any end, and the
        exit code is 2, as for any refusal before the first send."""
        self.refused = True
        self._stop_for(f"{REFUSED}: {reason}")
        self.cancel()

    def abandon(self, label: str) -> None:
        """End a run that has not begun for a fault (a worker gone while the master waited for
        the others, which nothing will replace): every row is recorded as `label`, never sent, the
        files written as at any end, and the exit code is a failure's."""
        self._stop_for(label)
        self.cancel()

    def _collect_held_records(self, reason: str) -> None:
        """Tell the workers to stop and give them a few seconds to return the records of every
        row they confirmed holding. The abort is sent again every ABORT_RESEND_S meanwhile (a
        worker applies it once): a lost one left its rows "no record from worker"."""
        live = [w for w in self.workers.values() if not w.lost]

        def abort() -> None:
            if self.local_part is not None:
                self.local_part.abort(reason)  # its records come through the link like a worker's
            else:
                for w in live:
                    self.link.to_worker(w.client_id, messages.ABORT, messages.Abort(reason=reason))

        abort()
        missing = [w.part.request_id(i) for w in live for i in range(len(w.part)) if w.holds(i)]
        clock = self.clock
        deadline = clock.now() + ABORT_WAIT_S
        aborted = clock.now()
        while clock.now() < deadline:
            missing = [rid for rid in missing if self.records.state(rid) != REAL]
            if not missing:
                break
            if clock.now() - aborted >= ABORT_RESEND_S:
                abort()
                aborted = clock.now()
            clock.sleep(0.1)

    def _finalize(self) -> Outcome:
        """Account for every row (the rows without a record get their labels), then end the run
        (`on_end`, the driver's: the merged file sorted by request_id, the summary, the last meta)
        and set the exit code it returns: 1 when any row failed for a reason other than the
        user's stop, 2 when the run was refused. Run once, by `end`."""
        if self._supervisor is not None:
            self._supervisor.kill(block=False)
        self._check_workers()  # Locust may stop the run on a lost worker before the supervisor saw it
        self._judge_pending_signals()
        user_stopped = self.end_reason is None
        logger.info("the run ends (%s): %d of %d rows recorded, writing the rest and the results",
                    self.end_reason or "stopped", self.records.count, self.total)
        never_sent = RUN_STOPPED if user_stopped else self.fault_label or NO_RECORD
        self.policy.stop(self.fault_label)
        if self.records.count < self.total or self.policy.more_rounds:  # its workers wait for rounds
            self._collect_held_records(RUN_STOPPED if user_stopped else self.fault_label or DRAIN_TIMEOUT)
        for state in self.workers.values():
            everything = range(len(state.part))
            if state.lost or state.stopped:
                self._fill(state.part, everything, state.index, state.unrecorded_label())
                continue
            self._fill(state.part, (i for i in everything if state.holds(i)), state.index, NO_RECORD)
            self._fill(state.part, everything, state.index, never_sent)  # never delivered to the worker
        self._fill(self.whole, range(len(self.whole)), None, never_sent)  # rows never assigned (no worker at all)
        if self.scraper is not None:
            self.scraper.stop()  # its last round is after the last answer; the file is complete
        outcome = Outcome(self.spec, self.records, self.facts(), self.incomplete,
                          capacity=self.policy.report(),
                          least_code=REFUSED_EXIT_CODE if self.refused else 0)
        code = self.on_end(outcome)
        if code or outcome.capacity is not None:  # a search's 0 too: its failing probes' rows are no run's failure
            self.on_exit_code(code)
        return outcome

    def facts(self) -> RunFacts:
        """What the run learned so far, for its meta file (RunSpec.metadata)."""
        workers = [{
            "index": state.index,
            "client_id": state.client_id,
            "host": self.worker_host(state.client_id) or platform.node(),
            "clock_offset_ms": state.clock_offset_ms,
            "rtt_ms": state.rtt_ms,
            "rows_assigned": len(state.positions),
            "lost": state.lost,
        } for state in sorted(self.workers.values(), key=lambda w: w.index)]  # fmt: skip
        host = host_load.figures(self.host_at_go, host_load.sample() if self.host_at_go else None,
                                 senders_here=self.local_part is not None)
        return RunFacts(workers=workers, epoch=self.epoch, started_at=self.started_at, server_check=self.server_check,
                        host_load=host)

    def metadata(self, incomplete: dict[str, str] | None = None) -> dict:
        """The run's metadata (OUTPUT.meta.json); `incomplete`: {file: why} of the files not whole."""
        return self.spec.metadata(self.facts(), incomplete)

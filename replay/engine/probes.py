"""The master's driver of a capacity search (docs/capacity.md): it opens each probe as a round
of the window's rows (replay.engine.rounds), tallies the probe's records as they come, cuts it
short once it can no longer meet the target, judges it once every row has a record, waits the
cooldown, and opens the next probe the search asks for (replay.engine.capacity), until the
search is over and the run ends.

It is the run's policy (the Coordinator's RunPolicy, replay.engine.coordinator): it holds the
run's rounds and is told what happens. It drives the run through `SearchRun`, which the
Coordinator implements, on its clock: it ships nothing itself, but asks the run to (`new_round`,
`cut_round`, `hand_over`), tells it how many records it now owes (`owe`), and ends it
(`stop_search`, `search_over`); it touches none of the Coordinator's own state.
"""

from __future__ import annotations

import logging
import math
from array import array
from bisect import bisect_right
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import gevent

from replay.engine.capacity import (
    INVALID,
    MAX_COOLDOWN_S,
    NO_METRICS_COOLDOWN_S,
    PASS,
    Probe,
    Search,
    capacity_report,
    parse_range,
)
from replay.engine.rounds import Round
from replay.protocol.headers import parse_headers
from replay.protocol.readiness import ready_problem
from replay.results.records import OVERSIZED, PROBE_CUT, PROBE_INVALID, REFUSED, Record
from replay.results.report import parse_slo
from replay.results.server_metrics import GAUGES
from replay.rules.capacity_result import (
    CLIENT_LIMITED,
    OUTAGE,
    REFUSED_BEFORE_SEND,
    SERVER_ERRORS,
    STOPPED,
    WORKER_SIGNALLED,
    WORKERS_LOST,
)
from replay.trace.amplify import Clones

if TYPE_CHECKING:
    from replay.engine.clock import Clock
    from replay.engine.coordinator import WorkerState
    from replay.engine.options import ReplayOptions
    from replay.engine.plan import Schedule

logger = logging.getLogger(__name__)

ROUND_LEAD_S = 2.0  # from a probe's decision to its first send: its rows reach the workers and are built
OUTAGE_WAIT_S = 300.0  # --on-outage retry: how long the search waits for the servers to answer again
OUTAGE_POLL_S = 1.0  # and how often it asks them


class SearchRun(Protocol):
    """What a capacity search needs of the run it drives (the Coordinator is one)."""

    clock: Clock
    options: ReplayOptions
    schedule: Schedule
    origin: float
    epoch: float | None  # the run's go (master clock); None before
    worker_cpu: Callable[[str], float | None]
    cpu_lag_s: float  # a worker's CPU figure covers this long before it is read
    scrape_listeners: list  # called with each round of the servers' /metrics

    @property
    def scrapes(self) -> bool: ...

    def endpoint_urls(self) -> list[str]: ...

    def live_workers(self) -> list[WorkerState]: ...

    def new_round(self, round_: Round) -> None: ...

    def cut_round(self, reason: str) -> None: ...

    def hand_over(self, state: WorkerState) -> None: ...

    def owe(self, total: int, last_request_id: int) -> None: ...

    def stop_search(self, label: str) -> None: ...

    def search_over(self) -> None: ...


def servers_problem(urls: list[str], api: str, model: str | None, headers: dict[str, str]) -> str | None:
    """None when every server answers a one-token request of the run's kind 200 again (its model
    list is no sign: a server shedding load answers it all the same); else the first one's problem."""
    return next((problem for url in urls if (problem := ready_problem(url, api, model, headers)) is not None), None)


def max_probes(search: Search) -> int:
    """More probes than the search can ask for (its request ids are laid out for this many)."""
    start = min(max(1.0, search.lo), search.hi)
    growth = math.ceil(math.log2(search.hi / start)) + 1 if search.hi > start else 1
    widest = max(2.0, start / search.lo)
    bisection = math.ceil(math.log2(math.log(widest) / math.log1p(search.precision))) + 1 if widest > 1 else 0
    return growth + 1 + max(bisection, 0) + 1


class Probes:
    """A capacity search's probes, each a round of the window's rows at its factor."""

    more_rounds = True  # each probe is a round, opened once the last is judged

    def __init__(self, run: SearchRun):
        self.c = run
        self.rounds: list[Round | None] = []  # a round per probe opened, in order
        options = run.options
        lo, hi = parse_range(options.search_range)
        self.search = Search(lo, hi, options.search_precision)
        self.slo = parse_slo(options.slo)
        self.target = options.goodput_target
        self.cooldown_s = options.cooldown
        first, last = run.schedule.request_id_range()
        self.first_id = first
        self.stride = max(last - first + 1, 1)  # a probe's request ids: the trace's + slot * stride (rounds.Round)
        self.max_probes = max_probes(self.search)
        self.slots = array("q")  # per probe: its first request-id slot
        self.next_slot = 0
        self.amplify = options.search_by == "amplify"
        self.probes: list[Probe] = []
        self.ended: str | None = None  # CLIENT_LIMITED, WORKERS_LOST: what ended the search without an answer
        self.fault: str | None = None  # the label of a fault that stopped the run (stop())
        self.over = False
        self.finished: list[dict] = []  # the judged probes' figures (Probe.to_dict), for the Replay view
        self.busy: float | None = None  # the servers' running + waiting at their last scrape; None: not known
        self.started_at: float | None = None
        self._next: gevent.Greenlet | None = None
        self.on_outage = options.on_outage
        headers = parse_headers(options.header)
        self.servers_problem = lambda: servers_problem(run.endpoint_urls(), options.api, options.model, headers)
        run.scrape_listeners.append(self.on_scrape)

    def clones(self, factor: float) -> Clones | None:
        """The window's copies at `factor` (--search-by amplify), chosen by --seed; None: scale."""
        if not self.amplify:
            return None
        return Clones(self.c.schedule.found_sessions(), factor, self.c.options.seed)

    def probe_of(self, request_id: int) -> int:
        """The number of the probe a request id is of (-1: none)."""
        slot = (request_id - self.first_id) // self.stride
        return bisect_right(self.slots, slot) - 1 if slot >= 0 else -1

    def begin(self) -> None:
        """The run begins: the first probe opens, due at the go."""
        self.started_at = self.c.clock.now()
        factor = self.search.next_factor()
        assert factor is not None  # a search with no probe yet has a first factor
        self._open(factor, 0.0)

    def _open(self, factor: float, offset_s: float, repeat_of: int | None = None) -> Round:
        """Probe `factor`'s round, added to the rounds, its rows (those over the prompt limit are
        recorded once, never sent) counted and its request ids' slots taken."""
        clones = self.clones(factor)
        rows = clones.rows() if clones is not None else len(self.c.schedule)
        slot = self.next_slot
        round_ = Round(len(self.probes), factor, offset_s, self.c.origin, self.stride, slot, clones)
        self.next_slot += round_.slots
        self.slots.append(slot)
        probe = Probe(len(self.probes), factor, rows, self.slo, self.target, started_at=self.c.clock.now(),
                      repeat_of=repeat_of)
        self.probes.append(probe)
        self.rounds.append(round_)
        self.c.owe(len(self.c.schedule.oversized) + sum(p.rows for p in self.probes),
                   self.first_id + (slot + round_.slots) * self.stride - 1)
        logger.info("capacity search: probe %d at %gx this trace's load (%d rows)", probe.number, factor, probe.rows)
        return round_

    def label(self, records: list[Record]) -> None:
        """Each record's probe and factor, read off its request id."""
        for record in records:
            error = record.get("error")
            if error and error.startswith(OVERSIZED):
                continue
            number = self.probe_of(record["request_id"])
            if 0 <= number < len(self.probes):
                record["probe"], record["factor"] = number, self.probes[number].factor

    def tally(self, records: list[Record]) -> None:
        if self.over or not self.probes:
            return
        current = self.probes[-1]
        for record in records:
            probe = record.get("probe")
            if probe is not None and probe < len(self.probes):
                self.probes[probe].add(record)
        if current.ended_at is not None:
            return
        if not current.cut and not current.invalid and not current.complete and current.hopeless:
            current.cut = True
            logger.warning("capacity search: probe %d (%gx) can no longer reach goodput %g: its unsent rows are "
                           "recorded as %r", current.number, current.factor, self.target, PROBE_CUT)
            self.c.cut_round(PROBE_CUT)
        if current.complete:
            self._judge(current)

    def tick(self) -> None:
        """The run's supervisor's turn: the workers' CPU, for the probe under way."""
        self.sample_cpu()

    def sample_cpu(self) -> None:
        """The live workers' CPU use into the probe under way's peak, once it has sent for the
        runner's sampling interval (`cpu_lag_s`: before, the figure still covers the building of
        its rows, or the previous probe), and once more as it is judged. A probe shorter than
        that has no figure (None), not a false one."""
        c = self.c
        if self.over or not self.probes or self.probes[-1].ended_at is not None or c.epoch is None:
            return
        last = self.rounds[-1]
        assert last is not None  # a search's rounds are its probes'
        if c.clock.now() < c.epoch + last.offset_s + c.cpu_lag_s:
            return
        probe = self.probes[-1]
        for w in c.live_workers():
            cpu = c.worker_cpu(w.client_id)
            if cpu is not None and (probe.cpu_peak is None or cpu > probe.cpu_peak):
                probe.cpu_peak = cpu

    def _judge(self, probe: Probe) -> None:
        self.sample_cpu()
        probe.ended_at = self.c.clock.now()
        verdict = probe.verdict
        self.finished.append(probe.to_dict())
        logger.info("capacity search: probe %d at %gx: %s (goodput %.4f, drift p99 %s ms)", probe.number,
                    probe.factor, verdict, probe.goodput, _num(probe.drift_p99_ms))
        if verdict == INVALID:
            if probe.repeat_of is not None:
                self.ended = WORKERS_LOST
                logger.error("capacity search: probe %d at %gx, the repeat of probe %d, lost a worker too: the "
                             "search ends here", probe.number, probe.factor, probe.repeat_of)
                self._finish()
                return
            logger.warning("capacity search: probe %d at %gx is invalid (a worker was lost): it is repeated with "
                           "the workers left", probe.number, probe.factor)
            self._next = gevent.spawn(self._after_cooldown, probe.factor, probe.number)
            return
        if verdict in (OUTAGE, SERVER_ERRORS):
            what = "the servers stopped answering" if verdict == OUTAGE else "the servers answered errors"
            reasons = "; ".join(f"{n} x {reason}" for reason, n in probe.top_reasons().items())
            if self.on_outage == "retry" and probe.repeat_of is None:
                logger.warning("capacity search: probe %d at %gx: %s (%s), not a failure of the load: it is repeated "
                               "once they answer again (--on-outage retry)", probe.number, probe.factor, what, reasons)
                self._next = gevent.spawn(self._after_outage, probe)
                return
            self.ended = verdict
            logger.error("capacity search: probe %d at %gx: %s (%s), not a failure of the load: the search ends "
                         "here (%s)", probe.number, probe.factor, what, reasons,
                         "its repeat failed so too" if probe.repeat_of is not None else "--on-outage stop")
            self._finish()
            return
        if verdict == CLIENT_LIMITED:
            if probe.repeat_of is None:  # a stall of the host is no limit of the client: once more
                logger.warning("capacity search: probe %d at %gx was limited by the client (%s): it is repeated "
                               "once at the same factor", probe.number, probe.factor, "; ".join(probe.client_limits))
                self._next = gevent.spawn(self._after_cooldown, probe.factor, probe.number)
                return
            self.ended = CLIENT_LIMITED
            logger.error("capacity search: probe %d at %gx was limited by the client (%s): add workers and search "
                         "again", probe.number, probe.factor, "; ".join(probe.client_limits))
            self._finish()
            return
        self.search.add(probe.factor, verdict == PASS)
        factor = self.search.next_factor()
        if factor is None or len(self.probes) >= self.max_probes:
            self._finish()
            return
        self._next = gevent.spawn(self._after_cooldown, factor)

    @property
    def between(self) -> bool:
        """The last probe is judged and the next not yet open (a cooldown, or the wait for servers
        gone): no row is owed an answer."""
        return bool(self.probes) and self.probes[-1].ended_at is not None and not self.over

    def _after_cooldown(self, factor: float, repeat_of: int | None = None) -> None:
        self._cool_down()
        assert self.c.epoch is not None  # a probe judged: the run went
        offset_s = self.c.clock.now() - self.c.epoch + ROUND_LEAD_S
        self.c.new_round(self._open(factor, offset_s, repeat_of))

    def _after_outage(self, probe: Probe) -> None:
        """--on-outage retry: once every server answers again (asked every OUTAGE_POLL_S, for at
        most OUTAGE_WAIT_S), the cooldown, then the probe again at its factor; servers that do
        not come back end the search as the outage it was."""
        clock, deadline = self.c.clock, self.c.clock.now() + OUTAGE_WAIT_S
        said = False
        while (problem := self.servers_problem()) is not None:
            if clock.now() >= deadline:
                self.ended = probe.verdict
                logger.error("capacity search: the servers did not answer within %g s of probe %d's end (%s): the "
                             "search ends here", OUTAGE_WAIT_S, probe.number, problem)
                self._finish()
                return
            if not said:
                said = True
                logger.warning("capacity search: waiting up to %g s for the servers to answer a request again (%s)",
                               OUTAGE_WAIT_S, problem)
            clock.sleep(OUTAGE_POLL_S)
        logger.info("capacity search: the servers answer again: probe %d at %gx is repeated", probe.number,
                    probe.factor)
        self._after_cooldown(probe.factor, probe.number)

    def worker_lost(self, state: WorkerState) -> None:
        """A worker was lost (told before its rows get their records): the probe under way, if
        any, is invalid; its rows not yet sent are recorded as PROBE_INVALID, and it is judged
        (and repeated) once every row has a record. Later probes go to the workers left."""
        self._invalidate(state.index)
        self.c.hand_over(state)

    def _invalidate(self, index: int) -> None:
        if self.over or not self.probes or self.probes[-1].ended_at is not None:
            return
        current = self.probes[-1]
        if not current.invalid:
            current.invalid = True
            logger.warning("capacity search: worker %d lost during probe %d (%gx): the probe is invalid; its unsent "
                           "rows are recorded as %r", index, current.number, current.factor, PROBE_INVALID)
            self.c.cut_round(PROBE_INVALID)

    def worker_stopped(self, index: int) -> None:
        """A worker got a stop signal of its own, not the user's stop: the search ends here, with
        no answer (the probe under way lost the worker's sends, and a fleet's capacity is never a
        worker's stop); the run stops, the probe's rows left recorded as PROBE_INVALID."""
        if self.over and self.ended not in (OUTAGE, SERVER_ERRORS):
            return
        if self.over:  # the probe failed on the servers meanwhile: the worker's stop is the stronger fact
            logger.error("capacity search: worker %d was stopped by a signal of its own during the probe that "
                         "ended the search (%s): the search ends without an answer", index, self.ended)
            self.ended = WORKER_SIGNALLED
            return
        self.over = True
        self.ended = WORKER_SIGNALLED
        logger.error("capacity search: worker %d was stopped by a signal of its own: the search ends without an "
                     "answer", index)
        self.c.stop_search(PROBE_INVALID)

    def _cool_down(self) -> None:
        """--cooldown S, or until the servers report nothing running nor waiting (at most
        MAX_COOLDOWN_S; NO_METRICS_COOLDOWN_S without /metrics)."""
        clock = self.c.clock
        if self.cooldown_s is not None:
            clock.sleep(self.cooldown_s)
            return
        if not self.c.scrapes:
            clock.sleep(NO_METRICS_COOLDOWN_S)
            return
        deadline = clock.now() + MAX_COOLDOWN_S
        self.busy = None  # only a scrape after this probe's last answer counts
        while clock.now() < deadline and self.busy != 0:
            clock.sleep(0.25)

    def on_scrape(self, t: float, results: dict) -> None:
        busy = 0.0
        for metrics in results.values():
            if metrics is None:
                return  # not known
            for role in ("running", "waiting"):
                busy += next((metrics[name] for name in GAUGES[role] if name in metrics), 0.0)
        self.busy = busy

    def _finish(self) -> None:
        self.over = True
        self.c.search_over()

    def stop(self, fault: str | None = None) -> None:
        """The run ends (by itself or stopped): no further probe; one under way is stopped, not judged.
        `fault`: what stopped it, if not the user (RunPolicy.stop), which the report names."""
        self.fault = fault
        if self._next is not None:
            self._next.kill(block=False)
        if self.probes and self.probes[-1].ended_at is None:
            self.probes[-1].stopped = True

    def live(self) -> dict:
        """The Replay view's: the probe under way (its factor, rows with a record so far, how
        many met the SLO, and whether it can still pass) and the probes judged so far."""
        current = None
        if self.probes and self.probes[-1].ended_at is None and not self.over:
            p = self.probes[-1]
            current = {"probe": p.number, "factor": p.factor, "rows": p.rows, "recorded": p.recorded, "good": p.good,
                       "goodput_so_far": p.good / p.recorded if p.recorded else None,
                       "can_pass": not (p.hopeless or p.invalid), "repeat_of": p.repeat_of}
        best, worst = self.search.bracket
        return {"target": self.target, "current": current, "probes": self.finished, "bracket": [best, worst],
                "result": (self.ended or self.search.result) if self.over else None}

    def report(self) -> dict:
        """OUTPUT.capacity.json's content."""
        last = self.probes[-1] if self.probes else None
        seconds = ((last.ended_at or self.c.clock.now()) - self.started_at) if last and self.started_at else None
        ended = self.ended
        if ended is None and not self.probes and self.fault is not None and self.fault.startswith(REFUSED):
            ended = REFUSED_BEFORE_SEND  # the servers' check refused the run: an outage is no stop
        report = capacity_report(self.search, self.probes, slo=self.slo, target=self.target,
                                 search_by=self.c.options.search_by, precision=self.search.precision,
                                 seconds=seconds, ended=ended)
        report["ended_because"] = self.fault if report["result"] in (STOPPED, REFUSED_BEFORE_SEND) else None
        report["id_stride"] = self.stride
        report["on_outage"] = self.on_outage
        return report


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"

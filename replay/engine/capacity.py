"""The capacity search's rules (docs/capacity.md): its options' checks, the search itself
(which load factor to probe next, and when the answer is known), a probe's tally and verdict,
and the results (OUTPUT.capacity.json; its results' names and the summary's quotable line
are replay.rules.capacity_result's, which the report reads too).

Pure: no clock, no I/O, no engine. The master's driver (replay.engine.probes) runs the probes
and feeds the outcomes here, so the search is tested on made-up outcomes in one process.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from replay.bounds import LOAD_FACTOR
from replay.errors import OptionError
from replay.results.records import Record, output_tokens_of
from replay.results.report import meets_slo
from replay.results.server_time import ServerTimeBuilder, growth, most_grown
from replay.results.summary import failure_reason, percentile
from replay.rules.capacity_result import (
    AT_LEAST_HI,
    BELOW_LO,
    CLIENT_CPU_PERCENT,
    CLIENT_DRIFT_P99_MS,
    CLIENT_LIMITED,
    FOUND,
    GREW_REST,
    OUTAGE,
    SERVER_ERRORS,
    STOPPED,
)

SEARCH_BY = ("amplify", "scale")
ON_OUTAGE = ("stop", "retry")  # --on-outage: end the search, or repeat the probe once the servers answer again
GROWTH = 2.0  # while probes pass, the next factor is this many times the last
MIN_PROBE_ROWS = 10  # a probe of fewer rows judges goodput by a handful: its verdict says nothing of the load
MAX_COOLDOWN_S = 60.0  # the default cooldown waits for idle servers at most this long
NO_METRICS_COOLDOWN_S = 5.0  # and this long when the servers' /metrics are not scraped

PASS, FAIL, FAIL_EARLY = "pass", "fail", "fail early"
INVALID = "invalid"  # a worker was lost during the probe: it says nothing, and is repeated once

# Why a row of a probe failed it (`failure_kind`): only LOAD failures say the load was too much.
LOAD = "load"  # answered, but over an --slo limit; or HTTP 429, the server's own "too many requests"
UNANSWERED = "unanswered"  # sent, and no HTTP answer came: the connection refused or reset, or no answer in time
ERROR = "error"  # answered with an error: an HTTP error status (429 aside), or a reply broken or not readable
LOAD_STATUSES = (429,)
NO_TOKEN = "answered ok without an output token"  # an ERROR's reason: the reply was no event stream
MAX_REASONS = 20  # a probe keeps this many distinct reasons of its not-load failures


def parse_range(text: str) -> tuple[float, float]:
    """--search-range LO:HI, two load factors (replay.bounds.LOAD_FACTOR) LO < HI, or OptionError naming it."""
    lo_text, sep, hi_text = str(text).partition(":")
    try:
        lo, hi = float(lo_text), float(hi_text)
    except ValueError:
        lo = hi = math.nan
    if not sep or not (math.isfinite(lo) and math.isfinite(hi)):
        raise OptionError(f"--search-range {text!r}: expected LO:HI, two finite numbers (e.g. 0.25:64)")
    for end, value in (("LO", lo), ("HI", hi)):
        if problem := LOAD_FACTOR.problem(value):  # a probe amplifies by its factor as `trace amplify` does
            raise OptionError(f"--search-range {text}: {end} {problem}")
    if lo >= hi:
        raise OptionError(f"--search-range {text}: LO must be below HI")
    return lo, hi


def check_search(options) -> None:
    """A --capacity-search's options (replay.engine.options.ReplayOptions), refused with one line
    naming the option before anything is sent; each number's own range is its bound's
    (ReplayOptions.check), the probe's length against the window the preflight's (it needs
    the trace)."""
    if not options.slo:
        raise OptionError("--capacity-search needs --slo: the limits a probe's rows must meet")
    if options.search_by not in SEARCH_BY:
        raise OptionError(f"--search-by {options.search_by}: expected one of {', '.join(SEARCH_BY)}")
    if options.on_outage not in ON_OUTAGE:
        raise OptionError(f"--on-outage {options.on_outage}: expected one of {', '.join(ON_OUTAGE)}")
    parse_range(options.search_range)
    if options.duration is not None and options.probe_duration > options.duration:
        raise OptionError(f"--probe-duration {options.probe_duration:g}: longer than the window "
                          f"(--duration {options.duration:g})")
    if options.max_requests is not None:
        raise OptionError("--max-requests: not with --capacity-search (a probe replays --probe-duration of the trace)")
    if options.scale != 1.0:
        raise OptionError(f"--scale {options.scale:g}: not with --capacity-search (the search sets the load itself)")


class Search:
    """Which factor to probe next: start at 1 (within LO:HI), double while probes pass, then
    bisect [largest pass, smallest fail] geometrically until HI/LO <= 1 + precision. A first
    probe that fails sends the search to LO; LO failing too is "below LO"."""

    def __init__(self, lo: float, hi: float, precision: float):
        self.lo, self.hi, self.precision = lo, hi, precision
        self.passed: list[float] = []
        self.failed: list[float] = []
        self.result: str | None = None  # FOUND, BELOW_LO, AT_LEAST_HI once the search is over

    @property
    def capacity(self) -> float | None:
        """The largest factor that passed."""
        return max(self.passed) if self.passed else None

    @property
    def bracket(self) -> tuple[float | None, float | None]:
        """[largest pass, smallest fail]; None for a side no probe found."""
        return self.capacity, (min(self.failed) if self.failed else None)

    def add(self, factor: float, passed: bool) -> None:
        (self.passed if passed else self.failed).append(factor)

    def next_factor(self) -> float | None:
        """The factor to probe next; None when the search is over (`result` says how)."""
        best, worst = self.bracket
        if best is None and worst is None:
            return min(max(1.0, self.lo), self.hi)
        if worst is None:
            assert best is not None  # both None is the first probe's case, above
            if best >= self.hi:
                self.result = AT_LEAST_HI
                return None
            return min(best * GROWTH, self.hi)
        if best is None:
            if worst <= self.lo:
                self.result = BELOW_LO
                return None
            return self.lo
        if worst / best <= 1 + self.precision:
            self.result = FOUND
            return None
        return math.sqrt(best * worst)


def _p(values: array, p: float) -> float | None:
    return percentile(sorted(values), p) if values else None


def failure_kind(record: Record, slo: dict[str, float]) -> str | None:
    """Why a record of a probe failed it (LOAD, UNANSWERED, ERROR); None: it met the SLO, or its
    row was never sent (a label: the probe cut short, a stop), which says nothing of the server.
    An answer "ok" without a single output token (a reply that is no event stream) is an
    ERROR whatever its latency: quick garbage would otherwise meet an e2e limit at any load."""
    if record.get("sent_at") is None:
        return None
    if not record.get("status"):
        return UNANSWERED
    if not record["ok"]:
        return LOAD if record["status"] in LOAD_STATUSES else ERROR
    if record.get("output_length") and not output_tokens_of(record):
        return ERROR
    return None if meets_slo(record, slo) else LOAD


@dataclass
class Probe:
    """One probe's tally: its rows' outcomes as they come, and the verdict. `rows` is how many
    rows it has; it fails early once more than (1 - target) of them failed the SLO."""

    number: int
    factor: float
    rows: int
    slo: dict[str, float]
    target: float
    started_at: float | None = None
    ended_at: float | None = None
    recorded: int = 0
    ok: int = 0
    good: int = 0
    cut: bool = False  # failed early: its unsent rows were recorded as PROBE_CUT
    invalid: bool = False  # a worker was lost during it: its unsent rows were recorded as PROBE_INVALID
    repeat_of: int | None = None  # the number of the invalid probe this one repeats
    cpu_peak: float | None = None  # the most CPU (% of a core) a worker reported while it ran; None: not known
    stopped: bool = False  # the run was stopped before the probe was judged: it says nothing
    sent: int = 0  # rows sent (a label's row never was)
    failures: dict[str, int] = field(default_factory=dict)  # failure_kind -> rows, so far
    failed_by: dict[str, int] | None = None  # `failures` when the probe could no longer meet the target
    reasons: dict[str, int] = field(default_factory=dict)  # the not-load failures' reasons (failure_reason) -> rows
    values: dict[str, array] = field(default_factory=lambda: {k: array("d") for k in
                                                              ("ttft_ms", "tpot_ms", "e2e_ms", "drift_ms")})
    server_time: ServerTimeBuilder = field(default_factory=ServerTimeBuilder)  # where its requests' time went

    def add(self, record: Record) -> None:
        self.recorded += 1
        self.ok += bool(record["ok"])
        self.server_time.add(record)
        kind = failure_kind(record, self.slo)
        self.good += kind is None and meets_slo(record, self.slo)
        self.sent += record.get("sent_at") is not None
        if kind is not None:
            self.failures[kind] = self.failures.get(kind, 0) + 1
            reason = failure_reason(record) if not record["ok"] else NO_TOKEN
            if kind != LOAD and (reason in self.reasons or len(self.reasons) < MAX_REASONS):
                self.reasons[reason] = self.reasons.get(reason, 0) + 1
        if self.failed_by is None and self.hopeless:
            self.failed_by = dict(self.failures)
        for key, values in self.values.items():
            value = cast(Mapping[str, Any], record).get(key)  # a field named by a variable
            if value is not None and (record["ok"] or key == "drift_ms"):
                values.append(value)

    @property
    def allowed_bad(self) -> float:
        return (1 - self.target) * self.rows

    @property
    def hopeless(self) -> bool:
        """It can no longer meet the target, whatever its other rows do."""
        return (self.recorded - self.good) > self.allowed_bad + 1e-9

    @property
    def complete(self) -> bool:
        return self.recorded >= self.rows

    @property
    def goodput(self) -> float:
        """The share of its rows that met the SLO; of a probe that did not send every row (cut
        short, invalid, stopped), the share of the rows it sent: the rows never sent say nothing."""
        if self.cut or self.invalid or self.stopped:
            return self.good / self.sent if self.sent else 0.0
        return self.good / self.rows if self.rows else 0.0

    @property
    def not_load(self) -> str | None:
        """OUTAGE or SERVER_ERRORS when the failures that failed the probe (those recorded by the
        time it could no longer meet the target) were mostly requests the servers never answered,
        or error answers (docs/capacity.md); None: mostly the load's, or it did not fail."""
        failed = self.failed_by
        if not failed:
            return None
        load, unanswered, errors = (failed.get(k, 0) for k in (LOAD, UNANSWERED, ERROR))
        if unanswered + errors < load or unanswered + errors == 0:
            return None
        return OUTAGE if unanswered >= errors else SERVER_ERRORS

    def top_reasons(self, count: int = 3) -> dict[str, int]:
        """The most common reasons of its failures that were not the load's."""
        return dict(sorted(self.reasons.items(), key=lambda item: -item[1])[:count])

    @property
    def drift_p99_ms(self) -> float | None:
        return _p(self.values["drift_ms"], 99)

    @property
    def client_limits(self) -> list[str]:
        """What made the client too late or too busy to measure the server (empty: neither)."""
        limits, drift = [], self.drift_p99_ms
        if drift is not None and drift > CLIENT_DRIFT_P99_MS:
            limits.append(f"dispatch drift p99 {drift:.2f} ms, over {CLIENT_DRIFT_P99_MS:g} ms")
        if self.cpu_peak is not None and self.cpu_peak >= CLIENT_CPU_PERCENT:
            limits.append(f"a worker's CPU at {self.cpu_peak:.0f}%, over {CLIENT_CPU_PERCENT:g}%")
        return limits

    @property
    def verdict(self) -> str:
        if self.invalid:
            return INVALID
        if self.stopped:
            return STOPPED
        not_load = self.not_load  # the servers gone or erroring: whatever the client did, it is not a capacity
        if not_load is not None:
            return not_load
        if self.client_limits:  # the client is never what fails a probe: a late or busy client wins over a cut
            return CLIENT_LIMITED
        if self.cut:
            return FAIL_EARLY
        return PASS if self.good >= (self.target - 1e-12) * self.rows else FAIL

    def to_dict(self) -> dict:
        latency = {k: {"p50": _p(v, 50), "p99": _p(v, 99)} for k, v in self.values.items() if k != "drift_ms"}
        seconds = (self.ended_at - self.started_at) if self.started_at is not None and self.ended_at else None
        return {"probe": self.number, "factor": self.factor, "rows": self.rows, "ok": self.ok, "good": self.good,
                "goodput": self.goodput, "verdict": self.verdict, **latency, "drift_p99_ms": self.drift_p99_ms,
                "seconds": seconds, "repeat_of": self.repeat_of, "cpu_peak_pct": self.cpu_peak, "sent": self.sent,
                "failed_by": self.failed_by, "not_load_reasons": self.top_reasons(),
                "server_timing": self.server_time.section()}


def split_judged(slo: Mapping[str, float]) -> str:
    """Which of a probe's splits (replay.results.server_time) says why it failed: the TTFT's when
    the SLO limits only TTFT (decode is then no part of the failure), else the E2E's."""
    return "ttft_ms" if set(slo) == {"ttft_ms"} else "e2e_ms"


def why_failed(failed: dict, passed: dict | None, slo: Mapping[str, float]) -> dict | None:
    """Why a failing probe failed, from the server's own times (to_dict's `server_timing`): the
    part whose mean grew most from `passed`, the largest passing probe below it, with each
    part's growth in ms. GREW_REST when the rest grew most: the client, the network or a
    router, not the server. None without a passing probe below, or without the server's times
    in both."""
    if passed is None:
        return None
    figure = split_judged(slo)
    before, after = passed["server_timing"][figure], failed["server_timing"][figure]
    grown = growth(before, after)
    if grown is None:
        return None
    part = most_grown(before, after)
    return {"against_probe": passed["probe"], "figure": figure, "grew_most": GREW_REST if part == "rest" else part,
            "growth_ms": {name: round(value, 3) for name, value in grown.items()}}


def capacity_report(search: Search, probes: list[Probe], *, slo: dict[str, float], target: float, search_by: str,
                    precision: float, seconds: float | None, ended: str | None = None) -> dict:
    """OUTPUT.capacity.json's content (docs/capacity.md). `ended`: what ended the search before
    it had its answer (CLIENT_LIMITED, WORKERS_LOST); None: the search itself, or a stop. Each
    failing probe says why it failed (`why_failed`), and the search says it of the bracket's
    failing end (`failed_because`)."""
    best, worst = search.bracket
    result = ended or search.result or STOPPED
    judged = [p.to_dict() for p in probes]
    return {
        "slo": slo, "goodput_target": target, "search_by": search_by, "range": [search.lo, search.hi],
        "precision": precision, "probes": judged,
        "capacity": best if result in (FOUND, AT_LEAST_HI) else None,  # claimed only by a search that ended itself
        "bracket": [best, worst], "result": result, "seconds": seconds,
        "failed_because": explain_failures(judged, worst, slo),
    }


def explain_failures(judged: list[dict], worst: float | None, slo: Mapping[str, float]) -> dict | None:
    """Set each failing probe's `why_failed` (of `judged`, to_dict's) and return the bracket's
    failing end's (`worst`: its factor), or None."""
    for entry in judged:
        if entry["verdict"] in (FAIL, FAIL_EARLY):
            below = [q for q in judged if q["verdict"] == PASS and q["factor"] < entry["factor"]]
            entry["why_failed"] = why_failed(entry, max(below, key=lambda q: q["factor"], default=None), slo)
    failing_end = [p for p in judged if p.get("why_failed") and p["factor"] == worst]
    return failing_end[-1]["why_failed"] if failing_end else None


def with_server_timing(report: dict, sections: Mapping[int, dict]) -> dict:
    """`report` (capacity_report's) with its probes' server_timing replaced by `sections`
    (probe number -> replay.results.server_time's section, from the records as written) and
    why each failed said again. Trace spans are joined to the records at the end of the run,
    after the probes were judged: without this a search whose servers tell their times only in
    spans would say nothing of why a probe failed."""
    judged = [{**entry, "server_timing": sections.get(entry["probe"], entry["server_timing"])}
              for entry in report["probes"]]
    return {**report, "probes": judged, "failed_because": explain_failures(judged, report["bracket"][1], report["slo"])}

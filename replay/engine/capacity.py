"""The capacity search's rules (docs/capacity.md): its options' checks, the search itself
(which load factor to probe next, and when the answer is known), a probe's tally and verdict,
and the results (OUTPUT.capacity.json, the summary's quotable line).

Pure: no clock, no I/O, no engine. The master's driver (replay.engine.probes) runs the probes
and feeds the outcomes here, so the search is tested on made-up outcomes in one process.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field

from replay.errors import OptionError
from replay.results.report import meets_slo
from replay.results.summary import percentile

SEARCH_BY = ("amplify", "scale")
GROWTH = 2.0  # while probes pass, the next factor is this many times the last
CLIENT_DRIFT_P99_MS = 10.0  # a probe whose sends were later than this at p99 measured the client, not the server
CLIENT_CPU_PERCENT = 90.0  # nor one during which a worker reported this much CPU use (Locust's own warning's)
MAX_COOLDOWN_S = 60.0  # the default cooldown waits for idle servers at most this long
NO_METRICS_COOLDOWN_S = 5.0  # and this long when the servers' /metrics are not scraped

PASS, FAIL, FAIL_EARLY, CLIENT_LIMITED = "pass", "fail", "fail early", "client-limited"
INVALID = "invalid"  # a worker was lost during the probe: it says nothing, and is repeated once
FOUND, BELOW_LO, AT_LEAST_HI = "found", "below LO", "at least HI"
WORKERS_LOST = "workers lost"  # a probe and its repeat were both invalid: the search ended there
STOPPED = "stopped"  # the user (or a fault) stopped the run before the search had its answer
WORKER_SIGNALLED = "worker stopped"  # a worker got a stop signal of its own (not the user's stop): the search ended there
NO_ANSWER = (BELOW_LO, CLIENT_LIMITED, WORKERS_LOST, STOPPED, WORKER_SIGNALLED)  # results whose run's exit code is 1


def parse_range(text: str) -> tuple[float, float]:
    """--search-range LO:HI, two finite numbers 0 < LO < HI, or OptionError naming it."""
    lo_text, sep, hi_text = str(text).partition(":")
    try:
        lo, hi = float(lo_text), float(hi_text)
    except ValueError:
        lo = hi = math.nan
    if not sep or not (math.isfinite(lo) and math.isfinite(hi)):
        raise OptionError(f"--search-range {text!r}: expected LO:HI, two finite numbers (e.g. 0.25:64)")
    if lo <= 0:
        raise OptionError(f"--search-range {text}: LO must be > 0")
    if lo >= hi:
        raise OptionError(f"--search-range {text}: LO must be below HI")
    return lo, hi


def check_search(options) -> None:
    """A --capacity-search's options (replay.run.options.ReplayOptions), refused with one line
    naming the option before anything is sent; the probe's length against the window is the
    preflight's (it needs the trace)."""
    if not options.slo:
        raise OptionError("--capacity-search needs --slo: the limits a probe's rows must meet")
    if options.search_by not in SEARCH_BY:
        raise OptionError(f"--search-by {options.search_by}: expected one of {', '.join(SEARCH_BY)}")
    parse_range(options.search_range)
    if not (math.isfinite(options.search_precision) and options.search_precision > 0):
        raise OptionError(f"--search-precision {options.search_precision}: must be a finite number > 0")
    if not (math.isfinite(options.goodput_target) and 0 < options.goodput_target <= 1):
        raise OptionError(f"--goodput-target {options.goodput_target}: must be a number above 0, at most 1")
    if not (math.isfinite(options.probe_duration) and options.probe_duration > 0):
        raise OptionError(f"--probe-duration {options.probe_duration}: must be a finite number of seconds > 0")
    if options.duration is not None and options.probe_duration > options.duration:
        raise OptionError(f"--probe-duration {options.probe_duration:g}: longer than the window "
                          f"(--duration {options.duration:g})")
    if options.cooldown is not None and not (math.isfinite(options.cooldown) and options.cooldown >= 0):
        raise OptionError(f"--cooldown {options.cooldown}: must be a finite number of seconds >= 0")
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
    values: dict[str, array] = field(default_factory=lambda: {k: array("d") for k in
                                                              ("ttft_ms", "tpot_ms", "e2e_ms", "drift_ms")})

    def add(self, record: dict) -> None:
        self.recorded += 1
        self.ok += bool(record["ok"])
        self.good += meets_slo(record, self.slo)
        for key, values in self.values.items():
            if record.get(key) is not None and (record["ok"] or key == "drift_ms"):
                values.append(record[key])

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
        return self.good / self.rows if self.rows else 0.0

    @property
    def drift_p99_ms(self) -> float | None:
        return _p(self.values["drift_ms"], 99)

    @property
    def verdict(self) -> str:
        if self.invalid:
            return INVALID
        drift = self.drift_p99_ms  # the client is never what fails a probe: a late or busy client wins over a cut
        if (drift is not None and drift > CLIENT_DRIFT_P99_MS) or (self.cpu_peak or 0.0) >= CLIENT_CPU_PERCENT:
            return CLIENT_LIMITED
        if self.cut:
            return FAIL_EARLY
        return PASS if self.goodput >= self.target - 1e-12 else FAIL

    def to_dict(self) -> dict:
        latency = {k: {"p50": _p(v, 50), "p99": _p(v, 99)} for k, v in self.values.items() if k != "drift_ms"}
        seconds = (self.ended_at - self.started_at) if self.started_at is not None and self.ended_at else None
        return {"probe": self.number, "factor": self.factor, "rows": self.rows, "ok": self.ok, "good": self.good,
                "goodput": self.goodput, "verdict": self.verdict, **latency, "drift_p99_ms": self.drift_p99_ms,
                "seconds": seconds, "repeat_of": self.repeat_of, "cpu_peak_pct": self.cpu_peak}


def capacity_report(search: Search, probes: list[Probe], *, slo: dict[str, float], target: float, search_by: str,
                    precision: float, seconds: float | None, ended: str | None = None) -> dict:
    """OUTPUT.capacity.json's content (docs/capacity.md). `ended`: what ended the search before
    it had its answer (CLIENT_LIMITED, WORKERS_LOST); None: the search itself, or a stop."""
    best, worst = search.bracket
    return {
        "slo": slo, "goodput_target": target, "search_by": search_by, "range": [search.lo, search.hi],
        "precision": precision, "probes": [p.to_dict() for p in probes], "capacity": best, "bracket": [best, worst],
        "result": ended or search.result or STOPPED, "seconds": seconds,
    }


def quotable_line(report: dict) -> str:
    """The summary's last line, one a person can quote."""
    best, worst = report["bracket"]
    limits = " and ".join(f"{k} <= {v:g} ms" for k, v in report["slo"].items())
    at = f"at goodput >= {_pct(report['goodput_target'])}% with {limits}"
    result = report["result"]
    if result == BELOW_LO:
        return f"Capacity: below {report['range'][0]:g}x this trace's load ({worst:g}x fails) {at}"
    if result == AT_LEAST_HI:
        return f"Capacity: at least {best:g}x this trace's load (the most tried, --search-range) {at}"
    if result == CLIENT_LIMITED:
        return ("Capacity: not measured: the client could not send on time (dispatch drift p99 over "
                f"{CLIENT_DRIFT_P99_MS:g} ms, or a worker's CPU at {CLIENT_CPU_PERCENT:g}%); add workers and run "
                "the search again")
    if result == WORKERS_LOST:
        return (f"Capacity: not measured: workers were lost during a probe and again during its repeat "
                f"(the bracket so far: {_side(best)} passes, {_side(worst)} fails); run the search again")
    if result == WORKER_SIGNALLED:
        return (f"Capacity: not measured: a worker was stopped by a signal of its own during the search "
                f"(the bracket so far: {_side(best)} passes, {_side(worst)} fails); run the search again")
    if best is None or worst is None:
        return f"Capacity: not known (the search was {result}) {at}"
    return f"Capacity: {best:.3g}x this trace's load ({best:.3g}x passes, {worst:.3g}x fails) {at}"


def _side(factor: float | None) -> str:
    return "none" if factor is None else f"{factor:.3g}x"


def _pct(target: float) -> str:
    return f"{target * 100:g}"

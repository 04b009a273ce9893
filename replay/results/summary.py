"""The end-of-run summary, computed from records. `percentile` here is the one every run
figure uses (the summary, reports, the live view): numpy's default linear interpolation, as
vLLM's benchmark reports them. `replay trace stats` ranks trace lengths by nearest rank
instead (replay.trace.stats), so a token count stays a count.

A run can have millions of records, so the summary is built in one pass (`SummaryBuilder`):
records are not kept, only counters and the values that need percentiles, 8 bytes each in
array('d') (a Python float in a list costs 32). Rows that were never sent cost only counters.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Iterable, Sequence

from replay.results.records import Record, output_tokens_of, prompt_tokens_of

DISTRIBUTION_KEYS = ("mean", "median", "std", "p25", "p50", "p75", "p90", "p99")
LATENCY_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")  # each a distribution over ok records
SORT_RUN = 1 << 16  # how many values sorted_array turns into Python floats at once (~2.5 MB)
MERGE_WINDOW_MIN = 1024  # bounds the rounds of a merge of many runs, and their Python overhead


def percentile(sorted_values: Sequence[float], p: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); `sorted_values` must be
    sorted. The percentile of every run figure (latencies, drift); a trace's own statistics use
    replay.trace.stats.nearest_rank instead, so that token counts stay values of the data."""
    n = len(sorted_values)
    if n == 0:
        return None
    k = (n - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def sorted_array(values: array) -> array:
    """`values` sorted: itself when it is one run, else a new array('d'); either way bit for bit
    array('d', sorted(values)). sorted() would hold every value as a Python float (32 bytes, 4x
    the array); here runs of SORT_RUN values are sorted in place, then merged, so the peak is
    the array twice."""
    n = len(values)
    for start in range(0, n, SORT_RUN):
        values[start : start + SORT_RUN] = array("d", sorted(values[start : start + SORT_RUN]))
    if n <= SORT_RUN:
        return values
    return _merge_runs(values)


def _merge_runs(values: array) -> array:
    """Merge the sorted runs of `values` in rounds, each over a window at the head of every run
    (heapq.merge goes value by value in Python: slower). t, the least of the windows' last
    values, bounds a round: all values below t are in the windows (runs are sorted), so they,
    sorted together, come next; then every value equal to t, run after run, as a stable sort
    puts them (0.0 and -0.0 are equal, not the same); what is left is above t. The run whose
    window ends at t is used up to the window's end, so each round moves a window or more."""
    runs = [[start, min(start + SORT_RUN, len(values))] for start in range(0, len(values), SORT_RUN)]
    window = max(MERGE_WINDOW_MIN, SORT_RUN // len(runs))  # a round holds <= runs x window floats
    out = array("d")
    while runs:
        t = min(values[min(pos + window, end) - 1] for pos, end in runs)
        below: list[float] = []
        for run in runs:
            stop = bisect_left(values, t, run[0], min(run[0] + window, run[1]))
            below.extend(values[run[0] : stop])
            run[0] = stop
        below.sort()
        out.fromlist(below)
        for run in runs:
            stop = bisect_right(values, t, run[0], run[1])
            out.extend(values[run[0] : stop])
            run[0] = stop
        runs = [run for run in runs if run[0] < run[1]]
    return out


def distribution(sorted_values: Sequence[float]) -> dict[str, float | None]:
    """Mean, std (population) and percentiles of sorted values. The sums run in sorted order,
    as they always have, so a report's floats do not depend on the order of the records."""
    n = len(sorted_values)
    if not n:
        return {k: None for k in DISTRIBUTION_KEYS}
    mean = sum(sorted_values) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in sorted_values) / n)
    out = {"mean": mean, "median": percentile(sorted_values, 50), "std": std}
    for p in (25, 50, 75, 90, 99):
        out[f"p{p}"] = percentile(sorted_values, p)
    return out


def failure_reason(record: Record) -> str:
    """One label per failed record: 'HTTP 503' for error statuses, else the error text's head."""
    status = record.get("status") or 0
    if status and not 200 <= status < 300:
        return f"HTTP {status}"
    error = str(record.get("error") or "no error text")
    return error if len(error) <= 80 else error[:77] + "..."


class FailureCounts:
    """Failed records counted by reason and by HTTP status (0 = no response), one at a time."""

    def __init__(self) -> None:
        self.by_reason: Counter[str] = Counter()
        self.by_status: Counter[str] = Counter()

    def add(self, record: Record) -> None:
        if not record.get("ok"):
            self.by_reason[failure_reason(record)] += 1
            self.by_status[str(record.get("status") or 0)] += 1

    def most_common(self) -> tuple[dict[str, int], dict[str, int]]:
        """(by reason, by status), most frequent first; ties in the order first seen."""
        return dict(self.by_reason.most_common()), dict(self.by_status.most_common())


def failures(records: Iterable[Record]) -> tuple[dict[str, int], dict[str, int]]:
    """Failed records counted by reason and by HTTP status (0 = no response)."""
    counts = FailureCounts()
    for r in records:
        counts.add(r)
    return counts.most_common()


class SummaryBuilder:
    """The summary keys (docs/reports.md) that records alone can give, from records added one at a time.

    Token totals add up in record order, as sum() did (token counts are ints, so exactly);
    the first send and the last finish are kept as min() and max() would pick them."""

    def __init__(self) -> None:
        self.requests = 0
        self.requests_ok = 0
        self.requests_sent = 0
        self.input_tokens = 0  # of ok records
        self.output_tokens = 0  # the servers' usage figures where they can be true, else the stream's events
        self.usage_mismatch = 0  # records whose usage claims something that cannot be true
        self.failures = FailureCounts()
        self.first_sent: float | None = None
        self.last_finished: float | None = None
        self.latencies = {key: array("d") for key in LATENCY_KEYS}  # of ok records
        self.drift = array("d")  # of sent records
        self.drift_max: float | None = None  # as given (an int stays an int), not as stored
        self.shifts = array("d")  # waited_ms of the session turns a closed-loop --turn-timing sent late

    def add(self, record: Record) -> None:
        self.requests += 1
        self.failures.add(record)
        if record.get("usage_mismatch"):
            self.usage_mismatch += 1
        sent_at = record.get("sent_at")
        if sent_at is not None:
            self.requests_sent += 1
            if self.first_sent is None or sent_at < self.first_sent:
                self.first_sent = sent_at
            finished_at = record.get("finished_at")
            if finished_at and (self.last_finished is None or finished_at > self.last_finished):
                self.last_finished = finished_at
            waited = record.get("waited_ms")
            if waited:  # > 0: a turn that waited for its previous answer
                self.shifts.append(waited)
            drift = record.get("drift_ms")
            if drift is not None:
                self.drift.append(drift)
                if self.drift_max is None or drift >= self.drift_max:  # the last of equals, as sorted()[-1]
                    self.drift_max = drift
        if record.get("ok"):
            self.requests_ok += 1
            self.input_tokens += prompt_tokens_of(record)
            self.output_tokens += output_tokens_of(record)
            for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
                value = record.get(key)
                if value is not None:
                    self.latencies[key].append(value)
            self.latencies["itl_ms"].extend(record.get("itl_ms") or ())

    @property
    def duration_s(self) -> float:
        """First send to last finish; 0.0 when nothing was sent or finished."""
        if self.first_sent is None or self.last_finished is None:
            return 0.0
        return self.last_finished - self.first_sent

    def summary(self) -> dict:
        """The summary of the records added so far (more may be added and summarized again)."""
        duration = self.duration_s
        by_reason, _ = self.failures.most_common()
        # each array is replaced by its sorted copy, so the unsorted one is freed at once
        self.drift = sorted_array(self.drift)
        out = {
            "requests": self.requests,
            "requests_ok": self.requests_ok,
            "requests_failed": self.requests - self.requests_ok,
            "failures": by_reason,
            "requests_usage_mismatch": self.usage_mismatch,
            "duration_s": duration,
            "request_throughput": self.requests_ok / duration if duration else 0.0,
            "input_token_throughput": self.input_tokens / duration if duration else 0.0,
            "output_token_throughput": self.output_tokens / duration if duration else 0.0,
        }
        for key in LATENCY_KEYS:
            self.latencies[key] = sorted_array(self.latencies[key])
            out[key] = distribution(self.latencies[key])
        out["drift_ms"] = {"p50": percentile(self.drift, 50), "p99": percentile(self.drift, 99), "max": self.drift_max}
        if self.shifts:  # only a closed-loop --turn-timing shifts turns
            self.shifts = sorted_array(self.shifts)
            out["sessions"] = {"turns_shifted": len(self.shifts), "shift_ms": {
                "p50": percentile(self.shifts, 50), "p99": percentile(self.shifts, 99)}}
        return out


def summarize(records: Iterable[Record]) -> dict:
    """The summary keys (docs/reports.md) that records alone can give (goodput and cache come later)."""
    builder = SummaryBuilder()
    for r in records:
        builder.add(r)
    return builder.summary()

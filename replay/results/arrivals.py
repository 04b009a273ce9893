"""How far a run's achieved arrival process is from the scheduled one, in bounded memory: the
schedule lines of the fidelity certificate (replay.results.certificate; docs/fidelity.md).

The sends are compared with their own due times (rows never sent are left out of both sides):

- the Kolmogorov-Smirnov statistic between the inter-arrival times of the sends (sent_at,
  sorted) and of their due times (scheduled_at, sorted). Each side's gaps go to a histogram of
  fixed log-spaced bins (BINS_PER_DECADE a decade from FLOOR_S up; everything below FLOOR_S, 0
  included, in the first bin) that keeps each bin's count, least and greatest gap. Inside a bin
  a CDF is known exactly below the bin's least gap and from its greatest on, and lies between
  its values at the bin's edges in between; so the statistic is bracketed: `ks` is the largest
  difference at the points where both CDFs are known (a lower bound of the exact statistic),
  `ks_upper_bound` the largest difference the ranges allow (an upper bound). A bin whose gaps
  are all equal (a schedule at a fixed rate) is known everywhere; otherwise the two differ by
  at most the larger side's mass in one 2.3%-wide bin.
- the largest gap between the two cumulative counts over time: in requests, max over t of
  |#due by t - #sent by t| (exact: a merge of the two sorted time lists), and in seconds,
  max over k of |k-th send - k-th due time| (the same lists side by side).

Both need the times sorted, so they are kept: two array('d'), 16 bytes a send, sorted one
after the other by replay.results.summary.sorted_array (its peak: one array twice); the due
times, in request_id order, are most often sorted already and then not copied. No other
per-send value is kept.
"""

from __future__ import annotations

import math
import operator
from array import array
from bisect import bisect_left, bisect_right
from itertools import islice

from replay.results.summary import sorted_array

FLOOR_S = 1e-6  # inter-arrival times below this (0 included) share the first bin
BINS_PER_DECADE = 100  # bins of 10**(1/100) = 1.0233: 2.3% wide
DECADES = 11  # 1 us .. 100,000 s; longer gaps go to the last bin
BINS = 1 + BINS_PER_DECADE * DECADES


def gap_bin(gap_s: float) -> int:
    """The histogram bin of an inter-arrival time: 0 below FLOOR_S, then log-spaced."""
    if gap_s < FLOOR_S:
        return 0
    return min(BINS - 1, 1 + int(math.log10(gap_s / FLOOR_S) * BINS_PER_DECADE))


class GapHistogram:
    """The inter-arrival times of sorted times: per bin, the count and the least and greatest gap.
    `floor_s`: gaps below it go to the first bin as if they were 0 (a coarser resolution)."""

    def __init__(self, times: array, floor_s: float = FLOOR_S) -> None:
        self.count = [0] * BINS
        self.least = [math.inf] * BINS
        self.most = [-math.inf] * BINS
        self.total = max(0, len(times) - 1)
        count, least, most = self.count, self.least, self.most
        for k in range(1, len(times)):
            gap = times[k] - times[k - 1]
            if gap < floor_s:
                gap = 0.0
            b = gap_bin(gap)
            count[b] += 1
            if gap < least[b]:
                least[b] = gap
            if gap > most[b]:
                most[b] = gap


def _cdf_range(t: float, low: float, high: float, least: float, most: float) -> tuple[float, float]:
    """What a CDF can be at `t` inside a bin: `low` below the bin's least gap, `high` from its
    greatest on, anything between them in between."""
    if t < least:
        return low, low
    if t >= most:
        return high, high
    return low, high


def ks_bounds(a: GapHistogram, b: GapHistogram) -> tuple[float, float]:
    """(a lower, an upper bound) of the KS statistic between the gaps of `a` and `b` (see the
    module's docstring); (0.0, 0.0) when either has no gap."""
    if not a.total or not b.total:
        return 0.0, 0.0
    lower = upper = 0.0
    ca = cb = 0
    for i in range(BINS):
        if not a.count[i] and not b.count[i]:
            continue
        a_low, b_low = ca / a.total, cb / b.total
        ca += a.count[i]
        cb += b.count[i]
        a_high, b_high = ca / a.total, cb / b.total
        for t in (a.least[i], a.most[i], b.least[i], b.most[i]):
            if math.isinf(t):  # the side has no gap in this bin
                continue
            a0, a1 = _cdf_range(t, a_low, a_high, a.least[i], a.most[i])
            b0, b1 = _cdf_range(t, b_low, b_high, b.least[i], b.most[i])
            upper = max(upper, abs(a1 - b0), abs(a0 - b1))
            if a0 == a1 and b0 == b1:
                lower = max(lower, abs(a0 - b0))
        lower = max(lower, abs(a_high - b_high))  # at the bin's upper edge both are known
        upper = max(upper, lower)
    return lower, upper


class ArrivalComparison:
    """Due and sent times of the sends, added one at a time; `result()` once, at the end.
    `resolution_s`: the second KS statistic's, gaps under it taken as 0 (rows due together
    leave one after another, microseconds apart: at the on-time tolerance they are together)."""

    def __init__(self, resolution_s: float = 1e-3) -> None:
        self.resolution_s = resolution_s
        self.late_due = array("d")  # the late sends' due and sent times (`add_late`)
        self.late_sent = array("d")
        self.due = array("d")
        self.sent = array("d")

    def add(self, due: float, sent: float) -> None:
        self.due.append(due)
        self.sent.append(sent)

    def add_late(self, due: float, sent: float) -> None:
        """A send also added with `add` that left late: `result` counts those that queued."""
        self.late_due.append(due)
        self.late_sent.append(sent)

    def result(self) -> dict:
        """The arrival lines (docs/fidelity.md#schedule); the arrays are freed."""
        self.due = _sorted(self.due)  # one at a time: the unsorted one is freed at once
        self.sent = _sorted(self.sent)
        due, sent = self.due, self.sent
        self.due = self.sent = array("d")
        n = len(due)
        ks, ks_bound = ks_bounds(GapHistogram(due), GapHistogram(sent))
        coarse, _ = ks_bounds(GapHistogram(due, self.resolution_s), GapHistogram(sent, self.resolution_s))
        out = {
            "inter_arrival_ks": ks if n >= 2 else None,
            "inter_arrival_ks_upper_bound": ks_bound if n >= 2 else None,
            "inter_arrival_ks_resolution_ms": self.resolution_s * 1000.0,
            "inter_arrival_ks_at_resolution": coarse if n >= 2 else None,
            "count_gap_requests": 0,
            "count_gap_at_s": None,
            "count_gap_s": max((abs(s - d) for d, s in zip(due, sent)), default=None),
        }
        if n:
            gap, at = _count_gap(due, sent)
            out["count_gap_requests"], out["count_gap_at_s"] = gap, at - due[0]
        # a late send queued when another send left between its due time and its own: the client was sending
        out["late_queued"] = sum(bisect_left(sent, s) > bisect_right(sent, d) for d, s in zip(self.late_due,
                                                                                              self.late_sent))
        out["late_checked"] = len(self.late_due)
        self.late_due = self.late_sent = array("d")
        return out


def _sorted(values: array) -> array:
    """`values` sorted; itself, not a copy, when it is sorted already (the due times of a
    trace in time order, in the merged file's request_id order)."""
    if all(map(operator.le, values, islice(values, 1, None))):
        return values
    return sorted_array(values)


def _count_gap(due: array, sent: array) -> tuple[int, float]:
    """(max over t of |#due <= t - #sent <= t|, the first t it is reached at) of two sorted,
    non-empty lists of the same length: only the times in either list can be that t."""
    i = j = 0
    n = len(due)
    best, at = 0, due[0]
    while i < n or j < n:
        t = due[i] if j >= n or (i < n and due[i] <= sent[j]) else sent[j]
        while i < n and due[i] <= t:
            i += 1
        while j < n and sent[j] <= t:
            j += 1
        if abs(i - j) > best:
            best, at = abs(i - j), t
    return best, at

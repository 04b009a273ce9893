"""How far a run's achieved arrival process is from the scheduled one, in bounded memory: the
schedule lines of the fidelity certificate (replay.results.certificate; docs/fidelity.md).

The sends are compared with their own due times (rows never sent are left out of both sides):

- the Kolmogorov-Smirnov statistic between the inter-arrival times of the sends (sent_at,
  sorted) and of their due times (scheduled_at, sorted). A whole-run histogram of each, in
  fixed log-spaced bins (BINS_PER_DECADE a decade from FLOOR_S up, everything below FLOOR_S,
  0 included, in one bin), gives the statistic at the bin edges: a lower bound of the exact
  one; the largest difference between one side's CDF at a bin's upper edge and the other's at
  its lower edge is an upper bound (a CDF moves only inside a bin). Both are reported; the
  bins are 2.3% wide, so for any smooth gap distribution the two differ by at most the mass of
  one bin.
- the largest gap between the two cumulative counts over time: in requests, max over t of
  |#due by t - #sent by t| (exact: a merge of the two sorted time lists), and in seconds,
  max over k of |k-th send - k-th due time| (the same lists side by side).

Both need the times sorted, so they are kept: two array('d'), 16 bytes a send, sorted in
place by replay.results.summary.sorted_array (its peak: one array twice). No other per-send
value is kept.
"""

from __future__ import annotations

import math
from array import array

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


def _histogram(times: array) -> list[int]:
    counts = [0] * BINS
    for k in range(1, len(times)):
        counts[gap_bin(times[k] - times[k - 1])] += 1
    return counts


def ks_bounds(a: list[int], b: list[int]) -> tuple[float, float]:
    """(the KS statistic at the bin edges, an upper bound of the exact one) of two histograms
    over the same bins; (0.0, 0.0) when either is empty."""
    na, nb = sum(a), sum(b)
    if not na or not nb:
        return 0.0, 0.0
    low = high = 0.0
    ca = cb = 0
    for x, y in zip(a, b):
        fa0, fb0 = ca / na, cb / nb
        ca += x
        cb += y
        fa1, fb1 = ca / na, cb / nb
        low = max(low, abs(fa1 - fb1))
        high = max(high, abs(fa1 - fb0), abs(fa0 - fb1), abs(fa1 - fb1))
    return low, high


class ArrivalComparison:
    """Due and sent times of the sends, added one at a time; `result()` once, at the end."""

    def __init__(self) -> None:
        self.due = array("d")
        self.sent = array("d")

    def add(self, due: float, sent: float) -> None:
        self.due.append(due)
        self.sent.append(sent)

    def result(self) -> dict:
        """The arrival lines (docs/fidelity.md#schedule); the arrays are freed."""
        due, sent = sorted_array(self.due), sorted_array(self.sent)
        self.due = self.sent = array("d")
        n = len(due)
        ks, ks_bound = ks_bounds(_histogram(due), _histogram(sent))
        out = {
            "inter_arrival_ks": ks if n >= 2 else None,
            "inter_arrival_ks_upper_bound": ks_bound if n >= 2 else None,
            "count_gap_requests": 0,
            "count_gap_at_s": None,
            "count_gap_s": max((abs(s - d) for d, s in zip(due, sent)), default=None),
        }
        if n:
            gap, at = _count_gap(due, sent)
            out["count_gap_requests"], out["count_gap_at_s"] = gap, at - due[0]
        return out


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

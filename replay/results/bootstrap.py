"""The paired bootstrap of `replay compare`, in pure Python, for runs of millions of rows.

A resample is a vector of counts, one per matched row (how often the resample drew it); both
runs are resampled with the same vector, so a row stays paired with itself. Every figure is a
function of the counts: a quantile is read off the values sorted once, each carrying its row's
count (the cumulative counts, C-level `accumulate`, then `bisect`), a mean or a share is a
weighted sum (of one precomputed term per drawn block). No resample is ever gathered or
sorted, so a resample costs a few passes of C loops over the values, and with many values
only over windows of them (Weighted).

Rows are drawn in blocks of consecutive rows (in trace order, wrapping around: the circular
block bootstrap) rather than one by one: requests close in time share the server's and the
client's moment (a busy second, a stalled core), so their noise is not independent, and
drawing them one by one would count it as evidence. With blocks of one row it is the
ordinary paired bootstrap.
"""

from __future__ import annotations

import math
import random
import sys
from array import array
from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate, chain, islice, repeat
from operator import itemgetter, mul, sub

from replay.results.summary import percentile

WINDOW_MIN_VALUES = 50_000  # below it, a resample's quantiles are read off every value


def block_rows(rows: int) -> int:
    """The default block length: the cube root of the rows, the usual order for a block bootstrap."""
    return max(1, math.ceil(rows ** (1 / 3)))


class Draw:
    """One resample: the blocks' first rows (`starts`, None for the sample itself) and how often
    each row was drawn (`counts`)."""

    def __init__(self, starts: list[int] | None, counts: list[int]) -> None:
        self.starts, self.counts = starts, counts
        # picks the blocks' terms out of a per-start array (Total), once built for every array
        self.pick = None if starts is None else itemgetter(*starts) if len(starts) > 1 else lambda a: (a[starts[0]],)


def sample(rows: int) -> Draw:
    """The sample itself: every row once."""
    return Draw(None, [1] * rows)


def draw(rng: random.Random, rows: int, block: int) -> Draw:
    """One circular block resample of `rows` rows: ceil(rows/block) blocks of `block`
    consecutive rows, each starting at a uniformly drawn row."""
    raw = array("Q", rng.randbytes(8 * -(-rows // block)))
    if sys.byteorder == "big":  # the same draws, so the same intervals, on every machine
        raw.byteswap()
    starts = [s % rows for s in raw]  # the bias of 2**64 modulo rows is below 1e-12
    diff = [0] * (rows + 1)
    for s in starts:
        diff[s] += 1
        end = s + block
        if end <= rows:
            diff[end] -= 1
        else:  # wraps around to the first rows
            diff[0] += 1
            diff[end - rows] -= 1
    counts = list(accumulate(diff))
    counts.pop()
    return Draw(starts, counts)


def block_sums(per_row: Sequence[float], block: int) -> array:
    """For each row s, the sum of `per_row` over the block that starts there (wrapping around):
    a resample's total is then the sum over its blocks, one term a block."""
    n = len(per_row)
    if block > n:  # a block longer than the rows wraps more than once
        return array("d", [sum(per_row[(s + j) % n] for j in range(block)) for s in range(n)])
    prefix = array("d", [0.0])
    prefix.extend(accumulate(chain(per_row, islice(per_row, block - 1))))
    return array("d", map(sub, islice(prefix, block, None), islice(prefix, 0, n)))


class Total:
    """A per-row figure summed over a resample (by its blocks: a sum of one term a block)."""

    def __init__(self, per_row: Sequence[float], block: int) -> None:
        self.total = math.fsum(per_row)
        self.blocks = block_sums(per_row, block)

    def of(self, d: Draw) -> float:
        if d.starts is None:
            return self.total
        return sum(d.pick(self.blocks))


class Weighted:
    """One figure's values on one side, sorted once, each with the row it belongs to (a row
    may own several: several runs of a side, or a request's inter-token gaps) and optionally a
    weight (how many values it stands for: a request's thinned gaps), over `rows` rows
    resampled in blocks of `block`.

    With many values, each quantile of `ps` is read off a window of the sorted values around
    the sample's own (QuantileWindow): a resample's quantile lies within a few standard
    deviations of it, so a resample reads the window, not every value. A resample whose
    quantile falls outside (never seen, but possible) is read off all of them."""

    def __init__(self, values: array, owners: array, rows: int, block: int, weights: array | None = None,
                 ps: Sequence[float] = ()) -> None:
        order = sorted(range(len(values)), key=values.__getitem__)
        self.values = array("d", map(values.__getitem__, order))
        self.owners = array("q", map(owners.__getitem__, order))
        self.weights = array("d", map(weights.__getitem__, order)) if weights is not None else None
        del order
        sums, numbers = array("d", bytes(8 * rows)), array("d", bytes(8 * rows))
        for v, r, w in zip(values, owners, weights if weights is not None else repeat(1.0)):
            sums[r] += v * w
            numbers[r] += w
        self.rows_with = rows - numbers.count(0.0)  # rows that have a value
        self._sum, self._number = Total(sums, block), Total(numbers, block)
        self.windows = quantile_windows(self, ps, numbers, block) if len(self.values) > WINDOW_MIN_VALUES else {}
        self.misses = 0  # resamples whose quantile fell outside its window

    def __len__(self) -> int:
        return len(self.values)

    def cumulative(self, d: Draw, start: int = 0, end: int | None = None, initial: float = 0) -> list[float]:
        """The cumulative drawn weight of the sorted values start..end-1, from `initial`."""
        owners = self.owners if start == 0 and end is None else self.owners[start:end]
        taken = map(d.counts.__getitem__, owners)
        if self.weights is not None:
            taken = map(mul, taken, self.weights if start == 0 and end is None else self.weights[start:end])
        return list(accumulate(taken, initial=initial))[1:]

    def quantiles(self, d: Draw, ps: Sequence[float]) -> list[float | None]:
        """The percentiles `ps` of the values each repeated its row's count (times its weight)
        times, by linear interpolation between closest ranks (replay.results.summary.percentile's
        rule: with every count and weight 1 they are exactly the report's figures)."""
        if not self.values:
            return [None] * len(ps)
        total = self._number.of(d) if self.windows and d.starts is not None else None
        cum: list[float] | None = None
        out: list[float | None] = []
        for p in ps:
            window = self.windows.get(p) if total is not None else None
            found = window.read(d, total, p) if window else None
            if found is None:
                if window:
                    self.misses += 1
                if cum is None:
                    cum = self.cumulative(d)
                found = _read(self.values, cum, 0, cum[-1], p) if cum[-1] else None
            out.append(found)
        return out

    def mean(self, d: Draw) -> float | None:
        number = self._number.of(d)
        return self._sum.of(d) / number if number else None


def _read(values: array, cum: list[float], start: int, total: float, p: float, below: float = 0) -> float | None:
    """The p-th percentile of the drawn values, from the cumulative weights `cum` of
    values[start:] (`below`: the weight drawn before them), or None when `cum` does not reach
    far enough to tell."""
    k = (total - 1) * p / 100.0 if total >= 1 else 0.0
    lo = math.floor(k)
    if below > lo:
        return None
    at = bisect_right(cum, lo)
    if at == len(cum):
        return None if start + at < len(values) else values[-1]
    low = values[start + at]
    if lo + 1 >= total:
        return low
    at = bisect_right(cum, lo + 1)
    if at == len(cum):
        return None if start + at < len(values) else values[-1]
    return low + (values[start + at] - low) * (k - lo)


class QuantileWindow:
    """The sorted values start..end-1 around one quantile of the sample, and the weight each
    block holds below them (a Total: a resample's weight below the window is a sum of one
    term a block)."""

    def __init__(self, weighted: Weighted, start: int, end: int, below: Total) -> None:
        self.weighted, self.start, self.end, self.below = weighted, start, end, below

    def read(self, d: Draw, total: float, p: float) -> float | None:
        below = self.below.of(d)
        cum = self.weighted.cumulative(d, self.start, self.end, below)
        return _read(self.weighted.values, cum, self.start, total, p, below) if total else None


def quantile_windows(weighted: Weighted, ps: Sequence[float], numbers: array, block: int) -> dict[float, QuantileWindow]:
    """A window for each quantile of `ps`: 8 standard deviations each side of the sample's
    quantile, in the resampled weight below it less the share p of the resampled total (the
    quantity whose sign says on which side a resample's quantile lies), as the blocks spread it."""
    values, weights = weighted.values, weighted.weights
    m, rows = len(values), len(numbers)
    cum = list(accumulate(weights)) if weights is not None else None
    total = cum[-1] if cum is not None else float(m)
    centers = {p: min(m - 1, bisect_right(cum, (total - 1) * p / 100.0) if cum is not None
                      else int((m - 1) * p / 100.0)) for p in ps}  # fmt: skip
    below = _below_at(weighted, sorted(set(centers.values())), rows)
    starts = -(-rows // block)
    bounds = {}
    for p, center in centers.items():
        z = array("d", map(sub, below[center], map(mul, numbers, repeat(p / 100.0))))
        sums = block_sums(z, block)
        mean = math.fsum(sums) / rows
        deviations = array("d", map(sub, sums, repeat(mean)))
        sd = math.sqrt(starts * math.fsum(map(mul, deviations, deviations)) / rows)
        half = math.ceil(8 * sd * m / total) + 256
        bounds[p] = (max(0, center - half), min(m, center + half + 1))
    below = _below_at(weighted, sorted({start for start, _ in bounds.values()}), rows)
    totals = {start: Total(below[start], block) for start in below}
    return {p: QuantileWindow(weighted, start, end, totals[start]) for p, (start, end) in bounds.items()}


def _below_at(weighted: Weighted, ends: list[int], rows: int) -> dict[int, array]:
    """For each of `ends` (ascending), each row's weight among the first `end` sorted values."""
    out, acc, at = {}, array("d", bytes(8 * rows)), 0
    for end in ends:
        if weighted.weights is None:
            for r in islice(weighted.owners, at, end):
                acc[r] += 1.0
        else:
            for r, w in zip(islice(weighted.owners, at, end), islice(weighted.weights, at, end)):
                acc[r] += w
        at = end
        out[end] = array("d", acc)
    return out


class Share:
    """A ratio of per-row sums (failed / requests, cached / prompt tokens) over a resample."""

    def __init__(self, numerator: Sequence[float], denominator: Sequence[float], block: int) -> None:
        self.numerator, self.denominator = Total(numerator, block), Total(denominator, block)

    def value(self, d: Draw) -> float | None:
        den = self.denominator.of(d)
        return self.numerator.of(d) / den if den else None


def interval(values: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """The percentile interval of a bootstrap distribution (None when it is empty)."""
    v = sorted(values)
    if not v:
        return None
    tail = 100.0 * (1.0 - confidence) / 2.0
    return percentile(v, tail), percentile(v, 100.0 - tail)


def std(values: list[float]) -> float | None:
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    return math.sqrt(sum((x - mean) ** 2 for x in values) / (len(values) - 1))

"""The paired bootstrap of `replay compare`, in pure Python and fast enough for 10,000 rows.

A resample is a vector of counts, one per matched row (how often the resample drew it); both
runs are resampled with the same vector, so a row stays paired with itself. Every figure is a
function of the counts: a quantile is read off the values sorted once, each carrying its row's
count (the cumulative counts, C-level `accumulate`, then `bisect`), a mean or a share is a
weighted sum. No resample is ever gathered or sorted, so a resample costs a few passes of C
loops over the values.

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
from operator import mul, sub

from replay.results.summary import percentile


def block_rows(rows: int) -> int:
    """The default block length: the cube root of the rows, the usual order for a block bootstrap."""
    return max(1, math.ceil(rows ** (1 / 3)))


class Draw:
    """One resample: the blocks' first rows (`starts`, None for the sample itself) and how often
    each row was drawn (`counts`)."""

    def __init__(self, starts: list[int] | None, counts: list[int]) -> None:
        self.starts, self.counts = starts, counts


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
        return sum(map(self.blocks.__getitem__, d.starts))


class Weighted:
    """One figure's values on one side, sorted once, each with the row it belongs to (a row
    may own several: several runs of a side, or a request's inter-token gaps) and optionally a
    weight (how many values it stands for: a request's thinned gaps), over `rows` rows
    resampled in blocks of `block`."""

    def __init__(self, values: array, owners: array, rows: int, block: int, weights: array | None = None) -> None:
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

    def __len__(self) -> int:
        return len(self.values)

    def quantiles(self, d: Draw, ps: Sequence[float]) -> list[float | None]:
        """The percentiles `ps` of the values each repeated its row's count (times its weight)
        times, by linear interpolation between closest ranks (replay.results.summary.percentile's
        rule: with every count and weight 1 they are exactly the report's figures)."""
        if not self.values:
            return [None] * len(ps)
        taken = map(d.counts.__getitem__, self.owners)
        cum = list(accumulate(map(mul, taken, self.weights) if self.weights is not None else taken))
        total = cum[-1]
        if total == 0:
            return [None] * len(ps)
        out: list[float | None] = []
        last = len(self.values) - 1
        for p in ps:
            k = (total - 1) * p / 100.0 if total >= 1 else 0.0
            lo = math.floor(k)
            low = self.values[min(bisect_right(cum, lo), last)]
            high = self.values[min(bisect_right(cum, lo + 1), last)] if lo + 1 < total else low
            out.append(low + (high - low) * (k - lo))
        return out

    def mean(self, d: Draw) -> float | None:
        number = self._number.of(d)
        return self._sum.of(d) / number if number else None


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

"""What a worker is sent: its part of the window, once per round (docs/capacity.md).

A run is one round of the window's rows as the trace has them. A capacity search is several:
each probe is a round of the same rows, made the probe's own here (`Round.encode`) as they are
shipped, so nothing per probe is kept in memory: its request ids moved past the earlier
probes', its times compressed by its factor and placed after its start, its hash ids and
sessions in a namespace of its own. This is the one place a probe's rows come from: another way
of raising the load (amplifying the window) is another `encode`.

A worker's rows are numbered across rounds: round r's i-th row is its part's `r * n + i`-th, and
a round's rows go in chunks of their own (a chunk never spans two rounds, whose rows are not
known at the same time), so chunk numbers are a function of row numbers (`Part.chunk_of`).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from replay.trace.record import TraceRow

if TYPE_CHECKING:
    from replay.engine.plan import Schedule

PROBE_HASH_BITS = 56  # a probe's hash ids carry its number from this bit up: 127 probes in 63 bits


@dataclass(frozen=True)
class Round:
    """One probe: its number, its load factor, and when the window's origin is due (wall
    seconds after the run's start, the GO's epoch). `stride` moves its request ids past every
    other probe's: request_id + probe * stride, with stride over the window's id span."""

    probe: int
    factor: float
    offset_s: float
    origin: float
    stride: int

    def request_id(self, trace_id: int) -> int:
        return trace_id + self.probe * self.stride

    def encode(self, data: list) -> list:
        """A spooled row (replay.engine.plan.encode_row's form) as this probe sends it."""
        data = list(data)
        data[0] = self.request_id(data[0])
        data[1] = self.origin + self.offset_s + (data[1] - self.origin) / self.factor
        if self.probe:
            if data[4] is not None:
                data[4] = [h ^ (self.probe << PROBE_HASH_BITS) for h in data[4]]
            if data[5] is not None:
                data[5] = f"{data[5]}#p{self.probe}"
        return data


class Part:
    """A worker's rows across rounds: its `positions` in the schedule, once per round of
    `rounds` (a list shared by every part and grown by the master as the search goes on; one
    None for a run without a search: the rows as the trace has them)."""

    def __init__(self, schedule: Schedule, positions: array, rounds: list[Round | None], chunk_rows: int):
        self.schedule, self.positions, self.rounds, self.chunk_rows = schedule, positions, rounds, chunk_rows
        self.n = len(positions)
        self.per_round = -(-self.n // chunk_rows)  # chunks in a round

    def __len__(self) -> int:
        return self.n * len(self.rounds)

    def where(self, i: int) -> tuple[Round | None, int]:
        """Row `i` of the part: its round and its place in the schedule."""
        r, j = divmod(i, self.n)
        return self.rounds[r], self.positions[j]

    def encoded(self, i: int) -> list:
        round_, position = self.where(i)
        data = self.schedule.encoded(position)
        return round_.encode(data) if round_ is not None else data

    def request_id(self, i: int) -> int:
        round_, position = self.where(i)
        trace_id = self.schedule.request_ids[position]
        return round_.request_id(trace_id) if round_ is not None else trace_id

    def rows(self, indices: Iterable[int]) -> Iterator[TraceRow]:
        from replay.engine.plan import decode_row

        for i in indices:
            yield decode_row(self.encoded(i))

    def chunk_of(self, i: int) -> int:
        """The number of the chunk that carries row `i`."""
        r, j = divmod(i, self.n)
        return r * self.per_round + j // self.chunk_rows

    def chunks_below(self, rows: int) -> int:
        """How many chunks carry only rows numbered below `rows` or start below it: the chunks a
        worker that takes `rows` rows may be sent."""
        if not self.n:
            return 0
        r, j = divmod(rows, self.n)
        return r * self.per_round + -(-j // self.chunk_rows)

    def round_chunks(self, r: int) -> Iterator[dict]:
        """Round `r`'s rows as ROWS payloads (messages.Rows, less the `seq` the window numbers
        them with), read from the spool only when the window has room."""
        base = r * self.n
        for start in range(0, self.n, self.chunk_rows):
            yield {"rows": [self.encoded(base + j) for j in range(start, min(start + self.chunk_rows, self.n))]}

    def round_range(self, r: int) -> range:
        """The row numbers of round `r`."""
        return range(r * self.n, (r + 1) * self.n)

"""What a worker is sent: its part of the window, once per round (docs/capacity.md).

A run is one round of the window's rows as the trace has them. A capacity search is several:
each probe is a round of the window made the probe's own here (`Round.encode`) as it is
shipped, so no row of a probe is kept in memory: its request ids moved past the earlier
probes', its hash ids and sessions in a namespace of its own, and its load raised one of two
ways. `--search-by scale`: the window's rows, their times compressed by the factor.
`--search-by amplify`: the window amplified by the factor as `replay trace amplify` does it
(replay.trace.amplify.Clones: each session k times, clones at start times drawn from the
window's own), at the trace's pace; a clone is a row of the part that holds its source.

A worker's rows are numbered across rounds (round r's rows follow round r - 1's), and a round's
rows go in chunks of their own (a chunk never spans two rounds, whose rows are not known at the
same time), so chunk numbers are a function of row numbers (`Part.chunk_of`).
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from replay.trace.record import TraceRow

if TYPE_CHECKING:
    from replay.engine.plan import Schedule
    from replay.trace.amplify import Clones

PROBE_HASH_BITS = 56  # a probe's hash ids carry its number from this bit up: 127 probes in 63 bits


@dataclass(frozen=True)
class Round:
    """One probe: its number, its load factor, and when the window's origin is due (wall
    seconds after the run's start, the GO's epoch). Its request ids are the trace's moved by
    `stride` (over the window's id span) times a slot: copy c of a row takes slot `slot + c`,
    so each probe takes the slots after the earlier probes'. `clones`: the window's copies at
    this factor (--search-by amplify); None: its rows are the window's, times compressed."""

    probe: int
    factor: float
    offset_s: float
    origin: float
    stride: int
    slot: int = 0
    clones: Clones | None = None

    @property
    def slots(self) -> int:
        """Request-id slots the probe takes: one per copy of the most copied row."""
        return max(self.clones.most, 1) if self.clones is not None else 1

    @property
    def speedup(self) -> float:
        """How many times faster than the trace's the probe's times run."""
        return 1.0 if self.clones is not None else self.factor

    def request_id(self, trace_id: int, copy: int = 0) -> int:
        return trace_id + (self.slot + copy) * self.stride

    def layout(self, schedule: Schedule, positions: array) -> tuple[array, array] | None:
        """A part's rows in this round, in send order, as (index into `positions`, copy);
        None: each position once, in order (no copies)."""
        if self.clones is None:
            return None
        count, times, ids = self.clones.count, schedule.times, schedule.request_ids
        items = []
        for j, position in enumerate(positions):
            for copy in range(count(position)):
                shift = self.clones.time_shift(position, copy)
                items.append((times[position] + shift, ids[position] + copy * self.stride, j, copy))
        items.sort()
        return array("q", (item[2] for item in items)), array("H", (item[3] for item in items))

    def encode(self, data: list, position: int = 0, copy: int = 0) -> list:
        """A spooled row (replay.engine.plan.encode_row's form), schedule position `position`,
        as this probe sends its copy `copy`."""
        data = list(data)
        shift = 0.0
        if self.clones is not None:
            data[5], data[4], shift = self.clones.copy(position, copy, data[4])
        data[0] = self.request_id(data[0], copy)
        data[1] = self.origin + self.offset_s + (data[1] + shift - self.origin) / self.speedup
        if self.probe:
            if data[4] is not None:
                data[4] = [h ^ (self.probe << PROBE_HASH_BITS) for h in data[4]]
            if data[5] is not None:
                data[5] = f"{data[5]}#p{self.probe}"
        elif data[4] is not None:
            data[4] = list(data[4])
        return data


class Part:
    """A worker's rows across rounds: its `positions` in the schedule, laid out once per round
    of `rounds` (a list shared by every part and grown by the master as the search goes on; one
    None for a run without a search: the rows as the trace has them)."""

    def __init__(self, schedule: Schedule, positions: array, rounds: list[Round | None], chunk_rows: int):
        self.schedule, self.positions, self.rounds, self.chunk_rows = schedule, positions, rounds, chunk_rows
        self._positions: list[array] = []  # per round laid out: the positions it was laid out with
        self._layouts: list[tuple[array, array] | None] = []  # per round laid out: Round.layout's
        self._bases = array("q", [0])  # round r's first row number; then the row count
        self._chunk_bases = array("q", [0])  # round r's first chunk number; then the chunk count
        # A run without a search: its one round (rounds is [None] for good) is the part's rows in
        # order, laid out now, and the per-row methods read it directly: a run's end asks them of
        # every row, several times.
        self._plain = bool(rounds) and rounds[0] is None
        if self._plain:
            self._sync()

    def _sync(self) -> None:
        """Lay out the rounds added since (each part's layout is its own, made once)."""
        while len(self._layouts) < len(self.rounds):
            round_ = self.rounds[len(self._layouts)]
            layout = round_.layout(self.schedule, self.positions) if round_ is not None else None
            size = len(self.positions) if layout is None else len(layout[0])
            self._positions.append(self.positions)
            self._layouts.append(layout)
            self._bases.append(self._bases[-1] + size)
            self._chunk_bases.append(self._chunk_bases[-1] + -(-size // self.chunk_rows))

    def hand_over(self, heir: Part) -> None:
        """This part's worker is lost: from the next round on, `heir` sends its rows too (a
        search goes on with the workers left); the rounds laid out so far stay as they were."""
        self._sync()
        heir._sync()
        heir.positions = array("q", sorted(heir.positions + self.positions))  # send order: the schedule's
        self.positions = array("q")

    def __len__(self) -> int:
        if not self._plain:
            self._sync()
        return self._bases[-1]

    def _round_of(self, i: int) -> int:
        self._sync()
        return bisect_right(self._bases, i, 0, len(self._layouts)) - 1

    def where(self, i: int) -> tuple[Round | None, int, int]:
        """Row `i` of the part: its round, its place in the schedule, and which copy it is."""
        if self._plain:
            return None, self._positions[0][i], 0
        r = self._round_of(i)
        j, layout, positions = i - self._bases[r], self._layouts[r], self._positions[r]
        if layout is None:
            return self.rounds[r], positions[j], 0
        return self.rounds[r], positions[layout[0][j]], layout[1][j]

    def encoded(self, i: int) -> list:
        round_, position, copy = self.where(i)
        data = self.schedule.encoded(position)
        return round_.encode(data, position, copy) if round_ is not None else data

    def request_id(self, i: int) -> int:
        if self._plain:
            return self.schedule.request_ids[self._positions[0][i]]
        round_, position, copy = self.where(i)
        trace_id = self.schedule.request_ids[position]
        return round_.request_id(trace_id, copy) if round_ is not None else trace_id

    def rows(self, indices: Iterable[int]) -> Iterator[TraceRow]:
        from replay.engine.plan import decode_row

        for i in indices:
            yield decode_row(self.encoded(i))

    def chunk_of(self, i: int) -> int:
        """The number of the chunk that carries row `i`."""
        if self._plain:
            return i // self.chunk_rows
        r = self._round_of(i)
        return self._chunk_bases[r] + (i - self._bases[r]) // self.chunk_rows

    def chunks_below(self, rows: int) -> int:
        """How many chunks carry only rows numbered below `rows` or start below it: the chunks a
        worker that takes `rows` rows may be sent, of the rounds laid out so far (a round added
        later is granted then: its size is not known before)."""
        if rows >= len(self):
            return self._chunk_bases[-1]
        r = self._round_of(rows)
        return self._chunk_bases[r] + -(-(rows - self._bases[r]) // self.chunk_rows)

    def round_chunks(self, r: int) -> Iterator[dict]:
        """Round `r`'s rows as ROWS payloads (messages.Rows, less the `seq` the window numbers
        them with), read from the spool only when the window has room."""
        rows = self.round_range(r)
        for start in range(rows.start, rows.stop, self.chunk_rows):
            yield {"rows": [self.encoded(i) for i in range(start, min(start + self.chunk_rows, rows.stop))]}

    def round_range(self, r: int) -> range:
        """The row numbers of round `r`."""
        self._sync()
        return range(self._bases[r], self._bases[r + 1])

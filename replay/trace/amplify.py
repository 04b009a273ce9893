"""`replay trace amplify`: K times a trace's sessions over the same time span.

Each session of IN (replay.trace.sessions: the trace's own, or inferred from its hash ids)
appears floor(K) times, and a seeded, exact share frac(K) of the sessions once more (K < 1: a
seeded sample of round(K x sessions) sessions). Copy 0 of a session is the session as it was;
copy c >= 1 (a clone) is the whole session shifted in time, so that its turns, the gaps between
them and its lengths are the source's. A clone's start is drawn from the source's own session
starts: a session start chosen uniformly, plus a uniform share of the gap to the next start (the
empirical distribution of starts, smoothed between them). So clones arrive as the sessions of IN
do, busy hours busy and quiet ones quiet, and the rate of session arrivals is K times IN's at
every point of the span; a random shift modulo the span would spread clones evenly and flatten
the trace's daily shape.

A clone's hash ids are fresh (the source's shifted by c times the span of IN's ids, so no clone
shares an id with IN or with another clone by accident) except the global ones, kept as they are:
a system prompt stays shared by every clone, a clone's later turns reuse its own earlier turns'
ids as the source's did. Written as the project's jsonl (replay.trace.convert.to_record), sorted
by time (replay.trace.sorted_spool), to OUT.tmp renamed to OUT when whole.

Memory: replay.trace.sessions' (about 20 bytes a row and 36 a distinct hash id, while sessions
are found), then per session 13 bytes and the set of global ids, and one sort chunk of lines.
"""

from __future__ import annotations

import math
import os
import random
from array import array
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

from replay.bounds import LOAD_FACTOR
from replay.errors import OutputError
from replay.rules.run_files import tmp_path
from replay.trace.convert import to_record
from replay.trace.file_array import TRIM_EVERY
from replay.trace.reader import TraceStream
from replay.trace.sessions import DEFAULT_GLOBAL_MIN_ROWS, Sessions
from replay.trace.sessions_on_disk import ReadFailed, SessionFiles, input_rows, open_input
from replay.trace.sorted_spool import DEFAULT_CHUNK_ROWS, SortedSpool
from replay.trace.source import open_output, remove_written

_HIGHEST_ID = (1 << 64) - 1  # what a JSON hash id may be (replay.trace.pairs)
_LOWEST_ID = -(1 << 63)
_M64 = (1 << 64) - 1


def factor_problem(value: float) -> str | None:
    """Why `value` cannot be a --factor (None when it can): replay.bounds.LOAD_FACTOR's rule."""
    if problem := LOAD_FACTOR.problem(value):
        return f"{problem}, got {value!r}"
    return None


@dataclass(frozen=True)
class Amplified:
    rows_in: int
    sessions_in: int
    rows_out: int
    sessions_out: int
    inferred: bool  # IN's sessions were (partly) inferred from its hash ids
    global_ids: int


def copies_per_session(sessions: int, factor: float, seed: int) -> Iterator[int]:
    """How many times each session appears, in session order: floor(factor), plus one for
    exactly round(frac(factor) x sessions) of them, chosen by the seed (selection sampling)."""
    whole = math.floor(factor)
    extra = round((factor - whole) * sessions)
    rng = random.Random(seed)
    for session in range(sessions):
        if extra and rng.random() * (sessions - session) < extra:
            extra -= 1
            yield whole + 1
        else:
            yield whole


def _mix(x: int) -> int:
    """splitmix64's finalizer: a well-spread 64-bit value of x (a clone's draw, computed where
    it is needed instead of held)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class CloneTimes:
    """The start of each clone: a draw from the empirical distribution of session starts, among
    the starts that leave the session room to end within IN's span (as every session of IN
    does: a long session of IN starts early, and so do its clones)."""

    def __init__(self, sessions: Sessions, seed: int):
        self.starts, self.ends = sessions.starts, sessions.ends
        self.sorted = sessions.sorted_starts
        self.last = sessions.last_end
        self.seed = _mix(seed & _M64)

    def shift(self, session: int, copy: int) -> float:
        """Seconds to add to each row of `session` in clone `copy` (0 for copy 0)."""
        if copy == 0:
            return 0.0
        draw = _mix(self.seed ^ _mix((session << 16) ^ copy))
        pick, fraction = draw >> 32, (draw & 0xFFFFFFFF) / 2.0**32
        start, ordered = self.starts[session], self.sorted
        latest = self.last - (self.ends[session] - start)  # >= start: the session itself fits
        room = bisect_right(ordered, latest)  # starts a clone may take
        index = pick * room >> 32
        low = ordered[index]
        high = min(ordered[index + 1], latest) if index + 1 < room else low
        return low + fraction * (high - low) - start


def id_shift(id_range: tuple[int, int] | None, most_copies: int) -> int:
    """What clone c adds to a private hash id: c times the span of IN's ids (negative when the
    room is below them); ValueError when neither side has room for the clones' ids."""
    if id_range is None or most_copies <= 1:
        return 0
    low, high = id_range
    span = high - low + 1
    if high + (most_copies - 1) * span <= _HIGHEST_ID:
        return span
    if low - (most_copies - 1) * span >= _LOWEST_ID:
        return -span
    raise ValueError(f"the trace's hash ids span {low} to {high}: {most_copies} copies of them do not fit in 64 bits")


class Clones:
    """Which copies each row of a trace gets and what each copy is: the one rule both `replay
    trace amplify` (a file, streamed) and a capacity search's probe (--search-by amplify: the
    window, in memory) amplify by. Rows are known by their position in the stream `sessions`
    was found over. `copies`: copies_per_session's counts, already written where the caller
    keeps them (a file), and the most of them; None: counted here, in memory."""

    def __init__(self, sessions: Sessions, factor: float, seed: int = 0,
                 copies: tuple[Sequence[int], int] | None = None):
        if problem := factor_problem(factor):
            raise ValueError(f"--factor {problem}")
        self.sessions = sessions
        if copies is None:
            counts = array("H", copies_per_session(len(sessions), factor, seed))
            copies = counts, max(counts, default=0)
        self.copies, self.most = copies  # the most copies of any row
        self.shift = id_shift(sessions.id_range, self.most)
        self.times = CloneTimes(sessions, seed)

    def count(self, position: int) -> int:
        """How many copies row `position` has (0: its session is not kept)."""
        return self.copies[self.sessions.row_session[position]]

    def rows(self) -> int:
        """How many rows the copies hold in all."""
        copies = self.copies
        return sum(copies[session] for session in self.sessions.row_session)

    def kept(self, hash_ids: Sequence[int]) -> list[bool]:
        """Which of `hash_ids` every clone keeps as they are (the global ones)."""
        global_ids = self.sessions.global_ids
        return [h in global_ids for h in hash_ids]

    def copy(self, position: int, copy: int, hash_ids: tuple[int, ...] | list[int] | None,
             kept: Sequence[bool] | None = None) -> tuple[str, tuple[int, ...] | None, float]:
        """Copy `copy` of row `position` (whose hash ids are `hash_ids`; `kept`: self.kept(hash_ids),
        when the caller has it for the row's other copies): its session id, its hash ids, and the
        seconds added to its time."""
        sessions = self.sessions
        session = sessions.row_session[position]
        name = sessions.names[session]
        if name is None:
            name = f"s{session}"
        if copy and hash_ids is not None:
            moved = copy * self.shift
            if kept is None:
                kept = self.kept(hash_ids)
            hash_ids = tuple(h if keep else h + moved for h, keep in zip(hash_ids, kept))
        elif hash_ids is not None:
            hash_ids = tuple(hash_ids)
        return (f"{name}#{copy}" if copy else name), hash_ids, self.times.shift(session, copy)

    def time_shift(self, position: int, copy: int) -> float:
        """The seconds added to row `position`'s time in copy `copy`."""
        return self.times.shift(self.sessions.row_session[position], copy)


def amplify_trace(
    stream_of: Callable[[], TraceStream],
    out_path: str | Path,
    factor: float,
    seed: int = 0,
    global_min_rows: int = DEFAULT_GLOBAL_MIN_ROWS,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> Amplified:
    """Write IN (read two or three times: `stream_of()` gives a fresh TraceStream) amplified
    `factor` times to out_path (.gz => gzip). OutputError when it cannot be written, its
    temporary files included (nothing is left at out_path then); ValueError when no session
    would be kept, or the ids do not fit; IN's own OSError when IN cannot be read."""
    if problem := factor_problem(factor):
        raise ValueError(f"--factor {problem}")
    out_path = Path(out_path)
    temporary = tmp_path(out_path)
    try:
        with SessionFiles(out_path.parent, chunk_rows) as files:
            sessions = files.find(stream_of, global_min_rows)
            counts, most, total = files.appender("copies", "H"), 0, 0
            for n in copies_per_session(len(sessions), factor, seed):
                counts.append(n)
                most, total = max(most, n), total + n
            clones = Clones(sessions, factor, seed, (files.mapped(counts).view, most))
            if not sessions:
                raise ValueError(f"{stream_of().path}: no rows to amplify")
            if not clones.most:
                raise ValueError(f"--factor {factor:g} keeps none of the trace's {len(sessions)} sessions "
                                 f"(at least {1 / max(len(sessions), 1):.3g} keeps one)")
            with SortedSpool(files.folder, chunk_rows) as spool:
                rows_in = _spool_clones(open_input(stream_of), clones, spool, files.trim)
                with open_output(temporary, gz=out_path.name.endswith(".gz")) as out:
                    spool.write_to(out)
            os.replace(temporary, out_path)
            done = Amplified(rows_in, len(sessions), spool.rows, total, sessions.inferred, len(sessions.global_ids))
    except ReadFailed as e:
        remove_written(temporary)
        raise e.error from None
    except OSError as e:  # a full disk: no half trace is left to be replayed by mistake
        remove_written(temporary)
        raise OutputError(out_path, e) from None
    except BaseException:  # a bad row, ^C: the same
        remove_written(temporary)
        raise
    return done


def _spool_clones(stream: TraceStream, clones: Clones, spool: SortedSpool, trim: Callable[[], None]) -> int:
    """Every copy of every row into the spool; returns the rows read. `trim` every TRIM_EVERY
    rows keeps the session arrays' resident window bounded."""
    rows = len(clones.sessions.row_session)
    dumps, add = orjson.dumps, spool.add
    position = -1
    for position, row in enumerate(input_rows(stream)):
        if position >= rows:
            raise ValueError(f"{stream.path}: changed while it was read (more rows than the first reading's {rows})")
        ids, start = row.hash_ids, row.timestamp_s
        count = clones.count(position)
        kept = clones.kept(ids) if count > 1 and ids else None
        for copy in range(count):
            row.session_id, row.hash_ids, shift = clones.copy(position, copy, ids, kept)
            record = to_record(row, start + shift, row.input_length, stream.block_size)
            add(record["timestamp"], copy * rows + position, dumps(record) + b"\n")
        if position % TRIM_EVERY == TRIM_EVERY - 1:
            trim()
    return position + 1

"""Which rows of a trace form a session, and which hash ids are global (shared across sessions).

A session is what `replay trace amplify` clones whole, and what `replay trace stats IN OUT`
counts turns in. Where the trace says (a jsonl `session_id`, a bailian chain's root), its
sessions are used, and an id is global when rows of 2 or more sessions carry it. Where it does
not (mooncake, azure, burstgpt: each turn of a conversation is a row of its own), sessions are
inferred from the hash ids: rows that share an id carried by fewer than `global_min_rows` rows
are one session (a conversation's later turn repeats its earlier turns' ids), and an id carried
by `global_min_rows` rows or more is global (a system prompt, a shared document). Counting
sessions instead of rows cannot work there: the sessions are what is being found. The threshold
is a trade: a conversation of that many turns or more has its first blocks counted as global
(its clones then hit its history), and a prompt shared by fewer rows links those rows into one
session. docs/amplify.md has the figures that set the default.

find_sessions holds it all in memory: per row its time (8 bytes) and session (4 bytes, plus 4
for the union-find during the second pass), and per distinct hash id a PairIndex entry (20-24
bytes) and three 4-byte counters. That suits rows already in memory (a capacity search's
window); a file's sessions are found by replay.trace.sessions_on_disk, which applies this same
rule in bounded memory and gives the same Sessions.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from replay.trace.pairs import PairIndex
from replay.trace.reader import TraceStream
from replay.trace.record import TraceRow

DEFAULT_GLOBAL_MIN_ROWS = 12
"""`--global-min-rows`: an id carried by this many rows of a trace without sessions is global."""

COUNT_CAP = (1 << 31) - 1  # the counters are 32-bit


@dataclass
class Sessions:
    """The sessions of a trace's rows, by position in the stream (0, 1, ... over rows read)."""

    row_session: Sequence[int]  # per row: its session's number, 0 .. len(starts) - 1
    starts: Sequence[float]  # per session: its first row's time (s)
    ends: Sequence[float]  # per session: its last row's time (s)
    names: Sequence[str | None]  # per session: the trace's own name for it, None when inferred
    global_ids: Collection[int]  # hash ids kept as they are by every clone
    id_range: tuple[int, int] | None  # (lowest, highest) hash id of the trace; None when it has none
    inferred: bool  # some sessions were inferred (rows without a session of their own)
    sorted_starts: Sequence[float]  # the session starts, in order
    last_end: float  # the latest session end (0.0 for none)
    turn_counts: dict[int, int] | None = None  # turns(), when counted as the sessions were found

    def __len__(self) -> int:
        return len(self.starts)

    def turns(self) -> dict[int, int]:
        """{turns: how many sessions have that many}."""
        if self.turn_counts is not None:
            return self.turn_counts
        per_session = array("i", bytes(4 * len(self.starts)))
        for session in self.row_session:
            per_session[session] += 1
        counts: dict[int, int] = {}
        for n in per_session:
            counts[n] = counts.get(n, 0) + 1
        return counts


def check_global_min_rows(global_min_rows: int) -> None:
    if global_min_rows < 2:
        raise ValueError(f"--global-min-rows must be >= 2, got {global_min_rows}")


def distinct_ids(ids: tuple[int, ...]) -> Iterable[int]:
    return ids if len(set(ids)) == len(ids) else dict.fromkeys(ids)


def find_sessions(stream_of: Callable[[], TraceStream | Iterable[TraceRow]],
                  global_min_rows: int = DEFAULT_GLOBAL_MIN_ROWS) -> Sessions:
    """The sessions of the trace that `stream_of()` reads (a fresh TraceStream each call: the
    file is read twice), or of rows in memory (a run's window: any iterable of rows, whose
    sessions need no re-rooting)."""
    check_global_min_rows(global_min_rows)
    index = PairIndex()  # (0, id) per distinct hash id, numbered 1, 2, ...
    unnamed_rows = array("i", [0])  # per id number: rows without a session of their own carrying it
    times = array("d")
    row_session = array("i")  # pass 1: the trace's session number, -1 for none
    numbers: dict[str, int] = {}
    low, high = math.inf, -math.inf
    find, add = index.find, index.add
    stream: TraceStream = stream_of()
    for row in stream:
        times.append(row.timestamp_s)
        session = -1 if row.session_id is None else numbers.setdefault(row.session_id, len(numbers))
        row_session.append(session)
        ids = row.hash_ids
        if not ids:
            continue
        low, high = min(low, min(ids)), max(high, max(ids))
        for hash_id in distinct_ids(ids):
            number = find(0, hash_id)
            if not number:
                number = add(0, hash_id)
                unnamed_rows.append(0)
            if session < 0 and unnamed_rows[number] < COUNT_CAP:
                unnamed_rows[number] += 1
    fixups = getattr(stream, "sessions", None)  # bailian rows a later row re-rooted: {request_id: session}

    rows = len(times)
    parent = array("i", range(rows))  # union-find over rows

    def root(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(x: int, y: int) -> None:
        x, y = root(x), root(y)
        if x != y:
            parent[max(x, y)] = min(x, y)  # the earliest row is the root: numbering in file order

    owner = array("i", bytes(4 * len(unnamed_rows)))  # per id: named session + 1 carrying it, -1: 2 or more
    first_row = array("i", [-1]) * len(unnamed_rows)  # per id: the first unnamed row carrying it
    session_row = array("i", [-1]) * len(numbers)  # per named session: its first row
    for position, row in enumerate(stream_of()):
        session = row_session[position]
        if fixups and row.request_id in fixups:
            session = row_session[position] = numbers.setdefault(fixups[row.request_id], len(numbers))
            if session == len(session_row):
                session_row.append(-1)
        if session >= 0:
            if session_row[session] < 0:
                session_row[session] = position
            else:
                union(position, session_row[session])
        ids = row.hash_ids
        if not ids:
            continue
        for hash_id in distinct_ids(ids):
            number = find(0, hash_id)
            if session >= 0:
                mark = owner[number]
                if mark == 0:
                    owner[number] = session + 1
                elif mark != session + 1:
                    owner[number] = -1
            elif 2 <= unnamed_rows[number] < global_min_rows:
                if first_row[number] < 0:
                    first_row[number] = position
                else:
                    union(position, first_row[number])
    global_ids = {
        index.second(number)
        for number in range(1, len(unnamed_rows))
        if owner[number] == -1 or unnamed_rows[number] >= global_min_rows
        or (owner[number] > 0 and unnamed_rows[number] > 0)
    }
    del index, owner, first_row, unnamed_rows

    names_by_number: list[str | None] = [None] * len(numbers)
    for name, number in numbers.items():
        names_by_number[number] = name
    starts, ends = array("d"), array("d")
    names: list[str | None] = []
    dense = array("i", [-1]) * rows  # per root row: its session's number
    inferred = False
    for position in range(rows):
        top = root(position)
        if dense[top] < 0:
            dense[top] = len(starts)
            starts.append(times[position])
            ends.append(times[position])
            named = row_session[position]
            names.append(names_by_number[named] if named >= 0 else None)
            inferred = inferred or named < 0
        session = dense[top]
        if times[position] < starts[session]:
            starts[session] = times[position]
        elif times[position] > ends[session]:
            ends[session] = times[position]
        row_session[position] = session
    return Sessions(row_session, starts, ends, names, global_ids, None if high < low else (int(low), int(high)), inferred,
                    array("d", sorted(starts)), max(ends, default=0.0))

"""replay.trace.sessions' rule on a trace file, in memory bounded whatever the trace's size.

`replay trace amplify` and `replay trace stats IN OUT` find the sessions of whole files, which
may have millions of rows and ids; find_sessions holds a few numbers per row and per distinct id
in memory, which a run's window (already in memory) can afford and a file cannot. Here the same
rule gives the same sessions, numbered the same, with every per-row, per-session and per-id
figure in a temporary folder:

1. One pass over the file writes each row's time and union-find parent (a named row's parent is
   its session's first row) and spools a (hash id, row, what the row is) triple per distinct id
   of each row into replay.trace.sorted_spool's external sort. A bailian file whose later rows
   re-rooted earlier ones (TraceStream.sessions) is read once more, knowing them.
2. The triples, merged in id order, are counted per id: the id is global or not
   (find_sessions' rule, written to a sorted file of global ids), and the rows of an id that
   links rows (carried by 2 to M - 1 rows without a session of their own; at most M - 1 held)
   are joined in the union-find, whose parent array is a replay.trace.file_array file.
3. One pass over the rows in order numbers the sessions by their first row (a component's root
   is its first row, as in find_sessions) and writes each row's session, each session's start,
   end and rows.

Memory: one sort chunk of triples and a read buffer per chunk while merging, the file arrays'
trimmed window, M - 1 rows of one id, and the names of the trace's own sessions (which the
reader holds anyway): none of it grows with the rows or the distinct ids of a trace without
sessions.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from array import array
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from replay.trace.file_array import TRIM_EVERY, Appender, FileArray
from replay.trace.reader import TraceStream
from replay.trace.record import TraceRow
from replay.trace.sessions import COUNT_CAP, Sessions, check_global_min_rows, distinct_ids
from replay.trace.sorted_spool import DEFAULT_CHUNK_ROWS, SortedSpool

_TWO_63 = 1 << 63
_UNNAMED = b"1\n"  # the spool's line for a row without a session: see _read_rows


class ReadFailed(Exception):
    """IN could not be read (an OSError of the reader's): not a full disk of ours."""

    def __init__(self, error: OSError):
        super().__init__(str(error))
        self.error = error


def open_input(stream_of: Callable[[], TraceStream]) -> TraceStream:
    """stream_of(), its OSError (IN cannot be opened) raised as ReadFailed."""
    try:
        return stream_of()
    except OSError as e:
        raise ReadFailed(e) from e


def input_rows(stream: Iterable[TraceRow]) -> Iterator[TraceRow]:
    """The rows of `stream`, its OSErrors raised as ReadFailed, so that a caller that writes
    temporary files tells a trace it cannot read from a disk it cannot write."""
    rows = iter(stream)
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except OSError as e:
            raise ReadFailed(e) from e
        yield row


class GlobalIds:
    """The global hash ids, a sorted file: `in` is a binary search. Ids below 2^63 are signed
    64-bit values, the rest (up to 2^64 - 1) unsigned ones, each in a file of its own."""

    def __init__(self, low: FileArray, high: FileArray):
        self.low, self.high = low.view, high.view

    def __len__(self) -> int:
        return len(self.low) + len(self.high)

    def __contains__(self, hash_id: int) -> bool:
        ids = self.low if hash_id < _TWO_63 else self.high
        at = bisect_left(ids, hash_id)
        return at < len(ids) and ids[at] == hash_id

    def __iter__(self) -> Iterator[int]:
        yield from self.low
        yield from self.high


class Names:
    """Per session its trace's own name, None when inferred: a dict of the named ones."""

    def __init__(self, named: dict[int, str], sessions: int):
        self.named, self.sessions = named, sessions

    def __len__(self) -> int:
        return self.sessions

    def __getitem__(self, session: int) -> str | None:
        return self.named.get(session)


class SessionFiles:
    """A temporary folder (under `folder`) for find(): its arrays live as long as this does. Use
    as a context manager: the folder is removed on exit, however it is left."""

    def __init__(self, folder: str | Path, chunk_rows: int = DEFAULT_CHUNK_ROWS):
        self.folder = Path(tempfile.mkdtemp(prefix=".sessions-", dir=folder))
        self.chunk_rows = chunk_rows
        self._arrays: list[FileArray] = []
        self._made = 0

    def __enter__(self) -> SessionFiles:
        return self

    def __exit__(self, *exc) -> None:
        for mapped in self._arrays:
            try:
                mapped.close()
            except BufferError:  # a view of it still held by the caller: the mapping goes with it
                pass
        self._arrays = []
        shutil.rmtree(self.folder, ignore_errors=True)

    def trim(self) -> None:
        """Every mapped array's pages out of the resident set (replay.trace.file_array)."""
        for mapped in self._arrays:
            mapped.trim()

    def _path(self, name: str) -> Path:
        self._made += 1
        return self.folder / f"{self._made}.{name}"

    def array(self, name: str, typecode: str, length: int) -> FileArray:
        """A fresh array of `length` zeros."""
        made = FileArray(self._path(name), typecode, length)
        self._arrays.append(made)
        return made

    def appender(self, name: str, typecode: str) -> Appender:
        return Appender(self._path(name), typecode)

    def mapped(self, appender: Appender) -> FileArray:
        made = FileArray.of(appender)
        self._arrays.append(made)
        return made

    def find(self, stream_of: Callable[[], TraceStream], global_min_rows: int) -> Sessions:
        """find_sessions(stream_of, global_min_rows), its arrays in this folder."""
        check_global_min_rows(global_min_rows)
        stream = open_input(stream_of)
        read = self._read_rows(stream, {})
        fixups = getattr(stream, "sessions", None)  # bailian rows a later row re-rooted: {request_id: session}
        if fixups:
            for appender in read[:2]:
                appender.close()
                appender.path.unlink()
            read[2].__exit__(None, None, None)
            read = self._read_rows(open_input(stream_of), fixups)
        times, parent_rows, spool, names, id_range = read
        with spool:
            parent = self.mapped(parent_rows)
            global_ids = self._count_ids(spool, global_min_rows, parent)
        return self._number(times, parent, names, global_ids, id_range)

    def _read_rows(self, stream: Iterable[TraceRow], fixups: dict[int, str]):
        """Pass 1: per row its time and union-find parent, and per distinct id of a row a triple
        (id, row, 2 x (named session's first row + 1, 0 for none) + 1 when the row came without
        a session) into an id-keyed sort spool."""
        times, parent = self.appender("times", "d"), self.appender("parent", "i")
        spool = SortedSpool(self.folder, self.chunk_rows, key_type=int)
        first_rows: dict[str, int] = {}  # a named session's first row
        low, high = math.inf, -math.inf
        add, add_time, add_parent = spool.add, times.append, parent.append
        for position, row in enumerate(input_rows(stream)):
            add_time(row.timestamp_s)
            name = row.session_id
            unnamed = name is None
            if fixups:
                name = fixups.get(row.request_id, name)
            if name is None:
                add_parent(position)
                line = _UNNAMED
            else:
                first = first_rows.setdefault(name, position)
                add_parent(first)
                line = b"%d\n" % (2 * (first + 1) + unnamed)
            ids = row.hash_ids
            if not ids:
                continue
            low, high = min(low, min(ids)), max(high, max(ids))
            for hash_id in distinct_ids(ids):
                add(hash_id, position, line)
        id_range = None if high < low else (int(low), int(high))
        return times, parent, spool, first_rows, id_range

    def _count_ids(self, spool: SortedSpool, global_min_rows: int, parent: FileArray) -> GlobalIds:
        """Pass 2: the triples in id order; per id whether it is global (find_sessions' rule)
        and the unions of the rows it links."""
        low, high = self.appender("global-low", "q"), self.appender("global-high", "Q")
        links = _UnionFind(parent)
        current, unnamed, owner = None, 0, 0  # rows without a session of their own carrying it; its named session
        linking = array("i")  # rows of no session carrying it, while fewer than global_min_rows

        def close() -> None:
            if owner == -1 or unnamed >= global_min_rows or (owner > 0 and unnamed > 0):
                (low if current < _TWO_63 else high).append(current)
            if 2 <= unnamed < global_min_rows and len(linking) > 1:  # global or not (find_sessions)
                first = linking[0]
                for position in linking[1:]:
                    links.union(position, first)

        for hash_id, position, line in spool.merged():
            if hash_id != current:
                if current is not None:
                    close()
                current, unnamed, owner = hash_id, 0, 0
                del linking[:]
            if line == _UNNAMED:
                named = 0
                unnamed += 1
            else:
                code = int(line)
                named = code >> 1
                if code & 1:
                    unnamed += 1
                if owner == 0:
                    owner = named
                elif owner != named:
                    owner = -1
            if unnamed > COUNT_CAP:
                unnamed = COUNT_CAP
            if not named and len(linking) < global_min_rows:
                linking.append(position)
        if current is not None:
            close()
        return GlobalIds(self.mapped(low), self.mapped(high))

    def _number(self, times: Appender, parent: FileArray, first_rows: dict[str, int], global_ids: GlobalIds,
                id_range: tuple[int, int] | None) -> Sessions:
        """Pass 3: sessions numbered by their first row; each row's session, each session's
        start, end and rows."""
        times.close()
        rows = times.length
        row_session = self.array("session", "i", rows)
        starts, ends, counts = self.array("starts", "d", rows), self.array("ends", "d", rows), self.array("rows", "i", rows)
        named_roots = {first: name for name, first in first_rows.items()}
        first_rows.clear()
        names: dict[int, str] = {}
        find = _UnionFind(parent).root
        of, start, end, count = row_session.view, starts.view, ends.view, counts.view
        sessions, last, inferred = 0, 0.0, False
        for position, time in enumerate(times.read()):
            top = find(position)
            if top == position:
                session = sessions
                sessions += 1
                start[session] = end[session] = time
                name = named_roots.get(position)
                if name is None:
                    inferred = True
                else:
                    names[session] = name
            else:
                session = of[top]
                if time < start[session]:
                    start[session] = time
                elif time > end[session]:
                    end[session] = time
            of[position] = session
            count[session] += 1
            if time > last or position == 0:
                last = time
            if position % TRIM_EVERY == TRIM_EVERY - 1:
                self.trim()
        named_roots.clear()
        turns: dict[int, int] = {}
        ordered = True
        before = -math.inf
        for session in range(sessions):
            n = count[session]
            turns[n] = turns.get(n, 0) + 1
            ordered = ordered and start[session] >= before
            before = start[session]
            if session % TRIM_EVERY == TRIM_EVERY - 1:
                self.trim()
        sorted_starts = start[:sessions] if ordered else self._sorted(start, sessions)
        self.trim()
        return Sessions(of, start[:sessions], end[:sessions], Names(names, sessions), global_ids, id_range, inferred,
                        sorted_starts, last if rows else 0.0, turns)

    def _sorted(self, starts: memoryview, sessions: int) -> memoryview:
        """The session starts in order, sorted on disk (a trace whose rows are not in time order)."""
        ordered = self.appender("sorted-starts", "d")
        with SortedSpool(self.folder, self.chunk_rows) as spool:
            for session in range(sessions):
                spool.add(starts[session], session, b"\n")
                if session % TRIM_EVERY == TRIM_EVERY - 1:
                    self.trim()
            for start, _, _ in spool.merged():
                ordered.append(start)
        return self.mapped(ordered).view


class _UnionFind:
    """find_sessions' union-find over rows (the root is a component's first row), its parent
    array a FileArray trimmed every TRIM_EVERY unions."""

    def __init__(self, parent: FileArray):
        self.parent, self.mapped, self.unions = parent.view, parent, 0

    def root(self, x: int) -> int:
        parent = self.parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(self, x: int, y: int) -> None:
        x, y = self.root(x), self.root(y)
        if x != y:
            self.parent[max(x, y)] = min(x, y)
        self.unions += 1
        if self.unions % TRIM_EVERY == 0:
            self.mapped.trim()

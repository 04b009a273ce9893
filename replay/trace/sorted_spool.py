"""Lines sorted by a key in bounded memory: an external merge sort.

`replay trace amplify` makes rows out of time order (each clone of a session is shifted by its
own offset), and a trace is read in time order. Lines are held `chunk_rows` at a time, each chunk
sorted and spooled to a file of its own in a temporary folder, and the chunks are merged
(heapq.merge) as the output is written; more than MAX_OPEN chunks are first merged in groups.
The same sort orders `replay.trace.sessions_on_disk`'s (hash id, row) pairs, whose keys are
integers of up to 64 bits (a float would merge two ids): `key_type` says which a spool holds.
Memory: one chunk of lines, plus a read buffer per chunk while merging.
"""

from __future__ import annotations

import heapq
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

Key = float | int

DEFAULT_CHUNK_ROWS = 65_536
MAX_OPEN = 256  # chunk files open at once while merging
_BUFFER = 1 << 16


class SortedSpool:
    """add(key, seq, line) lines, then write_to(file) them in (key, seq) order. `seq` breaks ties
    (and must be unique: equal (key, seq) pairs would compare the lines). Use as a context
    manager: the temporary folder (under `folder`) is removed on exit. Keys are `key_type`s
    (float or int), written with repr and read back by key_type: exact for both."""

    def __init__(self, folder: str | Path, chunk_rows: int = DEFAULT_CHUNK_ROWS, key_type: type = float):
        self.folder = Path(tempfile.mkdtemp(prefix=".spool-", dir=folder))
        self.chunk_rows = chunk_rows
        self.key_type = key_type
        self._chunk: list[tuple[Key, int, bytes]] = []
        self._files: list[Path] = []
        self._made = 0  # files made so far: each gets a name of its own
        self.rows = 0

    def __enter__(self) -> SortedSpool:
        return self

    def __exit__(self, *exc) -> None:
        self._chunk = []
        shutil.rmtree(self.folder, ignore_errors=True)

    def add(self, key: Key, seq: int, line: bytes) -> None:
        """`line` ends in a newline."""
        self._chunk.append((key, seq, line))
        self.rows += 1
        if len(self._chunk) >= self.chunk_rows:
            self._spill()

    def _spill(self) -> None:
        if not self._chunk:
            return
        self._chunk.sort()
        path = self._new_file()
        with open(path, "wb", buffering=_BUFFER) as f:
            f.writelines(b"%r %d %b" % item for item in self._chunk)
        self._chunk = []
        self._files.append(path)

    def _new_file(self) -> Path:
        self._made += 1
        return self.folder / f"{self._made}.run"

    def write_to(self, out: IO[bytes]) -> int:
        """Every line added, in order, written to `out`; returns how many."""
        count = 0
        for _, _, line in self.merged():
            out.write(line)
            count += 1
        return count

    def merged(self) -> Iterator[tuple[Key, int, bytes]]:
        """Every (key, seq, line) added, in order (once: the chunks are consumed)."""
        if not self._files:  # all of it fitted in one chunk: no file needed
            self._chunk.sort()
            yield from self._chunk
            return
        self._spill()
        while len(self._files) > MAX_OPEN:
            groups = [self._files[i:i + MAX_OPEN] for i in range(0, len(self._files), MAX_OPEN)]
            self._files = []
            for group in groups:
                path = self._new_file()
                with open(path, "wb", buffering=_BUFFER) as f:
                    f.writelines(b"%r %d %b" % item for item in _merged(group, self.key_type))
                for done in group:
                    os.unlink(done)
                self._files.append(path)
        yield from _merged(self._files, self.key_type)


def _merged(paths: list[Path], key_type: type) -> Iterator[tuple[Key, int, bytes]]:
    files = [open(path, "rb", buffering=_BUFFER) for path in paths]
    try:
        yield from heapq.merge(*(_read(f, key_type) for f in files))
    finally:
        for f in files:
            f.close()


def _read(f: IO[bytes], key_type: type) -> Iterator[tuple[Key, int, bytes]]:
    for raw in f:
        key, seq, line = raw.split(b" ", 2)
        yield key_type(key), int(seq), line

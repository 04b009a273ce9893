"""The master's records, kept on disk as they come, for runs of any size.

Each record is appended to the output file at once (so a crash still leaves every record
received), and the store remembers per request id only where its latest record is (13 bytes a
row). At the end, `finish` rewrites the file sorted by request_id, reading each record back
once, and hands every record to the caller's summary on the way.
"""

from __future__ import annotations

import os
from array import array
from pathlib import Path
from typing import Callable, Iterable

import orjson

from replay.results.records import Record

NONE, REAL, PLACEHOLDER = 0, 1, 2


class RecordStore:
    """Records for request ids first..last. A placeholder (a record the master made up, e.g.
    "worker lost") is replaced when the row's real record still arrives; a real one never is."""

    def __init__(self, path: str | Path, first: int, last: int):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w+b")
        self.first = first
        size = max(last - first + 1, 0)
        self._state = bytearray(size)
        self._offsets = array("q", bytes(8 * size))
        self._lengths = array("I", bytes(4 * size))
        self.count = 0  # request ids with a record of either kind

    def state(self, request_id: int) -> int:
        return self._state[request_id - self.first]

    def has(self, request_id: int) -> bool:
        return self._state[request_id - self.first] != NONE

    def add(self, records: Iterable[Record], placeholder: bool = False) -> list[Record]:
        """Store the records that are new (or replace a placeholder); returns those stored."""
        fresh, lines = [], []
        offset = self._file.seek(0, os.SEEK_END)
        for record in records:
            index = record["request_id"] - self.first
            state = self._state[index]
            if state == REAL or (state == PLACEHOLDER and placeholder):
                continue  # a resent batch, or a placeholder for a row already recorded
            if state == NONE:
                self.count += 1
            self._state[index] = PLACEHOLDER if placeholder else REAL
            line = orjson.dumps(record) + b"\n"
            self._offsets[index] = offset
            self._lengths[index] = len(line)
            offset += len(line)
            lines.append(line)
            fresh.append(record)
        if lines:
            self._file.write(b"".join(lines))
            self._file.flush()
        return fresh

    def finish(self, each: Callable[[Record], None] | None = None) -> int:
        """Rewrite the file sorted by request_id (each row's latest record); returns how many.
        `each` sees every record in that order (the end-of-run summary)."""
        self._file.flush()
        tmp = self.path.with_name(self.path.name + ".tmp")
        count = 0
        fd, offsets, lengths = self._file.fileno(), self._offsets, self._lengths
        with open(tmp, "wb") as out:
            for index, state in enumerate(self._state):
                if state == NONE:
                    continue
                line = os.pread(fd, lengths[index], offsets[index])  # a seek would refill 8 KB per line
                out.write(line)
                count += 1
                if each is not None:
                    each(orjson.loads(line))
        self._file.close()
        tmp.replace(self.path)
        return count

    def close(self) -> None:
        self._file.close()

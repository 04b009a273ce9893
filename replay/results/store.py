"""The master's records, kept on disk as they come, for runs of any size.

Each record is appended to the output file at once (so a crash still leaves every record
received), and the store remembers per request id only where its latest record is (13 bytes a
row). At the end, `finish` rewrites the file sorted by request_id, reading each record back
once, and hands every record to the caller's summary on the way.

A write that fails (a full disk) is the caller's fault handler's (`on_fault`, with the
OutputError), never an exception out of `add` or `finish`: the file keeps only whole lines, a
batch that could not be written is remembered as not on disk (`unwritten`), and later batches
are still tried. A placeholder's line is blanked in place once its row's real record is
written, so the appended file holds one line per row at every moment: when the sorted rewrite
cannot be written either, it is left as the run's records, unsorted.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable
from pathlib import Path

import orjson

from replay.errors import OutputError
from replay.results.files import AppendFile
from replay.results.records import Record
from replay.rules.run_files import tmp_path

NONE, REAL, PLACEHOLDER = 0, 1, 2
REWRITE_CHUNK = 1 << 20  # the sorted rewrite is written this many bytes at a time


class RecordStore:
    """Records for request ids first..last. A placeholder (a record the master made up, e.g.
    "worker lost") is replaced when the row's real record still arrives; a real one never is."""

    def __init__(self, path: str | Path, first: int, last: int,
                 on_fault: Callable[[OutputError], None] | None = None):
        """`on_fault` hears of each write that failed (None: it is raised)."""
        self.path = Path(path)
        self.on_fault = on_fault
        self._file: AppendFile | None = None  # None: it could not be made; every record is then unwritten
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = AppendFile(self.path, readable=True)
        except OSError as e:
            self._fault(OutputError(self.path, e))
        except OutputError as e:
            self._fault(e)
        self.first = first
        size = max(last - first + 1, 0)
        self._state = bytearray(size)
        self._offsets = array("q", bytes(8 * size))
        self._lengths = array("I", bytes(4 * size))
        self.answered = bytearray(size)  # 1: the row's record is ok (the rows whose server span the end waits for)
        self.count = 0  # request ids with a record of either kind
        self.unwritten = 0  # of them, rows whose record could not be written (a full disk)
        self.finished = False  # the sorted file is written: records that come later are not taken

    def grow(self, last: int) -> None:
        """Take request ids up to `last` too (a capacity search's next probe)."""
        more = last - self.first + 1 - len(self._state)
        if more > 0:
            self._state.extend(bytes(more))
            self._offsets.extend(array("q", bytes(8 * more)))
            self._lengths.extend(array("I", bytes(4 * more)))
            self.answered.extend(bytes(more))

    def state(self, request_id: int) -> int:
        return self._state[request_id - self.first]

    def has(self, request_id: int) -> bool:
        return self._state[request_id - self.first] != NONE

    def _fault(self, error: OutputError) -> None:
        if self.on_fault is None:
            raise error
        self.on_fault(error)

    def add(self, records: Iterable[Record], placeholder: bool = False) -> list[Record]:
        """Store the records that are new (or replace a placeholder); returns those stored. After
        `finish` none is: a worker's records that arrive while the run's end is written (every
        row already has its record by then) would go to a closed file."""
        if self.finished:
            return []
        fresh, lines = [], []
        replaced: dict[int, tuple[int, int]] = {}  # index -> the placeholder line's (offset, length)
        offset = self._file.size if self._file is not None else 0
        for record in records:
            index = record["request_id"] - self.first
            state = self._state[index]
            if state == REAL or (state == PLACEHOLDER and placeholder):
                continue  # a resent batch, or a placeholder for a row already recorded
            if state == NONE:
                self.count += 1
            elif self._lengths[index]:
                replaced[index] = (self._offsets[index], self._lengths[index])
            self._state[index] = PLACEHOLDER if placeholder else REAL
            self.answered[index] = record.get("ok") is True
            line = orjson.dumps(record) + b"\n"
            self._offsets[index] = offset
            self._lengths[index] = len(line)
            offset += len(line)
            lines.append(line)
            fresh.append(record)
        if not lines:
            return fresh
        try:
            if self._file is None:
                raise OutputError(self.path, OSError(0, "the file could not be made"))
            self._file.append(b"".join(lines))
        except OutputError as e:
            for record in fresh:  # recorded (counted), but not on disk: a placeholder's line stays its record
                index = record["request_id"] - self.first
                self._offsets[index], self._lengths[index] = replaced.get(index, (0, 0))
                self.unwritten += index not in replaced
            self._fault(e)
            return fresh
        for old_offset, old_length in replaced.values():  # blanked: one line per row on disk
            self._file.overwrite(old_offset, b" " * (old_length - 1) + b"\n")
        return fresh

    def finish(self, each: Callable[[Record], None] | None = None,
               fill: Callable[[dict], bool] | None = None) -> int:
        """Rewrite the file sorted by request_id (each row's latest record); returns how many.
        `each` sees every record in that order (the end-of-run summary), also when the
        rewrite cannot be written: the appended file is then kept as it is (one line per
        row, unsorted), and the fault handler hears why. `fill` adds to a record before
        `each` sees it and it is written (True: it changed; the server's spans,
        replay.results.span_join)."""
        self.finished = True
        if self._file is None:
            return 0
        tmp = tmp_path(self.path)
        count = 0
        offsets, lengths, read = self._offsets, self._lengths, self._file.read
        out: AppendFile | None = None
        try:
            out = AppendFile(tmp)
        except OutputError as e:
            self._fault(e)
        pending = bytearray()

        def write_pending() -> AppendFile | None:
            try:
                out.append(pending)
                return out
            except OutputError as e:
                self._drop(out, tmp)
                self._fault(e)
                return None
            finally:
                pending.clear()

        for index, state in enumerate(self._state):
            if state == NONE or not lengths[index]:
                continue
            line = read(offsets[index], lengths[index])  # a seek would refill 8 KB per line
            count += 1
            if fill is not None:
                record = orjson.loads(line)
                if fill(record):
                    line = orjson.dumps(record) + b"\n"
                if each is not None:
                    each(record)
            elif each is not None:
                each(orjson.loads(line))
            if out is not None:
                pending += line
                if len(pending) >= REWRITE_CHUNK:
                    out = write_pending()
        if out is not None and pending:
            out = write_pending()
        self._file.close()
        if out is not None:
            out.close()
            try:
                tmp.replace(self.path)
            except OSError as e:
                self._drop(None, tmp)
                self._fault(OutputError(self.path, e))
        return count

    @staticmethod
    def _drop(out: AppendFile | None, tmp: Path) -> None:
        if out is not None:
            out.close()
        try:
            tmp.unlink()
        except OSError:
            pass

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

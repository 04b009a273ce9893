"""Arrays of numbers that live in files, for what would otherwise grow with a trace's rows.

`replay trace amplify` and `replay trace stats IN OUT` hold per row and per session a few
numbers (a union-find parent, a session number, a start time) that they read back out of order.
Held in memory they grow with the trace; here each is a file in a temporary folder, mapped, and
`trim()` drops the pages the process has touched from its resident set (the data stays in the
file and the kernel's page cache, which is reclaimable and written back under pressure), so the
process holds a bounded window of them whatever the trace's size. Space is allocated when the file
is made (posix_fallocate), so a full disk is an OSError (ENOSPC) there, never a SIGBUS on a later
store into the mapping.

`Appender` writes one sequentially (a buffer of `array` items at a time) when its length is not
known in advance; `FileArray.of` maps what it wrote.
"""

from __future__ import annotations

import mmap
import os
from array import array
from pathlib import Path

_FLUSH_ITEMS = 1 << 14
TRIM_EVERY = 1 << 12
"""Operations (rows, unions) between two trim() calls in the loops that use these arrays. An
operation touches a few pages (a row's session, its clones' drawn starts), so the resident
window is a few times 4096 pages at most whatever the arrays' size; far fewer in practice, as
neighbouring rows share pages."""


class FileArray:
    """`length` items of an `array` typecode in the file `path`, mapped read-write: index `view`."""

    def __init__(self, path: str | Path, typecode: str, length: int, *, fresh: bool = True):
        """fresh: make the file (zeros, space allocated); else map the file `path` as it is."""
        self.path = Path(path)
        size = max(length, 1) * array(typecode).itemsize
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | (os.O_EXCL if fresh else 0) | os.O_CLOEXEC, 0o600)
        try:
            if fresh or os.fstat(fd).st_size < size:
                os.posix_fallocate(fd, 0, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.view = memoryview(self._map).cast(typecode)[:length]
        self.length = length

    @classmethod
    def of(cls, appender: Appender) -> FileArray:
        """The file `appender` wrote (closed first), mapped."""
        appender.close()
        return cls(appender.path, appender.typecode, appender.length, fresh=False)

    def __len__(self) -> int:
        return self.length

    def trim(self) -> None:
        """Drop the mapping's pages from the process's resident set (their data stays in the file)."""
        self._map.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        self.view.release()
        self._map.close()


class Appender:
    """A file of `array` items written in order: append(x), then FileArray.of(it) or read()."""

    def __init__(self, path: str | Path, typecode: str):
        self.path = Path(path)
        self.typecode = typecode
        self.length = 0
        self._buffer = array(typecode)
        self._file = open(self.path, "xb")

    def append(self, value) -> None:
        self._buffer.append(value)
        if len(self._buffer) >= _FLUSH_ITEMS:
            self._flush()

    def _flush(self) -> None:
        self._buffer.tofile(self._file)
        self.length += len(self._buffer)
        del self._buffer[:]

    def close(self) -> None:
        if not self._file.closed:
            self._flush()
            self._file.close()

    def read(self):
        """The items in order, a buffer at a time (closed first)."""
        self.close()
        with open(self.path, "rb") as f:
            while True:
                chunk = array(self.typecode)
                try:
                    chunk.fromfile(f, _FLUSH_ITEMS)
                except EOFError:  # the last, short buffer (read all the same)
                    pass
                if not chunk:
                    return
                yield from chunk

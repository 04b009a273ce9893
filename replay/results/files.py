"""Writing a run's files so that a failed write (a full disk, an I/O error) leaves no torn JSON
and is reported as one fault naming the file: `OutputError`.

Every file a run writes goes through here: the records (`AppendFile`: a batch of whole lines
lands whole or not at all; on a failure the file is cut back to its length before the batch),
and the documents (`write_atomically`: a temporary file renamed over the old one, removed when
it could not be written). Nothing here logs: the master's writers hand an OutputError to the
coordinator's one handler (`Coordinator.on_output_error`), a worker's goes to the master as a
FAULT message, and either way the run ends as a fault.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from replay.errors import OutputError
from replay.output_claim import kind_of, open_regular
from replay.rules.run_files import tmp_path


class AppendFile:
    """A file written a batch of whole lines at a time, created empty (or truncated). `size` is
    its length: the end of its last whole line."""

    def __init__(self, path: str | Path, readable: bool = False, fd: int | None = None):
        """`fd`: `path` opened (empty, for writing) by the caller, which checked what it is."""
        self.path = Path(path)
        if fd is None:
            flags = (os.O_RDWR if readable else os.O_WRONLY) | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
            try:
                fd = os.open(self.path, flags, 0o644)
            except OSError as e:
                raise OutputError(self.path, e) from None
        self.fd: int | None = fd
        self.size = 0

    def append(self, data: bytes | bytearray) -> int:
        """Write `data` at the end; returns the offset it starts at. Raises OutputError, the
        file cut back to where it was: a disk that fills mid-batch leaves no half line."""
        start, done = self.size, 0
        try:
            with memoryview(data) as view:  # released here: a bytearray passed in stays resizable
                while done < len(data):
                    done += os.pwrite(self.fd, view[done:], start + done)
        except OSError as e:
            try:
                os.ftruncate(self.fd, start)
            except OSError:
                pass
            raise OutputError(self.path, e) from None
        self.size = start + done
        return start

    def overwrite(self, offset: int, data: bytes) -> None:
        """Replace bytes already in the file (no new space needed; an error is ignored: the
        caller's file stays as it was there)."""
        try:
            os.pwrite(self.fd, data, offset)
        except OSError:
            pass

    def read(self, offset: int, length: int) -> bytes:
        return os.pread(self.fd, length, offset)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def write_atomically(path: str | Path, data: bytes) -> Path:
    """`data` as the whole of `path`: a reader sees the old file or the new one, never half.
    Raises OutputError naming `path`; no temporary file is left, and `path` is as it was.

    Only a regular file (or nothing) is replaced, and the temporary file is opened without
    following a link or blocking on a FIFO: the command's output claim refused anything else
    (replay.output_claim), and this refuses what was swapped in since. No folder is made."""
    path = Path(path)
    tmp = tmp_path(path)
    try:
        _only_a_regular_file(path)
        fd = open_regular(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)  # a node there: left as it is
    except OSError as e:
        raise OutputError(path, e) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        _only_a_regular_file(path)
        tmp.replace(path)
    except OSError as e:
        _remove(tmp)
        raise OutputError(path, e) from None
    return path


def _only_a_regular_file(path: Path) -> None:
    """OSError unless `path` is absent or a regular file."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise OSError(f"{path} is {kind_of(mode)}, not a regular file")


def overwrite_in_place(path: str | Path, data: bytes) -> bool:
    """`data` written over the start of `path`'s existing bytes, the rest blanked with spaces:
    for a file whose space was reserved ahead (the run's meta) when the disk has no room for a
    temporary copy. Only when `data` fits; returns whether it was written."""
    path = Path(path)
    try:
        with open(path, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            if len(data) > size:
                return False
            f.write(data + b" " * (size - len(data)))
            f.flush()
    except OSError:
        return False
    return True


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass

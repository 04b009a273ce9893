"""Opening trace files: gzip is recognised by its magic bytes, so a misnamed file still reads."""

from __future__ import annotations

import gzip
import io
import os
import stat
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from replay.output_claim import open_regular
from replay.trace.record import BadLine, TraceError

GZIP_MAGIC = b"\x1f\x8b"
GZIP_ERRORS = (EOFError, zlib.error, gzip.BadGzipFile)  # what a damaged gzip stream raises


MAX_LINE_BYTES = 64 << 20  # a row of a million tokens' messages is ~4 MB; past this it is no text file


def open_binary(path: str | Path) -> IO[bytes]:
    """The file's bytes, decompressed when it is gzip whatever its name. A trace is read more
    than once (its format, its rows, its hash), so only a regular file is: a FIFO would give
    its bytes to the first read and block the next, a device never end."""
    mode = os.stat(path).st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):  # a directory: open's own error names it
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a device or socket"
        raise TraceError(BadLine(str(path), 1, "(file)", f"is {kind}, not a regular file: give the trace as a file"))
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == GZIP_MAGIC:
        return gzip.open(path, "rb")
    return open(path, "rb")


def open_text(path: str | Path) -> IO[str]:
    """Text for the csv module: newline='' keeps quoted newlines intact, utf-8-sig drops a BOM.

    Bytes that are not UTF-8 become lone surrogates (surrogateescape) instead of failing the
    read of a whole chunk, far from their line: the CSV reader finds them row by row.
    """
    return io.TextIOWrapper(open_binary(path), encoding="utf-8-sig", errors="surrogateescape", newline="")


def numbered_lines(path: str | Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw line) for every non-blank line; blank lines are not rows.

    A damaged gzip stream raises TraceError naming the first line that could not be read.
    """
    number = 0
    with open_binary(path) as f:
        read = f.readline
        try:
            while line := read(MAX_LINE_BYTES):
                number += 1
                if len(line) == MAX_LINE_BYTES and not line.endswith(b"\n"):
                    raise TraceError(BadLine(str(path), number, "(line)", f"longer than {MAX_LINE_BYTES >> 20} MiB: "
                                                                          "not a trace's row (a binary file?)"))
                if not line.isspace():  # the same test as strip(), without copying the line
                    yield number, line
        except GZIP_ERRORS as err:
            raise gzip_error(path, err, number) from err


def gzip_error(path: str | Path, err: Exception, last_line: int) -> TraceError:
    """A damaged gzip stream as a TraceError on the line after the last one read.

    The gzip module says what is wrong (EOFError, zlib.error, BadGzipFile) but names no
    file, and a truncated download is common enough to say so in plain words.
    """
    if isinstance(err, EOFError):
        where = f"after line {last_line}" if last_line else "before the first line"
        message = f"truncated gzip file: ended {where}"
    else:
        message = f"corrupt gzip data: {err}"
    return TraceError(BadLine(str(path), last_line + 1, "(gzip)", message))


def open_output(path: str | Path, gz: bool | None = None) -> IO[bytes]:
    """A binary writer, gzip when `gz` (by default: when the name ends in .gz; a temporary
    file, FILE.gz.tmp, names the file it becomes). Only a regular file (or nothing) is
    replaced: a link is not followed, a FIFO not waited on, a device not written (the
    command's output claim, replay.output_claim, refused them; this, one swapped in since)."""
    raw = open(path, "wb", opener=open_regular)
    if str(path).endswith(".gz") if gz is None else gz:
        return _GzipOutput(raw)
    return raw


def remove_written(path: str | Path) -> None:
    """Remove what a failed write left at `path`: a regular file only (a node swapped in there,
    which open_output refused, stays)."""
    try:
        if stat.S_ISREG(os.lstat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass


class _GzipOutput(gzip.GzipFile):
    """A gzip stream that closes the file it writes into (GzipFile leaves a file it was
    handed open)."""

    def __init__(self, raw: IO[bytes]):
        super().__init__(mode="wb", fileobj=raw)
        self._raw = raw

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._raw.close()

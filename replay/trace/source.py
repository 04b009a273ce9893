"""Opening trace files: gzip is recognised by its magic bytes, so a misnamed file still reads."""

from __future__ import annotations

import gzip
import io
from pathlib import Path
from typing import IO, Iterator

GZIP_MAGIC = b"\x1f\x8b"


def open_binary(path: str | Path) -> IO[bytes]:
    """The file's bytes, decompressed when it is gzip whatever its name."""
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == GZIP_MAGIC:
        return gzip.open(path, "rb")
    return open(path, "rb")


def open_text(path: str | Path) -> IO[str]:
    """Text for the csv module: newline='' keeps quoted newlines intact, utf-8-sig drops a BOM."""
    return io.TextIOWrapper(open_binary(path), encoding="utf-8-sig", newline="")


def numbered_lines(path: str | Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw line) for every non-blank line; blank lines are not rows."""
    with open_binary(path) as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                yield number, line


def open_output(path: str | Path) -> IO[bytes]:
    """A binary writer, gzip when the name ends in .gz."""
    if str(path).endswith(".gz"):
        return gzip.open(path, "wb")
    return open(path, "wb")

"""Errors whose one-line message is the whole story for the user."""

from __future__ import annotations

from pathlib import Path


class OptionError(ValueError):
    """A value the user gave (an option, or what it names on this host) cannot be used.

    The message names the option and the value in one line, so it is shown exactly as it is,
    with no exception type in front: on the master as `replay: <message>` (exit 2), on a
    worker in its READY error and so in its rows' `worker failed: <message>` label.
    """


class OutputError(Exception):
    """A file a command writes could not be written (a full disk, an I/O error): its path and
    the system's reason, in one line. Here, not beside the writers, because every layer that
    writes a file (the trace commands, the results, the engine) raises or handles it."""

    def __init__(self, path: str | Path, error: OSError):
        self.path = Path(path)
        self.errno = error.errno
        self.strerror = error.strerror or str(error)
        self.reason = self.strerror + (f" (errno {self.errno})" if self.errno else "")
        super().__init__(f"cannot write {self.path}: {self.reason}")

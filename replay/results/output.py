"""Claiming a run's output before anything is sent: its folder writable, no other run writing
it, and an earlier run's results replaced only when asked (`--overwrite`).

Without this, a bad `--output` surfaced only when the master opened the file at the start of
the run (a traceback in Locust's test_start, and a run that never ended), two runs on the same
path interleaved their records, and a rerun silently replaced the results of the last one.

The claim is a lock: `fcntl.flock` on `OUTPUT.lock`, held by the master's process for its
whole life (the kernel drops it if the process dies, so a left-over lock file never blocks a
later run) and removed at its exit. flock is per host: on a network file system two masters
on two hosts may not see each other's lock.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import os
import socket
import stat
from collections.abc import Sequence
from pathlib import Path

from replay.errors import OptionError, OutputError
from replay.output_claim import Output, Read, Written, claim
from replay.rules.run_files import (
    capacity_path,
    fidelity_path,
    lock_path,
    meta_path,
    run_files,
    summary_path,
    tmp_path,
)

MAX_DEFAULT_TRIES = 100  # results/replay-<time>-2.jsonl ... when the default name is taken


class OutputTaken(OptionError):
    """The output is locked by another run, or holds an earlier run's results."""


def earlier_run_files(output: str | Path) -> list[Path]:
    """The files a run on `output` writes on this host that exist now: the merged records, the
    meta, summary, fidelity, server-metrics and capacity files and the per-worker files (any N: an earlier run may
    have had more workers)."""
    return [p for p in run_files(output) if os.path.lexists(p)]


def _scratch_files(output: Path) -> list[Path]:
    """What a run on `output` writes besides its results: the lock and the files written and
    then renamed over the results (the merged records', the meta's and the summary's)."""
    renamed = (output, meta_path(output), summary_path(output), fidelity_path(output), capacity_path(output))
    return [lock_path(output), *(tmp_path(p) for p in renamed)]


def _refuse_all_but_regular_files(output: str, paths: list[Path], hint: str, inputs: Sequence[Read] = (),
                                  others: Sequence[Written] = ()) -> None:
    """A run replaces or writes through only regular files, and none its inputs: --overwrite
    once unlinked whatever was there (as root, `--output /dev/full` deleted the device), and a
    link was written through to its target. Anything else is left as it is, with or without
    --overwrite (the rule of every command's outputs, replay.output_claim); `others`: the
    run's other outputs (Locust's reports), under the same rule and never on the run's files."""
    claim([Written("--output", output, tuple(paths), replaced="an earlier run's regular files are",
                   makes_folder=True), *others], list(inputs), hint)


def fresh_fd(output: str, path: Path) -> int:
    """A descriptor of `path` emptied for writing, if what is there is a regular file or nothing:
    a worker on another host writes its file where the master's claim did not look, and "wb"
    would write into a device or a FIFO, or through a link. Raises OptionError as the claim does,
    and OutputError when the file cannot be made (a full disk)."""
    _refuse_all_but_regular_files(output, [path], "")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        _refuse_all_but_regular_files(output, [path], "")  # swapped in since the look (a link: ELOOP)
        raise OutputError(path, e) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped in since the look
        os.close(fd)
        _refuse_all_but_regular_files(output, [path], "")
        raise OptionError(f"--output {output}: {path} is not a regular file")
    return fd


RUN_OUTPUT = Output("run output", files=lambda path: [*run_files(path), *_scratch_files(path)])
"""--output's role (replay.output_claim): every file a run writes beside it; claimed by
`claim_output`, in the run's preflight."""


class OutputClaim:
    """This process's hold on an output: the lock's descriptor, released (and the lock file
    removed) by `release`, which runs at the process's exit."""

    def __init__(self, output: str, fd: int):
        self.output = output
        self.lock_path = lock_path(output)
        self._fd: int | None = fd
        self._pid = os.getpid()
        atexit.register(self.release)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Remove the lock file, then drop the lock (in that order: a run that opened the file
        just before it went away finds, once it holds the lock, that the path is no longer
        its file, and tries again). Only in the process that claimed: a forked child inherits
        the descriptor and this hook, and must not free its parent's claim."""
        if self._fd is None or os.getpid() != self._pid:
            return
        try:
            os.unlink(self.lock_path)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None


def claim_output(output: str, *, overwrite: bool = False, default: bool = False,
                 inputs: Sequence[Read] = (), others: Sequence[Written] = ()) -> OutputClaim:
    """Make `output`'s folder, lock `output` for this process, and refuse an earlier run's
    results unless `overwrite` (then they are removed now, stale per-worker files included).

    `default`: `output` is the default name, which the user never chose: when it is taken,
    the next free `NAME-2.jsonl`, `NAME-3.jsonl`, ... is claimed instead, as before the lock
    two such runs would have written two files (or, in the same second, one).

    `inputs`: what the run reads (replay.output_claim.declared_inputs): none of its files may
    be one of them, with or without `overwrite`; nor may `others`, the files the run writes
    that are not its own (Locust's --html: replay.locust.outputs), be one of them or the run's.

    Raises OptionError (OutputTaken when another run holds it or results exist), one line
    naming `--output` and the path.
    """
    if not default:
        return _claim(output, overwrite, "", inputs, others)
    base = Path(output)
    for n in range(1, MAX_DEFAULT_TRIES + 1):
        name = output if n == 1 else str(base.with_name(f"{base.stem}-{n}{base.suffix}"))
        try:
            return _claim(name, False, " (the default output; pass --output PATH)", inputs, others)
        except OutputTaken:
            continue
    raise OptionError(f"--output {output}: it and {MAX_DEFAULT_TRIES - 1} numbered variants are all taken; "
                      f"pass --output PATH")


def _claim(output: str, overwrite: bool, hint: str, inputs: Sequence[Read], others: Sequence[Written]) -> OutputClaim:
    out = Path(output)
    if out.is_dir():
        raise OptionError(f"--output {output}: is a folder; name a file (e.g. {out / 'run.jsonl'}){hint}")
    _refuse_all_but_regular_files(output, [*run_files(out), *_scratch_files(out)], hint, inputs, others)
    _make_folder(output, out.parent, hint)
    fd = _lock(output, hint)
    claim = OutputClaim(output, fd)
    try:
        earlier = earlier_run_files(out)
        if earlier and not overwrite:
            raise OutputTaken(f"--output {output}: {earlier[0]} exists (an earlier run's results); pass --overwrite "
                              f"to replace them, or choose another --output{hint}")
        for path in earlier:
            try:
                path.unlink()
            except OSError as e:
                raise OptionError(f"--output {output}: cannot remove the earlier run's {path}: {e.strerror}") from None
    except BaseException:
        claim.release()
        raise
    return claim


def _make_folder(output: str, folder: Path, hint: str) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        # under a regular file mkdir says "File exists" or "Not a directory": name the file
        blocker = next((p for p in [folder, *folder.parents] if p.exists() and not p.is_dir()), None)
        why = f"{blocker} is a file, not a folder" if blocker is not None else e.strerror or str(e)
        raise OptionError(f"--output {output}: cannot create its folder {folder}: {why}{hint}") from None


def _lock(output: str, hint: str) -> int:
    """A descriptor of OUTPUT.lock holding an exclusive flock, its holder written in it."""
    path = lock_path(output)
    for _ in range(10):
        try:  # O_NOFOLLOW, and no device or FIFO opened: checked before, here against a late swap
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as e:  # a read-only mount, a folder this user cannot write
            raise OptionError(f"--output {output}: cannot write in {path.parent}: {e.strerror}{hint}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _holder(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise OutputTaken(f"--output {output}: another run is writing it ({holder or 'see ' + str(path)}); "
                                  f"wait for it to end, or choose another --output{hint}") from None
            raise OptionError(f"--output {output}: cannot lock {path}: {e.strerror}{hint}") from None
        try:
            mine = os.fstat(fd)
            same = stat.S_ISREG(mine.st_mode) and os.path.samestat(mine, os.lstat(path))
        except FileNotFoundError:
            same = False
        if not same:  # its holder removed it between our open and our lock: take the new one
            os.close(fd)
            continue
        try:  # a full disk has no room for even this line: said here, before anything is sent
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        except OSError as e:
            os.close(fd)
            _unlink(path)
            raise OptionError(f"--output {output}: cannot write {path}: {e.strerror}{hint}") from None
        return fd
    raise OptionError(f"--output {output}: cannot lock {path}: it keeps being replaced{hint}")


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _holder(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        return ""

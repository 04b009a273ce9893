"""A Python module run to its end in a child process, for work whose memory (a tokenizer, most
often) the calling process must never hold: the child imports only what the work needs, and
what it loaded is gone when it exits.

The child is spawned and waited for with the C library's calls, not gevent's: callers run this
in a gevent threadpool thread (off the event loop), where gevent's cooperative subprocess cannot
be used, and wait4 blocks that thread only. The child's peak RSS comes from the kernel's own
accounting of the reaped child (wait4), so callers can report it.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])  # where `replay` is, wherever this process found it


def run_module(module: str, args: list[str], errors: Path) -> tuple[int | str, int]:
    """Run `python -m module *args` to its end: (exit code, or the signal's name; the child's peak
    RSS in MiB). Its stdout and stderr go to `errors`, its stdin is /dev/null. Raises OSError when
    no child could be started."""
    return wait_module(start_module(module, args, errors))


def start_module(module: str, args: list[str], errors: Path, own_group: bool = False,
                 blocked: tuple[signal.Signals, ...] = ()) -> int:
    """Start `python -m module *args` (stdout and stderr to `errors`, stdin /dev/null): its pid,
    for wait_module. `own_group`: in a process group of its own, so that a signal to this
    process's group (a terminal's Ctrl-C, which a run takes as a stop and then ignores while it
    writes its results) does not end the child: this process decides when it ends (a child that
    outlives it must watch for that). `blocked`: signals the child starts with blocked, so that
    one sent before it is ready to wait for it is kept pending, not its death. Raises OSError
    when no child could be started."""
    argv = [sys.executable, "-m", module, *args]
    spawn = os.posix_spawn
    monkey = sys.modules.get("gevent.monkey")
    if monkey is not None and monkey.is_module_patched("os"):
        spawn = monkey.get_original("os", "posix_spawn")  # gevent's watches the child from the main loop only
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)}
    actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
               (os.POSIX_SPAWN_OPEN, 1, str(errors), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
               (os.POSIX_SPAWN_DUP2, 1, 2)]
    extra: dict = {"setpgroup": 0} if own_group else {}  # 0: a group of its own, numbered by its pid
    if blocked:
        extra["setsigmask"] = blocked
    return spawn(argv[0], argv, env, file_actions=actions, **extra)


def wait_module(pid: int) -> tuple[int | str, int]:
    """Wait for the child `pid` to end: (exit code, or the signal's name; its peak RSS in MiB)."""
    try:
        _, status, usage = os.wait4(pid, 0)  # wait4 is not gevent's: it blocks this thread only
    except ChildProcessError:  # reaped by a SIGCHLD handler of gevent's: ended; callers check its result anyway
        return 0, 0
    peak_mib = usage.ru_maxrss // 1024
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}", peak_mib
    return os.waitstatus_to_exitcode(status), peak_mib


def last_line(errors: Path) -> str:
    """The last line a child wrote to `errors` (its error, when it failed), or 'no output'."""
    try:
        lines = errors.read_text(errors="replace").strip().splitlines()
    except OSError:
        lines = []
    return lines[-1] if lines else "no output"

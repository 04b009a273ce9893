"""`python -m support.serve_vllm FILE` (with tests/ on PYTHONPATH): start the alone tests' vLLM
(small_cache_vllm) ahead of them, write its URL into FILE once it is healthy, and serve until
SIGTERM or SIGINT, then stop it.

`make test` runs it under SCHED_IDLE with the parallel tests, and passes FILE to the alone vLLM
test (SMALL_CACHE_ENV), which runs after them: a vLLM start is about 30 s of CPU (three processes
import torch and vLLM), spent beside the parallel tests instead of in the alone tests' wall time. Where it cannot
start one (vLLM not installed, no shared test data, a failed start) it writes "-" and exits,
and the test starts its own, with its own skip or failure.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
from pathlib import Path

from support import ports
from support.paths import SHARED
from support.vllm import SKIP_ENV, VllmStartError, small_cache_vllm, vllm_python

# Under SCHED_IDLE beside busy tests the start may take as long as they do: it must not time
# out before the alone vLLM test begins.
STARTUP_TIMEOUT_S = 1800.0


def _stop(signum, frame) -> None:
    raise SystemExit(0)  # unwinds small_cache_vllm, which stops the server's process group


def _as_any_other_process() -> None:
    """Back to normal scheduling (SCHED_OTHER, nice 0) once started, where this user may raise a
    priority (root: CI): the alone test then finds its server as one it started itself. vLLM is
    this process's child, leading a process group of its own (its engine and worker processes);
    a scheduling policy is each thread's own, so every thread of the group is set."""
    with contextlib.suppress(OSError):
        fields = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                after = stat.read_text().rsplit(")", 1)[1].split()
                fields[int(stat.parent.name)] = (int(after[1]), int(after[2]))  # parent, process group
        for leader in (pid for pid, (parent, _) in fields.items() if parent == os.getpid()):
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PGRP, leader, 0)
            for pid in (pid for pid, (_, group) in fields.items() if group == leader):
                for task in Path(f"/proc/{pid}/task").glob("[0-9]*"):
                    with contextlib.suppress(OSError, ValueError):
                        os.sched_setscheduler(int(task.name), os.SCHED_OTHER, os.sched_param(0))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m support.serve_vllm FILE", file=sys.stderr)
        return 2
    out = Path(argv[0])
    signal.signal(signal.SIGTERM, _stop)
    ports.use_block(ports.AHEAD)  # not the alone tests' block: they start servers while vLLM starts
    if vllm_python() is None or not SHARED.exists() or os.environ.get(SKIP_ENV) == "1":
        out.write_text("-")
        return 0
    try:
        with tempfile.TemporaryDirectory(prefix="tiny-qwen2-") as work, small_cache_vllm(work, STARTUP_TIMEOUT_S) as url:
            _as_any_other_process()
            out.write_text(url)
            while True:
                signal.pause()
    except VllmStartError as e:
        out.write_text("-")
        print(f"serve_vllm: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""What the benchmarks share: timing by median, which core each side runs on, and the project's
bytecode compiled before any process is timed."""

from __future__ import annotations

import compileall
import os
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def median_seconds(fn, runs: int = 5) -> float:
    """Median wall time of `runs` calls of fn()."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def split_cores() -> tuple[int | None, int | None]:
    """(client core, server core), so load generator and server never share one; Nones on a
    single-core machine."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None, None
    return cores[0], cores[1]


def compile_bytecode(tree: Path = REPO) -> None:
    """Compile the project's bytecode, as `make bytecode` does (and pip for an installed package):
    with PYTHONDONTWRITEBYTECODE set, as on CI machines and in the Dockerfile, every process a
    benchmark starts would otherwise compile the whole package again, a CPU cost of the checkout,
    not of the code being timed. Files already compiled are skipped."""
    ok = compileall.compile_dir(tree / "replay", quiet=1) and compileall.compile_file(tree / "locustfile.py", quiet=1)
    if not ok:
        raise SystemExit("bench: the project's bytecode did not compile")


# `python -c LOCUST USAGE_FILE ARGS` is `python -m locust ARGS` that writes, as it exits, its own CPU
# seconds and its reaped children's (e.g. the end-of-run cache child) to USAGE_FILE.
LOCUST = """
import resource, runpy, sys
usage_file = sys.argv.pop(1)
sys.argv[0] = "locust"
try:
    runpy.run_module("locust", run_name="__main__", alter_sys=True)
finally:
    own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    with open(usage_file, "w") as f:
        f.write(f"{own.ru_utime + own.ru_stime} {children.ru_utime + children.ru_stime}")
"""


def locust_cpu(usage_file: Path) -> tuple[float, float]:
    """(the locust process's own CPU seconds, its child processes'), as LOCUST wrote them."""
    own, children = usage_file.read_text().split()
    return float(own), float(children)


def tree_env(tree: Path) -> dict[str, str]:
    """This process's environment for a child that imports `tree`'s replay (a checkout that
    `--against TREE` compares with this one): `tree` first on PYTHONPATH, this checkout off it."""
    outer = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != REPO]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *outer])}


def tree_label(tree: Path) -> str:
    """How a benchmark that compares checkouts names `tree`."""
    return "this checkout" if tree == REPO else str(tree)


def high_water_kib(pid: int) -> int:
    """VmHWM of a live process, its own peak RSS (wait4's covers its reaped children too); 0 once
    it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0

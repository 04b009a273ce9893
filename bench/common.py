"""What the benchmarks share: timing by median, and which core each side runs on."""

from __future__ import annotations

import os
import statistics
import time


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

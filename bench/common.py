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
# seconds and its reaped children's (e.g. the end-of-run cache child) to USAGE_FILE; `python -c
# REPLAY USAGE_FILE run ARGS` is `python -m replay run ARGS` (the user's command) that does the same.
RUN_MODULE = """
import resource, runpy, sys
usage_file = sys.argv.pop(1)
sys.argv[0] = "{module}"
try:
    runpy.run_module("{module}", run_name="__main__", alter_sys=True)
finally:
    own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    with open(usage_file, "w") as f:
        f.write(f"{{own.ru_utime + own.ru_stime}} {{children.ru_utime + children.ru_stime}}")
"""
LOCUST = RUN_MODULE.format(module="locust")
REPLAY = RUN_MODULE.format(module="replay")


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


class TreeWatch:
    """A process and its descendants, read from /proc every `interval` seconds in a thread of
    this process: at each sample the tree's CPU seconds (every live member's own and its reaped
    children's, so a child that ended still counts) and the sum of the members' RSS (the
    memory of the processes alive at once, which one process's peak does not show), and per
    member its command line, its last CPU seconds and when it was last seen. `stop` ends it."""

    def __init__(self, pid: int, interval: float = 0.02):
        import threading

        self.pid, self.interval = pid, interval
        self.samples: list[tuple[float, float, int]] = []  # (time.time(), tree CPU s, tree RSS KiB)
        self.members: dict[int, dict] = {}  # pid -> {"cmd", "cpu_s", "first", "last", "rss_kib"}
        self.at_peak: list[tuple[str, int]] = []  # (command line, RSS KiB) of each member at the peak sample
        self._tick = os.sysconf("SC_CLK_TCK")
        self._page_kib = os.sysconf("SC_PAGE_SIZE") // 1024
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _stat(self, pid: int) -> tuple[int, float, float, int] | None:
        """(ppid, own CPU s, reaped children's CPU s, RSS KiB) of `pid`; None once it is gone."""
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            return None
        utime, stime, cutime, cstime = (int(v) / self._tick for v in fields[11:15])
        return int(fields[1]), utime + stime, cutime + cstime, int(fields[21]) * self._page_kib

    def _run(self) -> None:
        while not self._done.is_set():
            stats = {}
            for name in os.listdir("/proc"):
                if name.isdigit() and (st := self._stat(int(name))) is not None:
                    stats[int(name)] = st
            tree, frontier = {self.pid}, [self.pid]
            while frontier:
                parent = frontier.pop()
                for pid, st in stats.items():
                    if st[0] == parent and pid not in tree:
                        tree.add(pid)
                        frontier.append(pid)
            now = time.time()
            cpu = rss = 0
            for pid in tree:
                if pid not in stats:
                    continue
                _, own, reaped, kib = stats[pid]
                cpu += own + reaped
                rss += kib
                member = self.members.get(pid)
                root = self.members.get(self.pid, {}).get("cmd")
                if member is None or (pid != self.pid and member["cmd"] == root):
                    # a child seen between its spawn and its exec still shows the parent's command line
                    try:
                        cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
                    except OSError:
                        cmd = ""
                    first, peak = (now, 0) if member is None else (member["first"], member["rss_kib"])
                    member = self.members[pid] = {"cmd": cmd, "first": first, "rss_kib": peak}
                member.update(cpu_s=own, last=now, rss_kib=max(member["rss_kib"], kib))
            if self.pid in stats:
                if rss > self.peak_rss_kib():
                    self.at_peak = [(self.members[pid]["cmd"], stats[pid][3]) for pid in tree if pid in stats]
                self.samples.append((now, cpu, rss))
            self._done.wait(self.interval)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def cpu_at(self, when: float) -> float:
        """The tree's CPU seconds at the last sample before `when` (0 before the first)."""
        before = [cpu for t, cpu, _ in self.samples if t <= when]
        return before[-1] if before else 0.0

    def cpu_rate(self, start: float, end: float) -> float | None:
        """The tree's CPU seconds a second between `start` and `end` (None: no two samples there)."""
        inside = [(t, cpu) for t, cpu, _ in self.samples if start <= t <= end]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return None
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])

    def peak_rss_kib(self) -> int:
        return max((rss for _, _, rss in self.samples), default=0)

    def cpu_of(self, word: str) -> float:
        """The last CPU seconds seen of the members whose command line holds `word`."""
        return sum(m["cpu_s"] for m in self.members.values() if word in m["cmd"])

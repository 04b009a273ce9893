"""Distributed scaling: does the achieved rate grow with the workers, and what does it cost?

One real Locust master (`--master --headless --expect-workers W`) and W real worker processes
(`--worker`) replay a synthetic Poisson trace of R req/s per worker for D seconds, to completion
(no --run-time), against S `replay sim` processes (`--endpoints`, short TTFT and ITL, no
admission limit, so the servers are never the bottleneck). A separate row sends every worker to
one sim, as to a router in front of a fleet. From the merged JSONL it prints, per configuration
(median of --runs):

- rows, ok, and every non-ok row by error label and worker (a healthy run has none);
- the achieved send rate (sent rows / (last sent_at - first sent_at)) against the target and the
  trace's own rate, and the efficiency: achieved rate per worker relative to the smallest
  fleet configuration (normally W=1);
- dispatch drift p50/p99 overall and per worker, TTFT p50 (a saturated sim shows here first);
- CPU seconds and peak RSS of the master and of each worker, start-up included, from the
  kernel's own accounting of the reaped child (wait4: exact, nothing sampled, no /proc race at
  exit).

Placement: workers get cores of their own first (they are what is measured), keeping at least
one core for the master and the sims, which share the rest; with fewer cores than workers + 1
the workers share theirs. On 2 cores that is dispatch.py's split: load on one core, server on
the other. The placement is printed with each configuration.

    .venv/bin/python bench/scale.py [--workers 1,2] [--rate 100] [--duration 10] [--sims 2] [--runs 3]
    .venv/bin/python bench/scale.py --workers 1,2,4,8,14 --rate 250 --sims 4     # a 16-core host
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# Children (locust, replay sim) must import this checkout's `replay`, not whatever the venv's
# editable install points at.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)

from common import high_water_kib  # noqa: E402

from replay.results.records import read_records  # noqa: E402
from replay.results.summary import percentile  # noqa: E402
from replay.sim.process import SimProcess  # noqa: E402
from replay.synth.toy import build_toy_tokenizer  # noqa: E402

BLOCK = 16
LOCUST = [sys.executable, "-m", "locust", "-f", str(REPO / "locustfile.py")]
OUTPUT = "run.jsonl"  # relative: each process resolves it in its own folder (see one_run)
START_S = 120.0  # beyond the trace's length, for start-up, drain and the merge
QUIT_S = 20.0  # workers must exit this soon after the master


def write_trace(path: Path, rate: float, seconds: float, output_tokens: int, seed: int = 0) -> int:
    """round(rate * seconds) rows at uniformly random times in [0, seconds): a Poisson process
    conditioned on its count, so the row count is exact (2 workers x 250 req/s x 18 s is 9,000
    rows) and the trace's rate is the target's. Prompts of 2-6 blocks share a few prefixes."""
    rng = random.Random(seed)
    n = round(rate * seconds)
    times = sorted(rng.uniform(0, seconds) for _ in range(n))
    with open(path, "wb") as f:
        for i, t in enumerate(times):
            family = rng.randrange(8)
            hashes = [family * 100, family * 100 + 1] + [10_000 + i * 10 + k for k in range(rng.randint(0, 4))]
            row = {"timestamp": round(t * 1000, 3), "input_length": len(hashes) * BLOCK - rng.randrange(BLOCK),
                   "output_length": output_tokens, "hash_ids": hashes}
            f.write(orjson.dumps(row) + b"\n")
    return n


def place(workers: int, sims: int) -> tuple[int | None, list[int | None], list[int | None]]:
    """(master core, worker cores, sim cores): workers on cores of their own while there are
    enough, always leaving one or more for the master and the sims, which share the rest."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None, [None] * workers, [None] * sims
    load = cores[: min(workers, len(cores) - 1)]
    rest = cores[len(load):]
    return rest[0], [load[i % len(load)] for i in range(workers)], [rest[(1 + i) % len(rest)] for i in range(sims)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    """A child whose exit code, CPU seconds and peak RSS come from wait4 when it is reaped
    (`rss_mib`: the largest of it and its reaped children), and its own peak RSS from /proc
    while `reap` is asked (`own_rss_mib`: a peak in its last moments can be missed)."""

    name: str
    cwd: Path
    popen: subprocess.Popen | None = None
    rc: int | None = None
    cpu_s: float = float("nan")
    rss_mib: float = float("nan")
    own_rss_mib: float = 0.0

    def start(self, cmd: list[str], cpu: int | None) -> Proc:
        self.cwd.mkdir(parents=True, exist_ok=True)
        preexec = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
        with open(self.log, "w") as log:
            self.popen = subprocess.Popen(cmd, cwd=self.cwd, stdout=log, stderr=log, preexec_fn=preexec)
        return self

    @property
    def log(self) -> Path:
        return self.cwd / f"{self.name}.log"

    def reap(self) -> bool:
        """True once the child has exited (and its figures are in)."""
        if self.rc is not None:
            return True
        own_kib = high_water_kib(self.popen.pid)
        pid, status, usage = os.wait4(self.popen.pid, os.WNOHANG)
        if pid == 0:
            self.own_rss_mib = max(self.own_rss_mib, own_kib / 1024.0)
            return False
        self.rc = self.popen.returncode = os.waitstatus_to_exitcode(status)
        self.cpu_s = usage.ru_utime + usage.ru_stime
        self.rss_mib = usage.ru_maxrss / 1024.0  # KiB on Linux
        return True

    def kill(self) -> None:
        if self.rc is None:
            self.popen.send_signal(signal.SIGKILL)
            while not self.reap():
                time.sleep(0.01)

    def tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace").splitlines()
        return "\n".join("    | " + line for line in text[-lines:])


def wait_all(master: Proc, workers: list[Proc], deadline: float) -> list[str]:
    """Reap the master, then the workers (they quit when told by the master); returns problems."""
    problems = []
    while not master.reap():
        if time.monotonic() > deadline:
            problems.append(f"master still running after {START_S:.0f} s beyond the trace: killed")
            master.kill()
        time.sleep(0.05)
    quit_by = time.monotonic() + QUIT_S
    while not all(w.reap() for w in workers):
        if time.monotonic() > quit_by:
            for w in workers:
                if w.rc is None:
                    problems.append(f"{w.name} still running {QUIT_S:.0f} s after the master exited: killed")
                    w.kill()
        time.sleep(0.05)
    for p in (master, *workers):
        if p.rc != 0:
            problems.append(f"{p.name} exited with {p.rc}; last lines of {p.log}:\n{p.tail()}")
    return problems


def drift_stats(records: list[dict]) -> dict:
    sent = sorted(r["sent_at"] for r in records if r["sent_at"] is not None)
    drift = sorted(r["drift_ms"] for r in records if r["drift_ms"] is not None)
    span = sent[-1] - sent[0] if len(sent) > 1 else 0.0
    return {
        "rows": len(records),
        "ok": sum(1 for r in records if r["ok"]),
        "rate": len(sent) / span if span else float("nan"),
        "p50": percentile(drift, 50) if drift else float("nan"),
        "p99": percentile(drift, 99) if drift else float("nan"),
    }


def one_run(run_dir: Path, trace: Path, rows: int, tokenizer: Path, urls: list[str], workers: int,
            placement) -> dict:
    """One replay to completion; the figures of its merged JSONL and of its processes.

    Each process runs in a folder of its own and --output is relative, so each worker's own
    copy of its records (OUTPUT.worker-N.jsonl) lands in its folder: that is how a worker
    process (its CPU and RSS) is matched to its worker index in the records."""
    master_cpu, worker_cpus, _ = placement
    port = free_port()
    master = Proc("master", run_dir / "master").start(
        [*LOCUST, "--headless", "--master", "--expect-workers", str(workers), "--master-bind-host", "127.0.0.1",
         "--master-bind-port", str(port), "--host", urls[0], "--endpoints", ",".join(urls), "--trace", str(trace),
         "--block-size", str(BLOCK), "--tokenizer", str(tokenizer), "--model", "sim", "--output", OUTPUT,
         "--loglevel", "INFO", "--only-summary"], master_cpu)
    procs = [Proc(f"worker{k}", run_dir / f"worker{k}").start(
        [*LOCUST, "--worker", "--master-host", "127.0.0.1", "--master-port", str(port), "--loglevel", "INFO"], cpu)
        for k, cpu in enumerate(worker_cpus)]
    started = time.monotonic()
    problems = wait_all(master, procs, started + trace_seconds(trace) + START_S)
    wall_s = time.monotonic() - started

    merged = run_dir / "master" / OUTPUT
    records = list(read_records(merged)) if merged.exists() else []
    if not merged.exists():
        problems.append(f"no merged output {merged}")
    ids = collections.Counter(r["request_id"] for r in records)
    missing = rows - len(set(ids) & set(range(rows)))
    doubled = sum(c - 1 for c in ids.values() if c > 1)
    if missing or doubled:
        problems.append(f"merged file: {missing} trace rows without a record, {doubled} rows recorded twice")
    nonok = collections.Counter((r["error"] or f"status {r['status']}", r["worker"]) for r in records if not r["ok"])

    per_worker = {}
    by_worker = collections.defaultdict(list)
    for r in records:
        by_worker[r["worker"]].append(r)
    for proc in procs:
        own = sorted(proc.cwd.glob(f"{OUTPUT}.worker-*.jsonl"))
        if len(own) != 1:
            problems.append(f"{proc.name}: {len(own)} record files of its own (expected 1)")
            continue
        index = int(own[0].name.rsplit("-", 1)[1].split(".")[0])
        own_sent = sum(1 for r in read_records(own[0]) if r["sent_at"] is not None)
        merged_sent = sum(1 for r in by_worker[index] if r["sent_at"] is not None)
        if own_sent != merged_sent:
            problems.append(f"worker {index}: {own_sent} sent rows in its own file, {merged_sent} in the merged file")
        per_worker[index] = {**drift_stats(by_worker[index]), "cpu_s": proc.cpu_s, "rss_mib": proc.rss_mib}

    ttft = sorted(r["ttft_ms"] for r in records if r["ttft_ms"] is not None)
    return {
        **drift_stats(records),
        "ttft_p50": percentile(ttft, 50) if ttft else float("nan"),
        "worst_p99": max((w["p99"] for w in per_worker.values()), default=float("nan")),
        "master_cpu_s": master.cpu_s,
        "master_rss_mib": master.rss_mib,
        "worker_cpu_s": max((w["cpu_s"] for w in per_worker.values()), default=float("nan")),
        "worker_rss_mib": max((w["rss_mib"] for w in per_worker.values()), default=float("nan")),
        "wall_s": wall_s,
        "nonok": nonok,
        "problems": problems,
        "workers": per_worker,
    }


def trace_seconds(trace: Path) -> float:
    last = 0.0
    with open(trace, "rb") as f:
        for line in f:
            last = max(last, orjson.loads(line)["timestamp"])
    return last / 1000.0


def trace_rate(trace: Path) -> float:
    """The trace's own rate, by the same formula as the achieved rate."""
    stamps = [orjson.loads(line)["timestamp"] for line in open(trace, "rb")]
    return len(stamps) / ((max(stamps) - min(stamps)) / 1000.0)


def median(runs: list[dict], key: str) -> float:
    values = [r[key] for r in runs if r[key] == r[key]]  # NaN-free
    return statistics.median(values) if values else float("nan")


def cpus(label: str, cores: list[int | None]) -> str:
    return f"{label} " + (",".join("-" if c is None else str(c) for c in cores) if cores else "none")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2", help="worker counts, one fleet configuration each")
    parser.add_argument("--one-endpoint", default=None,
                        help="worker counts for rows where every worker sends to one sim (default: the largest "
                             "of --workers; 'none' for no such row)")
    parser.add_argument("--rate", type=float, default=100.0, help="target req/s per worker")
    parser.add_argument("--duration", type=float, default=10.0, help="trace seconds")
    parser.add_argument("--sims", type=int, default=2, help="replay sim processes in the fleet")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--ttft-ms", type=float, default=5.0)
    parser.add_argument("--itl-ms", type=float, default=1.0)
    args = parser.parse_args()

    counts = [int(w) for w in args.workers.split(",")]
    single = [] if args.one_endpoint in ("none", "") else (
        [max(counts)] if args.one_endpoint is None else [int(w) for w in args.one_endpoint.split(",")])
    configs = [(w, args.sims, False) for w in counts] + [(w, 1, True) for w in single]
    print(f"scale bench: {len(os.sched_getaffinity(0))} cores, {args.rate:g} req/s per worker, {args.duration:g} s "
          f"traces, {args.output_tokens} output tokens streamed, sim ttft {args.ttft_ms:g} ms itl {args.itl_ms:g} ms, "
          f"median of {args.runs} run(s)", flush=True)

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tokenizer = build_toy_tokenizer(tmp / "tok")
        for workers, sims, one in configs:
            placement = place(workers, sims)
            name = f"W={workers} {'1 endpoint' if one else f'{sims} sims'}"
            print(f"{name}: {cpus('master', [placement[0]])}; {cpus('workers', placement[1])}; "
                  f"{cpus('sims', placement[2])}", flush=True)
            trace = tmp / f"trace-{workers}.jsonl"
            rows = write_trace(trace, args.rate * workers, args.duration, args.output_tokens)
            sim_args = ["--block-size", str(BLOCK), "--ttft-ms", str(args.ttft_ms), "--itl-ms", str(args.itl_ms),
                        "--prefill-ms-per-1k", "0", "--max-num-seqs", "100000"]
            servers = [SimProcess(tokenizer, sim_args, cpu=cpu) for cpu in placement[2]]
            try:
                runs = []
                for i in range(args.runs):
                    run = one_run(tmp / f"{name.replace(' ', '_')}-{i}", trace, rows, tokenizer,
                                  [s.url for s in servers], workers, placement)
                    runs.append(run)
                    print(f"  run {i + 1}: {run['rows']} rows, {run['ok']} ok, {run['rate']:.1f} req/s, drift p99 "
                          f"{run['p99']:.2f} ms, master {run['master_cpu_s']:.1f} cpu s, {run['wall_s']:.1f} s wall",
                          flush=True)
                    for (label, worker), n in sorted(run["nonok"].items(), key=str):
                        print(f"    NON-OK: {n} rows {label!r} (worker {worker})", flush=True)
                    for problem in run["problems"]:
                        print(f"    PROBLEM: {problem}", flush=True)
            finally:
                for s in servers:
                    if s.stop() not in (0, -signal.SIGTERM):
                        print(f"  sim exited with {s.proc.returncode}: {s.errors()[-2000:]}", flush=True)
            results.append((workers, sims, one, rows, trace_rate(trace), runs))

    base = min((r for r in results if not r[2]), key=lambda r: r[0], default=None)
    base_rate = median(base[5], "rate") / base[0] if base else float("nan")
    print(f"\nefficiency: achieved req/s per worker relative to W={base[0] if base else '?'} "
          f"({base_rate:.1f} req/s); drift, TTFT in ms; CPU s and peak RSS include start-up; "
          f"worker columns: the largest worker; median of {args.runs} run(s)\n")
    print("| workers | endpoints | rows | ok | non-ok | target req/s | trace req/s | achieved req/s | efficiency "
          "| drift p50 | drift p99 | worst worker p99 | TTFT p50 | master CPU s | master RSS MiB | worker CPU s "
          "| worker RSS MiB |")
    print("|" + "---:|" * 17)
    for workers, sims, one, rows, trace_r, runs in results:
        nonok = sum(sum(r["nonok"].values()) for r in runs)
        rate = median(runs, "rate")
        print(f"| {workers} | {'1 (shared)' if one else sims} | {rows} | {median(runs, 'ok'):.0f} | {nonok} "
              f"| {args.rate * workers:.0f} | {trace_r:.1f} | {rate:.1f} | {rate / workers / base_rate:.1%} "
              f"| {median(runs, 'p50'):.2f} | {median(runs, 'p99'):.2f} | {median(runs, 'worst_p99'):.2f} "
              f"| {median(runs, 'ttft_p50'):.1f} | {median(runs, 'master_cpu_s'):.1f} "
              f"| {median(runs, 'master_rss_mib'):.0f} | {median(runs, 'worker_cpu_s'):.1f} "
              f"| {median(runs, 'worker_rss_mib'):.0f} |")

    print("\nper worker (median of runs):\n")
    print("| workers | endpoints | worker | rows | ok | achieved req/s | drift p50 | drift p99 | CPU s "
          "| peak RSS MiB |")
    print("|" + "---:|" * 10)
    for workers, sims, one, _rows, _trace_r, runs in results:
        for index in sorted({i for r in runs for i in r["workers"]}):
            per = [r["workers"][index] for r in runs if index in r["workers"]]
            print(f"| {workers} | {'1 (shared)' if one else sims} | {index} | {median(per, 'rows'):.0f} "
                  f"| {median(per, 'ok'):.0f} | {median(per, 'rate'):.1f} | {median(per, 'p50'):.2f} "
                  f"| {median(per, 'p99'):.2f} | {median(per, 'cpu_s'):.1f} | {median(per, 'rss_mib'):.0f} |")
    bad = sum(sum(r["nonok"].values()) + len(r["problems"]) for *_, runs in results for r in runs)
    if bad:
        print(f"\n{bad} non-ok rows or problems in all (listed above per run)")
        sys.exit(1)


if __name__ == "__main__":
    main()

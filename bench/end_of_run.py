"""The end of a big run with --server-block-size: the master's memory stays flat and the summary
carries the cache fidelity section. A 1,000,000-row Mooncake-format trace, one real master and
one real worker against `replay sim` (32-token server blocks over the trace's 16-token blocks),
at --scale with --run-time so it ends in minutes (the rows not sent by then are recorded as
"run stopped"; the section checks the sent ones, and the end still reads every record and every
trace row). Prints, per run and as the median of --runs: the master's peak RSS (wait4, start-up
included), the cache child's peak RSS and time (from the master's log), the time from the
run's end to the master's exit, and whether OUTPUT.summary.json has the cache section. The
master's peak is its own (VmHWM, read while it runs) and, from wait4, the largest of it and the
children it reaped (the cache child, which computes the section while the run replays).

Target (issue 21): master peak RSS <= 400 MB with the section present.

    .venv/bin/python bench/end_of_run.py [--rows 1000000] [--scale 5] [--run-time 60] [--runs 1]
    .venv/bin/python bench/end_of_run.py --repo /tmp/base   # the same run with another checkout's code
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import orjson
from big_trace import write_trace
from scale import BLOCK, OUTPUT, REPO, Proc, free_port, place, wait_all

from replay.sim.process import sim_process
from replay.synth.toy import build_toy_tokenizer

SERVER_BLOCK = 32
TRACE_RATE = 200.0  # req/s of the trace itself, before --scale
CHILD_LINE = re.compile(r"cache fidelity computed in a child process in ([\d.]+) s \(its peak RSS (\d+) MiB\)")
FOLLOWED_LINE = re.compile(r"cache fidelity computed while the run replayed, its last records in ([\d.]+) s")
END_LINE = "the run ends"


def one_run(run_dir: Path, repo: Path, trace: Path, tokenizer: Path, url: str, scale: float, run_time: int) -> dict:
    master_cpu, worker_cpus, _ = place(1, 1)
    locust = [sys.executable, "-m", "locust", "-f", str(repo / "locustfile.py")]
    port = free_port()
    master = Proc("master", run_dir / "master").start(
        [*locust, "--headless", "--master", "--expect-workers", "1", "--master-bind-host", "127.0.0.1",
         "--master-bind-port", str(port), "--host", url, "--trace", str(trace), "--block-size", str(BLOCK),
         "--tokenizer", str(tokenizer), "--model", "sim", "--output", OUTPUT, "--run-time", f"{run_time}s",
         "--scale", str(scale), "--server-block-size", str(SERVER_BLOCK), "--loglevel", "INFO", "--only-summary"],
        master_cpu)
    worker = Proc("worker0", run_dir / "worker0").start(
        [*locust, "--worker", "--master-host", "127.0.0.1", "--master-port", str(port), "--loglevel", "INFO"],
        worker_cpus[0])
    problems = wait_all(master, [worker], time.monotonic() + 900)
    ended = time.time()
    log = master.log.read_text(errors="replace")
    child = CHILD_LINE.search(log)
    followed = FOLLOWED_LINE.search(log)
    end_at = next((line for line in log.splitlines() if END_LINE in line), None)
    summary_path = run_dir / "master" / f"{OUTPUT}.summary.json"
    summary = orjson.loads(summary_path.read_bytes()) if summary_path.exists() else {}
    cache = summary.get("cache")
    if not cache:
        problems.append("no cache section in the summary: " + " | ".join(
            line for line in log.splitlines() if "cache fidelity" in line or "Error" in line)[-600:])
    if master.rc not in (0, 1):
        problems.append(f"master exit code {master.rc}:\n{master.tail()}")
    return {
        "master_rss_mib": master.own_rss_mib,
        "master_tree_rss_mib": master.rss_mib,
        "child_rss_mib": float(child.group(2)) if child else float("nan"),
        "child_s": float(child.group(1)) if child else float("nan"),
        "followed_s": float(followed.group(1)) if followed else float("nan"),
        "end_s": ended - _log_time(end_at) if end_at else float("nan"),
        "compared": cache["requests_compared"] if cache else 0,
        "matching": cache["requests_matching"] if cache else 0,
        "problems": problems,
    }


def _how(run: dict) -> str:
    """How the section was computed: while the run replayed (the end waited for its last
    records), or by a child at the end."""
    if not math.isnan(run["followed_s"]):
        return f"section computed while the run replayed (its last records {run['followed_s']:.1f} s)"
    return f"cache child at the end: peak RSS {run['child_rss_mib']:.0f} MiB in {run['child_s']:.1f} s"


def _log_time(line: str) -> float:
    """The time of a locust log line ('[2024-01-01 12:00:00,123] host/INFO/...')."""
    stamp = line[1:line.index("]")]
    return time.mktime(time.strptime(stamp[:19], "%Y-%m-%d %H:%M:%S")) + int(stamp[20:23]) / 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--scale", type=float, default=5.0, help="--scale of the run (the trace is 200 req/s)")
    parser.add_argument("--run-time", type=int, default=60)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose code runs (default: this one)")
    parser.add_argument("--keep", metavar="DIR", help="work in DIR and leave the logs and records there")
    args = parser.parse_args()
    repo = args.repo.resolve()
    os.environ["PYTHONPATH"] = str(repo)  # what the master, the worker and the sim import
    with tempfile.TemporaryDirectory(prefix="bench-end-") as tmp:
        tmp = Path(args.keep) if args.keep else Path(tmp)
        tokenizer = build_toy_tokenizer(tmp / "tok")
        trace = tmp / "trace.jsonl"
        if not trace.exists():
            write_trace(trace, args.rows, TRACE_RATE)
        print(f"trace: {args.rows:,} rows at {TRACE_RATE:g} req/s, {trace.stat().st_size / 2**20:.0f} MiB; master + 1 "
              f"worker, --scale {args.scale:g} --run-time {args.run_time}s --server-block-size {SERVER_BLOCK}; "
              f"code: {repo}")
        runs = []
        with sim_process(tokenizer, "--block-size", str(SERVER_BLOCK), "--ttft-ms", "5", "--itl-ms", "1",
                         "--prefill-ms-per-1k", "0", "--max-num-seqs", "100000", "--cache-blocks", "10000000") as sim:
            for k in range(args.runs):
                r = one_run(tmp / f"run{k}", repo, trace, tokenizer, sim.url, args.scale, args.run_time)
                runs.append(r)
                print(f"  run {k + 1}: master peak RSS {r['master_rss_mib']:.0f} MiB (with its children "
                      f"{r['master_tree_rss_mib']:.0f} MiB), {_how(r)}, run end to exit {r['end_s']:.0f} s, "
                      f"cache section: {r['matching']:,} of {r['compared']:,} requests matching")
                for problem in r["problems"]:
                    print(f"    PROBLEM: {problem}")

    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    print(f"median of {len(runs)}: master peak RSS {med('master_rss_mib'):.0f} MiB (target <= 400 MB; with its children "
          f"{med('master_tree_rss_mib'):.0f} MiB), run end to exit {med('end_s'):.0f} s")
    return 1 if any(r["problems"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())

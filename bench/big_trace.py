"""Memory flat in trace length: a 2,000,000-row Mooncake-format trace, one real master and two
real workers, stopped by --run-time. Prints (median of --runs) the peak RSS of the master and of
each worker (wait4, start-up included; the master's own from /proc while it runs, and with the
children it reaped, the cache child among them), how long after the master started the first request
went out, and checks the merged file: one record per row, every row accounted for.

Targets (issue 11): master <= 400 MB, each worker <= 300 MB, first send within 15 s, every row
recorded.

    .venv/bin/python bench/big_trace.py [--rows 2000000] [--rate 200] [--run-time 20] [--runs 3]
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import orjson
from scale import BLOCK, LOCUST, OUTPUT, Proc, free_port, place, wait_all

from replay.sim.process import sim_process
from replay.synth.toy import build_toy_tokenizer


def write_trace(path: Path, rows: int, rate: float, seed: int = 0) -> None:
    """`rows` rows at `rate` req/s (evenly spaced), prompts of 2-6 blocks sharing a few prefixes."""
    rng = random.Random(seed)
    with open(path, "wb") as f:
        lines = []
        for i in range(rows):
            family = rng.randrange(8)
            hashes = [family * 100, family * 100 + 1] + [10_000 + i * 10 + k for k in range(rng.randint(0, 4))]
            lines.append(orjson.dumps({"timestamp": round(i * 1000 / rate, 3),
                                       "input_length": len(hashes) * BLOCK - rng.randrange(BLOCK),
                                       "output_length": 4, "hash_ids": hashes}))
            if len(lines) == 10_000:
                f.write(b"\n".join(lines) + b"\n")
                lines = []
        if lines:
            f.write(b"\n".join(lines) + b"\n")


def check_records(path: Path, rows: int) -> tuple[list[str], collections.Counter, float | None]:
    """(problems, records by label, first sent_at) of the merged file, read as a stream."""
    seen = bytearray(rows)
    labels: collections.Counter = collections.Counter()
    first_sent = None
    count = 0
    with open(path, "rb") as f:
        for line in f:
            r = orjson.loads(line)
            count += 1
            seen[r["request_id"]] += 1
            labels["ok" if r["ok"] else r["error"]] += 1
            if r["sent_at"] is not None and (first_sent is None or r["sent_at"] < first_sent):
                first_sent = r["sent_at"]
    problems = []
    missing, doubled = seen.count(0), sum(1 for c in seen if c > 1)
    if count != rows or missing or doubled:
        problems.append(f"{count} records for {rows} rows: {missing} rows without one, {doubled} with several")
    return problems, labels, first_sent


def one_run(run_dir: Path, trace: Path, rows: int, tokenizer: Path, url: str, run_time: int) -> dict:
    master_cpu, worker_cpus, _ = place(2, 1)
    port = free_port()
    started = time.time()
    master = Proc("master", run_dir / "master").start(
        [*LOCUST, "--headless", "--master", "--expect-workers", "2", "--master-bind-host", "127.0.0.1",
         "--master-bind-port", str(port), "--host", url, "--trace", str(trace), "--block-size", str(BLOCK),
         "--tokenizer", str(tokenizer), "--model", "sim", "--output", OUTPUT, "--run-time", f"{run_time}s",
         "--loglevel", "INFO", "--only-summary"], master_cpu)
    workers = [Proc(f"worker{k}", run_dir / f"worker{k}").start(
        [*LOCUST, "--worker", "--master-host", "127.0.0.1", "--master-port", str(port), "--loglevel", "INFO"], cpu)
        for k, cpu in enumerate(worker_cpus)]
    problems = wait_all(master, workers, time.monotonic() + 600)
    wall_s = time.time() - started
    merged = run_dir / "master" / OUTPUT
    labels: collections.Counter = collections.Counter()
    first_sent = None
    if merged.exists():
        found, labels, first_sent = check_records(merged, rows)
        problems += found
    else:
        problems.append(f"no merged output {merged}")
    return {
        "master_rss_mib": master.own_rss_mib,
        "master_tree_rss_mib": master.rss_mib,
        "worker_rss_mib": max(w.rss_mib for w in workers),
        "first_send_s": (first_sent - started) if first_sent else float("nan"),
        "wall_s": wall_s,
        "labels": labels,
        "problems": problems,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--rate", type=float, default=200.0, help="trace rate, req/s")
    parser.add_argument("--run-time", type=int, default=20)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--keep", metavar="DIR", help="work in DIR and leave the logs and records there")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-big-") as tmp:
        tmp = Path(args.keep) if args.keep else Path(tmp)
        tokenizer = build_toy_tokenizer(tmp / "tok")
        trace = tmp / "trace.jsonl"
        started = time.perf_counter()
        write_trace(trace, args.rows, args.rate)
        print(f"trace: {args.rows:,} rows at {args.rate:g} req/s, {trace.stat().st_size / 2**20:.0f} MiB "
              f"(written in {time.perf_counter() - started:.0f} s); master + 2 workers, --run-time {args.run_time}s")
        runs = []
        with sim_process(tokenizer, "--block-size", str(BLOCK), "--ttft-ms", "20", "--itl-ms", "2",
                         "--prefill-ms-per-1k", "0", "--max-num-seqs", "100000") as sim:
            for k in range(args.runs):
                result = one_run(tmp / f"run{k}", trace, args.rows, tokenizer, sim.url, args.run_time)
                runs.append(result)
                print(f"  run {k + 1}: master {result['master_rss_mib']:.0f} MiB (with its children "
                      f"{result['master_tree_rss_mib']:.0f} MiB), worker {result['worker_rss_mib']:.0f}"
                      f" MiB, first send {result['first_send_s']:.1f} s, wall {result['wall_s']:.0f} s, "
                      f"records {dict(result['labels'])}")
                for problem in result["problems"]:
                    print(f"    PROBLEM: {problem}")

    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    print(f"median of {len(runs)}: master peak RSS {med('master_rss_mib'):.0f} MiB (target <= 400 MB), "
          f"worker peak RSS {med('worker_rss_mib'):.0f} MiB (<= 300 MB), first send {med('first_send_s'):.1f} s "
          f"(<= 15 s), wall {med('wall_s'):.0f} s")
    return 1 if any(r["problems"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())

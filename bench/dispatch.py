"""Dispatch accuracy of one worker process: achieved rate and drift at 100..1000 req/s.

Replays synthetic mooncake traces (streaming, ~100 output tokens per request) with
`locust --headless` pinned to one core against `replay sim` pinned to the other, and prints
the median over several runs of: achieved send rate, drift p50 / p99 / max (ms), TTFT p50,
the p99 lateness of the same timer in an idle process on that core just before the run
(the shared machine's own scheduling noise, which no dispatcher can beat), and the locust
process's CPU ms per request over the whole run (start-up and body building included; unlike
drift, it hardly depends on how busy the machine is) and how long in all it waited for its core
while runnable (other processes on that core: each such wait shows up as drift).
That CPU is then split in two: `own`, the locust process itself, and `children`, the child
processes it started and waited for (the end-of-run cache child, replay/results/cache_child.py;
with a cold set-up cache the set-up child too), from its own getrusage at its exit; own +
children = cpu/req. A fixed cost per run weighs more per request at the lower rates.
Target: drift p99 <= 2 ms up to 500 req/s per worker process.

With --against TREE (another checkout, e.g. `git worktree add /tmp/base COMMIT`), TREE's
locustfile and replay (on PYTHONPATH) replay the same traces against the same sim, run for run
alternately with this checkout's, and each rate prints a row for each tree and the ratio of
their own CPU: two sets of runs minutes apart differ by more than the fixed costs being compared.

    .venv/bin/python bench/dispatch.py [--rates 100,200,500,1000] [--seconds 5] [--runs 3] [--against TREE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common import LOCUST, compile_bytecode, locust_cpu, split_cores, tree_env, tree_label  # noqa: E402

from replay.results.records import read_records  # noqa: E402
from replay.results.summary import percentile  # noqa: E402
from replay.sim.process import sim_process  # noqa: E402
from replay.synth.toy import build_toy_tokenizer  # noqa: E402

BLOCK = 16


def write_trace(path: Path, rate: float, seconds: float, output_tokens: int, seed: int = 0) -> int:
    """Poisson arrivals at `rate`; prompts of 2-6 blocks sharing a few common prefixes."""
    rng = random.Random(seed)
    t, rows = 0.0, 0
    with open(path, "w") as f:
        while t < seconds:
            family = rng.randrange(8)
            prefix = [family * 100 + k for k in range(2)]
            hashes = prefix + [10_000 + rows * 10 + k for k in range(rng.randint(0, 4))]
            row = {"timestamp": round(t * 1000, 3), "input_length": len(hashes) * BLOCK - rng.randrange(BLOCK),
                   "output_length": output_tokens, "hash_ids": hashes}
            f.write(json.dumps(row) + "\n")
            rows += 1
            t += rng.expovariate(rate)
    return rows


NOISE_PROBE = """
import sys, time
sys.path.insert(0, sys.argv[1])
from replay.engine.timing import wait_until
late, t = [], time.time() + 0.05
for _ in range(400):
    t += 0.005
    wait_until(t)
    late.append((time.time() - t) * 1000)
late.sort()
print(late[int(len(late) * 0.99)])
"""


def timer_noise(cpu: int | None) -> float:
    """p99 lateness (ms) of the dispatcher's timer in an idle process on the client's core:
    what the machine itself (other processes on that core) adds to any drift figure."""
    preexec = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
    out = subprocess.run([sys.executable, "-c", NOISE_PROBE, str(REPO)], capture_output=True, text=True,
                         preexec_fn=preexec, check=True)
    return float(out.stdout)


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def runqueue_wait_ms(proc: subprocess.Popen, every: float = 0.05) -> float:
    """Wait for `proc`; return how long (ms) its main thread sat runnable but off the CPU
    (/proc/PID/schedstat, sampled until it exits). Other processes on the client's core cause
    this, and every such wait lands in drift, whatever the dispatcher does."""
    waited, give_up = 0, time.monotonic() + 600
    while proc.poll() is None:
        if time.monotonic() > give_up:
            proc.kill()
        try:
            with open(f"/proc/{proc.pid}/schedstat") as f:
                waited = int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            pass
        try:
            proc.wait(every)
        except subprocess.TimeoutExpired:
            pass
    return waited / 1e6


def one_run(tokenizer: Path, url: str, trace: Path, out: Path, cpu: int | None, tree: Path = REPO,
            extra: tuple[str, ...] = ()) -> dict:
    """One replay of `trace` by `tree`'s locustfile and replay package; `extra`: more of its options."""
    usage = out.with_name(out.name + ".cpu")
    cmd = [sys.executable, "-c", LOCUST, str(usage), "-f", str(tree / "locustfile.py"), "--headless", "--host", url,
           "--trace", str(trace), "--block-size", str(BLOCK), "--tokenizer", str(tokenizer), "--model", "sim",
           "--output", str(out), "--loglevel", "WARNING", "--only-summary", *extra]
    noise = timer_noise(cpu)
    preexec = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
    cpu_before = children_cpu()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, text=True, preexec_fn=preexec, env=tree_env(tree), cwd=tree)
        waited_ms = runqueue_wait_ms(proc)
        log.seek(0)
        if proc.returncode != 0:
            raise RuntimeError(f"locust ({tree}) failed ({proc.returncode}): {log.read()[-2000:]}")
    cpu_s = children_cpu() - cpu_before
    own_s, children_s = locust_cpu(usage)
    records = list(read_records(out))
    sent = sorted(r["sent_at"] for r in records if r["sent_at"] is not None)
    drift = sorted(r["drift_ms"] for r in records if r["drift_ms"] is not None)
    ttft = sorted(r["ttft_ms"] for r in records if r["ttft_ms"] is not None)
    span = sent[-1] - sent[0] if len(sent) > 1 else 0.0
    return {
        "noise_p99": noise,
        "rate": (len(sent) - 1) / span if span else 0.0,
        "ok": sum(1 for r in records if r["ok"]) / len(records),
        "p50": percentile(drift, 50),
        "p99": percentile(drift, 99),
        "max": drift[-1],
        "ttft_p50": percentile(ttft, 50) if ttft else float("nan"),
        "cpu_ms": cpu_s * 1000.0 / len(records),
        "runqueue_ms": waited_ms,
        "own_cpu_ms": own_s * 1000.0 / len(records),
        "children_cpu_ms": children_s * 1000.0 / len(records),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="100,200,500,1000")
    parser.add_argument("--seconds", type=float, default=5.0, help="trace length per run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--output-tokens", type=int, default=100)
    parser.add_argument("--itl-ms", type=float, default=5.0)
    parser.add_argument("--no-follow", action="store_true",
                        help="no cache follower beside the replay ($TRACEREPLAY_CACHE_FOLLOW=0): the end computes it")
    parser.add_argument("--against", type=Path, metavar="TREE",
                        help="another checkout to run alternately with this one, on the same traces and sim")
    args = parser.parse_args()
    trees = [REPO] if args.against is None else [REPO, args.against.resolve()]
    if args.no_follow:
        os.environ["TRACEREPLAY_CACHE_FOLLOW"] = "0"  # the replay's children inherit it

    client_cpu, sim_cpu = split_cores()
    for tree in trees:
        compile_bytecode(tree)
    print(f"dispatch bench: {args.seconds:g} s traces, {args.output_tokens} output tokens streamed, "
          f"itl {args.itl_ms:g} ms, median of {args.runs} runs; locust on cpu {client_cpu}, sim on cpu {sim_cpu}")
    print(f"{'target/s':>9} {'achieved/s':>10} {'ok':>6} {'drift p50':>10} {'p99':>8} {'max':>8} {'ttft p50':>9} "
          f"{'idle timer p99':>15} {'cpu/req':>8} {'runq wait':>9} {'own':>7} {'children':>8}  (ms)  loadavg")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tokenizer = build_toy_tokenizer(tmp / "tok")
        with sim_process(tokenizer, "--block-size", str(BLOCK), "--ttft-ms", "20", "--itl-ms", str(args.itl_ms),
                         "--prefill-ms-per-1k", "0", "--max-num-seqs", "100000", cpu=sim_cpu) as sim:
            rates = [float(r) for r in args.rates.split(",")]
            for rate in rates:
                trace = tmp / f"trace-{rate:g}.jsonl"
                write_trace(trace, rate, args.seconds, args.output_tokens)
                if rate == rates[0]:  # each tree's set-up cache filled before any run is timed
                    for t, tree in enumerate(trees):
                        one_run(tokenizer, sim.url, trace, tmp / f"warm-up-{t}.jsonl", client_cpu, tree)
                runs: dict[Path, list[dict]] = {tree: [] for tree in trees}
                for i in range(args.runs):
                    for t, tree in enumerate(trees):
                        runs[tree].append(one_run(tokenizer, sim.url, trace, tmp / f"out-{rate:g}-{i}-{t}.jsonl",
                                                  client_cpu, tree))
                own = {}
                for tree in trees:
                    med = {k: statistics.median(r[k] for r in runs[tree]) for k in runs[tree][0]}
                    own[tree] = med["own_cpu_ms"]
                    name = "" if len(trees) == 1 else f"  {tree_label(tree)}"
                    print(f"{rate:9.0f} {med['rate']:10.1f} {med['ok']:6.1%} {med['p50']:10.3f} {med['p99']:8.3f} "
                          f"{med['max']:8.3f} {med['ttft_p50']:9.1f} {med['noise_p99']:15.3f} {med['cpu_ms']:8.3f} "
                          f"{med['runqueue_ms']:9.0f} {med['own_cpu_ms']:7.3f} {med['children_cpu_ms']:8.3f}  "
                          f"{open('/proc/loadavg').read().split()[0]}{name}", flush=True)
                if len(trees) == 2:
                    print(f"{rate:9.0f} own cpu/req, this checkout / {trees[1]}: {own[REPO] / own[trees[1]]:.3f}",
                          flush=True)


if __name__ == "__main__":
    main()

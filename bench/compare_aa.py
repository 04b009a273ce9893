"""`replay compare` against noise and against a known regression, on real runs of `replay sim`.

A/A: --pairs pairs of runs of the same --rows-row trace, each run against a fresh
`replay sim --jitter 0.3` with a seed of its own (a server's noise does not repeat): the share
of (pair, tested metric) verdicts that are not "no detectable difference" is the false alarm
rate, which a 95% interval should hold near or under 5%. A/B: the first run of each pair
against a run on a sim whose --stall-ms adds --regression (10%) to BASE's TTFT p50: the share
of repetitions whose TTFT p50 verdict is "worse" is the power at this run size.

Every sim has a GPU server's latencies (SERVER_LATENCIES, --sim-args to change them).
The trace's prompts are of very different lengths (512 to 4096 tokens, no shared prefixes), so
rows differ as production rows do and the pairing has something to cancel.

    .venv/bin/python bench/compare_aa.py [--pairs 20] [--rows 250] [--scale 100] [--sim-args '...']
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from replay.results.compare import NOT_TESTED, SAME, compare, load_run
from replay.sim.process import sim_process
from replay.synth.toy import build_toy_tokenizer

BLOCK = 16
# TTFT some 230-400 ms and 20 ms between tokens, as a GPU server's: against the sim's own 20 ms
# TTFT, the client machine's scheduling (a few ms, shifting whole runs when other work comes and
# goes) weighs as much as the server's noise, which is not what comparing two servers meets.
SERVER_LATENCIES = "--ttft-ms 200 --prefill-ms-per-1k 50 --itl-ms 20"


def write_trace(path: Path, rows: int, gap_ms: float, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(rows):
            blocks = rng.randint(512, 4096) // BLOCK
            f.write(json.dumps({"timestamp": round(i * gap_ms, 3), "input_length": blocks * BLOCK,
                                "output_length": rng.randint(4, 12),
                                "hash_ids": [100_000 * (i + 1) + k for k in range(blocks)]}) + "\n")
    return path


def replay(tokenizer: Path, trace: Path, output: Path, scale: float, sim_seed: int, *sim_args: str) -> Path:
    with sim_process(tokenizer, "--block-size", str(BLOCK), "--jitter", "0.3", "--seed", str(sim_seed),
                     *sim_args) as sim:
        proc = subprocess.run([sys.executable, "-m", "replay", "run", "--headless", "--host", sim.url, "--trace",
                               str(trace), "--block-size", str(BLOCK), "--tokenizer", str(tokenizer), "--model", "sim",
                               "--output", str(output), "--scale", str(scale), "--only-summary", "--loglevel",
                               "WARNING"], capture_output=True, text=True, timeout=600)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"replay run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--rows", type=int, default=250)
    parser.add_argument("--scale", type=float, default=100.0)
    parser.add_argument("--gap-ms", type=float, default=1000.0, help="the trace's gap between rows, before --scale")
    parser.add_argument("--regression", type=float, default=0.10, help="the A/B's added share of BASE's TTFT p50")
    parser.add_argument("--resamples", type=int, default=1000)
    parser.add_argument("--sim-args", default=SERVER_LATENCIES,
                        help="more `replay sim` options for every run (default: %(default)s, a real server's "
                             "latencies; '' for the sim's own 20 ms TTFT and 10 ms ITL)")
    args = parser.parse_args()
    started = time.monotonic()
    sim_args = shlex.split(args.sim_args)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        tokenizer = build_toy_tokenizer(d / "tok")
        trace = write_trace(d / "trace.jsonl", args.rows, args.gap_ms)
        verdicts: Counter[str] = Counter()
        loud: Counter[str] = Counter()
        firsts = []
        for i in range(args.pairs):
            a = replay(tokenizer, trace, d / f"aa-{i}-a.jsonl", args.scale, 2 * i + 1, *sim_args)
            b = replay(tokenizer, trace, d / f"aa-{i}-b.jsonl", args.scale, 2 * i + 2, *sim_args)
            firsts.append(load_run(str(a)))
            result = compare([firsts[-1]], [load_run(str(b))], resamples=args.resamples, seed=i)
            for e in result["metrics"]:
                if e["verdict"] != NOT_TESTED:
                    verdicts[e["verdict"]] += 1
                    if e["verdict"] != SAME:
                        loud[e["metric"]] += 1
            print(f"A/A pair {i + 1}: " + (", ".join(f"{e['metric']} {e['verdict']}" for e in result["metrics"]
                                                     if e["verdict"] not in (SAME, NOT_TESTED)) or "all same"),
                  flush=True)  # fmt: skip
        tested = sum(verdicts.values())
        share = (tested - verdicts[SAME]) / tested
        p50s = [next(e["base"] for e in compare([r], [r], resamples=100)["metrics"] if e["metric"] == "ttft_p50")
                for r in firsts[:3]]  # fmt: skip
        stall = args.regression * sum(p50s) / len(p50s)
        worse, changes = 0, []
        for i in range(args.pairs):
            n = replay(tokenizer, trace, d / f"ab-{i}.jsonl", args.scale, 1000 + i, *sim_args, "--stall-ms",
                       f"{stall:.3f}")
            result = compare([firsts[i]], [load_run(str(n))], resamples=args.resamples, seed=i)
            e = next(e for e in result["metrics"] if e["metric"] == "ttft_p50")
            worse += e["verdict"] == "worse"
            changes.append(e["relative_change"])
            print(f"A/B rep {i + 1}: ttft_p50 {100 * e['relative_change']:+.1f}% "
                  f"[{100 * e['relative_ci'][0]:+.1f}%, {100 * e['relative_ci'][1]:+.1f}%] {e['verdict']}", flush=True)
    print(f"\nA/A: {args.pairs} pairs x {args.rows} rows, {tested} tested (pair, metric) verdicts: "
          f"{tested - verdicts[SAME]} not 'no detectable difference' = {100 * share:.1f}% (target <= 5%); "
          f"by metric: {dict(loud.most_common())}")
    print(f"A/B: --stall-ms {stall:.2f} (+{100 * args.regression:.0f}% of BASE TTFT p50 {sum(p50s) / len(p50s):.2f} ms): "
          f"TTFT p50 'worse' in {worse} of {args.pairs} = {100 * worse / args.pairs:.0f}% (target >= 95%); "
          f"measured change median {100 * sorted(changes)[len(changes) // 2]:+.1f}%")
    print(f"wall time {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()

"""The capacity search (docs/capacity.md) against a fleet of `replay sim`s of known capacity,
beside a fine grid of separate runs.

The fleet: --sims sims, each serving --max-num-seqs requests at once, each request for TTFT +
(output - 1) x ITL and nothing else in its time, so the fleet's full rate is sims x seqs /
that many requests a second; the trace's --rows rows come --gap-ms apart, so the load factor
of the fleet's full rate is printed as its bound (arrivals bunch once amplified, so the capacity
under a TTFT SLO lies below it). The search is one `replay run --capacity-search` (--search-by
amplify, the default); the grid is separate runs of `replay trace amplify`'s output (the rows a
probe at that factor sends) at factors --grid-step apart from --grid-from up, until one fails:
its answer is the last that passed.

Prints the search's probes, its probes' time and the run's wall time, its answer, and the
grid's answer and time.

    .venv/bin/python bench/capacity.py [--sims 2] [--rows 200] [--grid-step 0.05]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from replay.rules.run_files import capacity_path, summary_path
from replay.sim.process import sim_process
from replay.synth.toy import build_toy_tokenizer
from replay.trace.amplify import amplify_trace
from replay.trace.reader import TraceStream

BLOCK = 16


def write_trace(path: Path, rows: int, gap_ms: float, output: int) -> Path:
    """Rows --gap-ms apart, each a session of its own with two shared prefixes (a system prompt)."""
    with open(path, "w") as f:
        for i in range(rows):
            ids = ([0, 1, 2] if i % 2 == 0 else [7, 8]) + [1000 + 10 * i]
            f.write(json.dumps({"timestamp": round(i * gap_ms, 3), "input_length": len(ids) * BLOCK,
                                "output_length": output, "hash_ids": ids}) + "\n")
    return path


def replay(tokenizer: Path, trace: Path, output: Path, urls: list[str], *extra: str) -> float:
    """A headless run; its wall time."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "replay", "run", "--headless", "--host", urls[0], "--endpoints",
                    ",".join(urls), "--trace", str(trace), "--block-size", str(BLOCK), "--tokenizer", str(tokenizer),
                    "--model", "sim", "--output", str(output), "--verify-server", "off", "--only-summary",
                    "--loglevel", "WARNING", *extra], capture_output=True, text=True, timeout=3600)  # fmt: skip
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sims", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--ttft-ms", type=float, default=20.0)
    parser.add_argument("--itl-ms", type=float, default=10.0)
    parser.add_argument("--output-tokens", type=int, default=10)
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--gap-ms", type=float, default=50.0)
    parser.add_argument("--slo", default="ttft_ms=60")
    parser.add_argument("--goodput-target", type=float, default=0.9)
    parser.add_argument("--precision", type=float, default=0.05)
    parser.add_argument("--grid-from", type=float, default=2.0)
    parser.add_argument("--grid-step", type=float, default=0.05)
    args = parser.parse_args()
    request_s = (args.ttft_ms + (args.output_tokens - 1) * args.itl_ms) / 1000
    full_rate = args.sims * args.max_num_seqs / request_s
    seconds = args.rows * args.gap_ms / 1000
    print(f"fleet: {args.sims} sims x {args.max_num_seqs} seqs, {request_s * 1000:g} ms a request: "
          f"{full_rate:.1f} requests/s; trace {1000 / args.gap_ms:g} requests/s for {seconds:g} s: "
          f"full rate at {full_rate * args.gap_ms / 1000:.2f}x; SLO {args.slo}, goodput >= {args.goodput_target:g}")
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        d = Path(tmp)
        tokenizer = build_toy_tokenizer(d / "tok")
        sims = [stack.enter_context(sim_process(tokenizer, "--block-size", str(BLOCK), "--ttft-ms", str(args.ttft_ms),
                                                "--itl-ms", str(args.itl_ms), "--prefill-ms-per-1k", "0",
                                                "--max-num-seqs", str(args.max_num_seqs)))
                for _ in range(args.sims)]
        urls = [sim.url for sim in sims]
        trace = write_trace(d / "trace.jsonl", args.rows + 1, args.gap_ms, args.output_tokens)
        window = write_trace(d / "window.jsonl", args.rows, args.gap_ms, args.output_tokens)
        common = ("--slo", args.slo)
        out = d / "search.jsonl"
        wall = replay(tokenizer, trace, out, urls, *common, "--capacity-search", "--goodput-target",
                      str(args.goodput_target), "--search-precision", str(args.precision), "--probe-duration",
                      str(seconds), "--cooldown", "0.5")
        report = json.loads(capacity_path(out).read_text())
        print("\nsearch (one run, --search-by amplify):")
        print("| probe | factor | rows | goodput | verdict | TTFT p99 ms | drift p99 ms |\n|---|---|---|---|---|---|---|")
        for p in report["probes"]:
            print(f"| {p['probe']} | {p['factor']:.3f} | {p['rows']} | {p['goodput']:.3f} | {p['verdict']} | "
                  f"{_f(p['ttft_ms']['p99'])} | {_f(p['drift_p99_ms'])} |")
        print(f"probes: {len(report['probes'])}; probes' time {report['seconds']:.1f} s; run {wall:.1f} s; "
              f"result {report['result']}; capacity {report['capacity']}; bracket {report['bracket']}")

        print(f"\ngrid (separate runs of `replay trace amplify` output, {args.grid_step:.0%} apart):")
        print("| factor | rows | goodput | run s |\n|---|---|---|---|")
        grid_started, k, grid_answer, runs = time.monotonic(), args.grid_from, None, 0
        while True:
            amplified = d / f"x{k:.4f}.jsonl"
            done = amplify_trace(lambda: TraceStream(window, None, BLOCK), amplified, k)
            run_out = d / f"run-x{k:.4f}.jsonl"
            run_s = replay(tokenizer, amplified, run_out, urls, *common)
            runs += 1
            goodput = json.loads(summary_path(run_out).read_text())["requests_good"] / done.rows_out
            print(f"| {k:.3f} | {done.rows_out} | {goodput:.3f} | {run_s:.1f} |")
            if goodput < args.goodput_target:
                break
            grid_answer, k = k, k * (1 + args.grid_step)
        grid_s = time.monotonic() - grid_started
        print(f"grid: {runs} runs in {grid_s:.1f} s; answer {_f(grid_answer)} (first fail {k:.3f})")
        if grid_answer and report["capacity"]:
            print(f"search vs grid: {report['capacity'] / grid_answer - 1:+.1%}")


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}" if value < 100 else f"{value:.0f}"


if __name__ == "__main__":
    main()

"""The first second of a run is as punctual as the rest: the drift of the first rows a chat
replay sends, beside the drift of all of them.

A replay's start has its own work (the server check's aftermath, the set-up, the first body
builds, the first collection, the first record flush), and a row due in the first second
can be held back by it while the rest of the run is punctual: the whole run's p99 hides it.
This replays the first rows of a real Mooncake trace (../shared/traces), Qwen2's tokenizer,
openai-chat, against `replay sim`, several times on a warm set-up cache, and prints, per run,
the drift of each of the first rows sent and the whole run's p50/p99.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import split_cores  # noqa: E402
from replay.results.records import read_records  # noqa: E402
from replay.sim.process import sim_process  # noqa: E402

SHARED = Path(os.environ.get("TRACEREPLAY_SHARED", REPO.parent / "shared"))
CACHE_ENV = "TRACEREPLAY_CACHE_DIR"
MAX_INPUT = 32000  # with its answer, within the sim's default max_model_len


def replay(tokenizer: Path, url: str, model: str, trace: Path, out: Path, cache: Path, cpu: int | None,
           extra: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "locust", "-f", str(REPO / "locustfile.py"), "--headless", "--host", url,
           "--trace", str(trace), "--tokenizer", str(tokenizer), "--model", model, "--api", "openai-chat",
           "--output", str(out), "--overwrite", "--loglevel", "WARNING", "--only-summary", *extra]
    preexec = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
    proc = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=preexec,
                          env={**os.environ, CACHE_ENV: str(cache)})
    if not out.exists():
        raise SystemExit(f"locust exit {proc.returncode}, no records: {proc.stderr[-2000:]}")
    if proc.returncode != 0:  # a slow server's answers may time out: the sends are still measured
        print(f"  (locust exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1][:200]})")
    return list(read_records(out))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=250)
    parser.add_argument("--first", type=int, default=10, help="the first rows sent, shown one by one")
    parser.add_argument("--runs", type=int, default=5, help="warm runs (after one that fills the set-up cache)")
    parser.add_argument("--tokenizer", default="qwen2")
    parser.add_argument("--replay-args", default="", help="more locust flags")
    parser.add_argument("--sim-args", default="--ttft-ms 20 --itl-ms 2 --prefill-ms-per-1k 0",
                        help="the sim's timing (e.g. '--ttft-ms 500 --prefill-ms-per-1k 100 --itl-ms 30', "
                             "a slow server as vLLM on CPU is)")
    parser.add_argument("--url", help="replay against this running server instead of a sim of our own (e.g. "
                        "vLLM serving the same tokenizer)")
    parser.add_argument("--model", default="sim", help="with --url: the served model's name")
    args = parser.parse_args()
    tokenizer = SHARED / "tokenizers" / args.tokenizer
    source = SHARED / "traces" / "mooncake_synthetic_trace.jsonl"
    if not tokenizer.exists() or not source.exists():
        print(f"first_rows skipped: {tokenizer} or {source} is absent")
        return 0
    client, server = split_cores()
    worst_first, p99_all = [], []
    with tempfile.TemporaryDirectory(prefix="bench-first-rows-") as tmp:
        tmp = Path(tmp)
        trace = tmp / "trace.jsonl"
        with open(source) as f, open(trace, "w") as out:  # rows the sim's 32768-token context holds
            out.writelines(itertools.islice((line for line in f if json.loads(line)["input_length"] <= MAX_INPUT),
                                            args.rows))
        server_args = (*args.sim_args.split(), "--max-num-seqs", "100000")
        with (contextlib.nullcontext(argparse.Namespace(url=args.url)) if args.url
              else sim_process(tokenizer, *server_args, cpu=server)) as sim:
            print(f"first_rows: {args.rows} mooncake rows, {args.tokenizer}, openai-chat, locust on cpu {client}, "
                  f"{'server ' + args.url if args.url else f'sim on cpu {server}'}; one run to fill the set-up "
                  f"cache, then {args.runs} measured")
            for k in range(args.runs + 1):
                records = replay(tokenizer, sim.url, args.model, trace, tmp / "run.jsonl", tmp / "cache", client,
                                 args.replay_args.split())
                sent = sorted((r for r in records if r["sent_at"] is not None), key=lambda r: r["scheduled_at"])
                drifts = sorted(r["drift_ms"] for r in sent)
                first = sent[: args.first]
                epoch = min(r["scheduled_at"] for r in sent)
                shown = " ".join(f"{(r['scheduled_at'] - epoch) * 1000:.0f}:{r['drift_ms']:.1f}" for r in first)
                p99 = drifts[min(len(drifts) - 1, int(0.99 * len(drifts)))]
                label = "fill" if k == 0 else f"run {k}"
                print(f"  {label}: first {len(first)} (due ms:drift ms) {shown}")
                print(f"         worst of first {max(r['drift_ms'] for r in first):.2f} ms; all {len(sent)} sent: "
                      f"p50 {statistics.median(drifts):.2f} ms, p99 {p99:.2f} ms", flush=True)
                if k:
                    worst_first.append(max(r["drift_ms"] for r in first))
                    p99_all.append(p99)
    print(f"median of {args.runs} runs: worst drift of the first {args.first} rows "
          f"{statistics.median(worst_first):.2f} ms, whole-run p99 {statistics.median(p99_all):.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

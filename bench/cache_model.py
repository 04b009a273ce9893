"""What the finite-cache model (replay/results/cache_model.py over replay/rules/block_pool.py)
costs per request at the end of a big run, where the cache child feeds it every request the
server took in: --rows synthetic requests (200 req/s, each one of --families 20-block prefixes
and 0-10 blocks of its own, 16-token blocks, 8 output tokens, 0.2 s long) through a pool of
--blocks blocks (the default evicts on most requests), timed in a fresh process against the same
requests only generated (the difference is the model's: the infinite-cache checks and the pool),
with the process's peak RSS. Median of --runs.

    .venv/bin/python bench/cache_model.py [--rows 2000000] [--blocks 5000] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time

from replay.results.cache_model import CacheModel, ModelPrompt, ServerCache, model_checks

BLOCK = 16
T0 = 1_800_000_000.0


def prompts(rows: int, families: int, seed: int = 0):
    rng = random.Random(seed)
    prefixes = [[(f << 20) + k for k in range(20)] for f in range(families)]
    t = T0
    for i in range(rows):
        t += rng.expovariate(200.0)
        own = rng.randrange(11)
        hashes = prefixes[rng.randrange(families)] + [(1 << 40) + i * 16 + k for k in range(own)]
        observed = BLOCK * rng.randrange(len(hashes) + 1)
        yield ModelPrompt(i, t, len(hashes) * BLOCK + 5, observed, hashes, len(hashes) * BLOCK + 5, "e", t + 0.2, 8,
                          None, t + 0.001)


def child(variant: str, rows: int, blocks: int, families: int) -> None:
    started = time.perf_counter()
    if variant == "generate":
        for _ in prompts(rows, families):
            pass
        evictions = None
    else:
        model = CacheModel(BLOCK, {"e": ServerCache(blocks)})
        for _ in model_checks(prompts(rows, families), BLOCK, {}, model=model):
            pass
        evictions = model.endpoints["e"].pool.evictions
    print(json.dumps({"seconds": time.perf_counter() - started, "evictions": evictions,
                      "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--blocks", type=int, default=5000)
    parser.add_argument("--families", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.rows, args.blocks, args.families)
        return
    results: dict[str, list[dict]] = {"generate": [], "model": []}
    for _ in range(args.runs):
        for variant in results:
            out = subprocess.run([sys.executable, __file__, "--child", variant, "--rows", str(args.rows), "--blocks",
                                  str(args.blocks), "--families", str(args.families)],
                                 capture_output=True, text=True, check=True)
            results[variant].append(json.loads(out.stdout))
            print(variant, results[variant][-1], flush=True)
    gen = statistics.median(r["seconds"] for r in results["generate"])
    mod = statistics.median(r["seconds"] for r in results["model"])
    peak = statistics.median(r["peak_mib"] for r in results["model"])
    print(f"rows {args.rows}, pool {args.blocks} blocks, median of {args.runs}: generating {gen:.1f} s, with the "
          f"model {mod:.1f} s: the model {mod - gen:.1f} s ({1e6 * (mod - gen) / args.rows:.1f} us/request), "
          f"peak RSS {peak:.0f} MiB, evictions {results['model'][-1]['evictions']:,}")


if __name__ == "__main__":
    main()

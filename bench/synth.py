"""Synthesis speed on one core: prompt tokens/s and requests/s, body included, warm and cold.

Warm = every block already in the cache (a worker replaying a trace's hot prefixes); cold =
an empty cache (each block drawn and its text joined once). Prints the median of --runs, in
the thread's CPU time (other processes on the core do not count).

    .venv/bin/python bench/synth.py [--tokenizer DIR] [--trace FILE] [--block-size N] [--rows N] [--api A] [--runs 5] [--evict-mb N]

Prompts are made as a worker makes them, with a `pause` between steps (a no-op here).
--evict-mb N writes N MB of other memory before each prompt, untimed: in a run, sends, reads
and other processes evict the CPU's caches between two bodies, and a prompt then pays a
memory fetch for most of its words' table entries and texts, which a tight loop never shows.

Without --tokenizer it uses ../shared/tokenizers/qwen2 when present, else the toy tokenizer;
without --trace ../shared/traces/mooncake_synthetic_trace.jsonl when present, else rows
with a Mooncake-like shape made up here.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from replay.protocol.table import API_NAMES
from replay.synth.bodies import build_body
from replay.synth.prompts import PromptSynthesizer
from replay.synth.tokenizer import ServerTokenizer
from replay.trace.record import TraceRow

SHARED = Path(__file__).resolve().parent.parent.parent / "shared"


def _tokenizer_path(given: str | None) -> str:
    if given:
        return given
    real = SHARED / "tokenizers" / "qwen2"
    if real.exists():
        return str(real)
    from replay.synth.toy import build_toy_tokenizer

    return str(build_toy_tokenizer(tempfile.mkdtemp(prefix="toy-tokenizer-")))


def _rows(trace: str | None, count: int, block_size: int | None) -> tuple[list[TraceRow], int]:
    path = trace or (SHARED / "traces" / "mooncake_synthetic_trace.jsonl")
    if Path(path).exists():
        from replay.trace.reader import read_trace

        t = read_trace(path, block_size=block_size)
        return t.rows[:count], t.block_size or block_size
    block_size = block_size or 512
    rng = random.Random(0)  # prefix-sharing rows: a few long shared prefixes, then private blocks
    rows = []
    next_id = 10_000
    for i in range(count):
        length = rng.randint(1, 60) * block_size - rng.randrange(block_size)
        blocks = -(-length // block_size)
        shared = rng.randint(0, blocks) if rng.random() < 0.6 else 0
        ids = list(range(shared)) + list(range(next_id, next_id + blocks - shared))
        next_id += blocks - shared
        rows.append(TraceRow(i, float(i), length, 100, tuple(ids)))
    return rows, block_size


def _no_pause() -> None:
    """A worker's pause between a prompt's steps (replay.engine.lookahead), with no send to let go."""


def _pass(synth: PromptSynthesizer, rows: list[TraceRow], api: str, evict: bytearray | None = None) -> float:
    spent = 0.0
    for row in rows:
        if evict is not None:
            evict[::64] = bytes(len(evict) // 64)  # a byte of every cache line
        started = time.thread_time()
        prompt = synth.prompt(row, _no_pause)
        build_body(api, prompt, model="m", output_length=row.output_length, stream=True)
        spent += time.thread_time() - started
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer")
    parser.add_argument("--trace")
    parser.add_argument("--block-size", type=int, help="the trace's block size (default: its format's)")
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--api", choices=API_NAMES, default="openai-chat")
    parser.add_argument("--token-ids", action="store_true")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--evict-mb", type=int, default=0, help="MB written before each prompt (caches as in a run)")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    tokenizer = ServerTokenizer.load(_tokenizer_path(args.tokenizer))
    rows, block_size = _rows(args.trace, args.rows, args.block_size)
    synth = PromptSynthesizer(tokenizer, args.api, block_size, token_ids=args.token_ids, cache_blocks=1 << 20)
    tokens = sum(max(r.input_length, synth.template_overhead_tokens) for r in rows)
    distinct = len({h for r in rows for h in (r.hash_ids or ())})
    print(f"tokenizer {tokenizer.name}, api {args.api}{' (token ids)' if args.token_ids else ''}, "
          f"{len(rows)} rows, {tokens:,} prompt tokens, {distinct:,} distinct blocks of {block_size}")
    cold, warm = [], []
    evict = bytearray(args.evict_mb << 20) if args.evict_mb else None
    for _ in range(args.runs):
        synth.blocks.clear()
        cold.append(_pass(synth, rows, args.api, evict))
        warm.append(_pass(synth, rows, args.api, evict))
    for name, times in (("cold", cold), ("warm", warm)):
        t = statistics.median(times)
        print(f"{name}: {tokens / t / 1e6:8.2f} M prompt tokens/s  {len(rows) / t:10,.0f} requests/s  "
              f"(median of {len(times)}: {t * 1000:.1f} ms; runs {', '.join(f'{x * 1000:.0f}' for x in times)} ms)")


if __name__ == "__main__":
    main()

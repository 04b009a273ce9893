"""Helpers of the cache model's tests (tests/test_cache_model.py, tests/test_cache_model_vllm.py):
a trace with heavy prefix reuse, and the model's verdicts on a finished run, from its files."""

from __future__ import annotations

import json
import random
from pathlib import Path

from replay.results.cache_model import CacheModel, model_checks, model_prompts, server_caches, start_counters
from replay.results.metadata import read_run_metadata
from replay.results.records import read_records
from replay.rules.run_files import metrics_path
from replay.synth.prompts import PromptSynthesizer
from replay.synth.tokenizer import ServerTokenizer
from replay.trace.reader import TraceStream

SIM_BLOCK = 16  # the traces' block size


def reuse_trace(path: Path, rows: int = 160, families: int = 8, gap_ms: float = 10.0, seed: int = 3) -> Path:
    """Mooncake rows with heavy prefix reuse: each shares one of `families` 6-block prefixes,
    followed by 0 to 2 blocks of its own; families come back at random, so a small cache evicts."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(rows):
            family = rng.randrange(families)
            hashes = [100 * family + k for k in range(6)] + [10_000 + 10 * i + k for k in range(rng.randint(0, 2))]
            row = {"timestamp": round(i * gap_ms, 3), "input_length": len(hashes) * SIM_BLOCK - rng.randint(0, 8),
                   "output_length": 4, "hash_ids": hashes}
            f.write(json.dumps(row) + "\n")
    return path


def turns_trace(path: Path, gap_ms: float, conversations: int = 4) -> Path:
    """Two turns of each of `conversations` conversations, `gap_ms` apart (0: every row due at
    one instant): a shared 2-block system prompt, then the conversation's own 3 blocks; the
    second turn repeats the first whole and adds 2 blocks."""
    with open(path, "w") as f:
        for c in range(conversations):
            first = [0, 1, *range(100 + 10 * c, 103 + 10 * c)]
            for turn, hashes in enumerate((first, [*first, 105 + 10 * c, 106 + 10 * c])):
                row = {"timestamp": (2 * c + turn) * gap_ms, "input_length": len(hashes) * SIM_BLOCK - 3,
                       "output_length": 4, "hash_ids": hashes}
                f.write(json.dumps(row) + "\n")
    return path


def run_verdicts(output: Path, tokenizer_dir: Path) -> tuple[list, dict, dict]:
    """The cache model's verdicts on a finished run, from its files: the meta's server caches (as
    the preflight read them), the counters at the start, the records and the trace."""
    meta = read_run_metadata(output)
    caches = meta["server_cache"]
    (block,) = {c["block_size"] for c in caches.values()}
    trace = meta["trace"]
    rows = {row.request_id: row for row in TraceStream(trace["path"], trace["format"], trace["block_size"])}
    synth = PromptSynthesizer(ServerTokenizer.load(tokenizer_dir), api=meta["api"], block_size=trace["block_size"],
                              seed=meta["seed"])
    prompts = model_prompts(read_records(output), lambda rid: synth.server_ids(rows[rid]), block,
                            lambda rid: synth.prompt(rows[rid]).fingerprint)
    model = CacheModel(block, server_caches(caches, start_counters(metrics_path(output))))
    verdicts = list(model_checks(prompts, block, {}, model=model))
    return verdicts, model.tally.section(model), caches

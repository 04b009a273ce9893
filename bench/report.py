"""How long `replay report` takes: the summary alone, and the cache-fidelity check (prompt
re-synthesis + an infinite vLLM-style block cache), on a whole trace. Prints the median of --runs.

    .venv/bin/python bench/report.py [--trace FILE] [--rows N] [--tokenizer DIR] [--api A] [--runs 3]

Records are made up here (every row sent in trace order, answered, with cached_tokens 0);
only their count matters for the timing. Defaults: ../shared's Mooncake trace and Qwen2
tokenizer when present, else the bundled sample trace and the toy tokenizer.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import median_seconds
from replay.results.fidelity import check_cache, summarize_cache
from replay.results.records import RECORD_FIELDS
from replay.results.report import build_report
from replay.synth.prompts import PromptSynthesizer
from replay.synth.tokenizer import ServerTokenizer
from replay.trace.reader import read_trace

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"


def records_for(rows) -> list[dict]:
    out = []
    for k, row in enumerate(rows):
        r = dict.fromkeys(RECORD_FIELDS)
        t = 1_700_000_000.0 + row.timestamp_s
        r.update(request_id=row.request_id, sent_at=t, scheduled_at=t, finished_at=t + 1.0, drift_ms=0.1, ok=True,
                 status=200, ttft_ms=50.0 + k % 97, tpot_ms=10.0 + k % 7, e2e_ms=1000.0, itl_ms=[10.0] * 8,
                 input_length=row.input_length, output_length=row.output_length, prompt_tokens=row.input_length,
                 output_tokens=row.output_length, cached_tokens=0)  # fmt: skip
        out.append(r)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=None)
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--api", default="openai-chat")
    parser.add_argument("--server-block-size", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    trace_path = args.trace or (SHARED / "traces" / "mooncake_synthetic_trace.jsonl")
    if not Path(trace_path).exists():
        trace_path = REPO / "replay" / "data" / "sample_trace.jsonl"
    tokenizer_path = args.tokenizer or SHARED / "tokenizers" / "qwen2"
    if not Path(tokenizer_path).exists():
        from replay.synth.toy import build_toy_tokenizer

        tokenizer_path = build_toy_tokenizer(tempfile.mkdtemp(prefix="toy-tokenizer-"))
    trace = read_trace(trace_path)
    rows = trace.rows[: args.rows] if args.rows else trace.rows
    records = records_for(rows)
    by_id = {r.request_id: r for r in rows}
    tokens = sum(r.input_length for r in rows)
    tokenizer = ServerTokenizer.load(tokenizer_path)

    summary_s = median_seconds(lambda: build_report(records, {"ttft_ms": 100.0}), args.runs)

    def fidelity():
        # a fresh synthesizer each run: cold block cache, as in a `replay report` process
        synth = PromptSynthesizer(tokenizer, api=args.api, block_size=trace.block_size or 512)
        summarize_cache(check_cache(records, by_id, synth, args.server_block_size), "bench")

    fidelity_s = median_seconds(fidelity, args.runs)
    print(f"trace {trace_path}: {len(rows)} rows, {tokens:,} prompt tokens; tokenizer {Path(tokenizer_path).name}, "
          f"{args.api}, server block {args.server_block_size}; median of {args.runs}")  # fmt: skip
    print(f"  summary (build_report)      {summary_s * 1000:9.1f} ms   {len(rows) / summary_s:12,.0f} records/s")
    print(f"  cache fidelity (check)      {fidelity_s * 1000:9.1f} ms   {tokens / fidelity_s:12,.0f} prompt tokens/s")


if __name__ == "__main__":
    main()

"""How long `replay report` takes: the summary alone, and the cache-fidelity check (prompt
re-synthesis + an infinite vLLM-style block cache), on a whole trace; then the time and peak
memory of ReportBuilder on --builder-rows records (2,000,000: the run size the master must
report within 400 MB), all sent and answered (with 8 ITL values each, and with none), and with
90% never sent (a run stopped early).
Prints the median of --runs; the peak is tracemalloc's over one more run (it does not vary).

    .venv/bin/python bench/report.py [--trace FILE] [--rows N] [--tokenizer DIR] [--api A] [--runs 3]
                                     [--builder-rows 2000000]

Records are made up here (every row sent in trace order, answered, with cached_tokens 0);
only their count matters for the timing. Defaults: ../shared's Mooncake trace and Qwen2
tokenizer when present, else the bundled sample trace and the toy tokenizer.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import tracemalloc
from pathlib import Path

from common import median_seconds

from replay.results.fidelity import check_cache, summarize_cache
from replay.results.records import RECORD_FIELDS, RUN_STOPPED
from replay.results.report import ReportBuilder, build_report
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


def stream_records(n: int, sent_share: float, itl: bool = True):
    """n records made one at a time, as `replay report` reads them from the file: the first
    sent_share of them answered (records_for's shape: 8 ITL values each unless not `itl`, over
    4 endpoints), the rest never sent. Latencies come from tables of random values (sorting a constant is no
    test); the records are copies of two, made inside the time measured."""
    rng = random.Random(0)
    table = [rng.lognormvariate(5, 0.7) for _ in range(1009)]
    itls = [[rng.uniform(5, 40) for _ in range(8)] for _ in range(997)]
    ok = dict.fromkeys(RECORD_FIELDS)
    ok.update(ok=True, status=200, prompt_tokens=1000, output_tokens=9, api="openai-chat")
    unsent = dict.fromkeys(RECORD_FIELDS)
    unsent.update(ok=False, status=0, error=RUN_STOPPED, api="openai-chat")
    sent = int(n * sent_share)
    for k in range(n):
        if k < sent:
            r = ok.copy()
            t = 1_700_000_000.0 + k * 0.001
            ttft = table[k % 1009]
            r.update(request_id=k, endpoint=f"http://10.0.0.{k % 4}:8000", scheduled_at=t, sent_at=t,
                     finished_at=t + 1.0, drift_ms=table[(k * 7) % 1009] / 100, ttft_ms=ttft,
                     tpot_ms=table[(k * 3) % 1009] / 10, e2e_ms=ttft + table[(k * 5) % 1009] * 4,
                     itl_ms=itls[k % 997] if itl else None)  # fmt: skip
        else:
            r = unsent.copy()
            r["request_id"] = k
        yield r


def builder_figures(n: int, sent_share: float, itl: bool, runs: int) -> tuple[float, int]:
    """(median seconds to add n records and report, tracemalloc's peak bytes of one such run)."""

    def once() -> None:
        builder = ReportBuilder({"ttft_ms": 100.0})
        for r in stream_records(n, sent_share, itl):
            builder.add(r)
        builder.report()

    seconds = median_seconds(once, runs)
    tracemalloc.start()
    try:
        once()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return seconds, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=None)
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--api", default="openai-chat")
    parser.add_argument("--server-block-size", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--builder-rows", type=int, default=2_000_000)
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

    n = args.builder_rows
    # ITL is a value per output token: with 8 per row it outweighs the other latencies together
    for share, itl, label in ((1.0, True, "all sent"), (1.0, False, "all sent, no ITL"), (0.1, True, "10% sent")):
        seconds, peak = builder_figures(n, share, itl, args.runs)
        print(f"  ReportBuilder, {n:,} rows, {label:<16} {seconds * 1000:9.1f} ms   {n / seconds:10,.0f} records/s"
              f"   peak {peak / 1e6:6.1f} MB (tracemalloc)")


if __name__ == "__main__":
    main()

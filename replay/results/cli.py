"""`replay report RESULTS.jsonl`: the summary of a run, its cache fidelity, JSON and HTML.

What the records cannot say (trace, tokenizer, api, prompt format, seed) comes from the
run's metadata beside the results (RESULTS.jsonl.meta.json) unless given as flags; flags win.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections import Counter

import orjson

from replay.results.files import OutputError, write_atomically
from replay.results.metadata import file_sha256, read_run_metadata
from replay.results.records import read_records
from replay.results.report import ReportBuilder, ReportError, format_report, parse_slo
from replay.trace.cli import block_size_arg
from replay.protocol.table import PROMPT_FORMATS, prompt_format_problem
from replay.results.server_metrics import read_samples, read_server_section
from replay.rules.run_files import metrics_path


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "report",
        help="summarize a run's JSONL: latencies, throughput, goodput, cache fidelity",
        description="Summarize a replay's per-request JSONL (vLLM bench serve layout); with the trace and the "
        "server's block size, also check cached_tokens against what the replayed prompts imply.",
    )
    p.add_argument("results", help="the merged per-request JSONL of a run")
    p.add_argument("--trace", help="the trace the run replayed (default: from the run metadata)")
    p.add_argument("--trace-format", default=None, help="the trace's format (default: metadata, else auto-detected)")
    p.add_argument("--block-size", type=block_size_arg, default=None,
                   help="the trace's block size (default: metadata / format)")
    p.add_argument("--server-block-size", type=block_size_arg, default=None,
                   help="the server's KV block size (vLLM --block-size)")
    p.add_argument("--tokenizer", help="tokenizer the run used (default: metadata)")
    p.add_argument("--chat-template", help="chat template the run used (default: metadata)")
    p.add_argument("--api", default=None, help="api the run used (default: metadata, else the records' api)")
    p.add_argument("--prompt-format", choices=tuple(PROMPT_FORMATS), default=None,
                   help="prompt format the run used (default: metadata, else text)")
    p.add_argument("--seed", type=int, default=None, help="synthesis seed the run used (default: metadata, else 0)")
    p.add_argument("--slo", default=None, help="ttft_ms=..,tpot_ms=..,e2e_ms=.. for goodput (default: the run's)")
    p.add_argument("--reorder-window-ms", type=float, default=0.0,
                   help="also accept cached_tokens that requests sent this close together explain (default 0)")
    p.add_argument("--json", dest="json_out", default=None, help="write the summary as JSON here")
    p.add_argument("--html", dest="html_out", default=None, help="write a self-contained HTML report here")
    p.add_argument("--png-dir", default=None, help="with --html, also save each plot as a PNG in this folder")
    p.set_defaults(func=run)


def _pick(flag, meta_value, default=None):
    return flag if flag is not None else (meta_value if meta_value is not None else default)


def cache_trace(args, meta: dict | None, out=sys.stderr) -> str | None:
    """The trace to check cached_tokens against, or None when there is no cache check: no
    trace named, or (said on `out`) no server block size."""
    trace_path = _pick(args.trace, ((meta or {}).get("trace") or {}).get("path"))
    if trace_path is not None and args.server_block_size is None:
        print("cache fidelity: skipped (pass --server-block-size N, the server's KV block size)", file=out)
        return None
    return trace_path


def cache_section(args, records: list[dict], meta: dict | None, trace_path: str, records_api: str,
                  out=sys.stderr) -> tuple[dict, list]:
    """(cache dict, per-request checks) of the sent records against the trace at `trace_path`;
    `records_api` is the api most records name, for when neither --api nor the metadata does."""
    meta = meta or {}
    meta_trace = meta.get("trace") or {}
    tokenizer_path = _pick(args.tokenizer, meta.get("tokenizer"))
    if tokenizer_path is None:
        raise ReportError("cache fidelity needs the run's tokenizer: pass --tokenizer (no run metadata names it)")
    from replay.results.fidelity import cache_fidelity
    from replay.trace import read_trace

    if args.trace is None and meta_trace.get("sha256") and file_sha256(trace_path) != meta_trace["sha256"]:
        print(f"warning: {trace_path} changed since the run (sha256 differs from the run metadata)", file=out)
    same_trace = args.trace is None
    trace = read_trace(
        trace_path,
        _pick(args.trace_format, meta_trace.get("format") if same_trace else None),
        _pick(args.block_size, meta_trace.get("block_size") if same_trace else None),
    )
    # The run already warned about rows too short for the template; the report counts them instead.
    logging.getLogger("replay.synth.prompts").setLevel(logging.ERROR)
    api = args.api or meta.get("api") or records_api
    prompt_format = _pick(args.prompt_format, (meta.get("options") or {}).get("prompt_format"), "text")
    if problem := prompt_format_problem(prompt_format, api):
        raise ReportError(problem)
    return cache_fidelity(
        records,
        trace.rows,
        tokenizer=tokenizer_path,
        chat_template=_pick(args.chat_template, meta.get("chat_template")),
        api=api,
        seed=_pick(args.seed, meta.get("seed"), 0),
        trace_block_size=trace.block_size,
        server_block_size=args.server_block_size,
        reorder_window_ms=args.reorder_window_ms,
        prompt_format=prompt_format,
    )


def end_of_run_cache(results: str, records: list[dict], meta: dict, server_block_size: int,
                     api: str) -> dict | None:
    """The cache section a run's master prints at its end (--server-block-size): exactly what
    `replay report RESULTS --server-block-size N` computes, by the same arguments, from the
    run's metadata (just written) and its sent records."""
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["report", str(results), "--server-block-size", str(server_block_size)])
    trace_path = cache_trace(args, meta)
    if trace_path is None:
        return None
    return cache_section(args, records, meta, trace_path, api)[0]


def run(args) -> int:
    try:
        meta = read_run_metadata(args.results)
        if meta is not None and meta.get("complete") is False:  # a fault (full disk) cut a file of the run short
            print(f"replay report: {args.results}: the run's files are incomplete: "
                  + "; ".join(f"{i['file']}: {i['error']}" for i in meta.get("incomplete") or ()), file=sys.stderr)
        slo = parse_slo(_pick(args.slo, (meta or {}).get("options", {}).get("slo")))
        trace_path = cache_trace(args, meta)
        # One pass over the file. The summary keeps no record; the cache check and the plots
        # need the sent records (a run stopped early is mostly rows never sent: those are not kept).
        builder = ReportBuilder(slo)
        keep = trace_path is not None or bool(args.html_out)
        sent: list[dict] = []
        apis: Counter[str] = Counter()
        for record in read_records(args.results):
            builder.add(record)
            apis[record.get("api")] += 1
            if keep and record.get("sent_at") is not None:
                sent.append(record)
        if not builder.summary.requests:
            raise ReportError(f"{args.results}: no records")
        cache, checks = None, None
        if trace_path is not None:
            cache, checks = cache_section(args, sent, meta, trace_path, apis.most_common(1)[0][0])
    except (ReportError, ValueError, OSError) as e:
        print(f"replay report: {e}", file=sys.stderr)
        return 2
    report = builder.report(cache)
    extra = ((meta or {}).get("options") or {}).get("server_metric") or ()
    report["server"] = read_server_section(args.results, report["endpoints"], extra)
    print(format_report(report))
    try:
        if args.json_out:
            write_atomically(args.json_out, orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
        if args.html_out:
            from replay.results.html import PlottingMissing, write_html

            try:
                samples = list(read_samples(metrics_path(args.results))) if report["server"] else None
                write_html(args.html_out, report, sent, checks, meta, png_dir=args.png_dir, samples=samples)
            except PlottingMissing as e:
                print(f"replay report: {e}", file=sys.stderr)
                return 1
            print(f"HTML report: {args.html_out}")
    except OutputError as e:  # a full disk: the file is left as it was, or absent
        print(f"replay report: {e}", file=sys.stderr)
        return 1
    return 0

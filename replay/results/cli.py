"""`replay report RESULTS.jsonl`: the summary of a run, its cache fidelity and fidelity certificate, JSON and HTML.

What the records cannot say (trace, tokenizer, api, prompt format, seed) comes from the
run's metadata beside the results (RESULTS.jsonl.meta.json) unless given as flags; flags win.
"""

from __future__ import annotations

import sys

import orjson

from replay.bounds import CACHE_BLOCKS, HOUR_S, SEED, Bound
from replay.output_claim import INPUT, OUTPUT, OutputFolder
from replay.protocol.table import PROMPT_FORMATS
from replay.results.cache_section import cache_job, cache_section, cache_skipped
from replay.results.certificate import CertificateBuilder
from replay.results.metadata import RUN, read_run_metadata, trace_notes
from replay.results.outputs import write_outputs
from replay.results.records import read_records
from replay.results.report import ReportBuilder, ReportError, format_report, parse_slo
from replay.results.server_metrics import judge_usage, read_samples, read_server_section
from replay.rules.capacity_result import probe_table, quotable_line
from replay.rules.run_files import capacity_path, metrics_path
from replay.synth.tokenizer_source import TOKENIZER_HELP
from replay.trace.cli import block_size_arg


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "report",
        help="summarize a run's JSONL: latencies, throughput, goodput, cache fidelity",
        description="Summarize a replay's per-request JSONL (vLLM bench serve layout); with the trace and the "
        "server's block size, also check cached_tokens against what the replayed prompts imply.",
    )
    p.add_argument("results", type=RUN, metavar="RESULTS", help="the merged per-request JSONL of a run")
    p.add_argument("--trace", type=INPUT, help="the trace the run replayed (default: from the run metadata)")
    p.add_argument("--trace-format", default=None, help="the trace's format (default: metadata, else auto-detected)")
    p.add_argument("--block-size", type=block_size_arg, default=None,
                   help="the trace's block size (default: metadata / format)")
    p.add_argument("--server-block-size", type=block_size_arg, default=None,
                   help="the server's KV block size (vLLM --block-size; default: what it said before the run, "
                   "in the run metadata)")
    p.add_argument("--server-cache-blocks", type=CACHE_BLOCKS, default=None,
                   help="the server's KV cache size in blocks, vLLM's num_gpu_blocks (default: the run metadata): "
                   "the cache model that gives every miss a cause")
    p.add_argument("--tokenizer", type=INPUT, help=f"the run's tokenizer (default: metadata): {TOKENIZER_HELP}")
    p.add_argument("--chat-template", type=INPUT, help="chat template the run used (default: metadata)")
    p.add_argument("--api", default=None, help="api the run used (default: metadata, else the records' api)")
    p.add_argument("--prompt-format", choices=tuple(PROMPT_FORMATS), default=None,
                   help="prompt format the run used (default: metadata, else text)")
    p.add_argument("--seed", type=SEED, default=None, help="synthesis seed the run used (default: metadata, else 0)")
    p.add_argument("--slo", default=None, help="ttft_ms=..,tpot_ms=..,e2e_ms=.. for goodput (default: the run's)")
    p.add_argument("--reorder-window-ms", type=Bound(0.0, HOUR_S * 1000, unit="ms"), default=0.0,
                   help="also accept cached_tokens that requests sent this close together explain (default 0: "
                        "requests in flight together, until their first token, are accepted anyway)")
    p.add_argument("--json", dest="json_out", type=OUTPUT, default=None, help="write the summary as JSON here")
    p.add_argument("--html", dest="html_out", type=OUTPUT, default=None, help="write a self-contained HTML report here")
    p.add_argument("--png-dir", type=OutputFolder("*.png"), default=None,
                   help="with --html, also save each plot as a PNG in this folder (made when missing)")
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        meta = read_run_metadata(args.results)
        if meta is not None and meta.get("complete") is False:  # a fault (full disk) cut a file of the run short
            print(f"replay report: {args.results}: the run's files are incomplete: "
                  + "; ".join(f"{i['file']}: {i['error']}" for i in meta.get("incomplete") or ()), file=sys.stderr)
        slo = parse_slo(args.slo if args.slo is not None else (meta or {}).get("options", {}).get("slo"))
        job = cache_job(args.results, meta, server_block_size=args.server_block_size,
                        server_cache_blocks=args.server_cache_blocks, trace=args.trace,
                        trace_format=args.trace_format, block_size=args.block_size, tokenizer=args.tokenizer,
                        chat_template=args.chat_template, api=args.api, prompt_format=args.prompt_format,
                        seed=args.seed, reorder_window_ms=args.reorder_window_ms)
        # One pass over the file. The summary keeps no record; the plots need the sent records
        # (a run stopped early is mostly rows never sent: those are not kept).
        builder = ReportBuilder(slo)
        fidelity = CertificateBuilder(ignore_eos=not ((meta or {}).get("options") or {}).get("no_ignore_eos"))
        sent: list[dict] = []
        for record in read_records(args.results):
            builder.add(record)
            fidelity.add(record)
            if args.html_out and record.get("sent_at") is not None:
                sent.append(record)
        if not builder.summary.requests:
            raise ReportError(f"{args.results}: no records: expected the per-request JSONL a replay writes (its --output)")
        capacity = None  # a capacity search's run: its line and probes lead the report, its plot the HTML one
        if (found := capacity_path(args.results)).exists():
            try:
                capacity = orjson.loads(found.read_bytes())
            except orjson.JSONDecodeError as e:
                raise ReportError(f"{found}: not JSON: {e}") from None
        cache, checks = None, None
        if job is not None:
            cache, checks = cache_section(job, checks=bool(args.html_out))
    except (ReportError, ValueError, OSError) as e:
        print(f"replay report: {e}", file=sys.stderr)
        return 2
    report = builder.report(cache)
    extra = ((meta or {}).get("options") or {}).get("server_metric") or ()
    report["server"] = read_server_section(args.results, report["endpoints"], extra)
    report["fidelity"] = fidelity.certificate(report["drift_ms"], report["cache"], report["server"],
                                              (meta or {}).get("host_load"), cache_skipped(meta))
    judge_usage(report["server"], report["fidelity"].get("usage"))
    if capacity is not None and capacity.get("probes"):
        print(f"{quotable_line(capacity)}\n{probe_table(capacity)}\n"
              "(a capacity search: the figures below pool every probe, and the pauses between them)")
    print(format_report(report))
    said = (meta or {}).get("trace") or {}  # the rows the run left out, as its own end said them
    print(trace_notes(said.get("rows_skipped") or 0, said.get("rows_over_max_prompt_tokens") or 0,
                      said.get("max_prompt_tokens")), end="")

    def draw(path: str) -> None:
        from replay.results.html import write_html

        samples = list(read_samples(metrics_path(args.results))) if report["server"] else None
        write_html(path, report, sent, checks, meta, png_dir=args.png_dir, samples=samples, capacity=capacity)

    return write_outputs("replay report", report, args.json_out, args.html_out, draw, "HTML report")

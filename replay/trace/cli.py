"""`replay trace stats|validate|convert|amplify|anonymize`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import orjson

from replay.bounds import (
    BLOCK_SIZE,
    COUNT,
    DEFAULT_MAX_PROMPT_TOKENS,
    DURATION,
    LOAD_FACTOR,
    MAX_BLOCK_SIZE,
    MAX_INT,
    PROMPT_TOKENS,
    SCALE,
    SEED,
    START,
    Bound,
)
from replay.errors import OutputError
from replay.output_claim import INPUT, OUTPUT
from replay.record.recorder import TRACE  # anonymize writes what `replay record --output` writes
from replay.trace.amplify import amplify_trace
from replay.trace.convert import convert_trace
from replay.trace.formats import FORMATS
from replay.trace.reader import ON_BAD_LINE, TraceStream, read_trace
from replay.trace.record import TraceError
from replay.trace.sessions import DEFAULT_GLOBAL_MIN_ROWS
from replay.trace.stats import format_comparison, format_stats, inferred_sessions, trace_stats

MAX_ERRORS_SHOWN = 50


def register(subparsers: argparse._SubParsersAction) -> None:
    trace = subparsers.add_parser("trace", help="inspect, validate and convert trace files")
    commands = trace.add_subparsers(dest="trace_command", metavar="SUBCOMMAND", required=True)

    stats = commands.add_parser("stats", help="load, lengths and ideal prefix-cache reuse of a trace (or two, side by side)")
    stats.add_argument("file", type=INPUT, metavar="FILE")
    stats.add_argument("other", nargs="?", type=INPUT, metavar="OTHER",
                       help="a second trace (e.g. amplify's OUT): both side by side, sessions inferred where a "
                            "trace has none")
    _format_options(stats, "--format")
    stats.add_argument("--json", action="store_true", help="print one JSON document")
    stats.add_argument("--on-bad-line", choices=ON_BAD_LINE, default="fail")
    _global_min_rows_option(stats)
    stats.set_defaults(func=run_stats)

    anonymize = commands.add_parser("anonymize", help="a salted hash-id trace from a log of requests (replay record's "
                                    "--raw-log, LiteLLM's StandardLoggingPayload, an OpenAI batch): docs/record.md")
    anonymize.add_argument("input", type=INPUT, metavar="IN")
    anonymize.add_argument("output", type=TRACE, metavar="OUT", help="the trace (jsonl); OUT.meta.json beside it")
    anonymize.add_argument("--from", dest="shape", choices=("auto", "record", "litellm", "openai-batch"),
                           default="auto", help="IN's shape: replay record's --raw-log, LiteLLM's "
                           "StandardLoggingPayload, or an OpenAI batch's output file (default: from its first line)")
    anonymize.add_argument("--batch-input", type=INPUT, metavar="FILE",
                           help="with an OpenAI batch's output file as IN: the batch's input file (the request "
                                "bodies), joined to IN by custom_id")
    anonymize.add_argument("--tokenizer", type=INPUT, help="the served model's tokenizer (or --tokenize-url)")
    anonymize.add_argument("--chat-template", type=INPUT, help="the served chat template, with --tokenizer")
    anonymize.add_argument("--tokenize-url", metavar="URL", help="a server whose POST /tokenize counts the prompts")
    anonymize.add_argument("--block-size", type=block_size_arg, default=16, metavar="N",
                           help="tokens per hash id (default 16)")
    anonymize.add_argument("--salt-file", type=INPUT, help="key the hash ids with this file's bytes (as replay record's)")
    anonymize.add_argument("--session-names", action="store_true",
                           help="the log's session names (raw log: the session header or user; LiteLLM: end_user) "
                                "win over message continuation")
    anonymize.add_argument("--keep-text", action="store_true", help="write each prompt into its row (internal use)")
    anonymize.set_defaults(func=run_anonymize)

    validate = commands.add_parser("validate", help="check every row; exit 1 and list line-numbered errors")
    validate.add_argument("file", type=INPUT, metavar="FILE")
    _format_options(validate, "--format")
    validate.add_argument(
        "--max-prompt-tokens",
        type=PROMPT_TOKENS,
        default=DEFAULT_MAX_PROMPT_TOKENS,
        metavar="N",
        help=f"a row with a longer input_length is an error (default {DEFAULT_MAX_PROMPT_TOKENS}; 0: no limit)",
    )
    validate.set_defaults(func=run_validate)

    convert = commands.add_parser("convert", help="write (a window of) a trace as jsonl")
    convert.add_argument("input", type=INPUT, metavar="IN")
    convert.add_argument("output", type=OUTPUT, metavar="OUT", help="jsonl file; gzipped when it ends in .gz")
    _format_options(convert, "--from")
    convert.add_argument("--start", type=START, help="window start, trace seconds")
    convert.add_argument("--duration", type=DURATION, help="window length, trace seconds from --start, else from the first row")
    convert.add_argument("--max-rows", type=COUNT, help="keep only the first N rows (after the window)")
    convert.add_argument("--time-scale", type=SCALE, default=1.0, help="divide times by X (2 = twice as fast)")
    convert.add_argument("--block-size-to", type=block_size_arg, metavar="N",
                         help="rescale input lengths to blocks of N tokens")
    convert.add_argument("--on-bad-line", choices=ON_BAD_LINE, default="fail")
    convert.set_defaults(func=run_convert)

    amplify = commands.add_parser("amplify", help="K times a trace's sessions over the same time span, as jsonl")
    amplify.add_argument("input", type=INPUT, metavar="IN")
    amplify.add_argument("output", type=OUTPUT, metavar="OUT", help="jsonl file; gzipped when it ends in .gz")
    _format_options(amplify)
    amplify.add_argument("--factor", type=LOAD_FACTOR, required=True, metavar="K",
                         help="sessions out per session in (1.5: all once, half of them twice; 0.5: half of them)")
    amplify.add_argument("--seed", type=SEED, default=0, metavar="N",
                         help="which sessions and which clone start times (default 0)")
    _global_min_rows_option(amplify)
    amplify.add_argument("--on-bad-line", choices=ON_BAD_LINE, default="fail")
    amplify.set_defaults(func=run_amplify)


def _format_options(parser: argparse.ArgumentParser, flag: str | None = None) -> None:
    """--trace-format, the name a run and `replay report` use (and the error that asks for a
    format names), with the command's own older short name `flag` kept as its alias."""
    parser.add_argument("--trace-format", *([flag] if flag else []), dest="format", choices=list(FORMATS), metavar="FORMAT",
                        help=f"trace format: {', '.join(FORMATS)} (detected when omitted)")
    parser.add_argument("--block-size", type=block_size_arg, metavar="N",
                        help=f"tokens per hash id block, 1 to {MAX_BLOCK_SIZE} (overrides the format default)")


block_size_arg = BLOCK_SIZE  # a --block-size: every command's, one rule
MIN_ROWS = Bound(2, MAX_INT, integer=True, unit="rows", why="an id one row carries links nothing")


def _global_min_rows_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--global-min-rows", type=MIN_ROWS, default=DEFAULT_GLOBAL_MIN_ROWS, metavar="M",
                        help="in a trace without sessions: a hash id carried by M rows or more is global (shared "
                             "content), ids carried by fewer link rows into sessions (default "
                             f"{DEFAULT_GLOBAL_MIN_ROWS})")


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1


def _report_skipped(skipped: list, count: int) -> None:
    for bad in skipped[:MAX_ERRORS_SHOWN]:
        print(f"skipped: {bad}", file=sys.stderr)
    if count:
        print(f"skipped {count} bad rows", file=sys.stderr)


def run_stats(args: argparse.Namespace) -> int:
    if args.other is not None:
        return _run_comparison(args)
    try:
        trace = TraceStream(args.file, args.format, args.block_size, args.on_bad_line, keep_skipped=MAX_ERRORS_SHOWN)
        stats = trace_stats(trace)  # one pass: the rows are never held
    except (TraceError, ValueError, OSError, EOFError) as err:
        return _fail(str(err))
    _report_skipped(trace.skipped, trace.bad_rows)
    if args.json:
        print(orjson.dumps(stats, option=orjson.OPT_INDENT_2).decode())
    else:
        print(format_stats(stats))
    return 0


def _run_comparison(args: argparse.Namespace) -> int:
    """Two traces side by side; --trace-format and --block-size apply to the first (the second
    is detected: amplify's output says its own block size)."""
    both = []
    for path, fmt, block in ((args.file, args.format, args.block_size), (args.other, None, None)):
        def stream_of(path=path, fmt=fmt, block=block) -> TraceStream:
            return TraceStream(path, fmt, block, args.on_bad_line, keep_skipped=MAX_ERRORS_SHOWN)
        try:
            trace = stream_of()
            stats = trace_stats(trace)
            if stats["sessions"] is None:  # none of its own: what amplify would find
                stats.update(inferred_sessions(stream_of, args.global_min_rows))
        except (TraceError, ValueError, OSError, EOFError) as err:
            return _fail(str(err))
        _report_skipped(trace.skipped, trace.bad_rows)
        both.append(stats)
    if args.json:
        print(orjson.dumps({"first": both[0], "second": both[1]}, option=orjson.OPT_INDENT_2).decode())
    else:
        print(format_comparison(*both))
    return 0


def run_amplify(args: argparse.Namespace) -> int:
    source, out = Path(args.input), Path(args.output)  # OUT is not IN: claimed (replay.output_claim)
    streams: list[TraceStream] = []

    def stream_of() -> TraceStream:
        streams.append(TraceStream(source, args.format, args.block_size, args.on_bad_line,
                                   keep_skipped=MAX_ERRORS_SHOWN))
        return streams[-1]

    try:
        done = amplify_trace(stream_of, out, args.factor, args.seed, args.global_min_rows)
    except (TraceError, ValueError, OSError, EOFError, OutputError) as err:
        return _fail(str(err))
    _report_skipped(streams[-1].skipped, streams[-1].bad_rows)
    how = f"inferred from hash ids, --global-min-rows {args.global_min_rows}" if done.inferred else "the trace's own"
    print(f"wrote {done.rows_out} rows, {done.sessions_out} sessions to {args.output}: {args.factor:g} x "
          f"{done.rows_in} rows, {done.sessions_in} sessions ({how}); {done.global_ids} global hash ids kept")
    return 0


def run_validate(args: argparse.Namespace) -> int:
    """Every row checked as a replay checks it, in one pass holding no row: only the first
    MAX_ERRORS_SHOWN bad rows are kept, the rest counted."""
    try:
        limit = args.max_prompt_tokens or None
        trace = TraceStream(args.file, args.format, args.block_size, on_bad_line="skip", max_input_tokens=limit,
                            keep_skipped=MAX_ERRORS_SHOWN)
        good = sum(1 for _ in trace)
    except (TraceError, ValueError, OSError, EOFError) as err:
        return _fail(str(err))
    if trace.bad_rows:
        for bad in trace.skipped:
            print(bad)
        hidden = trace.bad_rows - len(trace.skipped)
        if hidden > 0:
            print(f"... and {hidden} more")
        print(f"INVALID: {trace.path}: {trace.bad_rows} bad rows, {good} good ({trace.format})")
        return 1
    block = f", block size {trace.block_size}" if trace.block_size else ""
    print(f"OK: {trace.path}: {good} rows ({trace.format}{block})")
    return 0


def run_convert(args: argparse.Namespace) -> int:
    try:
        trace = read_trace(args.input, args.format, args.block_size, args.on_bad_line)
        _report_skipped(trace.skipped, len(trace.skipped))
        written = convert_trace(
            trace,
            args.output,
            start=args.start,
            duration=args.duration,
            max_rows=args.max_rows,
            time_scale=args.time_scale,
            block_size_to=args.block_size_to,
        )
    except (TraceError, ValueError, OSError, EOFError, RuntimeError, OutputError) as err:
        return _fail(str(err))
    block = f", block size {written.block_size}" if written.rows and any(r.hash_ids for r in written.rows) else ""
    print(
        f"wrote {len(written.rows)} of {len(trace.rows)} rows to {args.output} "
        f"({written.format}{block}, {written.duration_s:.3f} s)"
    )
    return 0


def run_anonymize(args: argparse.Namespace) -> int:
    from replay.record.anonymize import LogError, anonymize
    from replay.record.hashing import BlockHasher, read_salt
    from replay.record.rows import PromptTokens

    if args.tokenizer is None and args.tokenize_url is None:
        print("replay trace anonymize: give --tokenizer or --tokenize-url: the prompts' tokens are counted as the "
              "server counts them", file=sys.stderr)
        return 2
    try:
        salt = read_salt(args.salt_file)
        tokenizer = None
        if args.tokenizer is not None:
            from replay.synth.tokenizer import ServerTokenizer

            tokenizer = ServerTokenizer.load(args.tokenizer, args.chat_template)
        meta = {"anonymized_by": "replay trace anonymize", "source": Path(args.input).name, "format": "jsonl",
                "block_size": args.block_size, "salt": "from --salt-file" if args.salt_file else "random, never written",
                "hash_ids": "salted (blake2b keyed), renumbered in order of first use"}
        done = anonymize(args.input, args.output, log_format=args.shape,
                         tokens=PromptTokens(args.tokenize_url, tokenizer), hasher=BlockHasher(salt, args.block_size),
                         session_names=args.session_names, keep_text=args.keep_text, meta=meta,
                         batch_input=args.batch_input)
    except (LogError, ValueError, FileNotFoundError) as e:
        print(f"replay trace anonymize: {e}", file=sys.stderr)
        return 2
    except OutputError as e:
        print(f"replay trace anonymize: {e}", file=sys.stderr)
        return 1
    never_ran = f", {done['not_in_output']} requests of --batch-input never ran" if done.get("not_in_output") else ""
    print(f"replay trace anonymize: {done['rows']} rows ({done['rows_marked_failed']} marked failed{never_ran}) to "
          f"{args.output}")
    return 0

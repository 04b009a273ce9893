"""`replay trace stats|validate|convert`."""

from __future__ import annotations

import argparse
import sys

import orjson

from replay.results.files import OutputError
from replay.trace.convert import convert_trace
from replay.trace.fields import DEFAULT_MAX_PROMPT_TOKENS, MAX_BLOCK_SIZE, block_size_problem
from replay.trace.formats import FORMATS
from replay.trace.reader import ON_BAD_LINE, TraceStream, read_trace
from replay.trace.record import TraceError
from replay.trace.stats import format_stats, trace_stats

MAX_ERRORS_SHOWN = 50


def register(subparsers: argparse._SubParsersAction) -> None:
    trace = subparsers.add_parser("trace", help="inspect, validate and convert trace files")
    commands = trace.add_subparsers(dest="trace_command", metavar="SUBCOMMAND", required=True)

    stats = commands.add_parser("stats", help="load, lengths and ideal prefix-cache reuse of a trace")
    stats.add_argument("file")
    _format_options(stats, "--format")
    stats.add_argument("--json", action="store_true", help="print one JSON document")
    stats.add_argument("--on-bad-line", choices=ON_BAD_LINE, default="fail")
    stats.set_defaults(func=run_stats)

    validate = commands.add_parser("validate", help="check every row; exit 1 and list line-numbered errors")
    validate.add_argument("file")
    _format_options(validate, "--format")
    validate.add_argument(
        "--max-prompt-tokens",
        type=_token_limit,
        default=DEFAULT_MAX_PROMPT_TOKENS,
        metavar="N",
        help=f"a row with a longer input_length is an error (default {DEFAULT_MAX_PROMPT_TOKENS}; 0: no limit)",
    )
    validate.set_defaults(func=run_validate)

    convert = commands.add_parser("convert", help="write (a window of) a trace as jsonl")
    convert.add_argument("input")
    convert.add_argument("output", help="jsonl file; gzipped when it ends in .gz")
    _format_options(convert, "--from")
    convert.add_argument("--start", type=float, help="window start, trace seconds")
    convert.add_argument("--duration", type=float, help="window length, trace seconds")
    convert.add_argument("--max-rows", type=_row_count, help="keep only the first N rows (after the window)")
    convert.add_argument("--time-scale", type=float, default=1.0, help="divide times by X (2 = twice as fast)")
    convert.add_argument("--block-size-to", type=block_size_arg, metavar="N",
                         help="rescale input lengths to blocks of N tokens")
    convert.add_argument("--on-bad-line", choices=ON_BAD_LINE, default="fail")
    convert.set_defaults(func=run_convert)


def _format_options(parser: argparse.ArgumentParser, flag: str) -> None:
    """--trace-format, the name a run and `replay report` use (and the error that asks for a
    format names), with the command's own short name `flag` kept as its alias."""
    parser.add_argument("--trace-format", flag, dest="format", choices=list(FORMATS), metavar="FORMAT",
                        help=f"trace format: {', '.join(FORMATS)} (detected when omitted)")
    parser.add_argument("--block-size", type=block_size_arg, metavar="N",
                        help=f"tokens per hash id block, 1 to {MAX_BLOCK_SIZE} (overrides the format default)")


def block_size_arg(text: str) -> int:
    """A --block-size value, under fields.block_size_problem's rule (argparse: exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of tokens, got {text!r}") from None
    if problem := block_size_problem(value):
        raise argparse.ArgumentTypeError(f"{problem}, got {value}")
    return value


def _count_arg(unit: str, zero: str = ""):
    """An argparse type: a whole number of `unit` >= 0 (`zero`: what 0 means, said in the error;
    a negative --max-rows once wrote an empty file, exit 0)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number of {unit}, got {text!r}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0{zero}, got {value}")
        return value

    return parse


_token_limit = _count_arg("tokens", " (0: no limit)")  # --max-prompt-tokens
_row_count = _count_arg("rows")  # --max-rows


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1


def _report_skipped(skipped: list, count: int) -> None:
    for bad in skipped[:MAX_ERRORS_SHOWN]:
        print(f"skipped: {bad}", file=sys.stderr)
    if count:
        print(f"skipped {count} bad rows", file=sys.stderr)


def run_stats(args: argparse.Namespace) -> int:
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

"""`replay prompts check`: synthesize a trace's prompts and count them as the server will."""

from __future__ import annotations

import argparse
import sys

import orjson

from replay.bounds import MAX_INT, SEED, Bound
from replay.output_claim import INPUT
from replay.protocol.ask import check_url
from replay.protocol.headers import parse_headers
from replay.protocol.models import ask_served, prompt_limit
from replay.protocol.table import API_NAMES, TOKEN_ID_APIS, get_api
from replay.synth.chat_template import ChatTemplateError
from replay.synth.check import check_prompts, rescale_rows
from replay.synth.prompts import PromptError, PromptSynthesizer
from replay.synth.server_check import build_samples, check_server, explain
from replay.synth.tokenizer import ServerTokenizer
from replay.synth.tokenizer_source import TOKENIZER_HELP, resolve_tokenizer
from replay.synth.vocab import VocabularyError
from replay.trace.cli import block_size_arg
from replay.trace.fields import DEFAULT_BLOCK_SIZE
from replay.trace.formats import FORMATS
from replay.trace.reader import read_trace
from replay.trace.record import TraceError

MISMATCHES_SHOWN = 20


def register(subparsers: argparse._SubParsersAction) -> None:
    prompts = subparsers.add_parser("prompts", help="synthesized prompts")
    commands = prompts.add_subparsers(dest="prompts_command", metavar="SUBCOMMAND", required=True)
    check = commands.add_parser(
        "check", help="synthesize each row's prompt and count it with the server's rule; exit 1 unless all exact"
    )
    check.add_argument("--trace", type=INPUT, required=True, help="trace file")
    check.add_argument("--trace-format", "--format", dest="format", choices=list(FORMATS), metavar="FORMAT",
                       help=f"trace format: {', '.join(FORMATS)} (detected when omitted)")
    check.add_argument("--block-size", type=block_size_arg,
                       help="tokens per hash id block (overrides the format default)")
    check.add_argument(
        "--block-size-to",
        type=block_size_arg,
        help="first rescale lengths to blocks of N tokens, ceil(L*N/B) with the same hash ids (faster; rows "
        "that become shorter than the chat template cannot be exact)",
    )
    check.add_argument("--tokenizer", type=INPUT, required=True, help=TOKENIZER_HELP)
    check.add_argument("--chat-template", type=INPUT, help="tokenizer_config.json or .jinja file (overrides the folder's)")
    check.add_argument("--api", choices=API_NAMES, default="openai-chat")
    check.add_argument("--token-ids", action="store_true", help=f"{' or '.join(TOKEN_ID_APIS)} prompts as token ids")
    check.add_argument("--limit", type=Bound(1, MAX_INT, integer=True, unit="rows"), help="check only the first N rows")
    check.add_argument("--seed", type=SEED, default=0)
    check.add_argument("--server", action="append", default=[], metavar="URL",
                       help="also ask this server (repeatable) to count a sample of prompts, as a replay's "
                            "--verify-server does; exit 1 when it counts otherwise, 2 when it cannot be asked")
    check.add_argument("--model", help="with --server: the served model name")
    check.add_argument("--header", action="append", default=[], help="with --server: 'Name: value' ($VAR expanded)")
    check.add_argument("--json", action="store_true", help="print one JSON document")
    check.add_argument("--verbose", "-v", action="store_true", help="list every mismatching request")
    check.set_defaults(func=run_check)


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def run_check(args: argparse.Namespace) -> int:
    try:
        trace = read_trace(args.trace, args.format, args.block_size)
        rows = trace.rows[: args.limit] if args.limit is not None else trace.rows
        block_size = trace.block_size or DEFAULT_BLOCK_SIZE
        if args.block_size_to is not None:
            if trace.block_size is not None:
                rows = rescale_rows(rows, trace.block_size, args.block_size_to)
            block_size = args.block_size_to
        # a template only a chat renders: a completions check is not stopped by one that fails to compile
        tokenizer = ServerTokenizer.load(resolve_tokenizer(args.tokenizer), args.chat_template,
                                         compiled=get_api(args.api).chat)
        synth = PromptSynthesizer(tokenizer, args.api, block_size, args.seed, token_ids=args.token_ids)
    except (TraceError, PromptError, VocabularyError, ValueError, OSError) as err:
        return _fail(str(err))
    try:
        result = check_prompts(synth, rows)
        code = 0 if result["exact"] + result["unsaid"] == result["requests"] else 1
        if args.server:
            code = max(code, _check_servers(args, synth, rows, result))
    except ChatTemplateError as err:
        return _fail(str(err))
    except ValueError as err:  # --header or --server not usable
        return _fail(str(err))
    if args.json:
        print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())
    else:
        print(_format(result, args.verbose))
    return code


def _check_servers(args: argparse.Namespace, synth: PromptSynthesizer, rows: list, result: dict) -> int:
    """The replay's --verify-server check (replay.synth.server_check) against each --server; its
    outcome goes in `result["servers"]`. 1 when one counts otherwise, 2 when one cannot be asked."""
    result["servers"] = []
    if synth.token_ids:
        result["servers_note"] = "--token-ids: a server counts the ids as given; not asked"
        return 0
    headers = parse_headers(args.header)
    for url in args.server:
        check_url("--server", url)
    lengths = [r.input_length for r in rows if r.messages is None]
    max_len = prompt_limit(ask_served(args.server, synth.api, headers), args.model)
    samples = build_samples(synth, (min(lengths), max(lengths)) if lengths else (), max_len)
    code = 0
    for url in args.server:
        check = check_server(url, samples, synth.api, args.model, headers)
        entry = check.to_dict()
        if check.mismatch is not None:
            entry["explanation"] = explain(check, synth, str(synth.tokenizer.path))
            code = 1
        elif check.method is None:
            code = max(code, 2)
        result["servers"].append(entry)
    return code


def _format(result: dict, verbose: bool) -> str:
    lines = [
        f"tokenizer        {result['tokenizer']}",
        f"api              {result['api']}{' (token ids)' if result['token_ids'] else ''}",
        f"block size       {result['block_size']}",
        f"template tokens  {result['template_overhead_tokens']}",
        f"requests         {result['requests']}",
        f"exact            {result['exact']}",
        *([f"own messages     {result['unsaid']} (rows that give their own prompt: sent as they are, not compared)"]
          if result["unsaid"] else []),
        f"max abs error    {result['max_abs_error']}",
        f"warnings         {result['warnings']} (rows shorter than the template)",
        f"elapsed          {result['elapsed_s']:.2f} s",
    ]
    shown = result["mismatches"] if verbose else result["mismatches"][:MISMATCHES_SHOWN]
    for m in shown:
        lines.append(
            f"  request {m['request_id']} (line {m['line']}): input_length {m['input_length']}, "
            f"server counts {m['server_tokens']} ({m['error']:+d})"
        )
    if len(shown) < len(result["mismatches"]):
        lines.append(f"  ... {len(result['mismatches']) - len(shown)} more (--verbose lists all)")
    if "servers_note" in result:
        lines.append(f"server           {result['servers_note']}")
    for server in result.get("servers", ()):
        if server["ok"]:
            lines.append(f"server           {server['endpoint']}: all {server['prompts']} sample prompts "
                         f"({server['tokens']} tokens) counted as here (by {server['method']})")
        elif "explanation" in server:
            lines.append(f"server           {server['explanation']}")
        else:
            lines.append(f"server           {server['endpoint']}: cannot be asked: {server['note']}")
    return "\n".join(lines)

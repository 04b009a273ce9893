"""`replay sim ...`: the reference LLM server."""

from __future__ import annotations

import argparse
import sys

from replay.sim.options import add_arguments, from_namespace


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sim",
        help="run the reference LLM server (vLLM-like prefix cache, latency model, faults)",
        description="A vLLM/TGI-compatible server without a GPU: exact token counts, block-hash prefix cache, "
        "a latency model and fault injection.",
    )
    add_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from replay.sim.server import serve

    try:
        options = from_namespace(args)
        return serve(options)
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"replay sim: {exc}", file=sys.stderr)
        return 2

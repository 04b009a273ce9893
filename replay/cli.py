"""The `replay` command. Each area registers its own subcommands, so this file only wires."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each module has register(subparsers): it adds its subcommand with set_defaults(func=...),
# and func(args) returns the process exit code.
COMMAND_MODULES = ("replay.trace.cli", "replay.synth.cli", "replay.sim.cli", "replay.results.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="replay", description="Replay production LLM request traces.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

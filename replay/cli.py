"""The `replay` command. Each area registers its own subcommands, so this file only wires."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys

# Each module has register(subparsers): it adds its subcommand with set_defaults(func=...),
# and func(args) returns the process exit code. `run` is listed by replay.locust.cli, but its
# arguments are Locust's to parse (main hands them over before any parsing here).
COMMAND_MODULES = ("replay.locust.cli", "replay.trace.cli", "replay.synth.cli", "replay.sim.cli", "replay.results.cli",
                   "replay.results.compare_cli")


def version() -> str:
    """`replay --version`: the installed distribution's version (pyproject.toml's, one source)
    and Locust's, which `replay run` is."""
    def of(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return f"tracereplay {of('tracereplay')} (locust {of('locust')})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="replay", description="Replay production LLM request traces.")
    parser.add_argument("--version", action="version", version=version())
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:  # before anything else is imported: Locust patches the standard library first
        from replay.locust.cli import run

        return run(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

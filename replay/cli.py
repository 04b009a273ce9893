"""The `replay` command. Each area registers its own subcommands, so this file only wires."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
from collections.abc import Iterator
from typing import NoReturn

from replay.errors import OptionError
from replay.output_claim import claim_command, command_prog

# Each command's module has register(subparsers): it adds that one subcommand with
# set_defaults(func=...), and func(args) returns the process exit code. A command imports only
# its own module (`replay sim` does not import the HTTP client or the report), so each process
# the suite and a fleet start pays for what it runs. `run` is listed by replay.locust.cli, but
# its arguments are Locust's to parse (main hands them over before any parsing here).
COMMAND_MODULES = {"run": "replay.locust.cli", "trace": "replay.trace.cli", "prompts": "replay.synth.cli",
                   "sim": "replay.sim.cli", "report": "replay.results.cli", "compare": "replay.results.compare_cli",
                   "record": "replay.record.cli"}


def version() -> str:
    """`replay --version`: the installed distribution's version (pyproject.toml's, one source)
    and Locust's, which `replay run` is."""
    def of(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return f"tracereplay {of('tracereplay')} (locust {of('locust')})"


class Parser(argparse.ArgumentParser):
    """argparse with its error in one line, as `replay run` (Locust's parser) gives it: what is
    wrong (a number's range: replay.bounds) and where the usage is, not the usage itself, which
    pushed the error below a screen of flags. Its subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (usage: {self.prog} --help)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line with every command, or with `command` only (one of COMMAND_MODULES)."""
    parser = Parser(prog="replay", description="Replay production LLM request traces.")
    parser.add_argument("--version", action="version", version=version())
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in COMMAND_MODULES.items():
        if command in (None, name):
            importlib.import_module(module).register(subparsers)
    return parser


def commands(parser: argparse.ArgumentParser, words: str = "replay") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every command `parser` runs, by its words ('replay trace convert'), with its own parser:
    what the docs list the options of, and the tests feed every option of."""
    subcommands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subcommands:
        yield words, parser
    for action in subcommands:
        for name, sub in action.choices.items():
            yield from commands(sub, f"{words} {name}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:  # before anything else is imported: Locust patches the standard library first
        from replay.locust.cli import run

        return run(argv[1:])
    parser = build_parser(argv[0] if argv and argv[0] in COMMAND_MODULES else None)
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:  # every file the command writes, before it reads or writes anything (replay.output_claim)
        claim_command(parser, args)
    except OptionError as e:
        print(f"{command_prog(parser, args)}: {e}", file=sys.stderr)
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

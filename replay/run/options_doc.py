"""docs/options.md, written from the options themselves: `python -m replay.run.options_doc > docs/options.md`.

The reference is rendered from the parser that `replay.engine.options.add_arguments` derives from
the options dataclasses, so a flag's name, type, choices, default and help have one home (the
dataclass field) and the page cannot list an option the replay does not have, nor miss one:
tests/test_docs.py compares docs/options.md with `render()`.
"""

from __future__ import annotations

import argparse
import sys

from replay.bounds import Bound
from replay.engine.options import CONFIG_FLAG, LOCAL_OPTION_NAMES, add_arguments

REGENERATE = "python -m replay.run.options_doc > docs/options.md"

_HEADER = f"""\
# Replay options

<!-- Generated from replay/engine/options.py by `{REGENERATE}`; do not edit by hand. -->

The options of a replay, as `replay run --help` lists them under "trace replay".
Every option is also a key of a `{CONFIG_FLAG} FILE.yaml` (the flag's name without the leading
dashes; `block_size` is accepted for `block-size`); flags given on the command line win over
the file. What the options do in depth: [replaying.md](replaying.md); the config files:
[replaying.md#run-configurations---replay-config](replaying.md#run-configurations---replay-config).
Options marked *master only* are used by the master (or a single process) and never shipped to
the workers nor written to the run's metadata.

| flag | config key | value | default | meaning |
|---|---|---|---|---|
"""

_FOOTER = """
Locust's own options (`--headless`, `--master`, `--worker`, `--expect-workers`, `--processes`,
`--run-time`, `--web-host`, ...) stay Locust's: `locust --help` lists them, and they are not
keys of the replay's config file.

## The numbers of the other commands

Every number a command takes has one range, its flag's type (`replay/bounds.py`): a value
outside it is refused before anything runs, exit 2, in one line naming the option and the
range. The replay's are in the table above (a `--replay-config` file's values are held to the
same ranges, naming the file and line); the other commands' are these:

| command | flag | value | default |
|---|---|---|---|
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return parser


def _value(action: argparse.Action) -> str:
    """What the option takes, in words a config file's author can use."""
    if action.choices:
        return "one of " + ", ".join(f"`{c}`" for c in action.choices)
    if isinstance(action, (argparse.BooleanOptionalAction, argparse._StoreTrueAction)):
        return "true or false"
    if isinstance(action, argparse._AppendAction):
        return "string, repeatable (a YAML list)"
    if isinstance(action.type, Bound):
        kind = "integer" if action.type.integer else "number"
        named = f" (`{action.metavar}`)" if action.metavar else ""
        return f"{kind}{named}: {action.type.words()}"
    kind = "integer" if action.type is int else "number" if action.type is float else "string"
    return f"{kind} (`{action.metavar}`)" if action.metavar else kind


def _default(action: argparse.Action) -> str:
    if action.default is None or action.default == []:
        return ""
    if isinstance(action.default, bool):
        return "`true`" if action.default else "`false`"
    return f"`{action.default}`"


def _cell(text: str) -> str:
    """Text as one table cell: a `|` would end the cell, a `<word>` would be read as HTML."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")


def render() -> str:
    """The whole of docs/options.md."""
    rows = []
    for action in _parser()._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if not longs:
            continue
        flag = "/".join(f"`{s}`" for s in longs)  # --stream/--no-stream
        key = longs[0][2:]
        meaning = action.help or ""
        if action.dest in LOCAL_OPTION_NAMES:
            meaning += " (*master only*)"
        if longs[0] == CONFIG_FLAG:
            key, meaning = "", meaning + " (a flag only)"
        else:
            key = f"`{key}`"
        rows.append(f"| {flag} | {key} | {_cell(_value(action))} | {_cell(_default(action))} | {_cell(meaning)} |")
    return _HEADER + "\n".join(rows) + "\n" + _FOOTER + _other_numbers()


def _other_numbers() -> str:
    """The table of every numeric option of the commands but `replay run` (whose options are
    the table above), from their parsers."""
    from replay.cli import build_parser, commands

    rows = []
    for words, parser in commands(build_parser()):
        if words == "replay run":
            continue
        for action in parser._actions:
            if isinstance(action.type, Bound):
                flag = "/".join(f"`{s}`" for s in action.option_strings if s.startswith("--"))
                rows.append(f"| `{words}` | {flag} | {_cell(_value(action))} | {_cell(_default(action))} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())

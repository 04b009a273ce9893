"""`--replay-config FILE.yaml`: a whole run pinned in one file, flags still winning.

The keys are the replay's option names without the leading dashes (`block-size`; the
underscore spelling `block_size` is accepted too, both at once is an error), so a file
reads like the command line it replaces. The valid keys, their types and choices come
from the parser itself (replay.engine.options.add_arguments, derived from the options
dataclass), never from a second list that could drift from it. This module imports
options, never the reverse. Paths in the file mean what they would mean as flags: relative
to the working directory, not to the file.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replay.bounds import Bound
from replay.engine.options import CONFIG_FLAG, ReplayOptions, add_arguments

CONFIG_DEST = CONFIG_FLAG[2:].replace("-", "_")
_APPLIED = "_replay_config_applied"


class ConfigError(ValueError):
    """A config file the run cannot use, with the file, line and key to fix."""


@dataclass(frozen=True)
class Key:
    """One option as a config key: its spelling, where it lands, what it accepts."""

    name: str  # option name without dashes: block-size
    dest: str  # argparse dest: block_size
    kind: str  # bool, int, float, str, list (repeatable flag)
    choices: tuple | None
    default: Any
    bound: Bound | None = None  # a number's range, the flag's own (replay.bounds)


def _replay_parser(**kwargs) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False, **kwargs)
    add_arguments(parser)
    return parser


def _kind(action: argparse.Action) -> str:
    if isinstance(action, (argparse.BooleanOptionalAction, argparse._StoreTrueAction)):
        return "bool"
    if isinstance(action, argparse._AppendAction):
        return "list"
    if isinstance(action.type, Bound):
        return "int" if action.type.integer else "float"
    if action.type in (int, float):
        return action.type.__name__
    return "str"


def config_keys() -> dict[str, Key]:
    """Every key a config file may hold, by its dashed name (`--replay-config` itself excluded)."""
    keys = {}
    for action in _replay_parser()._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]  # --stream before --no-stream
        if not longs or action.dest == CONFIG_DEST:
            continue
        name = longs[0][2:]
        keys[name] = Key(name, action.dest, _kind(action), tuple(action.choices) if action.choices else None,
                         action.default, action.type if isinstance(action.type, Bound) else None)
    return keys


_KIND_WORDS = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string",
               "list": "a string or a list of strings"}


def _convert(key: Key, value: Any, where: str) -> Any:
    """The value as the parser would have produced it from a flag, or a ConfigError."""
    bad = ConfigError(f"{where}: key '{key.name}': expected {_KIND_WORDS[key.kind]}, got {value!r} "
                      f"({type(value).__name__})")
    if key.kind == "bool":
        if not isinstance(value, bool):
            raise bad
    elif key.kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
    elif key.kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        value = float(value)
    elif key.kind == "list":
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise bad
    elif key.name == "endpoints" and isinstance(value, list):
        # a fleet reads better as a YAML list; the flag's form is comma-separated
        if not value or not all(isinstance(v, str) and v.strip() for v in value):
            raise bad
        value = ",".join(v.strip() for v in value)
    elif not isinstance(value, str):
        raise bad
    if key.bound and (problem := key.bound.problem(value)):
        raise ConfigError(f"{where}: key '{key.name}': {value!r} {problem}")
    if key.choices and value not in key.choices:
        raise ConfigError(f"{where}: key '{key.name}': {value!r} is not one of {', '.join(map(str, key.choices))}")
    return value


def load_config(path: str | Path) -> dict[str, Any]:
    """Read and check a config file; returns {argparse dest: value}."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"--replay-config {path}: cannot read: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{path}:{line}: not UTF-8: byte 0x{data[e.start]:02x}") from None
    import yaml  # here, not at the top: only a run with a config file pays its import

    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return {}
        if not isinstance(root, yaml.MappingNode):
            raise ConfigError(f"{path}:{root.start_mark.line + 1}: expected a mapping of option names to values")
        pairs = [(k.value if isinstance(k, yaml.ScalarNode) else None, k.start_mark.line + 1,
                  loader.construct_object(v, deep=True)) for k, v in root.value]
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    finally:
        loader.dispose()
    keys = config_keys()
    valid = ", ".join(sorted(keys))
    out: dict[str, Any] = {}
    seen: dict[str, Any] = {}  # dest -> the key that set it, as written
    for raw, line, value in pairs:
        where = f"{path}:{line}"
        key = keys.get(raw.lstrip("-").replace("_", "-")) if raw else None
        if key is None:
            hint = " (a config cannot name another)" if raw and raw.strip("-") in ("replay-config", "replay_config") else ""
            raise ConfigError(f"{where}: unknown key {raw!r}{hint}; valid keys: {valid}")
        if key.dest in seen:
            raise ConfigError(f"{where}: key {raw!r} given twice (also as {seen[key.dest]!r})")
        seen[key.dest] = raw
        out[key.dest] = _convert(key, value, where)
    return out


def given_on_command_line(argv: Sequence[str]) -> set[str]:
    """The replay options (dests) that `argv` sets, whatever their value."""
    parser = _replay_parser(argument_default=argparse.SUPPRESS)
    for action in parser._actions:
        action.default = argparse.SUPPRESS
        action.required = False
    namespace, _ = parser.parse_known_args(list(argv))
    return set(vars(namespace))


def apply_config(parsed: argparse.Namespace, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Merge the file named by parsed.replay_config into `parsed`; returns what it set.

    An option keeps its parsed value when it was given on the command line (`argv`,
    default sys.argv) or differs from its default (Locust's own config file can set it);
    otherwise the file's value applies.
    """
    path = getattr(parsed, CONFIG_DEST, None)
    if not path or getattr(parsed, _APPLIED, None) == path:
        return {}
    values = load_config(path)
    explicit = given_on_command_line(sys.argv[1:] if argv is None else argv)
    defaults = {k.dest: k.default for k in config_keys().values()}
    applied = {}
    for dest, value in values.items():
        current = getattr(parsed, dest, defaults[dest])
        if dest in explicit or current != defaults[dest]:
            continue
        setattr(parsed, dest, value)
        applied[dest] = value
    setattr(parsed, _APPLIED, path)  # once: a second call must not undo changes made since
    return applied


def replay_options(parsed: argparse.Namespace) -> ReplayOptions:
    """The run's options: --replay-config merged into `parsed` (flags win), then read."""
    apply_config(parsed)
    return ReplayOptions.from_parsed(parsed)

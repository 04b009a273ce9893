"""Every number every command takes has one range (replay/bounds.py), declared as its flag's
type: nan, inf, 0, a negative, 1e-300 and 1e300 are each accepted because they make sense or
refused, exit 2, in one line naming the option and the range. The options are enumerated from
the parsers themselves (`replay run`'s from ReplayOptions, the others from replay.cli), so a
new numeric option declared with a bare int or float fails here.

Before the ranges, `--cooldown 1e300` waited for ever after a capacity search's first probe,
`--search-precision 1e-300` bisected for ever, `--scale 1e-300` or `--time-scale 1e-300` never
sent or wrote times of 1e300 seconds, and a config file's value skipped the flag's checks.
"""

from __future__ import annotations

import argparse
import math

import pytest

from replay.bounds import Bound
from replay.cli import Parser, build_parser, commands
from replay.engine.capacity import MIN_PROBE_ROWS
from replay.engine.options import ReplayOptions, add_arguments
from replay.errors import OptionError
from replay.output_claim import PathRole
from replay.run.config import ConfigError, load_config
from replay.sim.options import SimOptions, validate
from support.processes import replay_args, run_replay
from support.traces import mooncake_trace

VALUES = ("nan", "inf", "-inf", "0", "-1", "1e-300", "1e300")
NEVER = {"nan", "inf", "-inf", "1e300"}  # no option has a use for these


def run_parser() -> argparse.ArgumentParser:
    """`replay run`'s options on a parser that errs in one line, as Locust's does (the last test)."""
    parser = Parser(prog="replay run")
    add_arguments(parser)
    return parser


def every_command() -> list[tuple[str, argparse.ArgumentParser]]:
    others = [(words, parser) for words, parser in commands(build_parser()) if words != "replay run"]
    return [("replay run", run_parser()), *others]


def typed_actions() -> list[tuple[str, argparse.ArgumentParser, argparse.Action]]:
    """Every option with a type (a number's is its Bound), of every command; a path's type is its
    role in the output claim (replay/output_claim.py), not a number's."""
    return [(words, parser, action) for words, parser in every_command() for action in parser._actions
            if action.type not in (None, str) and not isinstance(action.type, PathRole) and action.option_strings]


NUMBERS = [(words, parser, action) for words, parser, action in typed_actions() if isinstance(action.type, Bound)]


def test_every_command_and_its_numbers_are_found():
    words = {w for w, _ in every_command()}
    assert {"replay run", "replay sim", "replay report", "replay compare", "replay prompts check",
            "replay trace convert", "replay trace amplify", "replay trace validate", "replay trace stats"} <= words
    assert len(NUMBERS) > 50, len(NUMBERS)


def test_every_number_has_a_bound():
    """A numeric option typed int or float (or a hand-written parse function) has no range."""
    unbounded = [f"{words} {action.option_strings[0]}: {action.type!r}" for words, _, action in typed_actions()
                 if not isinstance(action.type, Bound)]
    assert unbounded == []


def parse_one(parser: argparse.ArgumentParser, flag: str, text: str, capsys) -> str | None:
    """The error line argparse gives `flag text` alone (None: the value was taken; what a
    command's required arguments then say is not this test's)."""
    try:
        parser.parse_args([f"{flag}={text}"])
    except SystemExit as stop:
        assert stop.code == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1, error  # one line, not the usage first
        return error if f"argument {flag}" in error else None
    return None


@pytest.mark.parametrize("text", VALUES)
@pytest.mark.parametrize("words, parser, action", NUMBERS,
                         ids=[f"{w} {a.option_strings[0]}" for w, _, a in NUMBERS])
def test_a_number_is_taken_in_its_range_or_refused_in_one_line(words, parser, action, text, capsys):
    flag, bound = action.option_strings[0], action.type
    error = parse_one(parser, flag, text, capsys)
    if error is None:
        assert text not in NEVER, f"{words} {flag} {text} was taken"
        assert bound.problem(int(text) if bound.integer else float(text)) is None
        return
    # "replay sim: error: argument --port: must be 0 to 65535, got 1e300": the option, the range, the value
    assert "argument " in error and bound.words() in error and text in error, error
    assert not bound.integer or "." in text or "e" in text or "n" in text or bound.problem(int(text)), error


@pytest.mark.parametrize("name", [f.name for f in ReplayOptions.__dataclass_fields__.values()
                                  if isinstance(f.metadata.get("type"), Bound)])
def test_a_value_that_came_another_way_is_held_to_the_same_range(name):
    """The web UI's form and the workers' plan give ReplayOptions values no flag parsed: check()
    refuses them, naming the option and the range."""
    bound = ReplayOptions.__dataclass_fields__[name].metadata["type"]
    for value in (math.nan, math.inf, 1e300, -1e300):
        value = int(min(max(value, -1e30), 1e30)) if bound.integer and math.isfinite(value) else value
        if bound.integer and not math.isfinite(value):
            continue
        options = ReplayOptions(trace="t", tokenizer="tok", **{name: value})
        with pytest.raises(OptionError) as refused:
            options.check()
        message = str(refused.value)
        assert message.startswith(f"--{name.replace('_', '-')} ") and bound.words() in message, message
        assert "\n" not in message


@pytest.mark.parametrize("text, message", [
    ("cooldown: 1.0e+300\n", "key 'cooldown': 1e+300 must be 0 to 3600 seconds"),
    ("search-precision: 1.0e-300\n", "key 'search-precision': 1e-300 must be 0.001 to 1"),
    ("scale: .nan\n", "key 'scale': nan must be 0.001 to 10000"),
    ("probe_duration: 0\n", "key 'probe-duration': 0.0 must be 0.001 to 604800 trace seconds"),
    ("seed: -1\n", "key 'seed': -1 must be 0 to 9223372036854775807"),
    ("max-error-rate: 2\n", "key 'max-error-rate': 2.0 must be 0 to 1"),
])  # fmt: skip
def test_a_config_file_value_is_held_to_the_flag_range(tmp_path, text, message):
    """A --replay-config value out of range is refused naming the file, the line and the key
    (it once skipped every check the flag had)."""
    path = tmp_path / "run.yaml"
    path.write_text("trace: t.jsonl\n" + text)
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert str(refused.value).startswith(f"{path}:2: {message}")


def test_the_sim_api_is_held_to_the_flag_ranges(toy_tokenizer_dir):
    for change in ({"ttft_ms": 1e300}, {"port": 70000}, {"jitter": math.nan}, {"max_num_seqs": 0}):
        with pytest.raises(ValueError, match="must be"):
            validate(SimOptions(tokenizer=str(toy_tokenizer_dir), **change))
    validate(SimOptions(tokenizer=str(toy_tokenizer_dir), stall_ms=0.0, error_rate=1.0))


@pytest.mark.parametrize("flags, message", [
    (["--cooldown", "1e300"], "argument --cooldown: must be 0 to 3600 seconds, got 1e300"),
    (["--search-precision", "1e-300"], "argument --search-precision: must be 0.001 to 1 (a bracket narrower"),
    (["--probe-duration", "1e-300"], "argument --probe-duration: must be 0.001 to 604800 trace seconds"),
    (["--scale", "1e-300"], "argument --scale: must be 0.001 to 10000, got 1e-300"),
    (["--max-error-rate", "2"], "argument --max-error-rate: must be 0 to 1 (1: never stop), got 2"),
])  # fmt: skip
def test_replay_run_refuses_a_number_out_of_range(tmp_path, toy_tokenizer_dir, flags, message):
    """Through Locust's own parser: exit 2, the option and its range, nothing written."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=3, gap_ms=10)
    args = replay_args(trace, toy_tokenizer_dir, "http://127.0.0.1:9", tmp_path / "run.jsonl", "--capacity-search",
                       "--slo", "ttft_ms=100", *flags)
    proc = run_replay(args, tmp_path, 60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run.jsonl").exists()


def test_a_probe_too_short_to_judge_is_refused(tmp_path, toy_tokenizer_dir, sim):
    """--probe-duration 0.001 took one row of the trace per probe and answered "at least 64x"
    with no warning: a probe of fewer than MIN_PROBE_ROWS rows is refused before the search."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=40, gap_ms=10)
    args = replay_args(trace, toy_tokenizer_dir, sim.url, tmp_path / "run.jsonl", "--capacity-search", "--slo",
                       "ttft_ms=1000", "--verify-server", "off", "--probe-duration", "0.001")
    proc = run_replay(args, tmp_path, 60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (f"--probe-duration 0.001: a probe would replay 1 rows of the trace; judging its goodput takes at least "
            f"{MIN_PROBE_ROWS}") in proc.stderr, proc.stderr[-2000:]

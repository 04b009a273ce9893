"""`replay trace stats|validate|convert`, through the real command line."""

from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from replay.cli import main
from replay.trace import Trace, read_trace, select_rows
from replay.trace.convert import rescale_length
from replay.trace.record import TraceRow
from replay.trace.stats import trace_stats
from support.paths import shared_path
from support.traces import (
    AZURE_HEADER,
    GZIP_DAMAGES,
    HUGE,
    bailian_rows,
    damaged_gzip,
    huge_prompt_trace,
    mooncake_rows,
    write_jsonl,
)

MOONCAKE = ("traces", "mooncake_synthetic_trace.jsonl")
AZURE = ("traces", "azure_conv_2023.csv")


def replay_command() -> list[str]:
    script = Path(sys.executable).parent / "replay"
    return [str(script)] if script.exists() else [sys.executable, "-m", "replay"]


def run_replay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(replay_command() + list(args), capture_output=True, text=True, timeout=60)


def stats_json(capsys, *args) -> dict:
    assert main(["trace", "stats", "--json", *map(str, args)]) == 0
    return json.loads(capsys.readouterr().out)


# --- stats -----------------------------------------------------------------------------------


def test_stats_of_the_shared_mooncake_trace():
    path = shared_path(*MOONCAKE)
    done = run_replay("trace", "stats", "--json", str(path))
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout)
    assert stats["requests"] == 3993 and stats["skipped"] == 0
    assert round(stats["duration_s"]) == 1022
    assert round(stats["ideal_prefix_hit_ratio"], 2) == 0.64
    assert round(stats["ideal_prefix_hit_ratio_tokens"], 2) == 0.65
    assert stats["input_length"]["p99"] == 66458 and stats["input_length"]["max"] == 191378
    assert round(stats["input_length"]["mean"]) == 15325 and round(stats["output_length"]["mean"]) == 149
    assert stats["mean_rps"] == pytest.approx(3993 / stats["duration_s"])
    assert 1 <= stats["peak_rps_1s"] < 3993 and stats["distinct_hash_ids"] > 0


def test_stats_of_the_shared_azure_trace(capsys):
    stats = stats_json(capsys, shared_path(*AZURE))
    assert (stats["requests"], stats["format"]) == (19366, "azure")
    assert round(stats["duration_s"]) == 3502 and round(stats["mean_rps"], 1) == 5.5
    assert stats["ideal_prefix_hit_ratio"] is None and stats["distinct_hash_ids"] == 0
    assert main(["trace", "stats", str(shared_path(*AZURE))]) == 0
    text = capsys.readouterr().out
    assert "19,366" in text and "azure" in text


def test_stats_of_a_hand_made_trace_and_its_text_form(tmp_path, capsys):
    # rows 0..2 share block 5 then diverge; row 3 repeats row 1 entirely
    rows = [
        {"timestamp": 0, "input_length": 20, "output_length": 1, "hash_ids": [5, 6]},
        {"timestamp": 100, "input_length": 30, "output_length": 2, "hash_ids": [5, 7, 8]},
        {"timestamp": 900, "input_length": 10, "output_length": 3, "hash_ids": [5]},
        {"timestamp": 2500, "input_length": 30, "output_length": 4, "hash_ids": [5, 7, 8]},
    ]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    stats = stats_json(capsys, path, "--block-size", 12)
    assert stats["block_size"] == 12 and stats["requests"] == 4
    assert stats["duration_s"] == 2.5 and stats["mean_rps"] == 4 / 2.5 and stats["peak_rps_1s"] == 3
    assert stats["distinct_hash_ids"] == 4
    # hits: 0, 1, 1, 3 of 2+3+1+3 blocks; tokens 0 + 12 + 10 + 30 of 90
    assert stats["ideal_prefix_hit_ratio"] == pytest.approx(5 / 9)
    assert stats["ideal_prefix_hit_ratio_tokens"] == pytest.approx(52 / 90)
    assert stats["input_length"] == {"mean": 22.5, "p50": 20, "p90": 30, "p99": 30, "max": 30}
    assert main(["trace", "stats", str(path), "--block-size", "12"]) == 0
    text = capsys.readouterr().out
    assert "0.5556 (blocks)" in text and "requests    4" in text


def test_stats_reports_sessions_and_skipped_rows(tmp_path, capsys):
    path = write_jsonl(tmp_path / "b.jsonl", bailian_rows() + ["{broken"])
    assert main(["trace", "stats", "--json", str(path)]) == 1
    assert "b.jsonl:6: field '(json)'" in capsys.readouterr().err
    assert main(["trace", "stats", "--json", str(path), "--on-bad-line", "skip"]) == 0
    captured = capsys.readouterr()
    assert "b.jsonl:6: field '(json)'" in captured.err  # a skipped row is never silent
    stats = json.loads(captured.out)
    assert (stats["requests"], stats["skipped"], stats["sessions"]) == (5, 1, 2)
    assert stats["turns_per_session"]["max"] == 3


# Forks the command from a small process of its own: a child's peak RSS starts at its parent's
# size when forked (the kernel keeps the high-water mark across exec), and this test process has
# hundreds of MB late in a suite run.
PEAK_RSS_LAUNCHER = """
import os, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
sys.stderr.write(f"\\npeak_rss_kib {usage.ru_maxrss}\\n")
sys.exit(os.waitstatus_to_exitcode(status))
"""


def peak_rss_mb(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    """Run `replay ARGS`; (its result, its own peak RSS in MB, from wait4 in a small launcher)."""
    done = subprocess.run([sys.executable, "-c", PEAK_RSS_LAUNCHER, *replay_command(), *args], capture_output=True)
    err, _, peak = done.stderr.rpartition(b"\npeak_rss_kib ")
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout, err), int(peak) / 1024


def test_validate_and_stats_hold_no_rows(tmp_path):
    """300,000 rows, 600,000 distinct hash ids: validate took 155 MB and stats 257 MB (every row
    held; 817 MB and 1.4 GB at 2,000,000 rows). Now validate holds no row and stats a time per
    row and ~50 bytes per distinct id; the bounds leave room for the interpreter (~40 MB)."""
    path = tmp_path / "big.jsonl"
    with open(path, "wb") as f:
        for start in range(0, 300_000, 10_000):
            f.write(b"".join(b'{"timestamp":%d,"input_length":60,"output_length":4,"hash_ids":[%d,%d,%d,%d]}\n'
                             % (i * 5, i % 8, 100 + i % 8, 1000 + 2 * i, 1001 + 2 * i)
                             for i in range(start, start + 10_000)))
    done, validate_mb = peak_rss_mb("trace", "validate", str(path), "--block-size", "16")
    assert done.returncode == 0 and b"OK:" in done.stdout, done.stderr
    assert validate_mb < 80, f"validate peak RSS {validate_mb:.0f} MB"
    done, stats_mb = peak_rss_mb("trace", "stats", "--json", str(path), "--block-size", "16")
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout)
    assert stats["distinct_hash_ids"] == 600_016 and stats["ideal_prefix_hit_ratio"] == pytest.approx(0.5, abs=1e-4)
    assert stats_mb < 150, f"stats peak RSS {stats_mb:.0f} MB"


# --- validate --------------------------------------------------------------------------------


def test_validate_exit_codes_through_the_console_script(tmp_path):
    good = run_replay("trace", "validate", str(shared_path(*MOONCAKE)))
    assert good.returncode == 0, good.stdout + good.stderr
    assert good.stdout.startswith("OK:") and "3993 rows" in good.stdout
    bad_rows = [{"timestamp": i, "input_length": 600, "output_length": 1, "hash_ids": [1]} for i in range(60)]
    bad = write_jsonl(tmp_path / "bad.jsonl", mooncake_rows(2) + bad_rows)
    done = run_replay("trace", "validate", str(bad))
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    assert lines[0] == f"{bad}:3: field 'hash_ids': has 1 ids but input_length 600 needs ceil(600/512) = 2"
    assert lines[49].startswith(f"{bad}:52: field 'hash_ids'")
    assert lines[50] == "... and 10 more"
    assert lines[51] == f"INVALID: {bad}: 60 bad rows, 2 good (mooncake)"
    undetectable = tmp_path / "what.csv"
    undetectable.write_text("x,y\n")
    done = run_replay("trace", "validate", str(undetectable))
    assert done.returncode == 1 and "what.csv:1: field '(format)'" in done.stderr
    assert "give it with --trace-format (mooncake, bailian, jsonl, azure, burstgpt)" in done.stderr


def test_the_bundled_sample_validates_as_shipped(capsys):
    """Its rows carry their block size (16): no --block-size, and Mooncake's default (512) is not
    applied to it."""
    sample = Path(__file__).resolve().parent.parent / "replay" / "data" / "sample_trace.jsonl"
    assert main(["trace", "validate", str(sample)]) == 0
    assert capsys.readouterr().out == f"OK: {sample}: 258 rows (jsonl, block size 16)\n"


def test_trace_format_is_the_flag_of_every_command(tmp_path, capsys):
    """The name the hint gives (and a run and report use); --format and convert's --from stay."""
    path = write_jsonl(tmp_path / "m.jsonl", mooncake_rows(3))
    for command in (["trace", "validate", str(path)], ["trace", "stats", str(path)],
                    ["trace", "convert", str(path), str(tmp_path / "out.jsonl")]):
        assert main([*command, "--trace-format", "bailian"]) != 0, command
        assert main([*command, "--trace-format", "mooncake"]) == 0, command
    capsys.readouterr()


def test_validate_the_shared_azure_trace_and_a_format_override(tmp_path, capsys):
    assert main(["trace", "validate", str(shared_path(*AZURE))]) == 0
    assert "19366 rows (azure)" in capsys.readouterr().out
    path = write_jsonl(tmp_path / "m.jsonl", mooncake_rows(3))
    assert main(["trace", "validate", str(path), "--format", "bailian"]) == 1
    assert f"{path}:1: field 'chat_id': missing" in capsys.readouterr().out


def test_validate_max_prompt_tokens_in_every_format(tmp_path, capsys):
    for fmt in ("mooncake", "jsonl", "bailian", "azure", "burstgpt"):
        path, line = huge_prompt_trace(tmp_path, fmt)
        assert main(["trace", "validate", str(path)]) == 1, fmt  # the default bound is on
        lines = capsys.readouterr().out.splitlines()
        assert lines == [
            f"{path}:{line}: field 'input_length': {HUGE} tokens is over the limit of 1048576 (--max-prompt-tokens)",
            f"INVALID: {path}: 1 bad rows, 3 good ({fmt})",
        ]
        assert main(["trace", "validate", str(path), "--max-prompt-tokens", "0"]) == 0  # 0: no bound
        assert capsys.readouterr().out.startswith(f"OK: {path}: 4 rows ({fmt}")
        assert main(["trace", "validate", str(path), "--max-prompt-tokens", str(HUGE - 1)]) == 1
        assert f"over the limit of {HUGE - 1} (--max-prompt-tokens)" in capsys.readouterr().out


def test_validate_refuses_a_negative_max_prompt_tokens(tmp_path):
    path, _ = huge_prompt_trace(tmp_path, "mooncake")
    done = run_replay("trace", "validate", str(path), "--max-prompt-tokens", "-1")
    assert done.returncode == 2 and "--max-prompt-tokens: must be 0 to 9223372036854775807 tokens, got -1" in done.stderr


SPAN_RULE = "a trace spans at most 315576000 s (10 years)"
PAST_ANY = "past any trace's time (at most 1e+13 s from 0, in either direction)"


@pytest.mark.parametrize("fmt, text, line, field, message", [
    ("mooncake", '{"timestamp": 0, "input_length": 1, "output_length": 1}\n'
                 '{"timestamp": 1e15, "input_length": 1, "output_length": 1}\n'
                 '{"timestamp": 5, "input_length": 1, "output_length": 1}\n',
     2, "timestamp", f"1e+12 s is 1e+12 s from an earlier row's 0 s; {SPAN_RULE}"),
    ("mooncake", '{"timestamp": 0, "input_length": 1, "output_length": 1}\n'
                 '{"timestamp": 1e300, "input_length": 1, "output_length": 1}\n'
                 '{"timestamp": 5, "input_length": 1, "output_length": 1}\n',
     2, "timestamp", f"1e+297 s is {PAST_ANY}"),
    ("mooncake", '{"timestamp": 5e15, "input_length": 1, "output_length": 1}\n'
                 '{"timestamp": -5e15, "input_length": 1, "output_length": 1}\n'
                 '{"timestamp": 5e15, "input_length": 1, "output_length": 1}\n',
     2, "timestamp", f"-5e+12 s is 1e+13 s from an earlier row's 5e+12 s; {SPAN_RULE}"),
    ("jsonl", '{"delay": 0, "input_length": 1, "output_length": 1}\n'
              '{"delay": 1e15, "input_length": 1, "output_length": 1}\n'
              '{"timestamp": 5, "input_length": 1, "output_length": 1}\n',
     2, "delay", f"1e+12 s is 1e+12 s from an earlier row's 0 s; {SPAN_RULE}"),
    ("bailian", '{"chat_id": 1, "parent_chat_id": -1, "timestamp": 1e12, "input_length": 1, "output_length": 1}\n'
                '{"chat_id": 2, "parent_chat_id": -1, "timestamp": 0, "input_length": 1, "output_length": 1}\n'
                '{"chat_id": 3, "parent_chat_id": -1, "timestamp": 1e12, "input_length": 1, "output_length": 1}\n',
     2, "timestamp", f"0 s is 1e+12 s from an earlier row's 1e+12 s; {SPAN_RULE}"),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1,1\n9999-11-16 18:15:46,1,1\n"
              "2023-11-16 18:15:47,1,1\n",
     3, "TIMESTAMP", f"2.51698e+11 s is 2.51698e+11 s from an earlier row's 0 s; {SPAN_RULE}"),
    ("burstgpt", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n0,m,1,1,2,x\n"
                 "1e12,m,1,1,2,x\n3,m,1,1,2,x\n",
     3, "Timestamp", f"1e+12 s is 1e+12 s from an earlier row's 0 s; {SPAN_RULE}"),
])  # fmt: skip
def test_validate_refuses_a_trace_longer_than_any_replay(tmp_path, capsys, fmt, text, line, field, message):
    """A row 10^297 s after the others used to be OK here and then spun a core in the replay
    (its send time overflowed the timer). The span rule is the readers' own, so the replay
    refuses the same row (tests/test_locust.py)."""
    path = tmp_path / ("trace.csv" if fmt in ("azure", "burstgpt") else "trace.jsonl")
    path.write_text(text)
    assert main(["trace", "validate", str(path), "--format", fmt]) == 1
    assert capsys.readouterr().out.splitlines() == [f"{path}:{line}: field '{field}': {message}",
                                                    f"INVALID: {path}: 1 bad rows, 2 good ({fmt})"]


def test_integers_beyond_64_bits_are_named_as_such(tmp_path, capsys):
    """orjson reads a JSON integer beyond 64 bits as a float: validate called one such hash id
    "not an integer: 1e+23" and took a 30-digit input_length as the float's rounded digits."""
    rows = ['{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [99999999999999999999999]}',
            '{"timestamp": 1, "input_length": 123456789012345678901234567890, "output_length": 1}',
            '{"timestamp": 2, "input_length": 10, "output_length": 18446744073709551615}',
            '{"timestamp": 3, "input_length": 10, "output_length": 1, "hash_ids": [18446744073709551615]}']
    path = tmp_path / "big.jsonl"
    path.write_text("\n".join(rows) + "\n")
    assert main(["trace", "validate", str(path), "--block-size", "16"]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"{path}:1: field 'hash_ids': item 0 is an integer beyond 64 bits (a JSON integer this long is read as "
        "the float 1e+23)",
        f"{path}:2: field 'input_length': an integer beyond 64 bits (a JSON integer this long is read as the float "
        "1.2345678901234568e+29)",
        f"{path}:3: field 'output_length': an integer beyond 64 bits: 18446744073709551615",
        f"INVALID: {path}: 3 bad rows, 1 good (mooncake)",  # an unsigned 64-bit hash id is fine
    ]
    csv = tmp_path / "burst.csv"
    csv.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                   "0,m,123456789012345678901234567890,1,2,x\n")
    assert main(["trace", "validate", str(csv)]) == 1
    assert capsys.readouterr().out.splitlines()[0] == (
        f"{csv}:2: field 'Request tokens': an integer beyond 64 bits: 123456789012345678901234567890")


@pytest.mark.parametrize("scale", ["nan", "inf", "1e-308", "1e-9"])
def test_convert_refuses_a_time_scale_that_breaks_the_times(tmp_path, capsys, scale):
    """nan, inf and 1e-308 wrote `"timestamp": null` (orjson's non-finite float), which reads
    back as no timestamp: every row at once, silently. The run's --scale range holds."""
    source = write_jsonl(tmp_path / "m.jsonl", mooncake_rows(8))  # rows every 0.25 s
    out = tmp_path / "out.jsonl"
    with pytest.raises(SystemExit) as stop:
        main(["trace", "convert", str(source), str(out), "--time-scale", scale])
    assert stop.value.code == 2
    assert f"argument --time-scale: must be 0.001 to 10000, got {scale}" in capsys.readouterr().err
    assert not out.exists()


def test_convert_refuses_a_negative_max_rows(tmp_path):
    source = write_jsonl(tmp_path / "m.jsonl", mooncake_rows(3))
    done = run_replay("trace", "convert", str(source), str(tmp_path / "out.jsonl"), "--max-rows=-1")
    assert done.returncode == 2 and "--max-rows: must be 0 to 9223372036854775807, got -1" in done.stderr, done.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_block_sizes_are_bounded(tmp_path, capsys):
    """--block-size 10^12 ran out of memory and 2^62 overflowed (tracebacks, exit 1); the bound
    is stated and the same for the option and a row's own block_size."""
    path = write_jsonl(tmp_path / "m.jsonl", mooncake_rows(2))
    for command in ("validate", "stats"):
        for size in (str(10**12), str(2**62), "0", "-1"):
            done = run_replay("trace", command, str(path), "--block-size", size)
            assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
            assert f"--block-size: must be 1 to 1048576 tokens (a block is never longer than the longest prompt), " \
                   f"got {size}" in done.stderr, done.stderr
    rows = [{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1], "block_size": 2**40}]
    path = write_jsonl(tmp_path / "j.jsonl", rows)
    assert main(["trace", "validate", str(path)]) == 1
    assert capsys.readouterr().out.splitlines()[0] == (
        f"{path}:1: field 'block_size': {2**40}: must be 1 to 1048576 tokens (a block is never longer than the "
        "longest prompt)")


# --- files that cannot be read ----------------------------------------------------------------


def command_line(command: str, path: Path, tmp_path: Path) -> list[str]:
    return ["trace", command, str(path)] + ([str(tmp_path / "out.jsonl")] if command == "convert" else [])


def assert_one_line_error(done: subprocess.CompletedProcess, *parts: str) -> None:
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith("error: "), done.stderr
    for part in parts:
        assert part in done.stderr, done.stderr


@pytest.mark.parametrize("command", ["validate", "stats", "convert"])
def test_a_damaged_gzip_is_one_line_naming_file_and_line(tmp_path, command):
    for damage in GZIP_DAMAGES:
        path, line, message = damaged_gzip(tmp_path, damage)
        done = run_replay(*command_line(command, path, tmp_path))
        assert_one_line_error(done, f"error: {path}:{line}: field '(gzip)': {message}")
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("command", ["validate", "stats", "convert"])
def test_csv_that_is_not_utf8_names_line_3(tmp_path, command):
    path = tmp_path / "azure.csv.gz"
    path.write_bytes(gzip.compress(AZURE_HEADER + b"2023-11-16 18:15:46,1,2\n2023-11-16 18:15:47,\xff1,2\n"))
    done = run_replay(*command_line(command, path, tmp_path))
    expected = f"{path}:3: field '(csv)': invalid UTF-8: byte 0xff in column 'ContextTokens'"
    assert done.returncode == 1 and "Traceback" not in done.stderr
    if command == "validate":  # a bad row like any other: listed, and the file is INVALID
        assert done.stdout.splitlines() == [expected, f"INVALID: {path}: 1 bad rows, 1 good (azure)"]
    else:
        assert_one_line_error(done, f"error: {expected}")


@pytest.mark.parametrize("command", ["validate", "stats", "convert"])
def test_an_unreadable_file_is_one_line_naming_it(tmp_path, command):
    for path in (tmp_path / "missing.jsonl", tmp_path):  # a directory is no trace either
        done = run_replay(*command_line(command, path, tmp_path))
        assert_one_line_error(done, f"'{path}'")


@pytest.mark.skipif(os.geteuid() == 0, reason="runs only as a user other than root: root reads a file whatever "
                                                 "its permissions say")
@pytest.mark.parametrize("command", ["validate", "stats", "convert"])
def test_a_file_without_read_permission_is_one_line_naming_it(tmp_path, command):
    path = write_jsonl(tmp_path / "secret.jsonl", mooncake_rows(2))
    path.chmod(0)
    done = run_replay(*command_line(command, path, tmp_path))
    assert_one_line_error(done, "Permission denied", f"'{path}'")


# --- convert ---------------------------------------------------------------------------------


def test_convert_window_and_time_scale(tmp_path, capsys):
    source = write_jsonl(tmp_path / "m.jsonl", mooncake_rows(8))  # rows every 0.25 s
    out = tmp_path / "w.jsonl"
    args = ["trace", "convert", str(source), str(out), "--start", "0.5", "--duration", "1", "--time-scale", "2"]
    assert main(args) == 0
    assert "wrote 4 of 8 rows" in capsys.readouterr().out
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["timestamp"] for r in records] == [0, 125, 250, 375]  # (t - 0.5 s) / 2, in ms
    originals = mooncake_rows(8)[2:6]
    assert [r["hash_ids"] for r in records] == [o["hash_ids"] for o in originals]
    assert all("block_size" not in r for r in records)  # 512 is the default: nothing to say
    assert main(["trace", "convert", str(source), str(tmp_path / "first3.jsonl"), "--max-rows", "3"]) == 0
    assert len(read_trace(tmp_path / "first3.jsonl").rows) == 3
    assert main(["trace", "convert", str(source), str(tmp_path / "none.jsonl"), "--start", "60"]) == 0
    assert "wrote 0 of 8 rows" in capsys.readouterr().out
    assert (tmp_path / "none.jsonl").read_text() == ""


def test_a_duration_without_a_start_counts_from_the_first_row(tmp_path, capsys):
    """A trace of epoch times (or cut from a longer one) does not start at 0: `--duration 1`
    alone is its first second, not the second after 1970."""
    rows = mooncake_rows(8)  # every 0.25 s
    for r in rows:
        r["timestamp"] += 1_715_299_200_000
    source = write_jsonl(tmp_path / "epoch.jsonl", rows)
    out = tmp_path / "w.jsonl"
    assert main(["trace", "convert", str(source), str(out), "--duration", "1"]) == 0
    assert "wrote 4 of 8 rows" in capsys.readouterr().out
    assert [json.loads(line)["timestamp"] for line in out.read_text().splitlines()] == \
        [r["timestamp"] for r in rows[:4]]  # fmt: skip
    assert [r.timestamp_s for r in select_rows(read_trace(source).rows, duration=0.5)] == \
        [1_715_299_200.0, 1_715_299_200.25]  # fmt: skip
    first = 1036801.355976058  # (first + duration) - duration rounds above first: still in order
    in_order = [TraceRow(i, first + i, 10, 1) for i in range(3)]
    assert select_rows(in_order, duration=62568.33656514532) == in_order
    unsorted = write_jsonl(tmp_path / "unsorted.jsonl", [rows[5], *rows[:5], *rows[6:]])  # the first is not the earliest
    assert main(["trace", "convert", str(unsorted), str(tmp_path / "u.jsonl"), "--duration", "1"]) == 1
    assert ("--duration 1 without --start counts from the trace's first row (at 1715299201.25 s), but an earlier row "
            "is at 1715299200 s (the rows are not in time order): give --start, e.g. --start 1715299200") \
        in capsys.readouterr().err  # fmt: skip
    assert main(["trace", "convert", str(unsorted), str(tmp_path / "u.jsonl"), "--duration", "1", "--start",
                 "1715299200"]) == 0  # fmt: skip


def test_convert_rescale_keeps_the_block_rule_and_the_hit_ratio(tmp_path, capsys):
    source = shared_path(*MOONCAKE)
    out = tmp_path / "small.jsonl.gz"
    assert main(["trace", "convert", str(source), str(out), "--max-rows", "300", "--block-size-to", "32"]) == 0
    capsys.readouterr()
    small = read_trace(out)  # no option: the rows say 32
    assert (small.block_size, len(small.rows), small.format) == (32, 300, "jsonl")
    original = select_rows(read_trace(source).rows, max_rows=300)
    for before, after in zip(original, small.rows):
        assert after.input_length == math.ceil(before.input_length * 32 / 512)
        assert after.hash_ids == before.hash_ids
        assert len(after.hash_ids) == math.ceil(after.input_length / 32)
        assert after.timestamp_s == before.timestamp_s
    stats = stats_json(capsys, out)
    before = trace_stats(Trace(str(source), "mooncake", 512, original))
    assert stats["ideal_prefix_hit_ratio"] == pytest.approx(before["ideal_prefix_hit_ratio"])


def test_rescale_length_property():
    for block_from, block_to in ((512, 32), (16, 512), (512, 512), (100, 7), (7, 100)):
        for length in range(0, 3000, 7):
            scaled = rescale_length(length, block_from, block_to)
            assert -(-scaled // block_to) == -(-length // block_from), (length, block_from, block_to)


def test_convert_azure_to_gzipped_jsonl_round_trip(tmp_path, capsys):
    source = tmp_path / "azure.csv"
    source.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
        "2023-11-16 18:16:00.0000001,1,0\n"
    )
    out = tmp_path / "azure.jsonl.gz"
    assert main(["trace", "convert", str(source), str(out)]) == 0
    assert out.read_bytes()[:2] == b"\x1f\x8b"
    back = read_trace(out)
    assert back.format == "mooncake"
    assert [(r.input_length, r.output_length) for r in back.rows] == [(374, 44), (396, 109), (1, 0)]
    assert [r.timestamp_s for r in back.rows] == pytest.approx([0.0, 4.314579, 13.3194101], abs=1e-9)
    assert main(["trace", "convert", str(source), str(tmp_path / "x.jsonl"), "--block-size-to", "32"]) == 1
    assert "no block size to rescale from" in capsys.readouterr().err


def test_convert_bailian_keeps_sessions_and_its_block_size(tmp_path):
    source = write_jsonl(tmp_path / "b.jsonl", bailian_rows())
    out = tmp_path / "b-out.jsonl"
    done = run_replay("trace", "convert", str(source), str(out), "--from", "bailian")
    assert done.returncode == 0, done.stderr
    first = json.loads(out.read_text().splitlines()[0])
    assert first["block_size"] == 16 and first["session_id"] == "10"
    back = read_trace(out)
    original = read_trace(source)
    assert (back.format, back.block_size) == ("jsonl", 16)
    assert [(r.session_id, r.hash_ids, r.input_length, r.timestamp_s) for r in back.rows] == [
        (r.session_id, r.hash_ids, r.input_length, r.timestamp_s) for r in original.rows]


def test_convert_keeps_messages_and_tools(tmp_path, capsys):
    messages = [{"role": "user", "content": "hi there"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    records = [
        {"session_id": "s", "timestamp": 1000, "messages": messages, "tools": tools, "output_length": 9},
        {"session_id": "s", "delay": 500, "input_length": 3, "output_length": 1},
    ]
    source = write_jsonl(tmp_path / "m.jsonl", records)
    out = tmp_path / "out.jsonl"
    assert main(["trace", "convert", str(source), str(out)]) == 0
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert written[0] == {"timestamp": 1000, "output_length": 9, "session_id": "s",
                          "messages": messages, "tools": tools}
    assert written[1] == {"timestamp": 1500, "input_length": 3, "output_length": 1, "session_id": "s"}


def test_convert_refuses_a_bad_input_and_names_the_line(tmp_path, capsys):
    source = write_jsonl(tmp_path / "bad.jsonl", mooncake_rows(2) + ['{"timestamp": 1}'])
    out = tmp_path / "out.jsonl"
    assert main(["trace", "convert", str(source), str(out)]) == 1
    assert "bad.jsonl:3: field 'input_length': missing" in capsys.readouterr().err
    assert main(["trace", "convert", str(source), str(out), "--on-bad-line", "skip"]) == 0
    captured = capsys.readouterr()
    assert "skipped 1 bad rows" in captured.err and "wrote 2 of 2 rows" in captured.out

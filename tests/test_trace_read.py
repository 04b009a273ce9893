"""Readers for every format, auto-detection, gzip, and the validation rules (file, line, field)."""

from __future__ import annotations

import gc
import gzip
import json
import os

import pytest

from replay.bounds import DEFAULT_MAX_PROMPT_TOKENS
from replay.trace import FORMATS, BadLine, TraceError, detect_format, prefix_hits, read_trace, source
from replay.trace.formats import parse_datetime
from replay.trace.record import Trace, TraceRow
from replay.trace.stats import trace_stats
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

# --- formats -------------------------------------------------------------------------------


def test_mooncake_rows_times_in_ms_and_line_numbers(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", mooncake_rows())
    trace = read_trace(path)
    assert (trace.format, trace.block_size, trace.skipped) == ("mooncake", 512, [])
    assert [r.timestamp_s for r in trace.rows] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert [r.request_id for r in trace.rows] == [0, 1, 2, 3, 4]
    assert [r.line for r in trace.rows] == [1, 2, 3, 4, 5]
    assert trace.rows[1].input_length == 1000 and trace.rows[1].output_length == 11
    assert trace.rows[1].hash_ids == (0, 101)
    assert trace.duration_s == 1.0


def test_blank_lines_are_not_rows_but_lines_still_count(tmp_path):
    rows = mooncake_rows(2)
    path = write_jsonl(tmp_path / "t.jsonl", [rows[0], "", "   ", rows[1]])
    trace = read_trace(path)
    assert [(r.request_id, r.line) for r in trace.rows] == [(0, 1), (1, 4)]


def test_a_byte_order_mark_is_not_part_of_the_first_row(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(mooncake_rows(1)[0]).encode() + b"\r\n")
    assert read_trace(path).rows[0].input_length == 700
    csv_path = tmp_path / "bom.csv"
    csv_path.write_bytes(b"\xef\xbb\xbfTIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 18:15:46.68,1,2\r\n")
    assert read_trace(csv_path).rows[0].output_length == 2


def test_gzip_is_read_transparently_even_when_misnamed(tmp_path):
    rows = mooncake_rows(3)
    for name in ("t.jsonl.gz", "t-really-gzip.jsonl"):
        trace = read_trace(write_jsonl(tmp_path / name, rows, gz=True))
        assert len(trace.rows) == 3 and trace.format == "mooncake"


def test_bailian_sessions_are_the_root_of_the_parent_chain(tmp_path):
    trace = read_trace(write_jsonl(tmp_path / "b.jsonl", bailian_rows()))
    assert (trace.format, trace.block_size) == ("bailian", 16)
    assert [r.session_id for r in trace.rows] == ["10", "20", "10", "20", "10"]
    assert [r.turn for r in trace.rows] == [1, 1, 2, 2, 3]
    assert [r.timestamp_s for r in trace.rows] == [0.0, 0.5, 1.25, 2.0, 3.5]  # seconds, not ms


def test_a_bailian_row_without_a_parent_is_a_first_turn(tmp_path):
    """AIPerf reads a missing or null parent_chat_id as -1: the row starts its own session."""
    rows = bailian_rows()
    del rows[0]["parent_chat_id"]
    rows[1]["parent_chat_id"] = None
    trace = read_trace(write_jsonl(tmp_path / "b.jsonl", rows))
    assert [r.session_id for r in trace.rows] == ["10", "20", "10", "20", "10"]


def test_bailian_children_before_parents_and_deep_chains(tmp_path):
    depth = 3000
    records = [
        {"chat_id": i, "parent_chat_id": i - 1 if i else -1, "timestamp": float(i),
         "input_length": 16, "output_length": 1, "type": "text", "turn": i + 1, "hash_ids": [i]}
        for i in range(depth)
    ]
    records.reverse()  # every child comes before its parent
    records.append({"chat_id": 99999, "parent_chat_id": 88888, "timestamp": 1.0,  # parent cut away
                    "input_length": 0, "output_length": 1, "hash_ids": []})
    trace = read_trace(write_jsonl(tmp_path / "deep.jsonl", records))
    assert {r.session_id for r in trace.rows[:depth]} == {"0"}
    assert trace.rows[-1].session_id == "88888"


def test_jsonl_delay_sessions_messages_and_tools(tmp_path):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    records = [
        {"session_id": "a", "input_length": 10, "output_length": 5},  # session start: t=0
        {"session_id": "b", "delay": 500, "input_length": 20, "output_length": 5},
        {"session_id": "a", "delay": 1500, "messages": messages, "tools": tools, "output_length": 3},
        {"session_id": "b", "timestamp": 4000, "text_input": "hello", "output_length": 2},
        {"session_id": "b", "delay": 250, "input_length": 600, "output_length": 1, "hash_ids": [1, 2], "gap_ms": 120},
    ]
    trace = read_trace(write_jsonl(tmp_path / "a.jsonl", records))
    assert [r.gap_s for r in trace.rows] == [None, None, None, None, 0.12]  # a recorded think time
    assert (trace.format, trace.block_size) == ("jsonl", 512)
    assert [r.timestamp_s for r in trace.rows] == [0.0, 0.5, 1.5, 4.0, 4.25]
    assert [r.session_id for r in trace.rows] == ["a", "b", "a", "b", "b"]
    assert trace.rows[2].messages == messages and trace.rows[2].tools == tools
    assert trace.rows[2].input_length == 0  # only a tokenizer can count a messages prompt
    assert trace.rows[3].messages == [{"role": "user", "content": "hello"}]


def test_jsonl_delay_without_sessions_follows_the_previous_row(tmp_path):
    records = [{"delay": 100, "input_length": 1, "output_length": 1},
               {"delay": 200, "input_length": 1, "output_length": 1}]
    trace = read_trace(write_jsonl(tmp_path / "d.jsonl", records))
    assert trace.format == "jsonl"
    assert [r.timestamp_s for r in trace.rows] == [0.1, pytest.approx(0.3)]


def test_jsonl_rows_carry_their_block_size(tmp_path):
    records = [{"timestamp": 0, "input_length": 40, "output_length": 1, "hash_ids": [1, 2], "block_size": 32}]
    path = write_jsonl(tmp_path / "b32.jsonl", records)
    assert read_trace(path).block_size == 32
    with pytest.raises(TraceError, match="ceil\\(40/16\\) = 3"):
        read_trace(path, block_size=16)  # an explicit override wins, and the rule then applies
    records.append({"timestamp": 1, "input_length": 40, "output_length": 1, "hash_ids": [1, 2], "block_size": 64})
    with pytest.raises(TraceError) as err:
        read_trace(write_jsonl(tmp_path / "mixed.jsonl", records))
    assert (err.value.bad.line, err.value.bad.field) == (2, "block_size")


def test_azure_datetimes_keep_100ns_and_are_relative_to_the_first_row(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
        "2023-11-16 18:16:00.0000001,1,0\n"
        "2023-11-17 00:00:00,5,5\n"
    )
    trace = read_trace(path)
    assert (trace.format, trace.block_size) == ("azure", None)
    assert [r.timestamp_s for r in trace.rows] == [0.0, 4.314579, 13.3194101, 20653.31941]
    assert [(r.input_length, r.output_length, r.line) for r in trace.rows][:2] == [(374, 44, 2), (396, 109, 3)]
    assert all(r.hash_ids is None for r in trace.rows)


def test_parse_datetime_reads_zones_as_utc_and_rejects_garbage():
    assert parse_datetime("1970-01-01 00:00:01.5", "T") == 1_500_000_000
    assert parse_datetime("2023-11-16 18:15:46.6805901", "T") % 1_000_000_000 == 680_590_100
    utc = parse_datetime("2024-05-10 00:00:00", "T")
    for text in ("2024-05-10 00:00:00+00:00", "2024-05-10T00:00:00Z", "2024-05-10 02:00:00+02:00",
                 "2024-05-09 19:00:00-0500"):
        assert parse_datetime(text, "T") == utc, text
    for text in ("yesterday", "2023-11-16 18:15:46.12x", "2023-11-16", "2023-11-16 18:15:46+25:00"):
        with pytest.raises(Exception, match="unparsable datetime"):
            parse_datetime(text, "T")


def test_azure_2024_traces_mix_zoned_times_with_and_without_decimals(tmp_path):
    """As Azure's week-long 2024 traces write them: a UTC offset, six decimals or none."""
    path = tmp_path / "AzureLLMInferenceTrace_code_1week.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
        "2024-05-10 00:00:00+00:00,2162,5\r\n"
        "2024-05-10 00:00:00.009930+00:00,2399,6\r\n"
        "2024-05-10 00:00:01.5+00:00,100,7\r\n"
    )
    trace = read_trace(path)
    assert trace.format == "azure"
    assert [r.timestamp_s for r in trace.rows] == [0.0, 0.00993, 1.5]


def test_burstgpt(tmp_path):
    path = tmp_path / "burst.csv"
    path.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,472,18,490,Conversation log\n"
        "45.5,GPT-4,1087,0,1087,API log\n"
    )
    trace = read_trace(path)
    assert trace.format == "burstgpt"
    assert [(r.timestamp_s, r.input_length, r.output_length, r.line) for r in trace.rows] == [
        (5.0, 472, 18, 2), (45.5, 1087, 0, 3)]


def test_detection_from_first_lines(tmp_path):
    cases = {
        "mooncake": json.dumps(mooncake_rows(1)[0]),
        "bailian": json.dumps(bailian_rows()[0]),
        "jsonl": json.dumps({"session_id": "s", "input_length": 1, "output_length": 1}),
        "azure": "TIMESTAMP,ContextTokens,GeneratedTokens",
        "burstgpt": "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type",
    }
    assert set(cases) == set(FORMATS)
    for name, first in cases.items():
        path = tmp_path / f"{name}.txt"
        path.write_text(first + "\n")
        assert detect_format(path) == name
    unknown = tmp_path / "unknown.csv"
    unknown.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(TraceError, match="cannot detect the trace format"):
        read_trace(unknown)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(TraceError, match="empty file"):
        read_trace(empty)
    assert read_trace(empty, format="mooncake").rows == []


def test_unknown_format_and_option_values():
    with pytest.raises(ValueError, match="unknown trace format 'nope'"):
        read_trace("x", format="nope")
    with pytest.raises(ValueError, match="on_bad_line"):
        read_trace("x", on_bad_line="ignore")


# --- validation rules ------------------------------------------------------------------------

GOOD = {"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}

BAD_ROWS = [
    ("{not json", "(json)", "unparsable JSON"),
    ("[1, 2]", "(json)", "expected a JSON object"),
    ({"input_length": 600, "output_length": 1}, "timestamp", "missing"),
    ({**GOOD, "timestamp": "noon"}, "timestamp", "unparsable timestamp"),
    ({**GOOD, "timestamp": True}, "timestamp", "expected a number"),
    ({"timestamp": 0, "output_length": 1}, "input_length", "missing"),
    ({**GOOD, "input_length": -5, "hash_ids": []}, "input_length", "must be >= 0"),
    ({**GOOD, "input_length": 1.5}, "input_length", "expected an integer"),
    ({**GOOD, "output_length": -1}, "output_length", "must be >= 0"),
    ({**GOOD, "hash_ids": [1, 2, 3]}, "hash_ids", "has 3 ids but input_length 600 needs ceil(600/512) = 2"),
    ({**GOOD, "hash_ids": [1, "x"]}, "hash_ids", "item 1 is not an integer: 'x'"),
    ({**GOOD, "hash_ids": [1, True]}, "hash_ids", "item 1 is not an integer: True"),
    ({**GOOD, "hash_ids": [False, 2]}, "hash_ids", "item 0 is not an integer: False"),
    ({**GOOD, "hash_ids": [1, 2.0]}, "hash_ids", "item 1 is not an integer: 2.0"),
    ({**GOOD, "hash_ids": [1, None]}, "hash_ids", "item 1 is not an integer: None"),
    ({**GOOD, "hash_ids": "1,2"}, "hash_ids", "expected a list"),
]


@pytest.mark.parametrize("bad, field, message", BAD_ROWS, ids=[f"{f}:{m}" for _, f, m in BAD_ROWS])
def test_each_rule_names_file_line_and_field(tmp_path, bad, field, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, GOOD, bad, GOOD])
    with pytest.raises(TraceError) as err:
        read_trace(path, format="mooncake")
    assert err.value.bad.line == 3 and err.value.bad.field == field and message in err.value.bad.message
    assert str(err.value).startswith(f"{path}:3: field '{field}': ")


def test_jsonl_and_bailian_specific_rules(tmp_path):
    cases = [
        ("jsonl", {"delay": -3, "input_length": 1, "output_length": 1}, "delay"),
        ("jsonl", {"messages": [], "output_length": 1}, "messages"),
        ("jsonl", {"messages": [{"content": "no role"}], "output_length": 1}, "messages"),
        ("jsonl", {"messages": [{"role": "user", "content": "x"}], "tools": {}, "output_length": 1}, "tools"),
        ("jsonl", {"session_id": [1], "input_length": 1, "output_length": 1}, "session_id"),
        ("jsonl", {"session_id": "a", "gap_ms": "soon", "input_length": 1, "output_length": 1}, "gap_ms"),
        ("bailian", {**bailian_rows()[0], "chat_id": 10}, "chat_id"),  # duplicate of line 1
        ("bailian", {**bailian_rows()[1], "parent_chat_id": -2}, "parent_chat_id"),
        ("bailian", {**bailian_rows()[1], "type": 3}, "type"),
        ("bailian", {**bailian_rows()[1], "hash_ids": [1, 2]}, "hash_ids"),
    ]
    for fmt, bad, field in cases:
        first = bailian_rows()[0] if fmt == "bailian" else {"timestamp": 0, "input_length": 1, "output_length": 1}
        path = write_jsonl(tmp_path / f"{fmt}.jsonl", [first, bad])
        with pytest.raises(TraceError) as err:
            read_trace(path, format=fmt)
        assert (err.value.bad.line, err.value.bad.field) == (2, field), (fmt, bad)


def test_csv_rules_name_the_column(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:47,-1,44\n"
        "not a date,1,1\n"
        "2023-11-16 18:15:48,1\n"
        "2023-11-16 18:15:49,1,many\n"
    )
    trace = read_trace(path, on_bad_line="skip")
    assert [(b.line, b.field) for b in trace.skipped] == [
        (3, "ContextTokens"), (4, "TIMESTAMP"), (5, "(csv)"), (6, "GeneratedTokens")]
    assert [r.request_id for r in trace.rows] == [0]
    missing = tmp_path / "missing.csv"
    missing.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,1\n")
    with pytest.raises(TraceError) as err:
        read_trace(missing, format="azure", on_bad_line="skip")  # no row can be read: always fatal
    assert (err.value.bad.line, err.value.bad.field) == (1, "GeneratedTokens")


def test_skip_mode_keeps_going_and_counts_every_bad_row(tmp_path):
    records = [GOOD, BAD_ROWS[0][0], GOOD, BAD_ROWS[9][0], BAD_ROWS[6][0], GOOD]
    path = write_jsonl(tmp_path / "mixed.jsonl", records)
    with pytest.raises(TraceError):
        read_trace(path)
    trace = read_trace(path, on_bad_line="skip")
    assert [(r.request_id, r.line) for r in trace.rows] == [(0, 1), (2, 3), (5, 6)]
    assert [(b.line, b.field) for b in trace.skipped] == [(2, "(json)"), (4, "hash_ids"), (5, "input_length")]
    assert all(isinstance(b, BadLine) and b.path == str(path) for b in trace.skipped)


# --- files that cannot be read whole ----------------------------------------------------------


def assert_bad(err, path, line, field, message):
    assert (err.value.bad.path, err.value.bad.line, err.value.bad.field) == (str(path), line, field)
    assert message in err.value.bad.message
    assert str(err.value).startswith(f"{path}:{line}: field '{field}': ")


@pytest.mark.parametrize("damage", GZIP_DAMAGES)
def test_a_damaged_gzip_names_file_line_and_what_is_wrong(tmp_path, damage):
    path, line, message = damaged_gzip(tmp_path, damage)
    for fmt in (None, "mooncake"):  # detected or named: the rows cannot be trusted either way
        for on_bad_line in ("fail", "skip"):
            with pytest.raises(TraceError) as err:
                read_trace(path, format=fmt, on_bad_line=on_bad_line)
            assert_bad(err, path, line, "(gzip)", message)
    if line == 1:  # damage in the first lines is met while detecting the format
        with pytest.raises(TraceError) as err:
            detect_format(path)
        assert_bad(err, path, line, "(gzip)", message)


@pytest.mark.parametrize("damage", ["truncated", "crc"])
def test_a_damaged_gzip_csv_names_file_and_line(tmp_path, damage):
    text = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:{i // 60 % 60:02d}:{i % 60:02d}.5,{i},1\n" for i in range(3000))
    path, line, message = damaged_gzip(tmp_path, damage, gzip.compress(text.encode()), name="azure.csv.gz")
    assert line > 100
    with pytest.raises(TraceError) as err:
        read_trace(path, format="azure", on_bad_line="skip")
    assert_bad(err, path, line, "(gzip)", message)


@pytest.mark.parametrize("gzipped", [False, True], ids=["plain", "gzip"])
def test_csv_bytes_that_are_not_utf8_name_their_line_and_column(tmp_path, gzipped):
    data = (AZURE_HEADER + b"2023-11-16 18:15:46,1,2\n" + b"2023-11-16 18:15:47,\xff1,2\n"
            + b"2023-11-16 18:15:48,3,4\n" * 3000)  # the bad byte is in the first chunk decoded
    path = tmp_path / "azure.csv"
    path.write_bytes(gzip.compress(data) if gzipped else data)
    with pytest.raises(TraceError) as err:
        read_trace(path)
    assert_bad(err, path, 3, "(csv)", "invalid UTF-8: byte 0xff in column 'ContextTokens'")
    trace = read_trace(path, on_bad_line="skip")
    assert [(b.line, b.field) for b in trace.skipped] == [(3, "(csv)")]
    assert [r.line for r in trace.rows[:3]] == [2, 4, 5] and len(trace.rows) == 3001


def test_csv_utf8_in_any_column_and_in_the_header(tmp_path):
    burst = tmp_path / "burst.csv"
    burst.write_bytes(
        b"Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        + "5,mod\u00e8le,472,18,490,Conversation log\n".encode()  # real UTF-8: fine
        + b"6,mod\xe8le,472,18,490,Conversation log\n"  # the same in Latin-1, in a column not replayed
    )
    with pytest.raises(TraceError) as err:
        read_trace(burst)
    assert_bad(err, burst, 3, "(csv)", "invalid UTF-8: byte 0xe8 in column 'Model'")
    header = tmp_path / "header.csv"
    header.write_bytes(b"TIMESTAMP,ContextTokens,GeneratedTokens,Not\xe9\n2023-11-16 18:15:46,1,2,x\n")
    with pytest.raises(TraceError) as err:
        read_trace(header, on_bad_line="skip")  # no row can be trusted: always fatal
    assert_bad(err, header, 1, "(csv)", "invalid UTF-8 in the header: byte 0xe9 in column 4")


def test_a_csv_quote_left_open_names_the_row_where_it_starts(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_bytes(AZURE_HEADER + b"2023-11-16 18:15:46,1,2\n" + b'2023-11-16 18:15:47,"1,2\n'
                     + b"2023-11-16 18:15:48,3,4\n" * 10000)  # the open quote swallows > 128 KiB
    with pytest.raises(TraceError) as err:
        read_trace(path, on_bad_line="skip")
    assert_bad(err, path, 3, "(csv)", "field larger than field limit")
    assert "a quote left open?" in err.value.bad.message


def test_json_bytes_that_are_not_utf8_are_a_bad_row_on_their_line(tmp_path):
    good = json.dumps(GOOD).encode() + b"\n"
    path = tmp_path / "latin1.jsonl"
    latin1 = b'{"timestamp": 0, "input_length": 600, "output_length": 1, "note": "caf\xe9"}\n'
    path.write_bytes(good * 2 + latin1 + good)
    with pytest.raises(TraceError) as err:
        read_trace(path)
    at = latin1.index(b"\xe9") + 1
    assert_bad(err, path, 3, "(json)", f"invalid UTF-8: byte 0xe9 at byte {at} of the line")
    trace = read_trace(path, on_bad_line="skip")
    assert [r.line for r in trace.rows] == [1, 2, 4] and [b.line for b in trace.skipped] == [3]


# --- the prompt length bound ------------------------------------------------------------------


def test_the_default_prompt_bound():
    assert DEFAULT_MAX_PROMPT_TOKENS == 2**20


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_prompt_over_max_input_tokens_is_a_bad_row(tmp_path, fmt):
    path, line = huge_prompt_trace(tmp_path, fmt)
    assert detect_format(path) == fmt
    assert len(read_trace(path).rows) == 4  # no bound unless one is asked for
    with pytest.raises(TraceError) as err:
        read_trace(path, max_input_tokens=DEFAULT_MAX_PROMPT_TOKENS)
    assert_bad(err, path, line, "input_length", f"{HUGE} tokens is over the limit of {2**20} (--max-prompt-tokens)")
    trace = read_trace(path, on_bad_line="skip", max_input_tokens=DEFAULT_MAX_PROMPT_TOKENS)
    assert [r.input_length for r in trace.rows] == [10, 20, 30]
    assert [(b.line, b.field) for b in trace.skipped] == [(line, "input_length")]
    assert len(read_trace(path, max_input_tokens=HUGE).rows) == 4  # the bound itself is allowed


def test_max_input_tokens_must_be_positive(tmp_path):
    path, _ = huge_prompt_trace(tmp_path, "mooncake")
    for bound in (0, -1):
        with pytest.raises(ValueError, match="max_input_tokens must be >= 1"):
            read_trace(path, max_input_tokens=bound)


def test_the_cycle_collector_is_back_as_it_was_after_a_read(tmp_path):
    """read_trace pauses the collector for speed; neither a good read nor a failed one may
    leave it off, and a caller that turned it off keeps it off."""
    good = write_jsonl(tmp_path / "good.jsonl", mooncake_rows(3))
    bad = write_jsonl(tmp_path / "bad.jsonl", [GOOD, "{broken"])
    assert gc.isenabled()
    read_trace(good)
    with pytest.raises(TraceError):
        read_trace(bad)
    assert gc.isenabled()
    gc.disable()
    try:
        read_trace(good)
        assert not gc.isenabled()
    finally:
        gc.enable()


# --- the ideal prefix cache -------------------------------------------------------------------


def test_prefix_hits_need_the_whole_chain_not_just_the_id(tmp_path):
    from replay.trace import TraceRow

    def row(i, ids):
        return TraceRow(request_id=i, timestamp_s=i, input_length=len(ids) * 4, output_length=1,
                        hash_ids=tuple(ids))

    rows = [
        row(0, [1, 2, 3]),
        row(1, [1, 2, 3, 4]),  # 3 cached
        row(2, [9, 2, 3]),  # 2 and 3 were seen, but after 1, not after 9
        row(3, [1, 2, 7]),  # 2
        row(4, [9, 2, 3, 4]),  # 3 (row 2 put 9,2,3 in the cache)
        row(5, [1, 2, 3, 4]),  # 4
        TraceRow(request_id=6, timestamp_s=6, input_length=5, output_length=1),  # no ids: 0
        row(7, [2, 3]),  # 0: 2 never started a chain
    ]
    assert list(prefix_hits(rows)) == [0, 3, 0, 2, 3, 4, 0, 0]


def test_the_ideal_cache_tells_every_64_bit_hash_id_apart():
    """The ideal cache and stats hold hash ids in flat arrays (replay.trace.pairs); an unsigned
    64-bit id and the negative one with the same bits are different ids, as JSON gives them."""
    ids = [(2**64 - 1,), (-1,), (2**64 - 1, 5), (-1, 5), (2**63,), (-(2**63),), (2**64 - 1, 5)]
    rows = [TraceRow(i, float(i), 32, 1, hash_ids=h) for i, h in enumerate(ids)]
    assert list(prefix_hits(rows)) == [0, 0, 1, 1, 0, 0, 2]
    assert trace_stats(Trace("t", "mooncake", 32, rows))["distinct_hash_ids"] == 5


def test_the_pair_index_adds_in_one_call_as_pair_by_pair():
    """PairIndex.add_new and add_chain (one call per row, the ideal cache's and the cache checks'
    hot loops) number and find the same pairs as find-then-add one pair at a time, through the
    table's growths and for ids of the top half of 64 bits."""
    import random

    from replay.trace.pairs import PairIndex

    rng = random.Random(7)
    ids = [rng.choice([rng.randrange(50), rng.randrange(2**63, 2**64), -rng.randrange(2**63)]) for _ in range(6000)]
    one_call, pair_by_pair = PairIndex(), PairIndex()
    pairs = []
    for start in range(0, len(ids), 30):
        a, chunk = start % 3, ids[start:start + 30]
        one_call.add_new(a, chunk)
        for b in chunk:
            pairs.append((a, b))
            if not pair_by_pair.find(a, b):
                pair_by_pair.add(a, b)
    assert len(one_call) == len(pair_by_pair) > 2000
    assert all(one_call.find(a, b) == pair_by_pair.find(a, b) != 0 for a, b in pairs)
    assert one_call.find(3, ids[0]) == 0
    chained, linked = PairIndex(), PairIndex()
    for start in range(0, len(ids), 40):
        chunk = ids[start:start + 40]
        hits, node = chained.walk(0, chunk)
        last = chained.add_chain(node, chunk[hits:])
        hits_too, node_too = linked.walk(0, chunk)
        for b in chunk[hits_too:]:
            node_too = linked.add(node_too, b)
        assert (hits, last) == (hits_too, node_too)
        assert chained.walk(0, chunk) == (len(chunk), last)
    assert [chained.second(n) for n in range(1, len(chained) + 1)] == [linked.second(n) for n in range(1, len(linked) + 1)]


def test_jsonl_keys_past_the_detected_lines_are_read_not_dropped(tmp_path):
    """The format is told from the first lines; a session, a delay or a prompt of its own further
    down makes the rest read as jsonl instead of being dropped in silence."""
    plain = mooncake_rows(25)
    late = [*plain, {"delay": 100, "input_length": 700, "output_length": 3, "hash_ids": [0, 1], "session_id": "s"},
            {"timestamp": 9000, "messages": [{"role": "user", "content": "hi"}], "output_length": 3}]
    trace = read_trace(write_jsonl(tmp_path / "late.jsonl", late))
    assert detect_format(tmp_path / "late.jsonl") == "mooncake"
    assert [(r.session_id, r.timestamp_s) for r in trace.rows[-2:]] == [("s", 100 / 1000.0), (None, 9.0)]
    assert trace.rows[-1].messages == [{"role": "user", "content": "hi"}]
    assert trace.rows[:25] == read_trace(write_jsonl(tmp_path / "plain.jsonl", plain)).rows


def test_a_row_with_both_a_timestamp_and_a_delay_is_refused(tmp_path):
    rows = [{"timestamp": 0, "delay": 5, "input_length": 10, "output_length": 1, "session_id": "a"}]
    with pytest.raises(TraceError) as err:
        read_trace(write_jsonl(tmp_path / "both.jsonl", rows))
    assert (err.value.bad.field, err.value.bad.message) == ("delay", "a row gives a timestamp or a delay, not both")


def test_a_time_past_any_traces_is_a_bad_row(tmp_path):
    rows = [{"timestamp": 123456789012345678901234567890, "input_length": 5, "output_length": 3}]
    with pytest.raises(TraceError, match="past any trace's time"):
        read_trace(write_jsonl(tmp_path / "far.jsonl", rows))


def test_only_a_regular_file_is_a_trace_and_a_line_has_a_bound(tmp_path, monkeypatch):
    """A FIFO would give its bytes to the first of the trace's reads and block the next; a
    device never ends: both are refused, named. A file of no newlines is not read whole."""
    fifo = tmp_path / "t.jsonl"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a FIFO"), ("/dev/zero", "a device or socket")):
        with pytest.raises(TraceError, match=f"is {kind}, not a regular file"):
            read_trace(path)
    monkeypatch.setattr(source, "MAX_LINE_BYTES", 1000)
    blob = tmp_path / "blob.jsonl"
    blob.write_bytes(b"x" * 5000)
    with pytest.raises(TraceError, match="longer than"):
        read_trace(blob)


def test_aiperfs_single_and_multi_turn_datasets_are_named_as_not_a_trace(tmp_path):
    for rows in ([{"text": "What is 2 + 2?"}], [{"session_id": "a", "turns": [{"text": "hi"}]}]):
        with pytest.raises(TraceError, match="AIPerf's single_turn and multi_turn datasets, not a trace"):
            read_trace(write_jsonl(tmp_path / "aiperf.jsonl", rows))

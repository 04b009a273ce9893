"""read_trace: detect the format, decode each line, parse it, and apply the on-bad-line rule."""

from __future__ import annotations

import csv
from itertools import islice
from pathlib import Path
from typing import Iterator

import orjson

from replay.trace.fields import RowError
from replay.trace.formats import FORMATS, Format
from replay.trace.record import BadLine, Trace, TraceError, TraceRow
from replay.trace.source import numbered_lines, open_text

ON_BAD_LINE = ("fail", "skip")
DETECT_LINES = 20
JSONL_KEYS = {"messages", "text_input", "delay", "session_id", "tools", "block_size"}
BAILIAN_KEYS = {"chat_id", "parent_chat_id"}
UTF8_BOM = b"\xef\xbb\xbf"


def read_trace(
    path: str | Path,
    format: str | None = None,
    block_size: int | None = None,
    on_bad_line: str = "fail",
) -> Trace:
    """Every row of a trace file, validated.

    on_bad_line="fail" raises TraceError (file, line, field) at the first broken rule;
    "skip" drops such rows and lists each one in Trace.skipped, so callers can report them.
    block_size overrides the format's default (and a jsonl file's own "block_size").
    """
    if on_bad_line not in ON_BAD_LINE:
        raise ValueError(f"on_bad_line must be one of {ON_BAD_LINE}, got {on_bad_line!r}")
    if block_size is not None and block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    path = str(path)
    fmt = get_format(format) if format else FORMATS[detect_format(path)]
    parser = fmt.new_parser(block_size, fmt.default_block)
    rows: list[TraceRow] = []
    skipped: list[BadLine] = []
    for index, (line, record) in enumerate(_records(path, fmt)):
        try:
            if isinstance(record, RowError):
                raise record
            rows.append(parser.parse(record, index, line))
        except RowError as err:
            bad = BadLine(path, line, err.field, err.message)
            if on_bad_line == "fail":
                raise TraceError(bad) from None
            skipped.append(bad)
    parser.finish(rows)
    return Trace(path=path, format=fmt.name, block_size=parser.block_size, rows=rows, skipped=skipped)


def get_format(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown trace format {name!r}; known: {', '.join(FORMATS)}") from None


def detect_format(path: str | Path) -> str:
    """The format named by the first lines: a CSV header, or the keys of the first JSON objects."""
    lines = list(islice(numbered_lines(path), DETECT_LINES))
    if not lines:
        raise TraceError(BadLine(str(path), 1, "(format)", "empty file: cannot detect the trace format"))
    first_line, first = lines[0]
    if first.removeprefix(UTF8_BOM).lstrip().startswith(b"{"):
        keys: set[str] = set()
        for _, raw in lines:
            try:
                record = orjson.loads(raw.removeprefix(UTF8_BOM))
            except orjson.JSONDecodeError:
                continue
            if isinstance(record, dict):
                keys.update(record)
        if keys & BAILIAN_KEYS:
            return "bailian"
        if keys & JSONL_KEYS:
            return "jsonl"
        return "mooncake"
    header = {name.strip() for name in next(csv.reader([first.decode("utf-8-sig", "replace")]))}
    for fmt in FORMATS.values():
        if fmt.is_csv and set(fmt.csv_columns) <= header:
            return fmt.name
    raise TraceError(
        BadLine(
            str(path),
            first_line,
            "(format)",
            f"cannot detect the trace format from {first[:80]!r}; give it with --format "
            f"({', '.join(FORMATS)})",
        )
    )


def _records(path: str, fmt: Format) -> Iterator[tuple[int, dict | RowError]]:
    """(line, record) per data row; a row that cannot even be decoded comes as a RowError."""
    if fmt.is_csv:
        yield from _csv_records(path, fmt)
        return
    for line, raw in numbered_lines(path):
        if line == 1:
            raw = raw.removeprefix(UTF8_BOM)
        try:
            record = orjson.loads(raw)
        except orjson.JSONDecodeError as err:
            yield line, RowError("(json)", f"unparsable JSON: {err}")
            continue
        if not isinstance(record, dict):
            yield line, RowError("(json)", f"expected a JSON object, got {type(record).__name__}")
            continue
        yield line, record


def _csv_records(path: str, fmt: Format) -> Iterator[tuple[int, dict | RowError]]:
    with open_text(path) as f:
        reader = csv.reader(f)
        header = None
        for values in reader:
            if not values or not any(v.strip() for v in values):
                continue
            if header is None:
                header = [name.strip() for name in values]
                for column in fmt.csv_columns:
                    if column not in header:
                        raise TraceError(
                            BadLine(path, reader.line_num, column, f"missing column; the header has {header}")
                        )
                continue
            if len(values) != len(header):
                yield reader.line_num, RowError(
                    "(csv)", f"expected {len(header)} columns ({','.join(header)}), got {len(values)}"
                )
                continue
            yield reader.line_num, dict(zip(header, values))

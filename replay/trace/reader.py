"""read_trace: detect the format, decode each line, parse it, and apply the on-bad-line rule."""

from __future__ import annotations

import csv
import functools
import gc
import math
from collections.abc import Callable, Iterator
from itertools import islice
from pathlib import Path
from typing import TypeVar

import orjson

from replay.bounds import MAX_TRACE_SPAN_S, MAX_TRACE_TIME_S
from replay.trace.fields import RowError, block_size_problem, check_prompt_limit, span_message
from replay.trace.formats import EXTENDED_KEYS, FORMATS, Format
from replay.trace.record import BadLine, Trace, TraceError, TraceRow
from replay.trace.source import GZIP_ERRORS, gzip_error, numbered_lines, open_text

ON_BAD_LINE = ("fail", "skip")
DETECT_LINES = 20
# what tells jsonl from mooncake (AIPerf's single/multi-turn `text`, `texts`, `turns` too: read as
# jsonl, their rows are refused saying what they are)
JSONL_KEYS = EXTENDED_KEYS | {"block_size"}
BAILIAN_KEYS = {"chat_id", "parent_chat_id"}
UTF8_BOM = b"\xef\xbb\xbf"

_F = TypeVar("_F", bound=Callable)


def _collector_paused(read: _F) -> _F:
    """Run `read` with Python's cycle collector off (and back on after, if it was on).

    Reading a trace allocates a few objects per row that never form cycles, and the
    collector kept walking them as the row list grew (docs/bench/2026-11-28-figures.md).
    """

    @functools.wraps(read)
    def paused(*args, **kwargs):
        if not gc.isenabled():
            return read(*args, **kwargs)
        gc.disable()
        try:
            return read(*args, **kwargs)
        finally:
            gc.enable()

    return paused  # type: ignore[return-value]


@_collector_paused
def read_trace(
    path: str | Path,
    format: str | None = None,
    block_size: int | None = None,
    on_bad_line: str = "fail",
    *,
    max_input_tokens: int | None = None,
) -> Trace:
    """Every row of a trace file, validated.

    on_bad_line="fail" raises TraceError (file, line, field) at the first broken rule;
    "skip" drops such rows and lists each one in Trace.skipped, so callers can report them.
    block_size overrides the format's default (and a jsonl file's own "block_size").
    max_input_tokens makes a row with a longer input_length a bad row like any other
    (None: no limit; replay.bounds.DEFAULT_MAX_PROMPT_TOKENS is the usual one).
    A file that cannot be read whole (damaged gzip, a CSV row that never ends) raises
    TraceError whatever on_bad_line says; one that cannot be opened raises OSError.
    """
    stream = TraceStream(path, format, block_size, on_bad_line, max_input_tokens=max_input_tokens)
    rows = list(stream)
    for row in rows:  # sessions a later row re-rooted (bailian chains read out of order)
        row.session_id = stream.sessions.get(row.request_id, row.session_id)
    return Trace(path=stream.path, format=stream.format, block_size=stream.block_size, rows=rows,
                 skipped=stream.skipped)


class TraceStream:
    """The rows of a trace file one at a time, validated as read_trace validates them, for
    callers that must not hold a whole trace (the master of a replay).

    Once iterated to the end: `block_size` is final, `skipped` lists the dropped rows (the
    first `keep_skipped`, when given; `bad_rows` counts them all), and
    `sessions` maps request_id -> session for the few rows whose session a later row changed.
    """

    def __init__(self, path: str | Path, format: str | None = None, block_size: int | None = None,
                 on_bad_line: str = "fail", *, max_input_tokens: int | None = None, keep_skipped: int | None = None):
        if on_bad_line not in ON_BAD_LINE:
            raise ValueError(f"on_bad_line must be one of {ON_BAD_LINE}, got {on_bad_line!r}")
        if block_size is not None and (problem := block_size_problem(block_size)):
            raise ValueError(f"block size {block_size}: {problem}")
        if max_input_tokens is not None and max_input_tokens < 1:
            raise ValueError(f"max_input_tokens must be >= 1 or None, got {max_input_tokens}")
        self.max_input_tokens = max_input_tokens
        self.path = str(path)
        self.on_bad_line = on_bad_line
        self._format = get_format(format) if format else FORMATS[detect_format(self.path)]
        self.format = self._format.name
        self._parser = self._format.new_parser(block_size, self._format.default_block)
        self.skipped: list[BadLine] = []  # the first `keep_skipped` of them (None: all)
        self.keep_skipped = keep_skipped
        self.bad_rows = 0  # skipped rows, kept or not
        self.sessions: dict[int, str] = {}

    @property
    def block_size(self) -> int | None:
        return self._parser.block_size

    def __iter__(self) -> Iterator[TraceRow]:
        parser, limit = self._parser, self.max_input_tokens
        earliest, latest = math.inf, -math.inf
        for index, (line, record) in enumerate(_records(self.path, self._format)):
            try:
                if isinstance(record, RowError):
                    raise record
                row = parser.parse(record, index, line)
                if limit is not None:
                    check_prompt_limit(row.input_length, limit)
                time_s = row.timestamp_s
                if not earliest <= time_s <= latest:  # only a row that widens the span can break it
                    low = time_s if time_s < earliest else earliest
                    high = time_s if time_s > latest else latest
                    if not (high - low <= MAX_TRACE_SPAN_S and -MAX_TRACE_TIME_S <= time_s <= MAX_TRACE_TIME_S):  # or nan
                        raise RowError(parser.time_field, span_message(time_s, earliest, latest))
                    earliest, latest = low, high
                yield row
            except RowError as err:
                bad = BadLine(self.path, line, err.field, err.message)
                if self.on_bad_line == "fail":
                    raise TraceError(bad) from None
                self.bad_rows += 1
                if self.keep_skipped is None or len(self.skipped) < self.keep_skipped:
                    self.skipped.append(bad)
        self.sessions = parser.finish()


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
            f"cannot detect the trace format from {first[:80]!r}; give it with --trace-format "
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
            yield line, _json_error(raw, err)
            continue
        if not isinstance(record, dict):
            yield line, RowError("(json)", f"expected a JSON object, got {type(record).__name__}")
            continue
        yield line, record


def _json_error(raw: bytes, err: orjson.JSONDecodeError) -> RowError:
    """orjson refuses bytes that are not UTF-8 with a position that is always the start of the
    line ("line 1 column 1 (char 0)"); say which byte it is and where instead."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as bad:
        return RowError("(json)", f"invalid UTF-8: byte 0x{raw[bad.start]:02x} at byte {bad.start + 1} of the line")
    return RowError("(json)", f"unparsable JSON: {err}")


def _csv_records(path: str, fmt: Format) -> Iterator[tuple[int, dict | RowError]]:
    """_records for CSV: {column: text} per data row. The csv module's own error (a row that
    never ends) and a damaged gzip stream are TraceError, with the line where they start."""
    with open_text(path) as f:
        reader = csv.reader(f)
        header = None
        line = 0  # the last line of the last row read
        try:
            for values in reader:
                line = reader.line_num
                text = "".join(values)
                if not text or text.isspace():
                    continue
                if header is None:
                    header = _csv_header(path, fmt, values, line)
                elif not text.isascii() and (bad_byte := _undecodable(values, header)):
                    yield line, RowError("(csv)", f"invalid UTF-8: {bad_byte}")
                elif len(values) != len(header):
                    yield line, RowError(
                        "(csv)", f"expected {len(header)} columns ({','.join(header)}), got {len(values)}"
                    )
                else:
                    yield line, dict(zip(header, values))
        except csv.Error as err:
            raise _csv_error(path, err, line + 1, reader.line_num) from err
        except GZIP_ERRORS as err:
            raise gzip_error(path, err, reader.line_num) from err


def _csv_header(path: str, fmt: Format, values: list[str], line: int) -> list[str]:
    """The column names; no row can be read without all of the format's, so this is fatal."""
    bad_byte = _undecodable(values, None)
    if bad_byte:
        raise TraceError(BadLine(path, line, "(csv)", f"invalid UTF-8 in the header: {bad_byte}"))
    header = [name.strip() for name in values]
    for column in fmt.csv_columns:
        if column not in header:
            raise TraceError(BadLine(path, line, column, f"missing column; the header has {header}"))
    return header


def _csv_error(path: str, err: csv.Error, row_start: int, line: int) -> TraceError:
    """Python's csv module raises csv.Error (field larger than field limit) when a quote is
    never closed and the row swallows the rest of the file; name where that row starts."""
    message = f"unreadable CSV: {err}"
    if line > row_start:
        message += f" (the row that starts here runs on to line {line}: a quote left open?)"
    return TraceError(BadLine(path, row_start, "(csv)", message))


def _undecodable(values: list[str], header: list[str] | None) -> str | None:
    """The first byte of a row that was not UTF-8, as "byte 0xff in column 'ContextTokens'";
    None for a clean row. open_text turned each such byte into a lone surrogate
    (U+DC80..U+DCFF). The caller skips ASCII rows, nearly all rows of real traces."""
    for index, value in enumerate(values):
        for char in value:
            if "\udc80" <= char <= "\udcff":
                column = repr(header[index]) if header and index < len(header) else str(index + 1)
                return f"byte 0x{ord(char) - 0xDC00:02x} in column {column}"
    return None

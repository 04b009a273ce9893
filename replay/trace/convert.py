"""Writing a trace back out as jsonl: a window of it, faster or slower, with smaller blocks.

The output is mooncake-style jsonl (timestamp in ms, input_length, output_length, hash_ids,
session_id, messages/tools when present). When its block size is not the jsonl default
(512), every row carries "block_size", which read_trace honours: a converted file reads
right with no option, even after `head` or `gzip`.
"""

from __future__ import annotations

import math
from pathlib import Path

import orjson

from replay.bounds import MAX_TRACE_SPAN_S
from replay.errors import OutputError
from replay.trace.formats import FORMATS
from replay.trace.reader import read_trace
from replay.trace.record import Trace, TraceRow
from replay.trace.source import open_output, remove_written
from replay.trace.window import select_rows

JSONL_BLOCK = FORMATS["jsonl"].default_block


def rescale_length(input_length: int, block_from: int, block_to: int) -> int:
    """ceil(L * to / from): keeps ceil(L' / to) == ceil(L / from), so hash ids stay valid."""
    return -(-input_length * block_to // block_from)


def to_record(row: TraceRow, timestamp_s: float, input_length: int, block_size: int | None) -> dict:
    timestamp_ms = round(timestamp_s * 1000.0, 4)
    record: dict = {"timestamp": int(timestamp_ms) if timestamp_ms.is_integer() else timestamp_ms}
    if row.messages is None or input_length > 0:
        record["input_length"] = input_length
    record["output_length"] = row.output_length
    if row.hash_ids is not None:
        record["hash_ids"] = list(row.hash_ids)
    if row.session_id is not None:
        record["session_id"] = row.session_id
    if row.messages is not None:
        record["messages"] = row.messages
    if row.tools is not None:
        record["tools"] = row.tools
    if block_size is not None and block_size != JSONL_BLOCK:
        record["block_size"] = block_size
    return record


def convert_trace(
    trace: Trace,
    out_path: str | Path,
    start: float | None = None,
    duration: float | None = None,
    max_rows: int | None = None,
    time_scale: float = 1.0,
    block_size_to: int | None = None,
) -> Trace:
    """Write the chosen rows of `trace` to out_path (.gz => gzip) and return it read back.

    Times are re-based to the window start (when --start is given) and divided by
    time_scale. Reading the output back checks that it is a valid trace of the same rows.
    """
    if not (math.isfinite(time_scale) and time_scale > 0):
        raise ValueError(f"--time-scale must be a finite number > 0, got {time_scale}")
    if block_size_to is not None:
        if block_size_to < 1:
            raise ValueError(f"--block-size-to must be >= 1, got {block_size_to}")
        if trace.block_size is None:
            raise ValueError(f"{trace.path}: a {trace.format} trace has no block size to rescale from")
    rows = select_rows(trace.rows, start, duration, max_rows)
    origin = start or 0.0
    if rows:  # the written times must read back as the same trace: finite, within the readers' span
        low, high = min(r.timestamp_s for r in rows), max(r.timestamp_s for r in rows)
        times = ((low - origin) / time_scale, (high - origin) / time_scale)
        written_ms = (times[0] * 1000.0, times[1] * 1000.0)
        if not all(map(math.isfinite, written_ms)) or times[1] - times[0] > MAX_TRACE_SPAN_S:
            raise ValueError(f"--time-scale {time_scale:g}: the rows' times would become {times[0]:g} to {times[1]:g} s; "
                             f"a trace spans at most {MAX_TRACE_SPAN_S:.0f} s (10 years)")
    block_out = block_size_to if block_size_to is not None else trace.block_size
    try:
        with open_output(out_path) as out:
            for row in rows:
                length = row.input_length
                if block_size_to is not None:
                    length = rescale_length(length, trace.block_size, block_size_to)
                record = to_record(row, (row.timestamp_s - origin) / time_scale, length, block_out)
                out.write(orjson.dumps(record) + b"\n")
    except OSError as e:  # a full disk: no half trace is left to be replayed by mistake
        remove_written(out_path)
        raise OutputError(out_path, e) from None
    except BaseException:  # nor by any other stop (a bug, Ctrl-C)
        remove_written(out_path)
        raise
    written = read_trace(out_path, format="jsonl")  # named: an empty window gives an empty file
    if len(written.rows) != len(rows) or written.block_size != (block_out if block_out is not None else JSONL_BLOCK):
        raise RuntimeError(
            f"{out_path}: read back {len(written.rows)} rows with block size {written.block_size}, "
            f"wrote {len(rows)} with {block_out}"
        )
    return written

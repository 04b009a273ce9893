"""Trace ingestion: readers per format, validation, stats, convert/slice/rescale.

    from replay.trace import read_trace
    trace = read_trace("mooncake_trace.jsonl")          # format detected, rules checked
    trace = read_trace(path, on_bad_line="skip")        # trace.skipped lists what was dropped
"""

from replay.trace.formats import FORMATS, Format
from replay.trace.prefix import hit_tokens, prefix_hits
from replay.trace.reader import detect_format, get_format, read_trace
from replay.trace.record import BadLine, Trace, TraceError, TraceRow
from replay.trace.window import select_rows

__all__ = [
    "FORMATS",
    "BadLine",
    "Format",
    "Trace",
    "TraceError",
    "TraceRow",
    "detect_format",
    "get_format",
    "hit_tokens",
    "prefix_hits",
    "read_trace",
    "select_rows",
]

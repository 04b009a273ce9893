"""Choosing rows: a time window in trace seconds and a row cap, shared by convert and the runner."""

from __future__ import annotations

from collections.abc import Iterable

from replay.trace.record import TraceRow


def select_rows(
    rows: Iterable[TraceRow],
    start: float | None = None,
    duration: float | None = None,
    max_rows: int | None = None,
) -> list[TraceRow]:
    """Rows with start <= timestamp_s < start + duration (file order kept), then the first max_rows.

    start defaults to 0 (the trace's own origin) and duration to the end of the trace.
    """
    begin = 0.0 if start is None else start
    end = None if duration is None else begin + duration
    chosen: list[TraceRow] = []
    for row in rows:
        if max_rows is not None and len(chosen) >= max_rows:
            break
        if start is not None and row.timestamp_s < begin:
            continue
        if end is not None and row.timestamp_s >= end:
            continue
        chosen.append(row)
    return chosen

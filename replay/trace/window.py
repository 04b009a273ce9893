"""Choosing rows: a time window in trace seconds and a row cap, shared by convert and the runner."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

from replay.trace.record import TraceRow


def window(rows: Iterable[TraceRow], start: float | None, duration: float | None
           ) -> tuple[Iterator[TraceRow], float, float]:
    """(the rows, all of them still to come, and the window [begin, end) in trace seconds).

    No `start`: from the trace's beginning. `duration` counts from `start`, else from the first
    row's time (the file's first row: a trace of epoch times, or one cut from a longer one, does
    not start at 0, and `--duration 60` alone means its first minute).
    """
    rows = iter(rows)
    begin = float("-inf") if start is None else start
    if duration is None:
        return rows, begin, float("inf")
    if start is not None:
        return rows, begin, start + duration
    first = next(rows, None)
    if first is None:
        return rows, begin, float("inf")
    return itertools.chain((first,), rows), begin, first.timestamp_s + duration


def select_rows(
    rows: Iterable[TraceRow],
    start: float | None = None,
    duration: float | None = None,
    max_rows: int | None = None,
) -> list[TraceRow]:
    """Rows with begin <= timestamp_s < end (file order kept), then the first max_rows; the
    window as `window` sets it."""
    remaining, begin, end = window(rows, start, duration)
    chosen: list[TraceRow] = []
    for row in remaining:
        if max_rows is not None and len(chosen) >= max_rows:
            break
        if begin <= row.timestamp_s < end:
            chosen.append(row)
    return chosen

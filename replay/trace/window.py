"""Choosing rows: a time window in trace seconds and a row cap, shared by convert and the runner."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

from replay.errors import OptionError
from replay.trace.record import TraceRow


def window(rows: Iterable[TraceRow], start: float | None, duration: float | None
           ) -> tuple[Iterator[TraceRow], float, float, float | None]:
    """(the rows, all of them still to come, the window [begin, end) in trace seconds, and the
    first row's time where the window counts from it, else None).

    No `start`: from the trace's beginning. `duration` counts from `start`, else from the first
    row's time (the file's first row: a trace of epoch times, or one cut from a longer one, does
    not start at 0, and `--duration 60` alone means its first minute).
    """
    rows = iter(rows)
    begin = float("-inf") if start is None else start
    if duration is None:
        return rows, begin, float("inf"), None
    if start is not None:
        return rows, begin, start + duration, None
    first = next(rows, None)
    if first is None:
        return rows, begin, float("inf"), None
    return itertools.chain((first,), rows), begin, first.timestamp_s + duration, first.timestamp_s


def check_window(first: float | None, duration: float | None, earliest: float) -> None:
    """Refuse a `--duration` without `--start` (`first`: the first row's time the window counts
    from, `window`'s) over a trace whose earliest row comes before its first (rows not in time
    order): rows before it would be replayed too, a window no one asked for. Known only once
    every row was read."""
    if first is not None and earliest < first:
        raise OptionError(f"--duration {duration:g} without --start counts from the trace's first row (at "
                          f"{first:.15g} s), but an earlier row is at {earliest:.15g} s (the rows are not in time "
                          f"order): give --start, e.g. --start {earliest:.15g}")


def select_rows(
    rows: Iterable[TraceRow],
    start: float | None = None,
    duration: float | None = None,
    max_rows: int | None = None,
) -> list[TraceRow]:
    """Rows with begin <= timestamp_s < end (file order kept), then the first max_rows; the
    window as `window` sets it."""
    remaining, begin, end, first = window(rows, start, duration)
    chosen: list[TraceRow] = []
    earliest = float("inf")
    for row in remaining:
        time_s = row.timestamp_s
        if time_s < earliest:
            earliest = time_s
        if begin <= time_s < end and (max_rows is None or len(chosen) < max_rows):
            chosen.append(row)
    check_window(first, duration, earliest)
    return chosen

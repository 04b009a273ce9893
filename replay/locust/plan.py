"""Which rows run, when, and on which worker: all decided on the master (or local runner)."""

from __future__ import annotations

from replay.trace.record import TraceRow
from replay.trace.window import select_rows


def schedule_rows(rows: list[TraceRow], start: float | None = None, duration: float | None = None, max_requests: int | None = None) -> tuple[list[TraceRow], float]:
    """The rows of the window in send order, and the schedule's origin in trace seconds
    (the window's start, or the first row's time when no --start is given)."""
    chosen = sorted(select_rows(rows, start, duration, max_requests), key=lambda r: (r.timestamp_s, r.request_id))
    if start is not None:
        return chosen, start
    return chosen, chosen[0].timestamp_s if chosen else 0.0


def send_offset_s(row: TraceRow, origin: float, scale: float) -> float:
    """Seconds from the replay's start to the row's send: its trace time past the origin, / --scale."""
    return (row.timestamp_s - origin) / scale


def partition(rows: list[TraceRow], workers: int, how: str = "round-robin") -> list[list[TraceRow]]:
    """Split time-ordered rows into one list per worker, each still in time order.

    "session" keeps every session on one worker (so its turns go out in order from one place),
    giving each new session to the worker with the fewest rows so far.
    """
    parts: list[list[TraceRow]] = [[] for _ in range(workers)]
    if how == "round-robin":
        for i, row in enumerate(rows):
            parts[i % workers].append(row)
        return parts
    if how != "session":
        raise ValueError(f"--partition {how!r}: expected round-robin or session")
    owner: dict[str, int] = {}
    for row in rows:
        if row.session_id is None:
            index = min(range(workers), key=lambda w: len(parts[w]))
        else:
            index = owner.get(row.session_id)
            if index is None:
                index = owner[row.session_id] = min(range(workers), key=lambda w: len(parts[w]))
        parts[index].append(row)
    return parts


def encode_row(row: TraceRow) -> list:
    """A compact msgpack-friendly form for master -> worker messages."""
    return [
        row.request_id, row.timestamp_s, row.input_length, row.output_length,
        list(row.hash_ids) if row.hash_ids is not None else None,
        row.session_id, row.messages, row.tools, row.turn,
    ]  # fmt: skip


def decode_row(data: list) -> TraceRow:
    rid, ts, inp, out, hashes, session, messages, tools, turn = data
    return TraceRow(
        request_id=rid, timestamp_s=ts, input_length=inp, output_length=out,
        hash_ids=tuple(hashes) if hashes is not None else None,
        session_id=session, messages=messages, tools=tools, turn=turn,
    )  # fmt: skip

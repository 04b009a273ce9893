"""When a row is sent, stated once: at the replay's epoch (the master's wall time the run began)
plus the row's trace time past the origin (the window's first row, or --start), divided by
--scale. The master plans and records by it, each worker sends by it, and the live view maps a
wall time back to the trace time it has reached by its inverse.
"""

from __future__ import annotations


def replay_seconds(trace_seconds: float, scale: float) -> float:
    """Wall seconds a span of `trace_seconds` takes to replay at --scale `scale`."""
    return trace_seconds / scale


def send_offset_s(timestamp_s: float, origin: float, scale: float) -> float:
    """Seconds from the replay's start to the send of a row at trace time `timestamp_s`."""
    return replay_seconds(timestamp_s - origin, scale)


def send_time(epoch: float, timestamp_s: float, origin: float, scale: float) -> float:
    """The wall time (the master's clock, unix seconds) a row at trace time `timestamp_s` is sent."""
    return epoch + send_offset_s(timestamp_s, origin, scale)


def trace_seconds_reached(now: float, epoch: float, scale: float) -> float:
    """send_offset_s's inverse: the trace seconds past the origin whose rows are due by wall time `now`."""
    return (now - epoch) * scale


# --turn-timing: when a session's later turn is sent. `trace`: at its trace time (open loop); the
# other two wait for the previous turn's answer (closed loop), applied by the worker that holds
# the session (replay.engine.dispatcher).
TURN_TIMINGS = ("trace", "not-before-answer", "after-answer")
# --on-turn-failure: what a failed turn does to the rest of its session under a closed-loop timing.
TURN_FAILURES = ("continue", "stop-session")


def turn_send_time(timing: str, trace_due: float, answered_at: float, gap_s: float, scale: float) -> float:
    """The wall time a session's turn is sent under a closed-loop `timing`, once the previous
    turn's answer ended (or it failed) at `answered_at`: `not-before-answer`, its trace time
    `trace_due` or the answer's end, whichever is later; `after-answer`, the trace's `gap_s`
    between the two turns (replayed at `scale`) after the answer's end, so a user's think time
    is kept and the session shifts with the server's speed."""
    if timing == "after-answer":
        return answered_at + replay_seconds(gap_s, scale)
    return max(trace_due, answered_at)

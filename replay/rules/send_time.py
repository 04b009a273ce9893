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

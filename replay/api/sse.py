"""Server-sent events, one line at a time.

A token's arrival time is the time its line arrives, so the stream is read line by line
(never in fixed-size chunks, which would smear TTFT toward the end of the response).
"""

from __future__ import annotations

DONE = b"[DONE]"


def sse_data(line: bytes) -> bytes | None:
    """The payload of a `data:` line, or None for blank lines, comments and other fields."""
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()
    return payload or None

"""Server-sent events: the payload of one `data:` line.

The client (replay.protocol.client) does not read the stream line by line: each read takes up to
16 KiB, whatever has arrived, and notes when. Lines are split only after the stream ends, and
each event is timed by the read that completed its line, so an event is timed when its bytes
arrived, never when a later parse got to it.
"""

from __future__ import annotations

DONE = b"[DONE]"


def sse_data(line: bytes) -> bytes | None:
    """The payload of a `data:` line, or None for blank lines, comments and other fields."""
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()
    return payload or None

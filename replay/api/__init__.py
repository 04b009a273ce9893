"""The dispatch side of talking to a server: the HTTP client, SSE parsing, headers, and the
master's own questions (`ask.py`). What differs between APIs is the table's (replay/apis)."""

from replay.api.client import Endpoint, Outcome, Sent, read, send, write
from replay.api.headers import parse_headers

__all__ = ["Endpoint", "Outcome", "Sent", "parse_headers", "read", "send", "write"]

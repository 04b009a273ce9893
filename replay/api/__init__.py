"""Protocol adapters: where a request goes and how its response is read, per API."""

from replay.api.adapters import API_NAMES, Adapter, get_adapter
from replay.api.client import Endpoint, Outcome, Sent, read, send, write
from replay.api.headers import parse_headers

__all__ = ["API_NAMES", "Adapter", "Endpoint", "Outcome", "Sent", "get_adapter", "parse_headers", "read", "send", "write"]

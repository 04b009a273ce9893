"""The master's questions to a server, each on a connection of its own.

The master asks the endpoints what they serve (`GET /v1/models`) and how they count tokens
(`POST /tokenize`) before anything is sent; none of it shares the workers' connection pools.
Each question gets a fresh connection closed by reset, so the run's servers are not left a
connection in TIME_WAIT, and a short timeout. (The `/metrics` scrapes during the run keep a
connection alive instead: replay.engine.scraper.)
"""

from __future__ import annotations

import http.client
from urllib.parse import urlsplit

import orjson

from replay.errors import OptionError
from replay.protocol.client import close_with_reset
from replay.protocol.urls import shown, with_credentials

ASK_TIMEOUT_S = 30.0  # a /tokenize of a long prompt on a busy CPU server takes seconds


class Unanswered(OSError):
    """The server could not be reached or answered no HTTP; `reason` says why without the URL
    ("connection refused", "no answer in 5 s", ...)."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason or message


def _why(error: BaseException, timeout: float) -> str:
    """Why a question got no HTTP answer, in a few words."""
    if isinstance(error, ConnectionRefusedError):
        return "connection refused"
    if isinstance(error, TimeoutError):
        return f"no answer in {timeout:g} s"
    return str(error) or type(error).__name__


def ask(url: str, body: dict | None = None, headers: dict[str, str] | None = None,
        timeout: float = ASK_TIMEOUT_S) -> tuple[int, bytes]:
    """GET `url` (POST `body` as JSON when given); (status, the answer's bytes). Raises
    Unanswered when no HTTP answer came. `url`'s credentials are sent, and never shown."""
    parts = urlsplit(url)
    assert parts.hostname is not None, url  # every URL asked was checked (check_url: a host, a scheme)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = kind(parts.hostname, parts.port, timeout=timeout)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    sent = with_credentials(url, headers)
    try:
        if body is None:
            connection.request("GET", path, headers=sent)
        else:
            sent["Content-Type"] = "application/json"
            connection.request("POST", path, body=orjson.dumps(body), headers=sent)
        answer = connection.getresponse()
        return answer.status, answer.read()
    except (OSError, http.client.HTTPException) as e:
        why = _why(e, timeout)
        raise Unanswered(f"{shown(url)}: {why}", why) from None
    finally:
        if connection.sock is not None:
            close_with_reset(connection.sock)
        connection.close()


def ask_json(url: str, body: dict | None = None, headers: dict[str, str] | None = None,
             timeout: float = ASK_TIMEOUT_S) -> tuple[int, object]:
    """`ask`, the answer read as JSON (None when it is not JSON)."""
    status, data = ask(url, body, headers, timeout)
    try:
        return status, orjson.loads(data)
    except orjson.JSONDecodeError:
        return status, None


def check_url(option: str, url: str) -> None:
    """An http(s) server URL with a host and, if any, a valid port (the client sends HTTP only).
    The scheme is required: every question the master asks (`ask`) parses the URL as given."""
    if "://" not in url:
        raise OptionError(f"{option} {shown(url)}: not a server URL: give http://HOST[:PORT] or https://HOST[:PORT]")
    parts = urlsplit(url)
    url = shown(url)
    if parts.scheme not in ("http", "https"):
        raise OptionError(f"{option} {url}: only http:// and https:// servers can be replayed to")
    if not parts.hostname:
        raise OptionError(f"{option} {url}: no host")
    try:
        _ = parts.port  # reading it checks it
    except ValueError:
        raise OptionError(f"{option} {url}: the port is not a number in 0-65535") from None

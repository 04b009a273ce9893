"""The master's questions to a server, on connections of their own.

The master asks the endpoints what they serve (`GET /v1/models`) and how they count tokens
(`POST /tokenize`) before anything is sent; none of it shares the workers' connection pools.
A question (`ask`) gets a fresh connection closed by reset, so the run's servers are not left a
connection in TIME_WAIT, and a short timeout. A series of questions (`Asker`: the server check's
tens of /tokenize) keeps one connection per server alive between them, closed by reset at the
end: a connect and a close a question cost as much CPU as the rest of the question. (The
`/metrics` scrapes during the run keep a connection alive too: replay.engine.scraper.)
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
    with Asker() as asker:
        return asker.ask(url, body, headers, timeout)


class Asker:
    """Questions asked one after another, one connection per server kept between them; `close`
    (or the end of a `with` block) closes them by reset. A kept connection the server closed
    while idle is opened again once for the question that finds it closed."""

    def __init__(self) -> None:
        self._connections: dict[tuple[str, str, int | None], http.client.HTTPConnection] = {}

    def __enter__(self) -> Asker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for connection in self._connections.values():
            _close(connection)
        self._connections.clear()

    def ask(self, url: str, body: dict | None = None, headers: dict[str, str] | None = None,
            timeout: float = ASK_TIMEOUT_S) -> tuple[int, bytes]:
        """The module's `ask`, on this asker's connection to `url`'s server."""
        parts = urlsplit(url)
        assert parts.hostname is not None, url  # every URL asked was checked (check_url: a host, a scheme)
        key = (parts.scheme, parts.hostname, parts.port)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        sent = with_credentials(url, headers)
        if body is not None:
            sent["Content-Type"] = "application/json"
        data = None if body is None else orjson.dumps(body)
        kept = self._connections.pop(key, None)
        for connection in ([kept] if kept is not None else []) + [None]:
            if connection is None:
                kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
                connection = kind(parts.hostname, parts.port, timeout=timeout)
            else:
                connection.timeout = timeout
                if connection.sock is not None:
                    connection.sock.settimeout(timeout)
            try:
                connection.request("GET" if body is None else "POST", path, body=data, headers=sent)
                answer = connection.getresponse()
                status, read = answer.status, answer.read()
            except (OSError, http.client.HTTPException) as e:
                _close(connection)
                if connection is kept and isinstance(e, ConnectionError):  # RemoteDisconnected is one
                    continue  # closed by the server while idle: once more on a fresh connection
                why = _why(e, timeout)
                raise Unanswered(f"{shown(url)}: {why}", why) from None
            if answer.will_close:
                _close(connection)
            else:
                self._connections[key] = connection
            return status, read
        raise AssertionError("unreachable: the fresh connection answers or raises")

    def ask_json(self, url: str, body: dict | None = None, headers: dict[str, str] | None = None,
                 timeout: float = ASK_TIMEOUT_S) -> tuple[int, object]:
        """The module's `ask_json`, on this asker's connection to `url`'s server."""
        return _json(*self.ask(url, body, headers, timeout))


def _close(connection: http.client.HTTPConnection) -> None:
    if connection.sock is not None:
        close_with_reset(connection.sock)
    connection.close()


def _json(status: int, data: bytes) -> tuple[int, object]:
    try:
        return status, orjson.loads(data)
    except orjson.JSONDecodeError:
        return status, None


def ask_json(url: str, body: dict | None = None, headers: dict[str, str] | None = None,
             timeout: float = ASK_TIMEOUT_S) -> tuple[int, object]:
    """`ask`, the answer read as JSON (None when it is not JSON)."""
    return _json(*ask(url, body, headers, timeout))


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

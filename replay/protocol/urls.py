"""Credentials in a server URL (`http://user:password@host:port`): used to connect, never shown.

A URL is the endpoint's name everywhere a run shows or writes it: records, the meta, the
summary, the server-metrics file, logs, error messages, Locust's statistics and web UI. Each of
those takes `shown(url)`, which hides the whole userinfo (a user name alone can be a token),
so one rule decides what leaves the process. Connecting takes the full URL: its userinfo is
sent as HTTP Basic credentials (`authorization`), as browsers and `requests` send it.
"""

from __future__ import annotations

import base64
from urllib.parse import unquote, urlsplit

MASK = "***"


def shown(url: str) -> str:
    """`url` fit to show: its userinfo, if any, replaced by *** (`http://***@host:port/path`)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    end = next((i for i, c in enumerate(rest) if c in "/?#"), len(rest))
    userinfo, at, host = rest[:end].rpartition("@")
    if not at:
        return url
    return f"{scheme}{sep}{MASK}@{host}{rest[end:]}"


def authorization(url: str) -> str | None:
    """The Authorization header value that carries `url`'s userinfo (HTTP Basic, percent-escapes
    decoded), None when it has none."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.username is None:
        return None
    credentials = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
    return "Basic " + base64.b64encode(credentials.encode()).decode("ascii")


def with_credentials(url: str, headers: dict[str, str] | None) -> dict[str, str]:
    """`headers` plus the URL's credentials; an Authorization given in `headers` (`--header`)
    wins, as curl's -H wins over the URL's."""
    sent = dict(headers or {})
    value = authorization(url)
    if value is not None and not any(name.lower() == "authorization" for name in sent):
        sent["Authorization"] = value
    return sent


def host_and_port(url: str) -> str:
    """The URL's `host[:port]`, without userinfo: the Host header's value."""
    return urlsplit(url if "://" in url else f"http://{url}").netloc.rpartition("@")[2]

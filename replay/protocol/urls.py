"""Credentials in a server URL (`http://user:password@host:port`): used to connect, never shown.

A URL is the endpoint's name everywhere a run shows or writes it: records, the meta, the
summary, the server-metrics file, logs, error messages, Locust's statistics and web UI. Each of
those takes `shown(url)`, which hides the whole userinfo (a user name alone can be a token),
so one rule decides what leaves the process. Connecting takes the full URL: its userinfo is
sent as HTTP Basic credentials (`authorization`), as browsers and `requests` send it.
"""

from __future__ import annotations

import base64
import re
from typing import Any
from urllib.parse import unquote, urlsplit

MASK = "***"


# A query parameter by these names carries a credential (an exporter's `?token=`, a gateway's
# `?api_key=`): its value is hidden as the userinfo is.
SECRET_PARAMS = re.compile(r"([?&](?:[\w-]*token|api[_-]?key|key|password|passwd|secret|auth|signature|sig)=)[^&#]*",
                           re.IGNORECASE)


def shown(url: str) -> str:
    """`url` fit to show: its userinfo, if any, replaced by *** (`http://***@host:port/path`),
    and so the value of a query parameter that carries a credential (`?token=***`)."""
    url = SECRET_PARAMS.sub(rf"\g<1>{MASK}", url)
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    end = next((i for i, c in enumerate(rest) if c in "/?#"), len(rest))
    userinfo, at, host = rest[:end].rpartition("@")
    if not at:
        return url
    return f"{scheme}{sep}{MASK}@{host}{rest[end:]}"


def redacted(value: Any) -> Any:
    """`value` (an option's, a document of them) with every URL in it as `shown`: a string
    that holds `://` is taken as URLs, comma-separated as --endpoints gives them; dicts and
    lists are walked. What the run writes or shows of its options passes here, so an option
    that takes a URL needs no rule of its own."""
    if isinstance(value, str):
        return ",".join(shown(part) for part in value.split(",")) if "://" in value else value
    if isinstance(value, dict):
        return {key: redacted(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [redacted(item) for item in value]
    return value


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

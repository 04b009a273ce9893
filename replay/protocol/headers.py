"""`--header 'K: V'` values. Values may name environment variables ($VAR or ${VAR}; `$$` is a
literal `$`), so that secrets stay out of command lines, records and logs; the rule is
replay.env_vars'. The master checks that they are set, and so does each worker.
"""

from __future__ import annotations

import string
from collections.abc import Mapping

from replay import env_vars
from replay.errors import OptionError

TOKEN_CHARS = frozenset(string.ascii_letters + string.digits + "!#$%&'*+-.^_`|~")  # RFC 9110 token
# Headers the HTTP client writes itself from the request (replay.protocol.client): a second value
# would contradict its own and break the framing (a wrong Content-Length).
CLIENT_HEADERS = ("Content-Length", "Transfer-Encoding", "Host", "Connection")


def parse_headers(values: list[str] | None, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """{name: value} of `--header` values, variables expanded from `environ` (default: this
    process's environment). Raises OptionError, naming the header, for anything malformed."""
    headers: dict[str, str] = {}
    for raw in values or []:
        name, sep, value = raw.partition(":")
        if not sep or not name.strip():
            raise OptionError(f"--header {name.strip() or raw!r}: expected 'Name: value'")
        name = name.strip()
        if not all(c in TOKEN_CHARS for c in name):
            raise OptionError(f"--header {name!r}: a header name is letters, digits and !#$%&'*+-.^_`|~ only")
        if name.lower() in (h.lower() for h in CLIENT_HEADERS):
            raise OptionError(f"--header {name!r}: set by the client itself ({', '.join(CLIENT_HEADERS)} are)")
        value = env_vars.expand(value.strip(), f"--header {name}", environ)
        if any(c in value for c in "\r\n\0"):  # would end the header and start another on the wire
            raise OptionError(f"--header {name!r}: the value holds a line break or NUL")
        headers[name] = value
    return headers

"""`--header 'K: V'` values. Values may name environment variables ($VAR or ${VAR}), so that
secrets stay out of command lines, records and logs."""

from __future__ import annotations

import os
import string

TOKEN_CHARS = frozenset(string.ascii_letters + string.digits + "!#$%&'*+-.^_`|~")  # RFC 9110 token


def parse_headers(values: list[str] | None) -> dict[str, str]:
    headers: dict[str, str] = {}
    for raw in values or []:
        name, sep, value = raw.partition(":")
        if not sep or not name.strip():
            raise ValueError(f"--header {name.strip() or raw!r}: expected 'Name: value'")
        name, value = name.strip(), os.path.expandvars(value.strip())
        if not all(c in TOKEN_CHARS for c in name):
            raise ValueError(f"--header {name!r}: a header name is letters, digits and !#$%&'*+-.^_`|~ only")
        if any(c in value for c in "\r\n\0"):  # would end the header and start another on the wire
            raise ValueError(f"--header {name!r}: the value holds a line break or NUL")
        headers[name] = value
    return headers


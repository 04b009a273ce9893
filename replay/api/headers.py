"""`--header 'K: V'` values. Values may name environment variables ($VAR or ${VAR}), so that
secrets stay out of command lines, records and logs."""

from __future__ import annotations

import os


def parse_headers(values: list[str] | None) -> dict[str, str]:
    headers: dict[str, str] = {}
    for raw in values or []:
        name, sep, value = raw.partition(":")
        if not sep or not name.strip():
            raise ValueError(f"--header {name.strip() or raw!r}: expected 'Name: value'")
        headers[name.strip()] = os.path.expandvars(value.strip())
    return headers


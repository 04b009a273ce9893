"""`--header 'K: V'` values. Values may name environment variables ($VAR or ${VAR}), so that
secrets stay out of command lines, records and logs.

The rule for `$` is strict, because a header that silently goes out wrong (a literal
`$API_KEY`, or a password cut at its `$`) fails every request of a run with a 401 that says
nothing about why: every `$` starts `$NAME` or `${NAME}` (NAME: letters, digits and `_`, not
starting with a digit), whose variable must be set where the header is built (the master
checks, and so does each worker), or is `$$`, a literal `$`. Anything else is an error.
(`os.path.expandvars` left unset variables as they were and had no escape: `$$X` became `$`
followed by X's value.)
"""

from __future__ import annotations

import os
import re
import string
from typing import Mapping

from replay.errors import OptionError

TOKEN_CHARS = frozenset(string.ascii_letters + string.digits + "!#$%&'*+-.^_`|~")  # RFC 9110 token
_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_DOLLAR = re.compile(rf"\$(?:(\$)|({_NAME})|\{{({_NAME})\}})?")


def expand_value(header: str, value: str, environ: Mapping[str, str] | None = None) -> str:
    """`value` with each $NAME / ${NAME} replaced by its variable and each $$ by $.

    Raises OptionError naming the header and the variable when one is unset (an empty value
    is set), and for a `$` that starts none of the three forms.
    """
    env = os.environ if environ is None else environ

    def replace(m: re.Match) -> str:
        if m.group(1):
            return "$"
        name = m.group(2) or m.group(3)
        if name is None:
            # its place, not the text around it: a literal value may be a secret
            raise OptionError(f"--header {header}: the '$' at character {m.start() + 1} of the value starts "
                              f"no $VAR or ${{VAR}}; write $$ for a literal $")
        if name not in env:
            raise OptionError(f"--header {header}: {m.group(0)} is not set on this host")
        return env[name]

    return _DOLLAR.sub(replace, value)


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
        value = expand_value(name, value.strip(), environ)
        if any(c in value for c in "\r\n\0"):  # would end the header and start another on the wire
            raise OptionError(f"--header {name!r}: the value holds a line break or NUL")
        headers[name] = value
    return headers

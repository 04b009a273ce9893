"""`$VAR` and `${VAR}` in option values (`--header`, `--web-user`), so that secrets stay out of
command lines, config files, records and logs.

The rule for `$` is strict, because a value that silently goes out wrong (a literal
`$API_KEY`, or a password cut at its `$`) fails every request of a run with a 401, or locks
everyone out of the web UI, and says nothing about why: every `$` starts `$NAME` or `${NAME}`
(NAME: letters, digits and `_`, not starting with a digit), whose variable must be set where
the value is used, or is `$$`, a literal `$`. Anything else is an error. (`os.path.expandvars`
left unset variables as they were and had no escape: `$$X` became `$` followed by X's value.)
A variable's own value is taken as it is: a `$` in it stays.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from replay.errors import OptionError

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_DOLLAR = re.compile(rf"\$(?:(\$)|({_NAME})|\{{({_NAME})\}})?")


def expand(value: str, where: str, environ: Mapping[str, str] | None = None, start: int = 0) -> str:
    """`value` with each $NAME / ${NAME} replaced by its variable and each $$ by $.

    Raises OptionError, starting with `where` (the option, e.g. "--header Authorization"),
    naming the variable when one is unset (an empty value is set), and for a `$` that starts
    none of the three forms by its place (counted from `start`, where `value` is part of a
    longer one), never by the text around it: a literal value may be a secret.
    """
    env = os.environ if environ is None else environ

    def replace(m: re.Match) -> str:
        if m.group(1):
            return "$"
        name = m.group(2) or m.group(3)
        if name is None:
            raise OptionError(f"{where}: the '$' at character {start + m.start() + 1} of the value starts "
                              f"no $VAR or ${{VAR}}; write $$ for a literal $")
        if name not in env:
            raise OptionError(f"{where}: {m.group(0)} is not set on this host")
        return env[name]

    return _DOLLAR.sub(replace, value)

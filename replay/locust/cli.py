"""`replay run`: Locust's own command with the replay's locustfile from the installed package, so a
replay needs no checkout and no locustfile of the user's.

`replay run ARGS` is `locust -f <replay/locust/locustfile.py> ARGS`, run in this process: Locust's
`main()` reads sys.argv, so it gets the arguments there. In-process rather than exec'ing `locust`:
no second interpreter start, one pid for the signals that stop a run, Locust's exit code is the
process's, and `--processes N` forks from here as from `locust`. The plugin registers the replay
options before Locust's `main()` runs, because Locust answers `--help` before it imports any
locustfile (locust/argument_parser.py, parse_locustfile_option): so `replay run --help` lists
Locust's options and the replay options together, which plain `locust -f ... --help` cannot.

With `-f`/`--locustfile` among ARGS, `replay run` is plain `locust`: the user's locustfile, no
replay options imported ahead (a locustfile that is no replay's must not get them).
"""

from __future__ import annotations

import gc
import importlib
import importlib.metadata
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCUSTFILE = Path(__file__).resolve().with_name("locustfile.py")
HELP = "replay a trace on Locust: Locust's options and the replay's (`replay run --help` lists both)"


def register(subparsers) -> None:
    """Listed in `replay --help` only: replay.cli.main hands `run`'s arguments to run() unparsed."""
    subparsers.add_parser("run", help=HELP, add_help=False)


def names_a_locustfile(args: list[str]) -> bool:
    """Whether ARGS give Locust a locustfile of their own (-f F, -fF, --locustfile F, --locustfile=F)."""
    return any(a == "--locustfile" or a.startswith("--locustfile=") or a.startswith("-f") for a in args)


def locust_argv(args: list[str]) -> list[str]:
    """Locust's arguments for `replay run ARGS`: the packaged locustfile first, unless ARGS name one."""
    return list(args) if names_a_locustfile(args) else ["-f", str(LOCUSTFILE), *args]


def _usage(parser) -> None:
    """Help's first line names the command typed."""
    parser.description = parser.description.replace("locust [options]", "replay run [options]")


@contextmanager
def entry_points_read_once() -> Iterator[None]:
    """`importlib.metadata.entry_points` reads every installed distribution's entry points once
    while the block runs, then is the standard function again.

    Importing Locust runs gevent's `patch_all`, which looks up its plugin entry points before and
    after patching each module, each time reading the metadata of every installed distribution;
    the installed distributions do not change within that import, so one read answers all.
    """
    original = importlib.metadata.entry_points
    everything = None

    def entry_points(**params):
        nonlocal everything
        if everything is None:
            everything = original()
        return everything.select(**params) if params else everything

    importlib.metadata.entry_points = entry_points
    try:
        yield
    finally:
        importlib.metadata.entry_points = original


def run(args: list[str]) -> int:
    """Run Locust's main with `locust_argv(args)`; Locust ends the process itself (sys.exit with its exit code)."""
    argv = locust_argv(args)
    gc.disable()  # no collections while importing: the modules' objects live as long as the process
    try:
        with entry_points_read_once():
            import locust.main  # first: importing Locust monkey-patches the standard library with gevent

        if not names_a_locustfile(args):
            importlib.import_module("replay.locust.plugin")  # the replay options on Locust's parser, for --help too
            locust.events.init_command_line_parser.add_listener(_usage)
            gc.freeze()  # Locust's objects and the replay's, out of every collection (see replay/locust/locustfile.py)
    finally:
        gc.enable()
    sys.argv = ["replay run", *argv]  # Locust's parsers read sys.argv; argv[0] names the command in errors
    locust.main.main()
    return 0


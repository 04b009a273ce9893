"""`locust -f locustfile.py --help` lists the replay options.

Locust prints `--help` before it imports the locustfile (locust/main.py: parse_locustfile_option
answers -h from its first, -f-only parse; locust issue #2917), so options a locustfile adds
from an `init_command_line_parser` listener never show there. The only code Locust runs first
is its own import of `locust_plugins`, a name taken by another project. So a start-up hook
(`tracereplay-locust-help.pth` in site-packages, written by `python -m replay.locust_help`,
which `make install` and the Dockerfile run) registers the listener for exactly that case: the
`locust` command, asked for help, with a locustfile that imports replay.locust. Any other
Python start costs two `in` tests of sys.argv.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

PTH_NAME = "tracereplay-locust-help.pth"
PTH_LINE = ('import sys; ("-h" in sys.argv or "--help" in sys.argv) '
            'and __import__("replay.locust_help", fromlist=["install"]).install(sys.argv)\n')
MARK = "replay.locust"  # a locustfile that mentions it is a replay's


def locustfile_of(argv: list[str]) -> Path:
    """The locustfile Locust will load: -f/--locustfile, else $LOCUST_LOCUSTFILE, else locustfile.py."""
    name = os.environ.get("LOCUST_LOCUSTFILE", "locustfile")
    for i, arg in enumerate(argv):
        if arg in ("-f", "--locustfile") and i + 1 < len(argv):
            name = argv[i + 1]
        elif arg.startswith("--locustfile="):
            name = arg.split("=", 1)[1]
    path = Path(name)
    return path if path.suffix == ".py" or path.is_dir() else path.with_suffix(".py")


def is_locust(argv: list[str]) -> bool:
    """This process is the `locust` command (or `python -m locust`)."""
    return bool(argv) and Path(argv[0]).name == "locust" or sys.orig_argv[1:3] == ["-m", "locust"]


def install(argv: list[str]) -> bool:
    """Register the replay options' listener if `argv` asks help of a replay locustfile.

    Never raises: a broken hook must not break a Python start-up."""
    try:
        if not is_locust(argv):
            return False
        path = locustfile_of(argv)
        if not path.is_file() or MARK not in path.read_text(errors="replace"):
            return False
        import locust  # noqa: F401  (first: it monkey-patches before anything imports gevent's targets)

        import replay.locust.plugin  # noqa: F401  (registers the init_command_line_parser listener)
        return True
    except Exception:
        return False


def write_pth(site_packages: str | None = None) -> Path:
    """Write the start-up hook into site-packages (this interpreter's, by default)."""
    path = Path(site_packages or sysconfig.get_paths()["purelib"]) / PTH_NAME
    path.write_text(PTH_LINE)
    return path


if __name__ == "__main__":
    print(write_pth(sys.argv[1] if len(sys.argv) > 1 else None))

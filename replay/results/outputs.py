"""The --json and --html files a results command (`replay report`, `replay compare`) writes
after printing its text: one way to write them and to say why one could not be written."""

from __future__ import annotations

import sys
from collections.abc import Callable

import orjson

from replay.errors import OutputError
from replay.results.files import write_atomically


def write_outputs(command: str, document: dict, json_out: str | None, html_out: str | None,
                  draw: Callable[[str], None], html_label: str) -> int:
    """`document` as JSON at `json_out`, then `draw(html_out)`; 0, or 1 with one line on stderr
    when the plotting extra is missing or a file cannot be written (a full disk leaves the file
    as it was, or absent). The plotting module is imported only when a page is asked for."""
    try:
        if json_out:
            write_atomically(json_out, orjson.dumps(document, option=orjson.OPT_INDENT_2) + b"\n")
        if html_out:
            from replay.results.html import PlottingMissing

            try:
                draw(html_out)
            except PlottingMissing as e:
                print(f"{command}: {e}", file=sys.stderr)
                return 1
            print(f"{html_label}: {html_out}")
    except OutputError as e:
        print(f"{command}: {e}", file=sys.stderr)
        return 1
    return 0

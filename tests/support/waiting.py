"""Waiting for something to happen: poll with a deadline, never sleep and hope."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests


def wait_for(check: Callable[[], Any], what: str, timeout: float = 60.0, every: float = 0.1) -> Any:
    """Call `check` every `every` s until it returns something true, and return that; fail
    saying `what` did not happen within `timeout` s. A connection error (a server not up yet)
    counts as not yet."""
    deadline = time.monotonic() + timeout
    last_error = ""
    while True:
        try:
            value = check()
        except requests.ConnectionError as e:
            value, last_error = None, f" (last: {e})"
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}{last_error}"
        time.sleep(every)


def wait_for_text(log: Path, text: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    """Wait for `text` in `proc`'s log; fail at once if `proc` exits first."""

    def seen() -> bool:
        content = log.read_text()
        assert proc.poll() is None or text in content, f"exited {proc.returncode} before {text!r}:\n{content[-3000:]}"
        return text in content

    wait_for(seen, f"{text!r} in {log}", timeout)

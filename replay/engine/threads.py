"""Blocking work off the event loop: a function run in gevent's threadpool while the loop
keeps turning (a tokenizer's load, a cache section, a body builder's set-up), for the master's
preflight and finish as for a worker.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import gevent

T = TypeVar("T")


def off_loop(function: Callable[..., T], *args) -> T:
    """function(*args) in gevent's threadpool, the event loop turning meanwhile; what it raises
    is raised here (the pool itself would print it to stderr as a crash, traceback and all,
    before the caller turned it into its one-line message)."""
    def run():
        try:
            return function(*args), None
        except Exception as e:
            return None, e

    result, error = gevent.get_hub().threadpool.apply(run)
    if error is not None:
        raise error
    return result

"""Waking up on time in a gevent process that is also reading hundreds of streams.

gevent.sleep resumes through the loop's callback queue, which runs only after every I/O
callback of the current loop turn: with hundreds of open streams a turn can take
milliseconds, and a send would leave that much late. Here the dispatcher wakes on timers of
libev's highest priority, which run before the turn's I/O callbacks, armed from a fresh
clock (libev's cached "now" can be a whole turn stale). epoll rounds timeouts up to whole
milliseconds, so a timer aims EARLY_S early and the rest is spent in zero-delay timers of
the same priority.
"""

from __future__ import annotations

import time

import gevent

EARLY_S = 0.001
MAX_PRIORITY = 2  # libev's EV_MAXPRI


def _sleep(seconds: float) -> None:
    hub = gevent.get_hub()
    loop = hub.loop
    loop.update_now()
    timer = loop.timer(max(seconds, 0.0), priority=MAX_PRIORITY)
    try:
        hub.wait(timer)
    finally:
        timer.close()


def wait_until(deadline: float) -> None:
    """Return at `deadline` (unix seconds), or as soon after it as the loop allows."""
    while True:
        remaining = deadline - time.time()
        if remaining <= 0:
            return
        _sleep(remaining - EARLY_S if remaining > EARLY_S else 0.0)

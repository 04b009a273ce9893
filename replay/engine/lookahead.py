"""Bodies built ahead of their sends, in steps that fit between sends, in bounded memory.

A worker's builder (Dispatcher._build_ahead) makes the request bodies of the rows due within
its window before they are due. It runs on the event loop that sends, so a build must never
hold a due send back. A whole body is not the unit: a prompt of 30,000 tokens takes tens of ms
to make, longer than the gaps between sends of a busy trace, and a builder that waited for a
gap of a whole build's length found none and built such rows only once they were due, one
after another (a burst of eight went out up to 300 ms late). So a body is made in steps
(replay.synth.prompts' `pause`, every PAUSE_BLOCKS blocks): `BuildSteps` is called between
steps and lets every send due within a few steps' time go first. A build starts when the next
send is a few steps away, not a few whole builds.

The row being built may itself be, or become, the next to send (the builder fell behind): its
build then takes no pauses, since the sends it would wait for are its own.

`Bodies` holds the built bodies and counts their bytes: the builder builds no further ahead
once they hold AHEAD_BYTES (rows of 30,000 tokens are ~150 KB each), whatever the window.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import gevent

GUARD_STEPS = 3.0  # a step is started only when the next send is at least this many steps away
FIRST_STEP_S = 0.0005  # a step's time until one is measured
AHEAD_BYTES = 256 << 20  # the built bodies held at once, at most (the builder waits for sends beyond it)


class Bodies(dict):
    """Built bodies by row position (an Exception for a row that could not be built), with the
    bytes they hold (`held`)."""

    def __init__(self) -> None:
        super().__init__()
        self.held = 0

    def __setitem__(self, position: int, body: bytes | Exception) -> None:
        self.pop(position, None)
        super().__setitem__(position, body)
        if isinstance(body, bytes):
            self.held += len(body)

    def pop(self, position: int, *default):
        body = super().pop(position, *default)
        if isinstance(body, bytes):
            self.held -= len(body)
        return body

    @property
    def full(self) -> bool:
        """They hold AHEAD_BYTES or more: no more is built until sends free some."""
        return self.held >= AHEAD_BYTES


class BuildSteps:
    """The pauses of a body built on the sending event loop: called between the steps of a
    build, it waits while a send is due within GUARD_STEPS steps (`next_due`: the local time of
    the next send), and measures a step's time meanwhile: in CPU time, so that a host that
    takes the core away for a while does not make every gap look too short for a step (the
    builder would then find none, and build only at the rows' due times). It never waits while the row being
    built is itself the next to send (`next_position`, the position of the next row to send):
    the sends it would wait for are its own."""

    def __init__(self, next_due: Callable[[], float], next_position: Callable[[], int]) -> None:
        self.next_due, self.next_position = next_due, next_position
        self.step_s = FIRST_STEP_S  # recent step time (moving average)
        self._step_started = time.thread_time()
        self._position = -1

    def clear(self, gap_s: float) -> bool:
        """A step may start with the next send `gap_s` away."""
        return gap_s >= GUARD_STEPS * self.step_s

    def start(self, position: int) -> None:
        """The build of the row at `position` starts."""
        self._position = position
        self._step_started = time.thread_time()

    def done(self) -> None:
        """The build ended: its last step (a short row's whole build) counts as one."""
        self._measure()

    def _measure(self) -> None:
        self.step_s = 0.8 * self.step_s + 0.2 * (time.thread_time() - self._step_started)

    def __call__(self) -> None:
        self._measure()
        while self.next_position() != self._position and not self.clear(gap := self.next_due() - time.time()):
            gevent.sleep(max(gap, 0.0) + 0.0002)  # the send goes first, then the build goes on
        self._step_started = time.thread_time()

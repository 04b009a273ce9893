"""--max-error-rate: the master stops a run whose servers fail most of what they answer.

A dead or broken server otherwise fails every row of the trace, one after the other, for as
long as the trace lasts. The decision is the master's (replay.engine.coordinator), from the
records the workers report, so a fleet of workers is judged as one run; it reads the answers by
their arrival on the master's clock, not by the workers' timestamps.

An answer is a request sent whose outcome came back (replay.results.records.is_answer): an ok
answer, an HTTP error, a broken stream, a refused or reset connection. Rows with a label (never
sent, or cut off by a stop) are no server's answer and are not counted.

The window is the answers of the last WINDOW_S seconds, and at least the last MIN_ANSWERS: a
fast trace is judged on its last half minute, a sparse one on its last MIN_ANSWERS answers (a
time window alone would never fill in a trace of a request a minute). No verdict comes before
MIN_ANSWERS answers, so a few failures at the start of a run never stop it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from replay.engine.clock import Clock
from replay.results.records import Record, is_answer

DEFAULT_MAX_ERROR_RATE = 0.5  # a server failing more than half of what it answers is broken, not busy
WINDOW_S = 30.0
MIN_ANSWERS = 20
OFF = 1.0  # no share of failures is over 1: never stops


class ErrorRate:
    """The failed share of the recent answers, against `limit` (`over` once it is past it)."""

    def __init__(self, limit: float, clock: Clock):
        self.limit = limit
        self.clock = clock
        self._answers: deque[tuple[float, bool]] = deque()  # (arrival, failed), oldest first
        self.failed = 0  # failed answers in the window
        self.over = False

    def add(self, records: Iterable[Record]) -> bool:
        """Count the answers among `records`; whether the failed share is now over the limit."""
        if self.limit >= OFF:
            return False
        now = self.clock.now()
        for record in records:
            if is_answer(record):
                failed = not record["ok"]
                self._answers.append((now, failed))
                self.failed += failed
        while len(self._answers) > MIN_ANSWERS and self._answers[0][0] < now - WINDOW_S:
            self.failed -= self._answers.popleft()[1]
        self.over = self.over or (len(self._answers) >= MIN_ANSWERS and self.failed > self.limit * len(self._answers))
        return self.over

    @property
    def answers(self) -> int:
        """Answers in the window."""
        return len(self._answers)

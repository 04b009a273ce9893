"""A worker's sessions under a closed-loop --turn-timing (docs/replaying.md, "Sessions that wait for their answers"):
which of its session turns may go, and when.

The dispatcher walks its rows in trace order and sends each at its trace time; a session's
later turn is handed here instead (`hold`). It goes at once when its time under the rule has
come, else it is parked: behind the session's previous turn while that is unanswered, then, once
the answer ended (`ended`), in a heap by the time the rule gives it (replay.rules.send_time.
turn_send_time), from which the dispatcher takes it when due (`pop_due`). The worker holds
every turn of its sessions (--partition session), so the rule needs no round trip to the
master. Times are the master's clock, as a record's.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable

from replay.rules.send_time import turn_send_time
from replay.trace.record import TraceRow

# A parked turn: (due, position, row, body, scheduled): `due` first, so the heap orders by it;
# positions are unique, so rows and bodies are never compared.
Parked = tuple[float, int, TraceRow, object, float]


class _Session:
    __slots__ = ("busy", "last_time_s", "answered_at", "waiting", "stopped")

    def __init__(self, time_s: float):
        self.busy = True  # a turn is out (in flight, or parked in the heap): the next one waits for it
        self.last_time_s = time_s  # the trace time of the session's latest turn out
        self.answered_at = 0.0  # when its answer ended (or it failed), once not busy
        self.waiting: deque[Parked] = deque()  # turns reached, behind the busy one
        self.stopped = False  # --on-turn-failure stop-session, after a failed turn


def _think_time(row: TraceRow, session: _Session) -> float:
    """The trace's gap between the session's previous turn and `row` that after-answer keeps:
    the row's recorded think time (`gap_ms`, from the previous answer's end to its arrival) where
    the trace has it, else arrival to arrival. A negative think time (the turn was sent before the
    previous answer ended) is none: the turn goes as soon as the answer ends."""
    if row.gap_s is not None:
        return max(0.0, row.gap_s)
    return row.timestamp_s - session.last_time_s


class Turns:
    """The sessions of one worker's part (one round's sessions are named apart from another's:
    replay.engine.rounds), and the turns parked until the rule lets them go."""

    def __init__(self, timing: str, scale: float, stop_on_failure: bool,
                 on_stopped: Callable[[TraceRow, float], None]):
        """`on_stopped(row, scheduled)`: records a turn never sent because its session stopped."""
        self.timing, self.scale, self.stop_on_failure = timing, scale, stop_on_failure
        self.on_stopped = on_stopped
        self.sessions: dict[str | None, _Session] = {}  # by the rows' session id
        self.heap: list[Parked] = []
        self.waiting = 0  # turns parked behind an unanswered one (not in the heap)

    def hold(self, pos: int, row: TraceRow, body: object, scheduled: float, now: float) -> float | None:
        """Row `pos` of a session, reached at its trace time `scheduled`: the time it may go when
        that is `now` already (its session's first turn: `scheduled`), else None (parked, or
        recorded as stopped)."""
        session = self.sessions.get(row.session_id)
        if session is None:
            self.sessions[row.session_id] = _Session(row.timestamp_s)
            return scheduled
        if session.stopped:
            self.on_stopped(row, scheduled)
            return None
        if session.busy:
            session.waiting.append((0.0, pos, row, body, scheduled))
            self.waiting += 1
            return None
        due = turn_send_time(self.timing, scheduled, session.answered_at, _think_time(row, session), self.scale)
        session.busy, session.last_time_s = True, row.timestamp_s
        if due <= now:
            return due
        heapq.heappush(self.heap, (due, pos, row, body, scheduled))
        return None

    def ended(self, row: TraceRow, at: float, ok: bool, cut_below: int = 0) -> float | None:
        """The turn `row` was answered (or failed) at `at`: its session's next turn reached, if
        any, is released into the heap; returns its due time then (None: none released). A
        released turn of a probe cut short (position below `cut_below`) is due at once, to be
        recorded as cut."""
        session = self.sessions.get(row.session_id)
        if session is None:
            return None
        if not ok and self.stop_on_failure:
            session.stopped, session.busy = True, False
            while session.waiting:
                _, _, turn, _, scheduled = session.waiting.popleft()
                self.waiting -= 1
                self.on_stopped(turn, scheduled)
            return None
        if not session.waiting:
            session.busy, session.answered_at = False, at
            return None
        _, pos, turn, body, scheduled = session.waiting.popleft()
        self.waiting -= 1
        due = turn_send_time(self.timing, scheduled, at, _think_time(turn, session), self.scale)
        if pos < cut_below:
            due = 0.0
        session.last_time_s = turn.timestamp_s
        heapq.heappush(self.heap, (due, pos, turn, body, scheduled))
        return due

    def next_due(self) -> float:
        """The earliest due time in the heap; inf when it is empty."""
        return self.heap[0][0] if self.heap else float("inf")

    def pop(self) -> Parked:
        return heapq.heappop(self.heap)

    def cut(self, below: int) -> None:
        """A probe was cut short: its turns parked in the heap are due at once (to be recorded as cut)."""
        if any(entry[1] < below for entry in self.heap):
            self.heap = [(0.0, *entry[1:]) if entry[1] < below else entry for entry in self.heap]
            heapq.heapify(self.heap)

    def parked(self) -> list[Parked]:
        """Every turn parked (the heap's, then those waiting), taken out: a stop records them."""
        taken, self.heap = self.heap, []
        for session in self.sessions.values():
            taken.extend(session.waiting)
            session.waiting.clear()
        self.waiting = 0
        return taken

    def __bool__(self) -> bool:
        """Whether any turn is still parked."""
        return bool(self.heap) or self.waiting > 0

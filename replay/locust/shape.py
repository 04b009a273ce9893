"""One driver user per worker, for as long as rows are still open.

The user count never changes during a run; the shape only decides when the run is over:
when every row has its record (or the master has given up on it), or at --run-time's end.
Locust ticks a shape once a second; after the first tick, which starts the users, the next one
waits for the run's end: an idle run is not woken each second (its CPU is mostly its wake-ups),
and it stops as soon as the last row has its record. A stop kills the shape's greenlet (Locust's
Runner.stop), wait or not.
"""

from __future__ import annotations

from locust import LoadTestShape


class ReplayShape(LoadTestShape):
    use_common_options = False
    _users: int | None = None

    def tick(self):
        replay = getattr(self.runner.environment, "replay", None)
        if replay is None or replay.coordinator is None:
            return None
        if replay.coordinator.finished.is_set():
            return None
        run_time = getattr(self.runner.environment.parsed_options, "run_time", None)
        if run_time and self.get_run_time() >= run_time:  # Locust applies --run-time only without a shape
            return None
        if self._users is None:
            # fixed at the first tick: the workers that take part are those present at the start
            self._users = max(1, getattr(self.runner, "worker_count", 1))
            return (self._users, self._users)
        replay.coordinator.finished.wait(run_time - self.get_run_time() if run_time else None)
        return None

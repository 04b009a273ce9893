"""One driver user per worker, for as long as rows are still open.

The user count never changes during a run; the shape only decides when the run is over:
when every row has its record (or the master has given up on it).
"""

from __future__ import annotations

from locust import LoadTestShape

END_WAIT_S = 0.95  # within Locust's tick of 1 s, which it shortens by the time a tick took


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
        # Locust ticks again a second after this tick began: the run's end is waited for meanwhile,
        # so that it stops as soon as every row has its record, not up to a second later
        if replay.coordinator.finished.wait(END_WAIT_S):
            return None
        return (self._users, self._users)

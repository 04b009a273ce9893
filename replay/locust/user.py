"""The driver user: one per worker process, running that worker's part of the trace."""

from __future__ import annotations

import gevent
from locust import User, task


class ReplayUser(User):
    """Not a simulated client: the open-loop dispatcher. A request's timing comes from the
    trace, never from this user's task loop; extra users given to a worker (rebalancing
    after a loss) find the part claimed and idle."""

    @task
    def drive(self) -> None:
        part = self.environment.replay.part
        if part is not None and part.claim():
            part.run()
        while True:
            gevent.sleep(3600)

"""The Locust user of a replay: a placeholder, one per worker.

Locust needs a user class to run a test, but a replay's requests are not paced by users: the
worker's dispatcher runs in its own greenlet from the master's go message on, so Locust may
start, stop or move these users (a worker joining, a rebalance) without touching the replay.
"""

from __future__ import annotations

import gevent
from locust import User, task


class ReplayUser(User):
    @task
    def idle(self) -> None:
        gevent.sleep(3600)

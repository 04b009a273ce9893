"""The replay's locustfile, inside the package: `replay run` loads it, and so does
`locust -f <this file>` for those who call Locust themselves (the checkout's `locustfile.py`
imports it).

Only wiring: the options, the placeholder user and the shape live in replay.locust.
"""

from replay.locust import ReplayShape, ReplayUser

__all__ = ["ReplayShape", "ReplayUser"]  # Locust finds them here

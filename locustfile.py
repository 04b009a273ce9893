"""Trace replay on Locust, for a checkout: `locust -f locustfile.py --headless --host URL --trace T ...`
is `replay run --headless --host URL --trace T ...`; the locustfile itself ships in the package
(replay/locust/locustfile.py).
"""

from replay.locust.locustfile import ReplayShape, ReplayUser

__all__ = ["ReplayShape", "ReplayUser"]  # Locust finds them here

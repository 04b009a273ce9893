"""Distributed, timestamp-accurate trace replay on Locust.

`locustfile.py` imports ReplayUser and ReplayShape from here; importing this package also
registers the command-line options and event listeners (see plugin.py).
"""

from replay.locust import plugin
from replay.locust.shape import ReplayShape
from replay.locust.user import ReplayUser

__all__ = ["ReplayShape", "ReplayUser", "plugin"]

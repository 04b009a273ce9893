"""Distributed, timestamp-accurate trace replay on Locust: the adapter between Locust and the
replay engine (replay.engine).

`locustfile.py` imports ReplayUser and ReplayShape from here; importing this package also
registers the command-line options and event listeners (plugin.py). The engine never imports
it back: its options live in replay.engine.options.
"""

from replay.locust import plugin
from replay.locust.shape import ReplayShape
from replay.locust.user import ReplayUser

__all__ = ["ReplayShape", "ReplayUser", "plugin"]

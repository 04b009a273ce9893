"""Distributed, timestamp-accurate trace replay on Locust: the adapter between Locust and the
replay engine (replay.engine).

`locustfile.py` imports ReplayUser and ReplayShape from here; importing this package also
registers the command-line options and event listeners (plugin.py). The engine never imports
it back: its options live in replay.run.options.
"""

import gc

# Locust, gevent and Flask are imported by now, and their objects (~50k) live as long as the
# process: frozen, they are out of the collector's way, and the full collection that importing
# the rest would set off walks only the new objects (it walked all of them: ~18 ms of CPU).
gc.freeze()

from replay.locust import plugin  # noqa: E402
from replay.locust.shape import ReplayShape  # noqa: E402
from replay.locust.user import ReplayUser  # noqa: E402

__all__ = ["ReplayShape", "ReplayUser", "plugin"]

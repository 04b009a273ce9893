"""The replay's locustfile, inside the package: `replay run` loads it, and so does
`locust -f <this file>` for those who call Locust themselves (the checkout's `locustfile.py`
imports it).

Only wiring: the options, the placeholder user and the shape live in replay.locust. Locust
executes this file to start a run, so it does one thing of the start's first: Locust's own objects
(~50k, alive as long as the process) are frozen out of the garbage collector before the replay's
modules are imported, or those imports' allocations set off a full collection that walks them all
(the plugin freezes again at init, once the replay's are loaded too). `replay run` imports Locust
and the plugin with the collector off, then freezes both (replay.locust.cli.run).
"""

import gc

gc.freeze()

from replay.locust import ReplayShape, ReplayUser  # noqa: E402

__all__ = ["ReplayShape", "ReplayUser"]  # Locust finds them here

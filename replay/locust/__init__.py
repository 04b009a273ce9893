"""Distributed, timestamp-accurate trace replay on Locust: the adapter between Locust and the
replay engine (replay.engine).

`locustfile.py` (this package's, which `replay run` loads) imports ReplayUser and ReplayShape
from here; asking for either (or for `plugin`) imports plugin.py, which registers the command-line options and event listeners. The engine
never imports it back: its options live in replay.engine.options.

The names are loaded on first use (PEP 562), not while this package is being imported: importing
Locust monkey-patches gevent, which makes `threading.get_ident` a greenlet's id, and a package
whose import is still in progress at that moment stays locked under the old id, so the next
`from replay.locust import ...` waited on that lock forever (`python -c "import
replay.locust.plugin"` hung). With nothing imported here, only the module that imports Locust is
mid-import when it patches, and nothing imports that module back.
"""

from __future__ import annotations

import importlib

_NAMES = {"ReplayShape": "replay.locust.shape", "ReplayUser": "replay.locust.user", "plugin": "replay.locust.plugin"}

__all__ = ["ReplayShape", "ReplayUser", "plugin"]


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module 'replay.locust' has no attribute {name!r}")
    plugin = importlib.import_module("replay.locust.plugin")  # the options and listeners, whichever name is asked
    value = plugin if name == "plugin" else getattr(importlib.import_module(_NAMES[name]), name)
    globals()[name] = value
    return value

"""Distributed, timestamp-accurate trace replay on Locust: the adapter between Locust and the
replay engine (replay.engine).

`locustfile.py` imports ReplayUser and ReplayShape from here, which also registers the
command-line options and event listeners (plugin.py). They are loaded on that first use, not
when the package is: the engine reads its options from replay.locust.options, and importing
those must neither pull in Locust nor import the engine back half-initialized.
"""

from __future__ import annotations

__all__ = ["ReplayShape", "ReplayUser", "plugin"]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import replay.locust.plugin
    from replay.locust.shape import ReplayShape
    from replay.locust.user import ReplayUser

    return {"ReplayShape": ReplayShape, "ReplayUser": ReplayUser, "plugin": replay.locust.plugin}[name]

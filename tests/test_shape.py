"""The Locust shape of a replay (replay/locust/shape.py): one driver user per worker until every
row has its record, and then the run stops at once, not at Locust's next tick a second later."""

from __future__ import annotations

import time
from types import SimpleNamespace

import gevent
from gevent.event import Event

from replay.locust.shape import ReplayShape


def _shape(finished: Event) -> ReplayShape:
    shape = ReplayShape()
    coordinator = SimpleNamespace(finished=finished)
    shape.runner = SimpleNamespace(worker_count=2, environment=SimpleNamespace(
        replay=SimpleNamespace(coordinator=coordinator), parsed_options=SimpleNamespace(run_time=None)))
    return shape


def test_the_shape_stops_the_run_as_it_finishes():
    finished = Event()
    shape = _shape(finished)
    assert shape.tick() == (2, 2)  # the first tick starts the users at once
    started = time.monotonic()
    assert shape.tick() == (2, 2)  # the run goes on: the same users, within Locust's tick of a second
    assert time.monotonic() - started < 1.0
    gevent.spawn_later(0.1, finished.set)
    started = time.monotonic()
    assert shape.tick() is None  # ended within the tick, at the run's end
    assert time.monotonic() - started < 0.5

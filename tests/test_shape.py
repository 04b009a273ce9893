"""The Locust shape of a replay (replay/locust/shape.py): one driver user per worker until every
row has its record, and then the run stops at once, not at Locust's next tick a second later;
meanwhile it does not tick at all."""

from __future__ import annotations

import time
from types import SimpleNamespace

import gevent
from gevent.event import Event

from replay.locust.shape import ReplayShape


def _shape(finished: Event, run_time: float | None = None) -> ReplayShape:
    shape = ReplayShape()
    coordinator = SimpleNamespace(finished=finished)
    shape.runner = SimpleNamespace(worker_count=2, environment=SimpleNamespace(
        replay=SimpleNamespace(coordinator=coordinator), parsed_options=SimpleNamespace(run_time=run_time)))
    return shape


def test_the_shape_stops_the_run_as_it_finishes():
    finished = Event()
    shape = _shape(finished)
    assert shape.tick() == (2, 2)  # the first tick starts the users at once
    gevent.spawn_later(0.1, finished.set)
    started = time.monotonic()
    assert shape.tick() is None  # ended within the tick, at the run's end
    assert time.monotonic() - started < 0.5


def test_while_the_run_goes_on_the_shape_waits_for_its_end_without_ticking():
    """Locust ticks a shape once a second; an idle run's CPU is mostly such wake-ups, so the
    second tick waits for the run's end (the users never change meanwhile)."""
    finished = Event()
    shape = _shape(finished)
    assert shape.tick() == (2, 2)
    gevent.spawn_later(1.5, finished.set)
    started = time.monotonic()
    assert shape.tick() is None  # one tick: the run's end, not a second's
    assert 1.4 < time.monotonic() - started < 2.5


def test_run_time_ends_the_wait():
    shape = _shape(Event(), run_time=0.5)
    assert shape.tick() == (2, 2)
    started = time.monotonic()
    assert shape.tick() is None  # --run-time's end, though rows are still open
    assert time.monotonic() - started < 1.0

"""The dispatcher's wake-up and garbage-collection helpers (replay/engine/timing.py).

What is asserted is behaviour, not speed (speed is bench/dispatch.py's): an Alarm never
returns before its deadline, a ring cuts a long wait short, and the quiet collector keeps
the young generation bounded even when it never gets a gap.
"""

from __future__ import annotations

import gc
import time

import gevent

from replay.engine.timing import Alarm, QuietCollector, wait_until


def test_alarm_never_returns_before_its_deadline():
    alarm = Alarm()
    try:
        for delay in (0.0005, 0.002, 0.02):
            deadline = time.time() + delay
            alarm.wait_until(deadline)
            assert time.time() >= deadline
    finally:
        alarm.close()
    deadline = time.time() + 0.005
    wait_until(deadline)
    assert time.time() >= deadline


def test_ring_from_the_loop_wakes_a_long_wait():
    alarm = Alarm()
    woke = []

    def waiter():
        alarm.wait_until(time.time() + 30.0)
        woke.append(time.time())

    try:
        g = gevent.spawn(waiter)
        gevent.sleep(0.05)
        rung_at = time.time()
        gevent.get_hub().loop.run_callback(alarm.ring)  # ring runs in the hub, as the stream readers do
        g.join(timeout=5)
        assert woke and woke[0] - rung_at < 1.0
    finally:
        alarm.close()


def test_quiet_collector_defers_to_gaps_but_bounds_the_backlog():
    threshold0 = gc.get_threshold()[0]
    with QuietCollector() as collector:
        assert not gc.isenabled()
        garbage = []
        for _ in range(threshold0 * 2):  # tracked objects pile up while automatic collection is off
            garbage.append([])
        collector.idle(gap_s=0.0)  # no gap and not yet far over: nothing runs
        assert gc.get_count()[0] >= threshold0
        collector.idle(gap_s=1.0)  # a gap: the due collection runs
        assert gc.get_count()[0] < threshold0
        for _ in range(threshold0 * (QuietCollector.FORCE_FACTOR + 1)):
            garbage.append([])
        collector.idle(gap_s=0.0)  # never a gap, but far over: runs anyway
        assert gc.get_count()[0] < threshold0
    assert gc.isenabled()

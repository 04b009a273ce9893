"""Waking up on time in a gevent process that is also reading hundreds of streams.

gevent.sleep resumes through the loop's callback queue, which runs only after every I/O
callback of the current loop turn: with hundreds of open streams a turn can take
milliseconds, and a send would leave that much late. Here the dispatcher wakes on watchers of
libev's highest priority, which run before the turn's other I/O callbacks.

On Linux the wake-up is a timerfd armed with the time left to the deadline (by time.time(),
on CLOCK_MONOTONIC: nothing assumes time.time() is the kernel's clock): the kernel wakes the loop
about WAKE_S after it, and only that much is spun away. libev's
own timers are the fallback elsewhere: epoll rounds their timeouts up to whole milliseconds, so
one aims EARLY_S early, from a fresh clock, and the rest is spent in zero-delay timers (a spin
that costs CPU, and on a shared core the scheduler then favours other processes).

A wake-up that falls due while the loop is running a turn's I/O callbacks is only seen on the
next turn, so an `Alarm` can also be rung from those callbacks (the stream readers do, after
each read, when a send is due): the waiting greenlet then runs at once, in the middle of the
turn.
"""

from __future__ import annotations

import ctypes
import gc
import math
import os
import time

import gevent
from gevent.hub import Waiter

EARLY_S = 0.001
WAKE_S = 0.0001  # a timerfd wake-up takes about this long here: aim this early, spin the rest
MAX_PRIORITY = 2  # libev's EV_MAXPRI

CLOCK_MONOTONIC = 1
TFD_FLAGS = os.O_NONBLOCK | os.O_CLOEXEC  # TFD_NONBLOCK, TFD_CLOEXEC have the same values


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _load_timerfd():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        create, settime = libc.timerfd_create, libc.timerfd_settime
    except (OSError, AttributeError):  # not Linux
        return None
    fd = create(CLOCK_MONOTONIC, TFD_FLAGS)
    if fd < 0:
        return None
    os.close(fd)
    settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec), ctypes.c_void_p]
    return create, settime


_TIMERFD = _load_timerfd()


class Alarm:
    """`wait_until` for one greenlet, which `ring` (called in the event loop) cuts short."""

    def __init__(self) -> None:
        self._waiter: Waiter | None = None
        self._fd = -1
        self._watcher = None
        self._spec = _Itimerspec()

    def wait_until(self, deadline: float) -> None:
        """Return at `deadline` (unix seconds), as soon after it as the loop allows, or when rung."""
        while True:
            remaining = deadline - time.time()
            if remaining <= 0:
                return
            if _TIMERFD is not None:
                if remaining > WAKE_S:
                    rung = self._sleep_fd(remaining - WAKE_S)
                else:
                    rung = self._sleep_timer(0.0)
            else:
                rung = self._sleep_timer(remaining - EARLY_S if remaining > EARLY_S else 0.0)
            if rung:
                return

    def ring(self) -> None:
        """Wake the waiting greenlet now; nothing when none waits. Only from the hub (an I/O
        callback), where switching into the waiter is allowed."""
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.switch(True)

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _wait(self, watcher, callback) -> bool:
        waiter = self._waiter = Waiter(gevent.get_hub())
        watcher.start(callback, waiter)
        try:
            return waiter.get()
        finally:
            self._waiter = None
            watcher.stop()

    def _sleep_fd(self, seconds: float) -> bool:
        if self._watcher is None:
            self._fd = _TIMERFD[0](CLOCK_MONOTONIC, TFD_FLAGS)
            if self._fd < 0:
                raise OSError(ctypes.get_errno(), "timerfd_create failed")
            self._watcher = gevent.get_hub().loop.io(self._fd, 1, priority=MAX_PRIORITY)
        frac, whole = math.modf(seconds)
        value = self._spec.it_value
        value.tv_sec, value.tv_nsec = int(whole), max(int(frac * 1e9), 1)  # all zero would disarm it
        if _TIMERFD[1](self._fd, 0, self._spec, None) != 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")
        return self._wait(self._watcher, self._expired)

    def _expired(self, waiter: Waiter) -> None:
        try:
            os.read(self._fd, 8)  # re-arms the fd's readiness
        except BlockingIOError:  # spurious: not expired after all
            return
        waiter.switch(False)

    def _sleep_timer(self, seconds: float) -> bool:
        loop = gevent.get_hub().loop
        loop.update_now()  # libev's cached "now" can be a whole turn stale
        timer = loop.timer(seconds if seconds > 0.0 else 0.0, priority=MAX_PRIORITY)
        try:
            return self._wait(timer, _switch_false)
        finally:
            timer.close()


def _switch_false(waiter: Waiter) -> None:
    waiter.switch(False)


class QuietCollector:
    """Runs the garbage collector in the dispatcher's gaps instead of wherever it falls due.

    An automatic collection is a pause of up to a few ms at a random moment; sends due in it
    leave late. With automatic collection off, the dispatcher calls `idle` before each wait
    and the collection CPython would have run by now runs there, when the next send is at
    least GAP_S away. With no such gap for a while it runs anyway, once the young generation
    is FORCE_FACTOR times over its threshold, so memory stays bounded at any rate.
    """

    GAP_S = 0.003
    FORCE_FACTOR = 8

    def __init__(self) -> None:
        self.thresholds = gc.get_threshold()
        self.was_enabled = False

    def __enter__(self) -> QuietCollector:
        self.was_enabled = gc.isenabled()
        gc.disable()
        return self

    def __exit__(self, *exc) -> None:
        if self.was_enabled:
            gc.enable()

    def idle(self, gap_s: float) -> None:
        """The next send is `gap_s` away: collect now if a collection is due and it fits."""
        if not self.was_enabled:
            return
        young, collections0, collections1 = gc.get_count()
        threshold0, threshold1, threshold2 = self.thresholds
        if young < threshold0 or (gap_s < self.GAP_S and young < self.FORCE_FACTOR * threshold0):
            return
        generation = 0
        if collections0 >= threshold1:  # gen0 collections since the last of gen1 (as CPython counts)
            generation = 2 if collections1 >= threshold2 else 1
        gc.collect(generation)


def wait_until(deadline: float) -> None:
    """Return at `deadline` (unix seconds), or as soon after it as the loop allows."""
    alarm = Alarm()
    try:
        alarm.wait_until(deadline)
    finally:
        alarm.close()

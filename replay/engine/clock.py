"""Time for the engine: the clock it reads and waits with, and a worker's offset to the master's.

`Clock` is what the Coordinator reads the time with and sleeps on (`SYSTEM_CLOCK`: the wall
clock and gevent's sleep); a test hands it a clock of its own, so its timeouts (workers not
ready, the drain, a stop's wait for held records) come in milliseconds, not minutes.

A worker's offset: master_time - local_time, taken from the sample with the smallest round
trip (the one least disturbed by queueing), assuming the reply was stamped half way.
"""

from __future__ import annotations

import time

import gevent
from gevent.event import Event

from replay.engine import messages, transport


class Clock:
    """The wall clock (unix seconds) and a cooperative sleep: what the engine reads and waits with."""

    def now(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        gevent.sleep(seconds)


SYSTEM_CLOCK = Clock()


class ClockSync:
    def __init__(self, link: transport.Link):
        self.link = link
        self.best_rtt = float("inf")
        self.offset = 0.0
        self._got = Event()

    def on_pong(self, data: messages.Pong, sender: str) -> None:
        t1 = time.time()
        rtt = t1 - data["t0"]
        if rtt < self.best_rtt:
            self.best_rtt = rtt
            self.offset = data["tm"] - (data["t0"] + t1) / 2.0
        self._got.set()

    def measure(self, samples: int = 12, spacing_s: float = 0.01, good_rtt_s: float = 0.002, rounds: int = 10,
                timeout_s: float = 10.0) -> float:
        """Ping the master in rounds of `samples` until one round trip is under `good_rtt_s`
        (a busy master answers late, and a late answer says little); returns the offset in seconds."""
        for _ in range(rounds):
            for _ in range(samples):
                self.link.to_master(messages.PING, messages.Ping(t0=time.time()))
                gevent.sleep(spacing_s)
            self._got.wait(timeout_s)
            gevent.sleep(spacing_s * 5)  # let the last answers land
            if self.best_rtt <= good_rtt_s:
                break
        return self.offset


def answer_ping(link: transport.Link, data: messages.Ping, sender: str, clock: Clock = SYSTEM_CLOCK) -> None:
    """Master side: stamp and return at once."""
    link.to_worker(sender, messages.PONG, messages.Pong(t0=data["t0"], tm=clock.now()))

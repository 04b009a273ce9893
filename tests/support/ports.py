"""Loopback ports for servers whose clients must be told the port before the server starts
(a Locust master's --master-bind-port, the web UI's --web-port). Servers that report the
port they bound (`replay sim --port 0`) need none of this.

A port found free by binding port 0 comes from the kernel's ephemeral range, where, while
the test starts its server, any process's outgoing connection or another test process's
free_port can take it. So each test process (pytest-xdist worker gw0, gw1, ...) takes its
ports from a block of its own below that range, checked free by binding it.
"""

from __future__ import annotations

import os
import socket

BASE = 20000  # the Linux default ephemeral range starts at 32768
BLOCK = 500  # ports per test process: 25 processes fit below 32768


_last: int | None = None  # the port this process handed out last


def _block() -> range:
    """This test process's ports: pytest-xdist names its workers gw0, gw1, ... in PYTEST_XDIST_WORKER."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    return range(BASE + BLOCK * index, BASE + BLOCK * (index + 1))


def free_port() -> int:
    """A loopback port nothing listens on now, from this test process's own block; each call
    moves on (a port just handed out may not be bound yet). The first call starts at a place
    chosen by the pid, so two pytest sessions run side by side rarely meet."""
    global _last
    block = _block()
    start = block.start + os.getpid() % BLOCK if _last is None else _last + 1
    for i in range(BLOCK):
        port = block.start + (start - block.start + i) % BLOCK
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _last = port
        return port
    raise RuntimeError(f"no free loopback port in {block.start}..{block.stop - 1}")

"""Loopback ports for servers whose clients must be told the port before the server starts
(a Locust master's --master-bind-port, the web UI's --web-port). Servers that report the
port they bound (`replay sim --port 0`) need none of this.

A port found free by binding port 0 comes from the kernel's ephemeral range, where, while
the test starts its server, any process's outgoing connection or another test process's
free_port can take it. So each process that starts servers takes its ports from a block of its
own below that range, checked free by binding it: `make test` runs at once a pytest process
without pytest-xdist (the alone tests: block 0), the vLLM server started ahead of them
(support.serve_vllm: block AHEAD) and the pytest-xdist workers gw0, gw1, ... (blocks 2, 3, ...).
A port is free until its server binds it, which takes vLLM half a minute: two processes in one
block could both hand it out in that time.
"""

from __future__ import annotations

import os
import socket

BASE = 20000  # the Linux default ephemeral range starts at 32768
BLOCK = 500  # ports per process: 25 blocks fit below 32768
AHEAD = 1  # the block of a server started ahead of the tests (support.serve_vllm)
FIRST_WORKER = 2  # the block of pytest-xdist's worker gw0; gw1 takes the next, and so on

_last: int | None = None  # the port this process handed out last
_chosen: int | None = None  # the block use_block chose, if any


def use_block(index: int) -> None:
    """Take this process's ports from block `index` (a process that is not a test process)."""
    global _chosen, _last
    _chosen, _last = index, None


def _block() -> range:
    """This process's ports: pytest-xdist names its workers gw0, gw1, ... in PYTEST_XDIST_WORKER."""
    index = _chosen
    if index is None:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "")
        index = FIRST_WORKER + int(worker[2:]) if worker[2:].isdigit() else 0
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

"""A worker's last messages reach its master before the process ends (replay.locust.link.flush_on_exit).

pyzmq does not end a context at interpreter exit, and a socket held in a reference cycle (as
Locust's runner holds its client, frozen by the plugin's gc.freeze) is never closed there: what
its I/O thread has not written yet dies with the process. A worker stopped by a signal of its own
then had its rows labelled "worker lost", not "worker stopped" (a CI run, once). The child here is
built that way and queues more than the I/O thread writes before the process is gone (without the
flush, 307 of 500 messages and not the last one arrived here).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import zmq
from locust.rpc import Message

from replay.locust.link import FLUSH_S
from support.paths import REPO
from support.ports import free_port

MESSAGES, SIZE = 500, 100_000  # 50 MB queued at the exit

CHILD = textwrap.dedent("""
    import gc, sys, types
    sys.path.insert(0, {repo!r})
    from locust.rpc import Message, rpc
    from replay.locust.link import flush_on_exit
    runner = types.SimpleNamespace(client=rpc.Client("127.0.0.1", {port}, "worker"))
    runner.me = runner  # a cycle: collected at no exit
    gc.freeze()
    for i in range({messages}):
        runner.client.send(Message("blob", {{"i": i, "payload": "x" * {size}}}, "worker"))
    runner.client.send(Message("last", None, "worker"))
    flush_on_exit(runner)
    sys.exit(0)
""")


def test_a_workers_last_messages_leave_before_it_exits():
    context = zmq.Context()
    master = context.socket(zmq.ROUTER)
    try:
        port = master.bind_to_random_port("tcp://127.0.0.1")
        child = subprocess.run([sys.executable, "-c", CHILD.format(repo=str(REPO), port=port, messages=MESSAGES,
                                                                     size=SIZE)], timeout=60)
        assert child.returncode == 0
        received, deadline = [], time.monotonic() + 30
        while time.monotonic() < deadline and (not received or received[-1] != "last"):
            if master.poll(1000):
                _, data = master.recv_multipart()
                message = Message.unserialize(data)
                received.append(message.data["i"] if message.type == "blob" else message.type)
        assert received == [*range(MESSAGES), "last"]  # all of them, in order, after the process ended
    finally:
        master.close(linger=0)
        context.term()


def test_a_worker_whose_master_is_gone_still_exits():
    """Nothing listens: its messages cannot leave, and the exit waits FLUSH_S for them, no longer."""
    port = free_port()
    started = time.monotonic()
    child = subprocess.run([sys.executable, "-c", CHILD.format(repo=str(REPO), port=port, messages=3, size=10)],
                           timeout=60)
    assert child.returncode == 0
    assert time.monotonic() - started < FLUSH_S + 9  # the interpreter's start and end besides

"""The engine's transport over Locust's own custom messages (MasterRunner or WorkerRunner)."""

from __future__ import annotations

from typing import Any

from replay.engine.transport import Handler, Link


class RunnerLink(Link):
    """Locust's own custom messages (MasterRunner or WorkerRunner). Locust takes one listener
    per message type, once: the link registers its own, which calls the latest handler."""

    def __init__(self, runner):
        self.runner = runner
        self.handlers: dict[str, Handler] = {}

    def on(self, msg_type: str, handler: Handler) -> None:
        if msg_type not in self.handlers:
            self.runner.register_message(msg_type, lambda environment, msg, **kw: self._handle(msg_type, msg))
        self.handlers[msg_type] = handler

    def _handle(self, msg_type: str, msg) -> None:
        self.handlers[msg_type](msg.data, msg.node_id)

    def to_worker(self, client_id: str, msg_type: str, data: Any) -> None:
        self.runner.send_message(msg_type, data, client_id=client_id)

    def to_master(self, msg_type: str, data: Any) -> None:
        self.runner.send_message(msg_type, data)


FLUSH_S = 1.0  # the most a worker's exit waits for its last messages to leave (a master that is gone)


def flush_on_exit(runner, timeout_s: float = FLUSH_S) -> None:
    """Let what a worker queued for its master leave before the process ends. pyzmq does not end
    a context at interpreter exit, so the last messages (a signal's STOPPED, Locust's quit) die
    with the process where its I/O thread has not written them yet: the master then labels the
    worker's rows "worker lost", not "worker stopped". Closing the socket with a linger and ending
    its context waits as long as the writing takes, and no longer than `timeout_s`."""
    socket = runner.client.socket
    socket.close(linger=int(timeout_s * 1000))
    socket.context.term()

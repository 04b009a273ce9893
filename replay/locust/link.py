"""The engine's transport over Locust's own custom messages (MasterRunner or WorkerRunner)."""

from __future__ import annotations

from typing import Any

from replay.engine.transport import Handler, Link


class RunnerLink(Link):
    """Locust's own custom messages (MasterRunner or WorkerRunner)."""

    def __init__(self, runner):
        self.runner = runner

    def on(self, msg_type: str, handler: Handler) -> None:
        self.runner.register_message(msg_type, lambda environment, msg, **kw: handler(msg.data, msg.node_id))

    def to_worker(self, client_id: str, msg_type: str, data: Any) -> None:
        self.runner.send_message(msg_type, data, client_id=client_id)

    def to_master(self, msg_type: str, data: Any) -> None:
        self.runner.send_message(msg_type, data)

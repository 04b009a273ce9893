"""Master <-> worker messaging: one interface (`Link`) for a runner's messages (Locust's ZeroMQ
ones: replay.locust.link.RunnerLink) and for a local run (`LocalLink`). What is sent over it,
message by message, is in replay.engine.messages.

ZeroMQ drops master->worker messages past its high-water mark without a word, so bulk data
(trace rows one way, records the other) goes through `Window`: numbered chunks, at most
`size` unacknowledged at a time, resent if no ack comes. Nothing is lost and memory stays flat.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import gevent

logger = logging.getLogger(__name__)

# A worker is shipped at most this many of its rows ahead of its sends; it asks for more as it
# sends (messages.RowsAck.want), so its memory does not grow with its part of the trace.
HOLD_ROWS = 8_000

Handler = Callable[[Any, str], None]  # (payload, one of messages' TypedDicts; sender's client id) -> None


class Link:
    """Sends and receives replay messages. `to_worker` takes the runner's client id of a worker."""

    def on(self, msg_type: str, handler: Handler) -> None:
        """Handle `msg_type` with `handler` from now on (replacing an earlier one)."""
        raise NotImplementedError

    def to_worker(self, client_id: str, msg_type: str, data: Any) -> None:
        raise NotImplementedError

    def to_master(self, msg_type: str, data: Any) -> None:
        raise NotImplementedError


LOCAL_CLIENT = "local"


class LocalLink(Link):
    """Both sides in one process. Each message is handled in its own greenlet, in order,
    so a chain of sends and acks never recurses."""

    def __init__(self):
        self.handlers: dict[str, Handler] = {}

    def on(self, msg_type: str, handler: Handler) -> None:
        self.handlers[msg_type] = handler

    def _deliver(self, msg_type: str, data: Any) -> None:
        gevent.spawn(self.handlers[msg_type], data, LOCAL_CLIENT)

    def to_worker(self, client_id: str, msg_type: str, data: Any) -> None:
        self._deliver(msg_type, data)

    def to_master(self, msg_type: str, data: Any) -> None:
        self._deliver(msg_type, data)


class Window:
    """Numbered chunks with at most `size` unacknowledged; unacknowledged ones are resent
    after `resend_s`. The receiver acks every chunk (duplicates included) and applies each
    sequence number once. The number rides in the payload itself, as its `seq` key
    (messages.Chunk), so a chunk on the wire is one flat dict."""

    def __init__(self, send: Callable[[dict], None], size: int = 8, resend_s: float = 5.0,
                 source: Iterator[dict] | None = None, limit: int | None = None):
        self._send = send
        self._source = source  # payloads made only when there is room: a big trace is not encoded all at once
        self.limit = limit  # no chunk numbered this or higher is sent until the receiver grants it
        self.size = size
        self.resend_s = resend_s
        self._queue: list[dict] = []
        self._unacked: OrderedDict[int, tuple[float, dict]] = OrderedDict()
        self._next_seq = 0
        self._resender: gevent.Greenlet | None = None
        self._sources: list[Iterator[dict]] = []  # more payloads, each taken once the one before is used up

    def feed(self, source: Iterator[dict]) -> None:
        """More payloads, after those of the sources given so far (a search's next round)."""
        if self._source is None:
            self._source = source
        else:
            self._sources.append(source)
        self._pump()

    def put(self, payload: Any) -> None:  # a message's TypedDict, to which the window adds its seq
        self._enqueue(payload)
        self._pump()

    def _enqueue(self, payload: dict) -> None:
        payload["seq"] = self._next_seq
        self._next_seq += 1
        self._queue.append(payload)

    def start(self) -> None:
        self._pump()

    def ack(self, seq: int) -> None:
        self._unacked.pop(seq, None)
        self._pump()

    def grant(self, limit: int) -> None:
        """The receiver takes chunks numbered below `limit` (it never takes back a grant)."""
        if self.limit is not None and limit > self.limit:
            self.limit = limit
            self._pump()

    def _pump(self) -> None:
        while (self._source is not None and len(self._queue) + len(self._unacked) < self.size
               and (self.limit is None or self._next_seq < self.limit)):
            payload = next(self._source, None)
            if payload is None:
                self._source = self._sources.pop(0) if self._sources else None
            else:
                self._enqueue(payload)
        while self._queue and len(self._unacked) < self.size:
            payload = self._queue.pop(0)
            self._unacked[payload["seq"]] = (time.monotonic(), payload)
            self._send(payload)
        if self._unacked and (self._resender is None or self._resender.dead):
            self._resender = gevent.spawn(self._resend_loop)

    def _resend_loop(self) -> None:
        while self._unacked:
            gevent.sleep(self.resend_s / 2)
            now = time.monotonic()
            for seq, (sent, payload) in list(self._unacked.items()):
                if now - sent >= self.resend_s:
                    logger.warning("resending unacknowledged chunk %d", seq)
                    self._unacked[seq] = (now, payload)
                    self._send(payload)

    def close(self) -> None:
        if self._resender is not None:
            self._resender.kill(block=False)

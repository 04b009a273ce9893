"""Sending one request and timing it.

One geventhttpclient pool per endpoint, sized far beyond any in-flight demand: a pool
smaller than the number of requests in flight queues requests inside the client, where
dispatch timing cannot see it (Locust's FastHttpUser default of 10 turned a 51 ms TTFT
into 8.8 s). Connections are opened lazily, so a large size costs nothing until used.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import gevent
import orjson
from gevent.hub import Waiter
from geventhttpclient import HTTPClient
from geventhttpclient.response import HTTPSocketPoolResponse

from replay.api.adapters import Adapter
from replay.api.sse import DONE, sse_data

POOL_SIZE = 100_000
ERROR_TEXT_LIMIT = 300
REQUEST_ID_HEADER = "X-Request-Id"  # "<run id>-<request_id>": servers and routers log it, `replay sim` counts it
READ_SIZE = 16384  # one recv takes whatever has arrived (dozens of events when the loop is busy)


def _nothing(now: float) -> None:
    pass


class Endpoint:
    """A server URL with its own connection pool and in-flight count (for routing).

    Besides geventhttpclient's blocking request(), it can write a request on an idle
    kept-alive connection without ever yielding (`idle_socket`, `request_bytes`): the
    dispatcher then sends every row that is due in one go, instead of one per event-loop
    turn. `warm` keeps such connections ready. The pool's internals are used for this; they
    are geventhttpclient's own get_socket/return_socket steps, split apart.
    """

    def __init__(self, url: str, network_timeout: float = 3600.0, connection_timeout: float = 30.0):
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if not parts.hostname:
            raise ValueError(f"endpoint {url!r}: no host")
        self.url = url.rstrip("/")
        self.prefix = parts.path.rstrip("/")
        self.in_flight = 0
        # Called with the arrival time after every read of a stream body (the dispatcher's
        # hook). It runs inside the event loop, so it must not block.
        self.on_read = _nothing
        self.host_header = parts.netloc
        self._heads: dict[tuple, bytes] = {}
        self.http = HTTPClient(
            parts.hostname,
            parts.port,
            ssl=parts.scheme == "https",
            concurrency=POOL_SIZE,
            network_timeout=network_timeout,
            connection_timeout=connection_timeout,
        )

    @property
    def pool(self):
        return self.http._connection_pool

    def idle_socket(self):
        """A kept-alive connection that can be written to now, or None."""
        pool = self.pool
        queue = pool._socket_queue
        while not queue.empty():
            sock = queue.get(block=False)
            if pool._is_socket_alive(sock):
                pool._semaphore.acquire()  # what get_socket does; never waits (the pool is huge)
                return sock
            sock.close()
        return None

    def idle(self) -> int:
        return self.pool._socket_queue.qsize()

    def warm(self, idle: int) -> None:
        """Open connections until `idle` wait in the pool (blocks while connecting)."""
        pool = self.pool
        while pool._socket_queue.qsize() < idle:
            pool._semaphore.acquire()
            try:
                sock = pool._create_socket()
            except Exception:
                pool._semaphore.release()
                raise
            pool.return_socket(sock)

    def request_bytes(self, path: str, body: bytes, headers: dict[str, str], request_id: str | None = None) -> bytes:
        key = (path, tuple(headers.items()))
        head = self._heads.get(key)
        if head is None:
            lines = [f"POST {self.prefix}{path} HTTP/1.1", f"Host: {self.host_header}", "User-Agent: tracereplay"]
            lines += [f"{name}: {value}" for name, value in headers.items()]
            head = self._heads[key] = ("\r\n".join(lines) + "\r\n").encode("latin-1")
        if request_id is not None:
            head += b"%s: %s\r\n" % (REQUEST_ID_HEADER.encode(), request_id.encode("latin-1"))
        return b"%sContent-Length: %d\r\n\r\n%s" % (head, len(body), body)

    def close(self) -> None:
        self.http.close()


@dataclass(slots=True)
class Outcome:
    """What happened to one request, in unix seconds and server-reported counts."""

    sent_at: float
    finished_at: float = 0.0
    status: int = 0
    error: str | None = None
    token_times: list[float] = field(default_factory=list)  # arrival of each content event
    events_tokens: int = 0
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    streamed: bool = True

    @property
    def ok(self) -> bool:
        return self.error is None and 200 <= self.status < 300

    @property
    def e2e_ms(self) -> float | None:
        return (self.finished_at - self.sent_at) * 1000.0 if self.finished_at else None

    @property
    def ttft_ms(self) -> float | None:
        if not self.streamed or not self.token_times:
            return None
        return (self.token_times[0] - self.sent_at) * 1000.0

    @property
    def itl_ms(self) -> list[float]:
        t = self.token_times
        return [(b - a) * 1000.0 for a, b in zip(t, t[1:])]

    @property
    def tpot_ms(self) -> float | None:
        n = self.output_tokens if self.output_tokens is not None else self.events_tokens
        if not self.streamed or not self.token_times or n is None or n < 2:
            return None
        return (self.finished_at - self.token_times[0]) * 1000.0 / (n - 1)

    def apply_usage(self, usage: dict | None) -> None:
        if not usage:
            return
        for key in ("prompt_tokens", "output_tokens", "cached_tokens"):
            if usage.get(key) is not None:
                setattr(self, key, usage[key])


def _exception_text(e: Exception) -> str:
    """A failure as a record's error: the exception's type and message, bounded."""
    return f"{type(e).__name__}: {e}"[:ERROR_TEXT_LIMIT] or type(e).__name__


class _BodyReader:
    """Reads a response body inside the event loop and wakes its greenlet when it is over.

    A raw I/O watcher on the connection does one non-blocking recv and one call into the C
    parser per read: a token costs no greenlet switch, hundreds of open streams keep each turn
    of the loop short, and dispatch is not held up behind them. Each read appends an int and a
    float, which the garbage collector does not track: one tuple per read made its young
    generation tens of thousands of objects long, and each collection a millisecond-long pause.
    """

    __slots__ = ("response", "buf", "sock", "on_read", "sizes", "times", "error", "watcher", "waiter")

    def __init__(self, response, on_read):
        self.response = response
        self.buf = response._body_buffer  # geventhttpclient's de-chunked body, grown in place by feed()
        self.sock = response._sock._sock  # the non-blocking _socket.socket under gevent's
        self.on_read = on_read
        self.sizes: list[int] = []  # body bytes so far after each read
        self.times: list[float] = []  # and when that read arrived (unix seconds)
        self.error: str | None = None
        hub = gevent.get_hub()
        self.watcher = hub.loop.io(self.sock.fileno(), 1)
        self.waiter = Waiter(hub)

    def read(self) -> None:
        if self.buf:  # body bytes that came with the headers
            self.sizes.append(len(self.buf))
            self.times.append(time.time())
        self.watcher.start(self._readable)
        try:
            self.waiter.get()
        finally:
            self.watcher.close()

    def _end(self, error: str | None) -> None:
        self.watcher.stop()
        self.error = error
        self.waiter.switch(None)

    def _readable(self) -> None:  # runs in the hub: must never block, must never raise
        try:
            data = self.sock.recv(READ_SIZE)
        except BlockingIOError:
            return
        except Exception as e:
            return self._end(_exception_text(e))
        now = time.time()
        if not data:
            return self._end("connection closed before the end of the response")
        response = self.response
        try:
            response.feed(data)
        except Exception as e:
            return self._end(_exception_text(e))
        self.sizes.append(len(self.buf))
        self.times.append(now)
        if response.message_complete:
            return self._end(None)
        self.on_read(now)


def _receive(response, on_read=_nothing) -> tuple[bytes, list[int], list[float], str | None]:
    """The whole body, when each part of it arrived (body bytes so far after each read, and
    the read's unix time), and the error that cut it short, if any.

    No per-read timeout while streaming; a server that stops answering is cut off by
    --drain-timeout instead. Lines are split and parsed after the stream ends.
    """
    if response._sock is None:  # the whole body came with the headers
        buf = response._body_buffer
        return bytes(buf), [len(buf)] if buf else [], [time.time()] if buf else [], None
    reader = _BodyReader(response, on_read)
    reader.read()
    return bytes(reader.buf), reader.sizes, reader.times, reader.error


def _read_stream(response, adapter: Adapter, outcome: Outcome, on_read=_nothing) -> None:
    """Time each content event by the read that completed its line."""
    body, sizes, times, outcome.error = _receive(response, on_read)
    pos = 0
    mark = 0
    last = len(sizes) - 1
    for line in body.split(b"\n"):
        pos += len(line) + 1
        data = sse_data(line)
        if data is None:
            continue
        if data == DONE:
            break
        while mark < last and sizes[mark] < pos - 1:
            mark += 1
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            outcome.error = f"unparsable stream event: {data[:ERROR_TEXT_LIMIT].decode(errors='replace')}"
            break
        count, usage, error = adapter.read_event(obj)
        if error is not None:
            outcome.error = error[:ERROR_TEXT_LIMIT]
            break
        if count:
            outcome.token_times.append(times[mark])
            outcome.events_tokens += count
        outcome.apply_usage(usage)


def _release(response) -> None:
    """Return the connection to the pool only when its response was read to the end."""
    if response.message_complete:
        response.release()
        return
    pool, sock = response._pool, response._sock
    response._pool = response._sock = None
    if pool is not None and sock is not None:
        pool.release_socket(sock)


def _answer(endpoint: Endpoint, adapter: Adapter, stream: bool, outcome: Outcome, respond) -> Outcome:
    """Read the answer `respond()` gives into `outcome`; never raises for server or network failures."""
    response = None
    try:
        response = respond()
        outcome.status = response.status_code
        if outcome.status >= 300:
            text = response.read()
            outcome.error = f"HTTP {outcome.status}: {text[:ERROR_TEXT_LIMIT].decode(errors='replace')}"
        elif stream:
            _read_stream(response, adapter, outcome, endpoint.on_read)
        else:
            obj = orjson.loads(response.read())
            count, usage, error = adapter.read_body(obj)
            outcome.events_tokens = count
            outcome.error = error
            outcome.apply_usage(usage)
    except Exception as e:  # network errors, resets, timeouts, bad JSON: all become the record's error
        outcome.error = _exception_text(e)
    finally:
        outcome.finished_at = time.time()
        endpoint.in_flight -= 1
        if response is not None:
            _release(response)
    if outcome.output_tokens is None and outcome.streamed and outcome.error is None:
        outcome.output_tokens = outcome.events_tokens
    return outcome


def send(endpoint: Endpoint, adapter: Adapter, body: bytes, stream: bool, headers: dict[str, str],
         request_id: str | None = None) -> Outcome:
    """POST one request and read its answer (blocks; opens a connection when none is idle)."""
    if request_id is not None:
        headers = {**headers, REQUEST_ID_HEADER: request_id}
    outcome = Outcome(sent_at=time.time(), streamed=stream)
    endpoint.in_flight += 1
    path = endpoint.prefix + adapter.path(stream)
    return _answer(endpoint, adapter, stream, outcome,
                   lambda: endpoint.http.request("POST", path, body=body, headers=headers))


@dataclass(slots=True)
class Sent:
    """A request written by `write`, whose answer `read` collects."""

    outcome: Outcome
    sock: object | None


def write(endpoint: Endpoint, adapter: Adapter, body: bytes, stream: bool, headers: dict[str, str],
          request_id: str | None = None) -> Sent | None:
    """Write the request on an idle connection without yielding; None when no connection is idle."""
    sock = endpoint.idle_socket()
    if sock is None:
        return None
    data = endpoint.request_bytes(adapter.path(stream), body, headers, request_id)
    outcome = Outcome(sent_at=time.time(), streamed=stream)
    endpoint.in_flight += 1
    try:
        sock.sendall(data)
    except Exception as e:
        endpoint.pool.release_socket(sock)
        outcome.error = _exception_text(e)
        return Sent(outcome, None)
    return Sent(outcome, sock)


def read(endpoint: Endpoint, adapter: Adapter, stream: bool, sent: Sent) -> Outcome:
    """Collect the answer to a request sent by `write` (blocks)."""
    if sent.sock is None:
        sent.outcome.finished_at = time.time()
        endpoint.in_flight -= 1
        return sent.outcome
    pool = endpoint.pool
    return _answer(endpoint, adapter, stream, sent.outcome,
                   lambda: HTTPSocketPoolResponse(sent.sock, pool, block_size=endpoint.http.block_size, method="POST"))

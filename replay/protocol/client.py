"""Sending one request and timing it.

Connections, per endpoint: HTTP/1.1 carries one request at a time, so every request in flight
holds a connection of its own, and a finished one goes back to the pool for the next request
(keep-alive). There is no fixed pool size: a pool smaller than the number of requests in
flight queues requests inside the client, where dispatch timing cannot see it (Locust's
FastHttpUser default of 10 turned a 51 ms TTFT into 8.8 s). What bounds the connections is
demand: a new one is opened only when no idle one is there (the worker keeps a few open ahead
of the sends due next), so a worker opens about as many as it ever has requests in flight.

Opening is throttled, because connections are a shared budget: all the worker processes on a
host draw their source ports for one server from the same ~28,000 ephemeral ports, and a
connect that hangs holds its port. At most MAX_CONNECTING connects are in progress at once per
endpoint. After a connection fails (a connect, or a reset before any answer) the endpoint backs
off (BACKOFF_S, doubling, reset by the next connect that succeeds): meanwhile no socket is
opened; a request that needs one fails at once if the server refused (nothing listens), else
waits for a connection to come back, up to the connection timeout. So a server that stops
accepting gets no storm of SYNs, and a host out of ports (EADDRNOTAVAIL) or descriptors
(EMFILE) waits for its own connections to come back instead of failing rows. Such a wait is
never hidden: `sent_at` is when the request was written, so it shows as dispatch drift, and
TTFT is the server's alone.
"""

from __future__ import annotations

import errno
import socket
import struct
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import gevent
import orjson
from gevent.hub import Waiter
from gevent.lock import Semaphore
from gevent.queue import Empty
from geventhttpclient import HTTPClient

from replay.protocol.gevent_pool import PoolInternals
from replay.protocol.sse import DONE, sse_data
from replay.protocol.table import Api
from replay.protocol.urls import host_and_port, shown, with_credentials
from replay.rules.server_timing import answer_fields
from replay.rules.usage import is_count

POOL_SIZE = 100_000  # geventhttpclient's own cap: never the limit (see above)
MAX_CONNECTING = 256  # connects in progress at once, per endpoint
BACKOFF_S = (0.05, 2.0)  # after a failed connect: first and longest backoff
# An idle kept-alive connection is retired after this long: servers close theirs (uvicorn, so
# vLLM and SGLang, after 5 s), and a request written just as the server's close crosses it is
# lost with "connection closed". Each retired connection is closed with a reset (no TIME_WAIT).
IDLE_MAX_S = 4.0  # + PRUNE_EVERY_S, still under 5
PRUNE_EVERY_S = 0.5
LOCAL_EXHAUSTION = frozenset({errno.EADDRNOTAVAIL, errno.EMFILE, errno.ENFILE})  # this host, not the server
HEAD_CACHE = 64  # request heads kept (per-request headers would otherwise grow the cache by one a request)
ERROR_TEXT_LIMIT = 300
REQUEST_ID_HEADER = "X-Request-Id"  # "<run id>-<request_id>": servers and routers log it, `replay sim` counts it
READ_SIZE = 16384  # one recv takes whatever has arrived (dozens of events when the loop is busy)
# How every chunked body ends (the last chunk, with or without trailers, then a blank line); a read
# that ends so may end the body, and the parser decides. A stream whose events end in CRLF ends
# each read so: then the parser is fed at every read.
CHUNKED_END = b"\r\n\r\n"
# The parser is fed at the latest once this many reads wait for it: fed in a batch, reads cost
# less than one by one, and a bounded batch at the body's end holds a due send back for no
# more than a few reads' parse (a whole stream's, ~100 reads, added ~0.15 ms to drift p99).
FEED_BATCH = 8


def _nothing(now: float) -> None:
    pass


class Endpoint:
    """A server URL with its own connection pool and in-flight count (for routing).

    Besides blocking sends, it can write a request on an idle kept-alive connection without
    ever yielding (`idle_socket`, `request_bytes`): the dispatcher then sends every row that is
    due in one go, instead of one per event-loop turn. `warm` keeps such connections ready. This
    takes geventhttpclient's own get_socket/return_socket steps apart (`pool`, a PoolInternals:
    the only user of the library's private names). `opened` counts the connections opened.
    `url` is the URL as shown (replay.protocol.urls): its credentials go only into the requests.
    """

    def __init__(self, url: str, network_timeout: float = 3600.0, connection_timeout: float = 30.0):
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if not parts.hostname:
            raise ValueError(f"endpoint {shown(url)!r}: no host")
        self.url = shown(url).rstrip("/")
        self._full_url = url
        self.prefix = parts.path.rstrip("/")
        self.in_flight = 0
        self.opened = 0
        self.connecting = 0
        self.connection_timeout = connection_timeout
        self._slots = Semaphore(MAX_CONNECTING)
        self._backoff_s = 0.0
        self._backoff_until = 0.0  # time.monotonic() before which no connection is opened
        self._refused = False  # the failure that started the backoff was a refusal
        self._failure: str | None = None
        # Called with the arrival time after every read of a stream body (the dispatcher's
        # hook). It runs inside the event loop, so it must not block.
        self.on_read = _nothing
        self.host_header = host_and_port(url)
        self._heads: dict[tuple, bytes] = {}
        self._idle_since: dict[int, float] = {}  # id(socket) -> when it went back to the pool
        self._pruned_at = 0.0
        self.http = HTTPClient(
            parts.hostname,
            parts.port,
            ssl=parts.scheme == "https",
            concurrency=POOL_SIZE,
            network_timeout=network_timeout,
            connection_timeout=connection_timeout,
        )
        self.pool = PoolInternals(self.http, oldest_first=True)

    def _take(self, sock):
        """A socket just taken off the idle queue, if it is still usable (else closed)."""
        since = self._idle_since.pop(id(sock), None)
        if (since is None or time.monotonic() - since < IDLE_MAX_S) and self.pool.claim(sock):
            return sock
        close_with_reset(sock)
        return None

    def give_back(self, sock) -> None:
        """Return a connection to the idle pool, noting when (see IDLE_MAX_S)."""
        self._idle_since[id(sock)] = time.monotonic()
        self.pool.return_socket(sock)

    def prune(self) -> None:
        """Retire the idle connections older than IDLE_MAX_S (at most every PRUNE_EVERY_S), so
        that `warm` replaces them before a burst needs them."""
        now = time.monotonic()
        if now - self._pruned_at < PRUNE_EVERY_S:
            return
        self._pruned_at = now
        pool = self.pool
        kept = []
        while (sock := pool.pop_idle()) is not None:  # oldest first (PoolInternals' oldest_first)
            # a connection geventhttpclient returned itself (a body that came with the head) is
            # first seen here: its age counts from now, at most PRUNE_EVERY_S late
            if now - self._idle_since.setdefault(id(sock), now) < IDLE_MAX_S:
                kept.append(sock)
            else:
                self._idle_since.pop(id(sock), None)
                close_with_reset(sock)
        for sock in kept:  # back in the same order
            pool.put_idle(sock)

    def idle_socket(self):
        """A kept-alive connection that can be written to now, or None (never yields)."""
        pool = self.pool
        while (sock := pool.pop_idle()) is not None:
            sock = self._take(sock)
            if sock is not None:
                return sock
        return None

    def idle(self) -> int:
        return self.pool.idle_count()

    def backing_off(self) -> bool:
        return time.monotonic() < self._backoff_until

    def failed(self, error: Exception) -> None:
        """A connection failed (connect, or reset before any answer): back off before opening more."""
        now = time.monotonic()
        if now >= self._backoff_until:  # failures that come together count as one
            self._backoff_s = min(BACKOFF_S[1], max(BACKOFF_S[0], self._backoff_s * 2))
            self._backoff_until = now + self._backoff_s
            self._refused = isinstance(error, ConnectionRefusedError)
        self._failure = _exception_text(error)

    def _open(self):
        """Open one connection, holding a connect slot (blocks while connecting)."""
        self.connecting += 1
        try:
            sock = self.pool.open()
        except BaseException as e:
            if isinstance(e, Exception):
                self.failed(e)
            raise
        finally:
            self.connecting -= 1
        self.opened += 1
        self._backoff_s = 0.0
        return sock

    def connection(self):
        """An idle connection, else a new one (blocks while connecting or waiting, see the module
        docstring); raises the connect error, or TimeoutError when none came in time."""
        deadline = time.monotonic() + self.connection_timeout
        while True:
            sock = self.idle_socket()
            if sock is not None:
                return sock
            now = time.monotonic()
            if now >= deadline:
                last = f" (last failure: {self._failure})" if self._failure else ""
                raise TimeoutError(f"no connection to {self.url} within {self.connection_timeout:g} s{last}")
            if now < self._backoff_until:
                if self._refused:
                    raise ConnectionRefusedError(f"not connecting while backing off: {self._failure}")
            elif self._slots.acquire(timeout=deadline - now):
                try:
                    if not self.backing_off():  # the wait for a slot may have seen a failure
                        return self.idle_socket() or self._open()
                except OSError as e:
                    if e.errno not in LOCAL_EXHAUSTION:
                        raise
                finally:
                    self._slots.release()
                continue
            else:
                continue
            try:  # until the backoff ends: a connection another request hands back
                sock = self._take(self.pool.wait_idle(min(deadline, self._backoff_until) - now))
            except Empty:
                continue
            if sock is not None:
                return sock

    def warm(self, idle: int) -> None:
        """Open connections until `idle` wait in the pool (blocks while connecting); opens none
        while the endpoint backs off, nor beyond the free connect slots."""
        self.prune()
        while self.pool.idle_count() < idle and not self.backing_off() and self._slots.acquire(blocking=False):
            try:
                sock = self._open()
            finally:
                self._slots.release()
            self.give_back(sock)

    def request_bytes(self, path: str, body: bytes, headers: dict[str, str], request_id: str | None = None) -> bytes:
        key = (path, tuple(headers.items()))
        head = self._heads.get(key)
        if head is None:
            if len(self._heads) >= HEAD_CACHE:
                self._heads.clear()
            lines = [f"POST {self.prefix}{path} HTTP/1.1", f"Host: {self.host_header}", "User-Agent: tracereplay"]
            lines += [f"{name}: {value}" for name, value in with_credentials(self._full_url, headers).items()]
            head = self._heads[key] = ("\r\n".join(lines) + "\r\n").encode("latin-1")
        if request_id is not None:
            head += b"%s: %s\r\n" % (REQUEST_ID_HEADER.encode(), request_id.encode("latin-1"))
        return b"%sContent-Length: %d\r\n\r\n%s" % (head, len(body), body)

    def close(self) -> None:
        """Close the idle connections with a reset (SO_LINGER 0) rather than a FIN: a connection
        the client closes first otherwise holds its source port in TIME_WAIT for a minute, and
        the next run against the same server may need every port. Only once nothing is in flight."""
        while (sock := self.pool.pop_idle()) is not None:
            close_with_reset(sock)
        self._idle_since.clear()
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
    usage_notes: list[str] | None = None  # usage figures dropped: not counts (replay.rules.usage)
    server_timing: dict | None = None  # the answer's own times, as the record's fields (replay.rules.server_timing)
    server_timing_problems: list[str] | None = None  # its figures dropped: not durations

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
        return self.tpot_ms_over(self.output_tokens if self.output_tokens is not None else self.events_tokens)

    def tpot_ms_over(self, tokens: int | None) -> float | None:
        """Time per output token after the first, over `tokens` output tokens (the records take
        the count replay.rules.usage believes)."""
        if not self.streamed or not self.token_times or tokens is None or tokens < 2:
            return None
        return (self.finished_at - self.token_times[0]) * 1000.0 / (tokens - 1)

    def apply_usage(self, usage: dict | None) -> None:
        """Take the server's counts; a figure that is not a count (a string, a float, a negative
        number) is left out and noted, so no record carries it and no sum meets it."""
        if not usage:
            return
        for key in ("prompt_tokens", "output_tokens", "cached_tokens"):
            value = usage.get(key)
            if value is None:
                continue
            if is_count(value):
                setattr(self, key, value)
            else:
                note = f"usage {key} {value!r:.40} is not a count"
                self.usage_notes = [*(self.usage_notes or ()), note]


    def apply_metrics(self, metrics: object) -> None:
        """Take the server's per-request timing from its answer's `metrics` object (None: it sent
        none); a figure that is not a duration is left out and noted, never a failure."""
        if metrics is None:
            return
        self.server_timing, problems = answer_fields(metrics)
        if problems:
            self.server_timing_problems = [*(self.server_timing_problems or ()), *problems]


def _exception_text(e: Exception) -> str:
    """A failure as a record's error: the exception's type and message, bounded."""
    return f"{type(e).__name__}: {e}"[:ERROR_TEXT_LIMIT] or type(e).__name__


class _BodyReader:
    """Reads a response body inside the event loop and wakes its greenlet when it is over.

    A raw I/O watcher on the connection does one non-blocking recv per read and keeps the bytes
    with the read's time: a token costs no greenlet switch and no call into the parser, hundreds
    of open streams keep each turn of the loop short, and dispatch is not held up behind them.
    The HTTP parser is fed when the body may be over (a read that ends like a chunked body's
    end, or that reaches the Content-Length), and otherwise once FEED_BATCH reads wait: it then
    takes the reads since its last feed one by one, so each read's body size is what it would
    have been, and decides whether the message is complete (or malformed). The lists hold
    bytes, ints and floats, which the garbage collector does not track: one tuple per read made
    its young generation tens of thousands of objects long, and each collection a
    millisecond-long pause.
    """

    __slots__ = ("response", "buf", "sock", "on_read", "reads", "fed", "left", "sizes", "times", "error",
                 "watcher", "waiter")

    def __init__(self, response, on_read):
        self.response = response
        self.buf = PoolInternals.body(response)  # the de-chunked body, grown in place by feed()
        self.sock = PoolInternals.raw_socket(response)  # the non-blocking _socket.socket under gevent's
        self.on_read = on_read
        self.reads: list[bytes] = []  # what each read took, as received
        self.fed = 0  # how many of them the parser has had
        length = response.content_length
        self.left = length - len(self.buf) if length is not None else -1  # body bytes still due; -1: not said
        self.sizes: list[int] = []  # body bytes so far after each read (filled as the parser is fed)
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
        if self.fed < len(self.reads):  # cut short: the body so far, as far as it parses
            self._feed()

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
        if not data:  # closed: the reads before it still count, and may have ended the message
            if (self._feed() or self._ends_with_close()) and self.error is None:
                return self._end(None)
            return self._end(self.error or "connection closed before the end of the response")
        self.reads.append(data)
        self.times.append(now)
        if self.left >= 0:
            self.left -= len(data)
            ended = self.left <= 0
        else:
            ended = data.endswith(CHUNKED_END) or (len(data) < len(CHUNKED_END) and self._ends_chunked())
        self.on_read(now)  # first: a send that fell due goes out before the parser's batch below
        if (ended or len(self.reads) - self.fed >= FEED_BATCH) and self._feed():
            return self._end(self.error)

    def _ends_with_close(self) -> bool:
        """Whether the close just read ends the message (PoolInternals.ended_by_close)."""
        try:
            return PoolInternals.ended_by_close(self.response)
        except Exception as e:
            self.error = self.error or _exception_text(e)
            return True

    def _ends_chunked(self) -> bool:
        """Whether the reads end like a chunked body's end, over short reads."""
        return b"".join(self.reads[-len(CHUNKED_END):]).endswith(CHUNKED_END)

    def _feed(self) -> bool:
        """Give the parser the reads it has not had, one at a time; True when the message is over
        (complete, or refused by the parser: then `error` says why)."""
        response, buf, sizes = self.response, self.buf, self.sizes
        reads = self.reads
        try:
            for i in range(self.fed, len(reads)):
                response.feed(reads[i])
                sizes.append(len(buf))
        except Exception as e:
            self.error = self.error or _exception_text(e)
            return True
        finally:
            self.fed = len(reads)
        return response.message_complete


def _receive(response, on_read=_nothing) -> tuple[bytes, list[int], list[float], str | None]:
    """The whole body, when each part of it arrived (body bytes so far after each read, and
    the read's unix time), and the error that cut it short, if any.

    No per-read timeout while streaming; a server that stops answering is cut off by
    --drain-timeout instead. Lines are split and parsed after the stream ends.
    """
    if PoolInternals.socket(response) is None:  # the whole body came with the headers
        buf = PoolInternals.body(response)
        return bytes(buf), [len(buf)] if buf else [], [time.time()] if buf else [], None
    reader = _BodyReader(response, on_read)
    reader.read()
    return bytes(reader.buf), reader.sizes, reader.times, reader.error


def _read_stream(response, api: Api, outcome: Outcome, on_read=_nothing) -> None:
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
        count, usage, error = api.read_event(obj)
        if error is not None:
            outcome.error = error[:ERROR_TEXT_LIMIT]
            break
        if count:
            outcome.token_times.append(times[mark])
            outcome.events_tokens += count
        if usage is not None:  # the final usage event, where vLLM's `metrics` rides: no work on a token's event
            outcome.apply_usage(usage)
            outcome.apply_metrics(api.read_metrics(obj))


def close_with_reset(sock) -> None:
    """Close a connection with a reset (SO_LINGER 0) rather than a FIN: a connection the client
    closes first otherwise holds its source port in TIME_WAIT for a minute."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


def _release(endpoint: Endpoint, response) -> None:
    """Return the connection to the pool only when its response was read to the end."""
    if response.message_complete:
        sock = PoolInternals.socket(response)
        if sock is not None:
            endpoint._idle_since[id(sock)] = time.monotonic()
        response.release()
        return
    pool, sock = PoolInternals.detach(response)
    if pool is not None and sock is not None:
        pool.release_socket(sock)


def _answer(endpoint: Endpoint, api: Api, stream: bool, outcome: Outcome, respond) -> Outcome:
    """Read the answer `respond()` gives into `outcome`; never raises for server or network failures."""
    response = None
    try:
        response = respond()
        outcome.status = response.status_code
        if outcome.status >= 300:
            text = response.read()
            outcome.error = f"HTTP {outcome.status}: {text[:ERROR_TEXT_LIMIT].decode(errors='replace')}"
        elif stream:
            _read_stream(response, api, outcome, endpoint.on_read)
        else:
            obj = orjson.loads(response.read())
            count, usage, error = api.read_body(obj)
            outcome.events_tokens = count
            outcome.error = error
            outcome.apply_usage(usage)
            outcome.apply_metrics(api.read_metrics(obj))
    except Exception as e:  # network errors, resets, timeouts, bad JSON: all become the record's error
        outcome.error = _exception_text(e)
        if not outcome.status and isinstance(e, OSError):
            endpoint.failed(e)  # reset before any answer: the next ones should not all reconnect
        # (a plain close before any answer is a kept-alive connection the server retired: no backoff)
    finally:
        outcome.finished_at = time.time()
        endpoint.in_flight -= 1
        if response is not None:
            _release(endpoint, response)
    if outcome.output_tokens is None and outcome.streamed and outcome.error is None:
        outcome.output_tokens = outcome.events_tokens
    return outcome


def send(endpoint: Endpoint, api: Api, body: bytes, stream: bool, headers: dict[str, str],
         request_id: str | None = None) -> Outcome:
    """POST one request on an idle or a new connection and read its answer (blocks)."""
    outcome = Outcome(sent_at=time.time(), streamed=stream)
    endpoint.in_flight += 1
    try:
        sock = endpoint.connection()
    except BaseException as e:
        outcome.finished_at = time.time()
        endpoint.in_flight -= 1
        if not isinstance(e, Exception):
            raise
        outcome.error = _exception_text(e)
        return outcome
    return read(endpoint, api, stream,
                _write_on(endpoint, sock, outcome, api.path(stream), body, headers, request_id))


@dataclass(slots=True)
class Sent:
    """A request written by `write`, whose answer `read` collects."""

    outcome: Outcome
    sock: object | None


def _write_on(endpoint: Endpoint, sock, outcome: Outcome, path: str, body: bytes, headers: dict[str, str],
              request_id: str | None) -> Sent:
    """Write the request on `sock` (no yield when the socket has room); `sent_at` is now."""
    data = endpoint.request_bytes(path, body, headers, request_id)
    outcome.sent_at = time.time()
    try:
        sock.sendall(data)
    except Exception as e:
        endpoint.pool.release_socket(sock)
        outcome.error = _exception_text(e)
        if isinstance(e, OSError):
            endpoint.failed(e)
        return Sent(outcome, None)
    return Sent(outcome, sock)


def write(endpoint: Endpoint, api: Api, body: bytes, stream: bool, headers: dict[str, str],
          request_id: str | None = None) -> Sent | None:
    """Write the request on an idle connection without yielding; None when no connection is idle."""
    sock = endpoint.idle_socket()
    if sock is None:
        return None
    outcome = Outcome(sent_at=0.0, streamed=stream)  # stamped as it is written
    endpoint.in_flight += 1
    return _write_on(endpoint, sock, outcome, api.path(stream), body, headers, request_id)


def read(endpoint: Endpoint, api: Api, stream: bool, sent: Sent) -> Outcome:
    """Collect the answer to a request sent by `write` (blocks)."""
    if sent.sock is None:
        sent.outcome.finished_at = time.time()
        endpoint.in_flight -= 1
        return sent.outcome
    return _answer(endpoint, api, stream, sent.outcome, lambda: endpoint.pool.response(sent.sock))

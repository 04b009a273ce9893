"""The one place that touches geventhttpclient's (and gevent's socket's) private names.

The client (`client.py`) splits geventhttpclient's get_socket/return_socket into their steps
(take an idle connection without yielding, open one under a connect throttle, retire old idle
ones) and reads a response body from inside the event loop. That needs names the library does
not promise to keep: the pool's queue and semaphore, its liveness check and socket factory, a
response's buffer, socket and pool. They are all used here, behind `PoolInternals`, and checked
when the first one is built (`require`, once a process): a geventhttpclient outside the tested
range that renamed one fails there with the version and the name, instead of turning every
request into an error. The tested range is the project's own pin (`tested_range`), read, not
copied.
"""

from __future__ import annotations

import functools
import re
import select
import tomllib
from importlib import metadata
from pathlib import Path

import gevent.queue
import gevent.socket
from gevent.monkey import get_original
from geventhttpclient import HTTPClient
from geventhttpclient import __version__ as GEVENTHTTPCLIENT_VERSION
from geventhttpclient.connectionpool import ConnectionPool
from geventhttpclient.response import HTTPSocketPoolResponse

DISTRIBUTION = "tracereplay"
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"  # a source checkout's; absent once installed
UNKNOWN_RANGE = ""  # neither a checkout nor an installed distribution to read the pin from


@functools.cache
def tested_range() -> str:
    """The geventhttpclient versions this code was tested with: pyproject.toml's pin, from the
    checkout beside this package when there is one (the truth while it is edited), else from the
    installed distribution's requirements, as a specifier (">=2.6,<2.7"); UNKNOWN_RANGE if neither."""
    if PYPROJECT.is_file():
        requirements = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    else:
        try:
            requirements = metadata.requires(DISTRIBUTION) or []
        except metadata.PackageNotFoundError:
            requirements = []
    for requirement in requirements:
        found = re.fullmatch(r"\s*geventhttpclient\s*([^;]*?)\s*(;.*)?", requirement)
        if found:
            return ",".join(part.strip() for part in found.group(1).split(","))
    return UNKNOWN_RANGE

POOL_METHODS = ("_create_socket", "return_socket", "release_socket")
POOL_ATTRIBUTES = {"_semaphore": ("acquire", "release"), "_socket_queue": ("get", "put", "qsize", "empty"),
                   "size": ("__index__",)}
RESPONSE_METHODS = ("feed", "release")
RESPONSE_ATTRIBUTES = ("_sock", "_pool", "_body_buffer", "message_complete")
_HEAD = b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n"  # headers complete, body not: nothing is read
_poll = get_original("select", "poll")  # the C library's poll(2), never gevent's cooperative one
_READABLE_OR_CLOSED = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP | select.POLLNVAL


class PoolInternals:
    """One HTTPClient's connection pool, by steps, and what the client reads off its responses.

    The pool counts the sockets out of it in a semaphore: `claim` and `open` count one out,
    `return_socket` and `release_socket` count it back in. `pop_idle`, `wait_idle` and
    `put_idle` move sockets without counting. The library's idle queue is last in, first out;
    with `oldest_first` (given a new client) it is first in, first out: the idle connections
    are used in turn, so at a few requests a second each is used well within the servers' idle
    timeout and none has to be retired and replaced (last in, first out left the spare ones
    idle until they aged out: two reconnects a second at 4 requests a second).
    """

    __slots__ = ("_pool", "block_size")

    def __init__(self, http: HTTPClient, oldest_first: bool = False):
        require_once()
        self._pool = http._connection_pool
        self.block_size = http.block_size
        if oldest_first:
            if not self._pool._socket_queue.empty():
                raise ValueError("oldest_first needs a pool with no idle connection yet")
            self._pool._socket_queue = gevent.queue.Queue(self._pool.size)

    def idle_count(self) -> int:
        return self._pool._socket_queue.qsize()

    def pop_idle(self):
        """The next idle socket (the newest, or the oldest with `oldest_first`), or None (never yields)."""
        queue = self._pool._socket_queue
        return None if queue.empty() else queue.get(block=False)

    def wait_idle(self, timeout: float):
        """The next socket handed back, waiting up to `timeout`; raises gevent.queue.Empty."""
        return self._pool._socket_queue.get(timeout=timeout)

    def put_idle(self, sock) -> None:
        """Put a socket taken with pop_idle back (not counted: it never left)."""
        self._pool._socket_queue.put(sock)

    def claim(self, sock) -> bool:
        """Count an idle socket out of the pool if it is still usable (what get_socket does;
        never waits: the pool's size is never the limit)."""
        if not _idle_and_open(sock):
            return False
        self._pool._semaphore.acquire()
        return True

    def open(self):
        """A new connection, counted out of the pool (blocks while connecting)."""
        pool = self._pool
        pool._semaphore.acquire()
        try:
            return pool._create_socket()
        except BaseException:
            pool._semaphore.release()
            raise

    def return_socket(self, sock) -> None:
        self._pool.return_socket(sock)

    def release_socket(self, sock) -> None:
        """Close a socket out of the pool and count it back in."""
        self._pool.release_socket(sock)

    def response(self, sock) -> HTTPSocketPoolResponse:
        """Read the head of the answer on `sock` (blocks); the body is left to the caller."""
        return HTTPSocketPoolResponse(sock, self._pool, block_size=self.block_size, method="POST")

    @staticmethod
    def body(response) -> bytearray:
        """The response's de-chunked body so far, grown in place by feed()."""
        return response._body_buffer

    @staticmethod
    def socket(response):
        """The response's connection, None once the library returned it (whole body read)."""
        return response._sock

    @staticmethod
    def raw_socket(response):
        """The non-blocking _socket.socket under the response's gevent socket."""
        return response._sock._sock

    @staticmethod
    def ended_by_close(response) -> bool:
        """The server closed the connection mid-body: whether that ended the message. A body with
        neither a Content-Length nor chunked framing is delimited by the close (RFC 9112, 6.3),
        which the parser is told as an empty feed; any other body was cut. Raises the parser's
        error for a message the close leaves malformed."""
        framing = response.get("transfer-encoding") or ""  # a list when the header came more than once
        if response.content_length is not None or "chunked" in (
                ",".join(framing) if isinstance(framing, list) else framing).lower():
            return False
        response.feed(b"")
        return response.message_complete

    @staticmethod
    def detach(response) -> tuple:
        """Take the (pool, socket) off a response, so it neither returns nor closes them."""
        pool, sock = response._pool, response._sock
        response._pool = response._sock = None
        return pool, sock


def _idle_and_open(sock) -> bool:
    """The library's liveness check (_is_socket_alive): an idle kept-alive connection has
    nothing to read; readable means the server closed it or sent something unasked. By one
    poll(2) call: the library's gevent select takes a watcher and a turn of the event loop
    for each request. poll, unlike select(2), takes any descriptor number."""
    try:
        fd = sock.fileno()
        if fd < 0:
            return False
        poller = _poll()
        poller.register(fd, _READABLE_OR_CLOSED)
        return not poller.poll(0)
    except (OSError, ValueError):
        return False


def _missing(obj, names, what: str) -> str | None:
    for name in names:
        if not hasattr(obj, name):
            return f"{what}.{name}"
    return None


def self_check(client_cls=HTTPClient, pool_cls=ConnectionPool, response_cls=HTTPSocketPoolResponse,
               socket_cls=gevent.socket.socket) -> str | None:
    """The first name PoolInternals relies on that these classes lack, or None.

    Methods are looked up on the classes; instance attributes on small objects built without
    network I/O: a client for a port nobody is asked about, a pool, and a response over a local
    socket pair whose head is handed in (nothing is read from the socket).
    """
    for name in POOL_METHODS:
        if not callable(getattr(pool_cls, name, None)):
            return f"{pool_cls.__name__}.{name}()"
    for name in RESPONSE_METHODS:
        if not callable(getattr(response_cls, name, None)):
            return f"{response_cls.__name__}.{name}()"
    client = client_cls("127.0.0.1", 9, concurrency=1)
    pool = getattr(client, "_connection_pool", None)
    if pool is None:
        return f"{client_cls.__name__}._connection_pool"
    if not isinstance(pool, pool_cls):
        return f"{client_cls.__name__}._connection_pool as a {pool_cls.__name__}"
    if not hasattr(client, "block_size"):
        return f"{client_cls.__name__}.block_size"
    for name, methods in POOL_ATTRIBUTES.items():
        if not hasattr(pool, name):
            return f"{pool_cls.__name__}.{name}"
        missing = _missing(getattr(pool, name), methods, f"{pool_cls.__name__}.{name}")
        if missing:
            return missing
    a, b = gevent.socket.socketpair()
    try:
        if not isinstance(a, socket_cls) or not hasattr(a, "_sock"):
            return f"{socket_cls.__module__}.{socket_cls.__name__}._sock"
        response = response_cls(a, pool, pre_buffered=_HEAD)
        missing = _missing(response, RESPONSE_ATTRIBUTES, response_cls.__name__)
        if not missing and response._sock is not a:
            missing = f"{response_cls.__name__}._sock as the response's socket"
        for name in ("_pool", "_sock"):  # never let the response return or close the pair
            if hasattr(response, name):
                setattr(response, name, None)
        return missing
    finally:
        a.close()
        b.close()


def require(**classes) -> None:
    """Raise ImportError, naming the version, the missing name and the tested range, if self_check fails."""
    missing = self_check(**classes)
    if missing:
        tested = tested_range()
        raise ImportError(
            f"tracereplay needs geventhttpclient{tested} (tested); the installed geventhttpclient "
            f"{GEVENTHTTPCLIENT_VERSION} (gevent {gevent.__version__}) has no {missing}, which "
            f"replay/protocol/gevent_pool.py uses. Install a tested version: pip install 'geventhttpclient{tested}'")


@functools.cache
def require_once() -> None:
    """`require()` for the installed library, on the first PoolInternals of a process (it builds a
    client and a socket pair: never at import). A failure is raised again at each call."""
    require()

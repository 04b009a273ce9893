"""The sim's HTTP front: routes, error shapes, and starting/stopping the gevent server.

In-process use (tests, benches) needs a gevent-friendly caller (a monkey-patched process
such as Locust, or geventhttpclient): `server, port = start(options)`; `server.stop()`.
"""

from __future__ import annotations

import resource
import signal
import socket
import sys
import traceback
from collections.abc import Callable

import gevent
from gevent.event import Event
from gevent.server import StreamServer

from replay.sim import metrics, openai, tgi
from replay.sim.engine import Engine
from replay.sim.errors import ApiError
from replay.sim.http import Connection, Request, Response, Stream
from replay.sim.options import SimOptions, validate
from replay.sim.spans import SpanExporter

Handler = Callable[[Engine, Request], "Response | Stream"]

# Connections waiting to be accepted. Linux silently caps it at net.core.somaxconn (4096 on
# current kernels); past it, connects are dropped and the client retries them after 1, 3, 7 s
# ... until its connect timeout. A replay opens thousands at once, so ask for the most allowed.
BACKLOG = 65535
MIN_OPEN_FILES = 10_000  # below this (after raising to the hard limit), warn: Locust's own floor


def _health(engine: Engine, request: Request) -> Response:
    return Response(200, b"", "text/plain")


def _metrics(engine: Engine, request: Request) -> Response:
    if not engine.options.metrics:
        return _detail(404, "Not Found")
    return Response(200, metrics.render(engine), "text/plain; version=0.0.4; charset=utf-8")


def _debug_requests(engine: Engine, request: Request) -> Response:
    return Response(200, engine.ledger.to_json())


def _reset_prefix_cache(engine: Engine, request: Request) -> Response:
    # vLLM serves this with VLLM_SERVER_DEV_MODE=1; parity runs use it to start cold. As vLLM's
    # BlockPool.reset_prefix_cache it fails while a request holds blocks: {"success": false}.
    if not engine.options.reset_endpoint:  # as vLLM without VLLM_SERVER_DEV_MODE=1: 404
        return _detail(404, "Not Found")
    return Response(200, b'{"success":%s}' % (b"true" if engine.cache.reset() else b"false"))


def _tokenize(engine: Engine, request: Request) -> Response:
    if not engine.options.tokenize_endpoint:  # as a server without one (TGI's own, older vLLM): 404
        return _detail(404, "Not Found")
    return openai.tokenize(engine, request)


# path -> (method, handler, error style)
ROUTES: dict[str, tuple[str, Handler, str]] = {
    "/v1/chat/completions": ("POST", openai.chat_completions, "openai"),
    "/v1/completions": ("POST", openai.completions, "openai"),
    "/v1/models": ("GET", openai.models, "openai"),
    "/tokenize": ("POST", _tokenize, "openai"),
    "/health": ("GET", _health, "openai"),
    "/metrics": ("GET", _metrics, "openai"),
    "/reset_prefix_cache": ("POST", _reset_prefix_cache, "openai"),
    "/generate": ("POST", tgi.generate, "tgi"),
    "/generate_stream": ("POST", tgi.generate_stream, "tgi"),
    "/info": ("GET", tgi.info, "tgi"),
    "/debug/requests": ("GET", _debug_requests, "openai"),
}
# Requests on these paths have their X-Request-Id counted in the ledger (whatever their method
# and outcome); http.py lower-cases header names.
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/generate", "/generate_stream"})
REQUEST_ID_HEADER = "x-request-id"
OPEN_PATHS = frozenset({"/health", "/debug/requests"})  # answered without --require-authorization's header


def _detail(status: int, text: str) -> Response:
    # FastAPI's shape for routing errors, as vLLM answers them.
    return Response(status, b'{"detail":"%s"}' % text.encode())


class App:
    def __init__(self, engine: Engine):
        self.engine = engine

    def __call__(self, request: Request) -> Response | Stream:
        path = request.path.rstrip("/") or "/"
        if path in GENERATION_PATHS:
            self.engine.ledger.arrived(request.headers.get(REQUEST_ID_HEADER))
        route = ROUTES.get(path)
        if route is None:
            return _detail(404, "Not Found")
        required = self.engine.options.require_authorization
        if required is not None and path not in OPEN_PATHS and request.headers.get("authorization") != required:
            self.engine.record_error(401)
            return _detail(401, "Unauthorized")
        method, handler, style = route
        if request.method != method and not (method == "GET" and request.method == "HEAD"):
            return _detail(405, "Method Not Allowed")
        try:
            return handler(self.engine, request)
        except ApiError as exc:
            self.engine.record_error(exc.status)
            body = exc.tgi_body() if style == "tgi" else exc.openai_body()
            return Response(exc.status, body)

    def internal_error(self, exc: BaseException) -> Response:
        traceback.print_exception(exc, file=sys.stderr)
        self.engine.record_error(500)
        return Response(500, ApiError(f"internal error: {type(exc).__name__}: {exc}", status=500).openai_body())


def start(options: SimOptions, engine: Engine | None = None) -> tuple[StreamServer, int]:
    """Bind and start serving in the current gevent hub; returns the server and its port."""
    validate(options)
    engine = engine or Engine(options)
    if options.otlp_endpoint and engine.spans is None:
        engine.spans = SpanExporter(options.otlp_endpoint)
    app = App(engine)
    ledger = engine.ledger

    def handle(sock, address) -> None:
        ledger.connections_accepted += 1
        ledger.connections_open += 1
        # Each event goes out when written, as vLLM's (uvicorn's asyncio transports set
        # TCP_NODELAY): with Nagle on, a first token written a TTFT after the answer's head waits
        # for the client's delayed ACK of the head, up to 40 ms.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            Connection(sock, app, app.internal_error).serve()
        finally:
            ledger.connections_open -= 1

    server = StreamServer((options.host, options.port), handle, backlog=BACKLOG)
    server.engine = engine  # for tests and benches that inspect the cache or counters
    server.start()
    return server, server.server_port


def raise_open_file_limit() -> int:
    """Raise this process's open-file limit to its hard limit, and return it.

    Every connection is a descriptor. At the usual soft limit of 1024, accept() fails with
    EMFILE from the ~1020th open connection on: gevent stops accepting for up to a second at a
    time, connects pile up in the listen queue and then get dropped, and requests already
    written on connections the sim never accepted are never answered (client timeouts,
    resets, drain timeouts). Locust raises its own limit the same way.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft < MIN_OPEN_FILES:
        print(f"replay sim: open file limit {soft}: at most about {soft - 20} connections at once "
              f"(raise it with `ulimit -n`)", file=sys.stderr, flush=True)
    return soft


def serve(options: SimOptions) -> int:
    """Run until SIGTERM/SIGINT; prints the one line tests wait for once accepting."""
    raise_open_file_limit()
    server, port = start(options)
    stop = Event()
    gevent.signal_handler(signal.SIGTERM, stop.set)
    gevent.signal_handler(signal.SIGINT, stop.set)
    print(f"replay sim listening on http://{options.host}:{port}", flush=True)
    stop.wait()
    server.stop(timeout=1)
    if server.engine.spans is not None:
        server.engine.spans.close()  # the last batch goes out
    return 0

"""`--otlp-receiver HOST:PORT`: an OTLP/HTTP trace receiver for the servers to export their
spans to (POST /v1/traces; protobuf or JSON, gzip or not: replay.protocol.otlp), run by the
master (or the single process) in a child process of its own, so that neither the decoding nor
the file writes share the interpreter (its lock, its event loop) with the dispatch of a local run,
and at a lower CPU priority (NICE), so that on a busy core the sends go first.

The child binds the address (a port in use: the run is refused, exit 2, naming the option and
the port, before the first send: `SpanReceiver.start`, from the preflight), then appends each
span it is sent to OUTPUT.spans.jsonl, one JSON line a span (replay.protocol.otlp.decode's
dict), flushed after each body; a body it refuses is a line too (`{"rejected": why, "status":
413 or 400, "bytes": N}`): over MAX_BODY_BYTES (413, inflated or not) or not an OTLP trace
export (400). So the file holds everything the receiver heard, and the end of the run
(replay.results.span_join) counts it all. It ends on SIGTERM (`SpanReceiver.stop`), or by
itself once the process that started it is gone.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import orjson

from replay.child import last_line, start_module
from replay.errors import OptionError
from replay.protocol.otlp import JSON, PROTOBUF, TRACES_PATH, BadBody, TooLarge, decode, unzip

MAX_BODY_BYTES = 16 << 20  # a body (or its gzip content) over this is refused, 413: an exporter's batch is far smaller
START_TIMEOUT_S = 30.0  # the child's imports and bind; a slower start is reported as a failure to start
PARENT_CHECK_S = 1.0
# The receiver's CPU priority below the run's: on a busy core the dispatch's sends go first, and
# the spans (which wait in the socket, and at the end for --otlp-wait) after.
NICE = 10


def split_listen(listen: str) -> tuple[str, int]:
    """HOST:PORT (an IPv6 host in brackets) as (host, port); OptionError naming the option otherwise."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise OptionError(f"--otlp-receiver {listen}: give HOST:PORT (e.g. 0.0.0.0:4318), the port 0-65535")
    return host.strip("[]"), int(port)


class SpanReceiver:
    """The master's handle on its receiver child: where it listens and where it writes."""

    def __init__(self, listen: str, spans_path: Path, pid: int, log: Path, port: int):
        self.listen = listen
        self.spans_path = spans_path
        self.pid = pid
        self.log = log
        self.port = port  # the port bound (HOST:0 picks one)
        self._ended = False

    @classmethod
    def start(cls, listen: str, spans_path: str | Path) -> SpanReceiver:
        """Start the child and wait until it listens; OptionError naming --otlp-receiver when
        it cannot (the port in use, an address not this host's)."""
        host, port = split_listen(listen)
        spans_path = Path(spans_path)
        spans_path.write_bytes(b"")  # the run's own: an earlier run's spans never join this one's records
        fd, name = tempfile.mkstemp(prefix="replay-otlp-", suffix=".log")
        os.close(fd)
        log = Path(name)
        pid = start_module(__name__, ["--host", host, "--port", str(port), "--spans", str(spans_path),
                                      "--parent", str(os.getpid())], log, own_group=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            text = log.read_text(errors="replace")
            for line in text.splitlines():
                if line.startswith("listening on port "):
                    return cls(listen, spans_path, pid, log, int(line.rsplit(" ", 1)[1]))
            if _ended(pid):
                why = last_line(log)
                log.unlink(missing_ok=True)
                spans_path.unlink(missing_ok=True)  # no run: no file of one (a rerun would be refused as an earlier run's)
                raise OptionError(f"--otlp-receiver {listen}: {why}")
            time.sleep(0.02)  # a monkey-patched process: the event loop turns meanwhile
        _terminate(pid)
        log.unlink(missing_ok=True)
        spans_path.unlink(missing_ok=True)
        raise OptionError(f"--otlp-receiver {listen}: the receiver did not start within {START_TIMEOUT_S:g} s")

    def stop(self) -> None:
        """End the child (its last body's lines are in the file when this returns)."""
        if self._ended:
            return
        self._ended = True
        _terminate(self.pid)
        self.log.unlink(missing_ok=True)


def _ended(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # reaped by gevent's SIGCHLD handler: ended
        return True
    return done != 0


def _terminate(pid: int, timeout_s: float = 10.0) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + timeout_s
    while not _ended(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            deadline = float("inf")
        time.sleep(0.01)


class _Spans:
    """The spans file, appended by the handler threads one body at a time."""

    def __init__(self, path: Path):
        self.file = path.open("ab")
        self.lock = threading.Lock()

    def write(self, lines: list[dict]) -> None:
        data = b"".join(orjson.dumps(line) + b"\n" for line in lines)
        with self.lock:
            if not self.file.closed:
                self.file.write(data)
                self.file.flush()

    def close(self) -> None:
        with self.lock:
            self.file.close()


class _Handler(BaseHTTPRequestHandler):
    spans: _Spans
    protocol_version = "HTTP/1.1"  # exporters keep their connection

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.split("?")[0] != TRACES_PATH:
            self._drain_and_answer(404, b"only POST /v1/traces")
            return
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            self._reject(411, "no Content-Length", 0)
            return
        size = int(length)
        if size > MAX_BODY_BYTES:
            self.close_connection = True  # never read: the connection goes with it
            self._reject(413, f"body of {size} bytes, over {MAX_BODY_BYTES}", size)
            return
        body = self.rfile.read(size)
        content_type = self.headers.get("Content-Type")
        try:
            spans = decode(unzip(body, self.headers.get("Content-Encoding"), MAX_BODY_BYTES), content_type)
        except TooLarge as e:
            self._reject(413, str(e), size)
            return
        except BadBody as e:
            self._reject(400, str(e), size)
            return
        self.spans.write(spans)
        json = (content_type or "").split(";")[0].strip().lower() == JSON
        self._answer(200, b"{}" if json else b"", JSON if json else PROTOBUF)  # an empty ExportTraceServiceResponse

    def _drain_and_answer(self, status: int, text: bytes) -> None:
        length = self.headers.get("Content-Length")
        if length and length.isdigit() and int(length) <= MAX_BODY_BYTES:
            self.rfile.read(int(length))
        else:
            self.close_connection = True
        self._answer(status, text, "text/plain")

    def _reject(self, status: int, why: str, size: int) -> None:
        self.spans.write([{"rejected": why, "status": status, "bytes": size}])
        self._answer(status, why.encode(), "text/plain")

    def _answer(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's name)
        pass  # a line per export would fill the log; the spans file holds what came


class _Server(ThreadingHTTPServer):
    # An exporter keeps its connection open between batches: its handler thread waits on it, so
    # the end never waits for the threads; it takes the file's lock, which a body being
    # written holds, and closes the file under it (a body the thread writes later is dropped).
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True


def _off_the_senders_cores() -> None:
    """A replay pinned to some cores (taskset, a benchmark) keeps them for its sends: the receiver
    takes the host's other cores where it may run on any. A replay free to run anywhere leaves the
    choice to the kernel's scheduler."""
    try:
        others = set(range(os.cpu_count() or 1)) - os.sched_getaffinity(0)
        if others:
            os.sched_setaffinity(0, others)
    except (AttributeError, OSError):  # no affinity calls (macOS), or a cpuset that allows none of them
        pass


def serve(host: str, port: int, spans_path: Path, parent: int) -> int:
    """The child: listen, write spans until SIGTERM or the parent is gone; 2 when it cannot bind."""
    try:
        server = _Server((host, port), _Handler)
    except OSError as e:
        print(f"cannot listen there: {e.strerror or e}", flush=True)
        return 2
    _Handler.spans = _Spans(spans_path)
    os.nice(NICE)
    _off_the_senders_cores()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the run's stop is the master's to tell
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    print(f"listening on port {server.server_address[1]}", flush=True)
    while not stop.wait(PARENT_CHECK_S):
        if os.getppid() != parent:
            break
    server.shutdown()
    server.server_close()
    _Handler.spans.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--spans", required=True)
    parser.add_argument("--parent", type=int, required=True)
    args = parser.parse_args(argv)
    return serve(args.host, args.port, Path(args.spans), args.parent)


if __name__ == "__main__":
    sys.exit(main())

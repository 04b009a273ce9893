"""A minimal HTTP/1.1 server loop for gevent sockets: keep-alive, content-length and
chunked bodies, chunked streaming responses.

Why not gevent.pywsgi: the sim must answer >= 1,000 requests/s and stream >= 50,000
tokens/s on one core, batch the SSE events that fall due together into one socket write,
and be able to cut a stream mid-way on purpose (fault injection). A WSGI layer costs more
per request than this whole loop and hides the socket.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import orjson

MAX_HEAD = 64 * 1024
MAX_BODY = 64 * 1024 * 1024
RECV = 65536

REASONS = {
    200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 411: "Length Required",
    413: "Payload Too Large", 422: "Unprocessable Entity", 429: "Too Many Requests", 431: "Request Header Fields Too Large",
    500: "Internal Server Error", 501: "Not Implemented", 502: "Bad Gateway", 503: "Service Unavailable",
    504: "Gateway Timeout", 505: "HTTP Version Not Supported",
}


@dataclass
class Request:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes
    keep_alive: bool


@dataclass
class Response:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class Stream:
    """A chunked response; every item the iterator yields goes out as one socket write."""

    chunks: Iterator[bytes]
    content_type: str = "text/event-stream; charset=utf-8"
    status: int = 200


class DropConnection(Exception):
    """Raised by a stream to cut the connection without ending the response."""


class ProtocolError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


App = Callable[[Request], "Response | Stream"]


def reason(status: int) -> str:
    return REASONS.get(status, "Unknown")


def head(status: int, content_type: str, length: int | None, keep_alive: bool, extra=()) -> bytes:
    lines = [f"HTTP/1.1 {status} {reason(status)}", f"content-type: {content_type}"]
    lines.append(f"content-length: {length}" if length is not None else "transfer-encoding: chunked")
    if not keep_alive:
        lines.append("connection: close")
    lines.extend(f"{k}: {v}" for k, v in extra)
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class Connection:
    """Reads requests off one socket and writes the app's answers back, until either side closes."""

    def __init__(self, sock, app: App, on_error: Callable[[BaseException], Response]):
        self.sock = sock
        self.app = app
        self.on_error = on_error
        self.buf = b""

    def _fill(self) -> bool:
        data = self.sock.recv(RECV)
        if not data:
            return False
        self.buf += data
        return True

    def _read_exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self._fill():
                raise ConnectionResetError("client closed mid-body")
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def _read_line(self) -> bytes:
        while (i := self.buf.find(b"\r\n")) < 0:
            if len(self.buf) > MAX_HEAD:
                raise ProtocolError(400, "chunk size line too long")
            if not self._fill():
                raise ConnectionResetError("client closed mid-body")
        line, self.buf = self.buf[:i], self.buf[i + 2 :]
        return line

    def _read_chunked(self) -> bytes:
        parts: list[bytes] = []
        total = 0
        while True:
            line = self._read_line().split(b";", 1)[0].strip()
            try:
                size = int(line, 16)
            except ValueError:
                raise ProtocolError(400, f"bad chunk size {line[:20]!r}") from None
            if size == 0:
                while self._read_line():  # trailers up to the blank line
                    pass
                return b"".join(parts)
            total += size
            if total > MAX_BODY:
                raise ProtocolError(413, "request body too large")
            parts.append(self._read_exact(size))
            self._read_exact(2)

    def read_request(self) -> Request | None:
        while (end := self.buf.find(b"\r\n\r\n")) < 0:
            if len(self.buf) > MAX_HEAD:
                raise ProtocolError(431, "request head too large")
            if not self._fill():
                if self.buf.strip():
                    raise ProtocolError(400, "incomplete request head")
                return None
        raw, self.buf = self.buf[:end], self.buf[end + 4 :]
        lines = raw.decode("latin-1").split("\r\n")
        while lines and not lines[0]:  # tolerate stray CRLFs between requests
            lines.pop(0)
        parts = lines[0].split(" ") if lines else []
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise ProtocolError(400, "malformed request line")
        method, target, version = parts
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise ProtocolError(400, f"malformed header line {line[:40]!r}")
            headers[name.strip().lower()] = value.strip()
        conn = headers.get("connection", "").lower()
        keep_alive = "close" not in conn if version == "HTTP/1.1" else "keep-alive" in conn
        if headers.get("expect", "").lower() == "100-continue":  # curl sends it for bodies over 1 kB
            self.sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        if "chunked" in headers.get("transfer-encoding", "").lower():
            body = self._read_chunked()
        else:
            try:
                length = int(headers.get("content-length", "0"))
            except ValueError:
                raise ProtocolError(400, "bad content-length") from None
            if length < 0:
                raise ProtocolError(400, "bad content-length")
            if length > MAX_BODY:
                raise ProtocolError(413, "request body too large")
            body = self._read_exact(length) if length else b""
        path, _, query = target.partition("?")
        return Request(method, path, query, headers, body, keep_alive)

    def serve(self) -> None:
        sock = self.sock
        try:
            while True:
                try:
                    request = self.read_request()
                except ProtocolError as exc:
                    body = orjson.dumps({"detail": str(exc)})
                    sock.sendall(head(exc.status, "application/json", len(body), False) + body)
                    return
                if request is None:
                    return
                try:
                    answer = self.app(request)
                except Exception as exc:  # the server never dies on input
                    answer = self.on_error(exc)
                if isinstance(answer, Response):
                    body = answer.body if request.method != "HEAD" else b""
                    sock.sendall(
                        head(answer.status, answer.content_type, len(answer.body), request.keep_alive, answer.headers)
                        + body
                    )
                else:
                    if not self._stream(answer, request.keep_alive):
                        return
                if not request.keep_alive:
                    return
        except (ConnectionError, TimeoutError, OSError):
            return
        finally:
            try:
                sock.close()
            except OSError:
                pass

    def _stream(self, stream: Stream, keep_alive: bool) -> bool:
        # Headers go out at once, as uvicorn's StreamingResponse does for vLLM: a client
        # sees 200 while the request still waits for a slot or its first token.
        sock = self.sock
        sock.sendall(head(stream.status, stream.content_type, None, keep_alive))
        chunks = stream.chunks
        try:
            send = sock.send
            for data in chunks:
                if data:
                    # One send() is enough for a socket with room; gevent's sendall adds a
                    # getsockopt and a chunking loop per call, a third of the cost per token.
                    frame = b"%x\r\n%s\r\n" % (len(data), data)
                    sent = send(frame)
                    if sent < len(frame):
                        sock.sendall(frame[sent:])
            sock.sendall(b"0\r\n\r\n")
            return True
        except DropConnection:
            return False
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()

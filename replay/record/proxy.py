"""The forwarding half of `replay record`: a gevent WSGI server that passes every request to the
upstream and every answer back, chunk by chunk as it arrives, and hands each finished
generation request to the recorder process (replay/record/recorder.py).

Nothing is computed about a request before it is forwarded: the proxy reads the request,
sends it on, relays the answer, and only then queues the bytes it saw; a greenlet of its own
writes them down the recorder's pipe. Requests to other paths (`/v1/models`, `/tokenize`,
`/metrics`, ...) are forwarded and not recorded. The Authorization header goes to the upstream
and nowhere else: the recorder never sees a header but the session header it is told to take.
"""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

import gevent
import orjson
from gevent import GreenletExit
from gevent.queue import Queue
from geventhttpclient import HTTPClient

from replay.protocol.gevent_pool import PoolInternals
from replay.protocol.urls import authorization, shown
from replay.record.rows import api_of

READ_SIZE = 65536
# RFC 9110 7.6.1: connection-specific fields, never forwarded; Host is the upstream's own.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "transfer-encoding", "upgrade", "host", "content-length"})
RECORDER_STOPPED = object()
QUICKACK = getattr(socket, "TCP_QUICKACK", None)  # Linux only


def _acknowledge_now(sock) -> None:
    """Acknowledge what the upstream sent at once (Linux's TCP_QUICKACK, which the kernel turns
    off again by itself, so it is set before every read). A server that streams without
    TCP_NODELAY writes an answer's head, then its first token a TTFT later: Nagle holds that
    token until the head is acknowledged, and a receiver that delays its ACKs (Linux does, up to
    40 ms, on a connection that a busy proxy reuses at once) delays the token as long. A direct
    client, whose connections idle between its requests, is acknowledged sooner; the proxy must
    not be slower."""
    if QUICKACK is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, QUICKACK, 1)
        except OSError:
            pass


def _bad_gateway(message: str, status: int) -> bytes:
    """The proxy's own error answer, in the OpenAI error shape the clients read."""
    kind = "GatewayTimeout" if status == 504 else "BadGateway"
    return orjson.dumps({"error": {"message": message, "type": kind, "code": status}})


class Forwarder:
    """The WSGI application. `exchanges` gets (header, request bytes, response bytes) per
    finished generation request, for the recorder."""

    def __init__(self, upstream: str, *, session_header: str | None, timeout_s: float, max_record_bytes: int,
                 id_header: str | None = None):
        parts = urlsplit(upstream)
        self.upstream = upstream
        self.base_path = parts.path.rstrip("/")
        self.credentials = authorization(upstream)
        self.client = HTTPClient(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80),
                                 ssl=parts.scheme == "https", concurrency=100_000, connection_timeout=30.0,
                                 network_timeout=timeout_s, block_size=READ_SIZE)
        self.session_header = session_header
        self.id_header = None if id_header is None else "HTTP_" + id_header.upper().replace("-", "_")
        self.max_record_bytes = max_record_bytes
        self.exchanges: Queue = Queue()
        self.seq = 0
        self.origin: float | None = None
        self.active = 0  # requests between their arrival and their answer's last byte

    def __call__(self, environ, start_response):
        self.active += 1
        try:
            answer = self._forward(environ, start_response)
        except BaseException:
            self.active -= 1
            raise
        return self._counted(answer)

    def _counted(self, answer):
        try:
            yield from answer
        finally:
            close = getattr(answer, "close", None)
            if close is not None:
                close()
            self.active -= 1

    def _forward(self, environ, start_response):
        arrival = time.time()
        method = environ["REQUEST_METHOD"]
        path = environ.get("PATH_INFO") or "/"
        query = environ.get("QUERY_STRING")
        uri = self.base_path + path + (f"?{query}" if query else "")
        recorded = method == "POST" and api_of(path) is not None
        if recorded:  # numbered at its arrival (reading the body may yield to a later request)
            seq = self.seq
            self.seq += 1
            if self.origin is None:
                self.origin = arrival
            client_id = environ.get(self.id_header) if self.id_header else None
        try:
            body = environ["wsgi.input"].read()
        except Exception as e:
            if recorded:
                self._hand_over(seq, path, arrival, 400, f"the client's request broke off: {_reason(e)}", None,
                                client_id, b"", b"")
            raise
        headers = [(k[5:].replace("_", "-").title(), v) for k, v in environ.items() if k.startswith("HTTP_")]
        headers = [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP]
        if environ.get("CONTENT_TYPE"):
            headers.append(("Content-Type", environ["CONTENT_TYPE"]))
        if self.credentials and not any(k.lower() == "authorization" for k, _ in headers):
            headers.append(("Authorization", self.credentials))
        if recorded:
            session_name = self._session_name(environ)
        try:
            response = self.client.request(method, uri, body=body, headers=headers)
        except Exception as e:
            why = _reason(e)
            status = 504 if why == "timed out" else 502
            message = f"replay record: the upstream {shown(self.upstream)} did not answer: {why}"
            start_response("504 Gateway Timeout" if status == 504 else "502 Bad Gateway",
                           [("Content-Type", "application/json")])
            answer = _bad_gateway(message, status)
            if recorded:
                self._hand_over(seq, path, arrival, status, f"the upstream did not answer: {why}", session_name, client_id,
                                body, answer)
            return [answer]
        status = f"{response.status_code} {_reason_phrase(response)}"
        out_headers = [(k, v) for k, v in response.items() if k.lower() not in HOP_BY_HOP - {"content-length"}]
        start_response(status, out_headers)
        relay = self._relay(response)
        if not recorded:
            return relay
        return self._recorded(relay, seq, path, arrival, response.status_code, session_name, client_id, body)

    def _session_name(self, environ) -> str | None:
        """The client's own name for the session in the header the recording takes (the body's
        `user` is the recorder's to read: nothing is parsed before the request is forwarded)."""
        if self.session_header:
            return environ.get("HTTP_" + self.session_header.upper().replace("-", "_")) or None
        return None

    def _relay(self, response):
        """The answer's body as it arrives: each read from the upstream is one chunk to the client."""
        buf = PoolInternals.body(response)
        finished = False
        try:
            while True:
                if buf:
                    chunk = bytes(buf)
                    del buf[:]
                    yield chunk
                sock = PoolInternals.socket(response)
                if response.message_complete or sock is None:
                    finished = True
                    return
                _acknowledge_now(sock)
                data = sock.recv(READ_SIZE)
                if not data:
                    if PoolInternals.ended_by_close(response):  # a body delimited by the close: whole
                        continue
                    raise ConnectionError("the upstream closed the connection before the end of the answer")
                response.feed(data)
        finally:
            if not finished and PoolInternals.socket(response) is not None:  # cut short: the connection is spoilt
                pool, sock = PoolInternals.detach(response)
                pool.release_socket(sock)

    def _recorded(self, relay, seq: int, path: str, arrival: float, status: int, session_name: str | None,
                  client_id: str | None, body: bytes):
        kept = bytearray()
        error = "client disconnected before the end of the answer"
        try:
            for chunk in relay:
                if len(kept) < self.max_record_bytes:
                    kept += chunk
                yield chunk
            error = None
        except GeneratorExit:  # the client is gone: pywsgi closes the answer it could not write
            raise
        except GreenletExit:  # killed: the proxy stopped, its --drain-timeout past
            error = "the proxy stopped before the end of the answer (--drain-timeout)"
            raise
        except Exception as e:
            error = f"the upstream broke off the answer: {_reason(e)}"
            raise
        finally:
            relay.close()
            if error is None and len(kept) >= self.max_record_bytes:
                error = f"answer over {self.max_record_bytes} bytes: not read for its usage"
            self._hand_over(seq, path, arrival, status, error, session_name, client_id, body, bytes(kept))

    def _hand_over(self, seq: int, path: str, arrival: float, status: int, error: str | None,
                   session_name: str | None, client_id: str | None, request: bytes, response: bytes) -> None:
        if len(request) > self.max_record_bytes:
            request, error = b"", error or f"request over {self.max_record_bytes} bytes: forwarded, not counted"
        head = {"seq": seq, "path": path, "arrival": arrival, "origin": self.origin, "end": time.time(),
                "status": status, "error": error, "session_name": session_name, "client_id": client_id,
                "request": len(request), "response": len(response)}
        self.exchanges.put((orjson.dumps(head) + b"\n", request, response))


def _reason(e: BaseException) -> str:
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, TimeoutError | gevent.Timeout):
        return "timed out"
    return str(e) or type(e).__name__


def _reason_phrase(response) -> str:
    from http import HTTPStatus

    try:
        return HTTPStatus(response.status_code).phrase
    except ValueError:
        return "Unknown"


def pump(exchanges: Queue, pipe, forwarder: Forwarder | None = None) -> None:
    """Write each queued exchange down the recorder's pipe (a greenlet: the forwarding never waits
    for the pipe). Ends at RECORDER_STOPPED with the count of requests numbered, so that the
    recorder can tell a recording closed in order from a proxy that died (EOF without it), or
    when the recorder is gone."""
    while True:
        item = exchanges.get()
        if item is RECORDER_STOPPED:
            if forwarder is not None:
                try:
                    pipe.write(orjson.dumps({"closed": forwarder.seq}) + b"\n")
                    pipe.flush()
                except OSError:
                    pass
            return
        try:
            for part in item:
                pipe.write(part)
            pipe.flush()
        except OSError:
            return

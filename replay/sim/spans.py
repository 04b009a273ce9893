"""`replay sim --otlp-endpoint URL`: one vLLM `llm_request` span per finished request, exported
to an OTLP/HTTP trace receiver (protobuf, replay.protocol.otlp's opentelemetry-proto messages),
with vLLM's attribute names and units (seconds), so a run's --otlp-receiver can be tested
against times that are known exactly.

The times are the sim's own model's, not measured: queue = from the request's arrival to its
slot (--max-num-seqs, FIFO; --reorder-ms's batch wait included), prefill = the planned time to
first token from the slot (--ttft-ms, --prefill-ms-per-1k on the uncached tokens, --stall-ms,
jitter), decode = the sum of the planned gaps of the tokens after the first, time to first
token = queue + prefill, e2e = queue + prefill + decode; the request id is vLLM's
(`chatcmpl-<X-Request-Id>`, `cmpl-<X-Request-Id>-0`; TGI: the X-Request-Id). Spans are batched
and sent by a background greenlet every FLUSH_S (or at BATCH spans), as vLLM's exporter does,
off the requests' own greenlets; a batch the receiver refuses or never gets is counted
(`dropped`) and logged, never retried.
"""

from __future__ import annotations

import sys
import time
from urllib.parse import urlsplit

import gevent
from geventhttpclient import HTTPClient

from replay.protocol import otlp

FLUSH_S = 0.5
BATCH = 512
SERVICE = "replay-sim"


class SpanExporter:
    def __init__(self, url: str):
        parts = urlsplit(url)
        self.path = parts.path or otlp.TRACES_PATH
        self.http = HTTPClient.from_url(url, concurrency=1, connection_timeout=5, network_timeout=10)
        self.pending: list[dict] = []
        self.sent = 0
        self.dropped = 0
        self._greenlet = gevent.spawn(self._loop)

    def add(self, request_id: str, arrived: float, queue_s: float, prefill_s: float, decode_s: float,
            prompt_tokens: int, completion_tokens: int) -> None:
        """One finished request's span; `arrived`: time.monotonic() at its arrival."""
        e2e_s = queue_s + prefill_s + decode_s
        start_ns = time.time_ns() - int((time.monotonic() - arrived) * 1e9)
        self.pending.append({"name": otlp.LLM_REQUEST, "start_ns": start_ns, "end_ns": start_ns + int(e2e_s * 1e9),
                             "attributes": {otlp.REQUEST_ID: request_id, otlp.TIME_IN_QUEUE: queue_s,
                                            otlp.PREFILL: prefill_s, otlp.DECODE: decode_s,
                                            otlp.INFERENCE: prefill_s + decode_s,
                                            otlp.TIME_TO_FIRST_TOKEN: queue_s + prefill_s, otlp.E2E: e2e_s,
                                            otlp.PROMPT_TOKENS: prompt_tokens,
                                            otlp.COMPLETION_TOKENS: completion_tokens}})
        if len(self.pending) >= BATCH:
            gevent.spawn(self.flush)

    def _loop(self) -> None:
        while True:
            gevent.sleep(FLUSH_S)
            self.flush()

    def flush(self) -> None:
        batch, self.pending = self.pending, []
        if not batch:
            return
        try:
            response = self.http.post(self.path, body=otlp.export_body(batch, SERVICE),
                                      headers={"Content-Type": otlp.PROTOBUF})
            response.read()
            ok = response.status_code == 200
        except (OSError, gevent.Timeout) as e:
            ok, why = False, str(e)
        else:
            why = f"HTTP {response.status_code}"
        if ok:
            self.sent += len(batch)
        else:
            self.dropped += len(batch)
            print(f"replay sim: --otlp-endpoint: {len(batch)} spans not taken: {why}", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Send what is pending, then stop."""
        self._greenlet.kill()
        self.flush()
        self.http.close()

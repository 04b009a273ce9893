"""Timing a server's streamed answers from outside, as a client sees them."""

from __future__ import annotations

import time

import requests


def first_token_lateness_ms(session: requests.Session, url: str, body: dict, ttft_s: float,
                            times: int = 30) -> list[float]:
    """Send `body` (a streamed request) `times` times one after another on `session`'s kept-alive
    connection; each answer's first data event's lateness past `ttft_s` after its send (ms),
    sorted. A first token held for the client's delayed ACK shows here as tens of ms."""
    late = []
    for _ in range(times):
        started = time.perf_counter()
        with session.post(url, json=body, stream=True, timeout=10) as answer:
            lines = answer.iter_lines()
            next(line for line in lines if line.startswith(b"data: {"))
            late.append((time.perf_counter() - started - ttft_s) * 1000.0)
            for _ in lines:
                pass
    return sorted(late)

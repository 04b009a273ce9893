"""Choosing an endpoint of the fleet for each request (`--routing`)."""

from __future__ import annotations

import zlib
from itertools import count
from typing import Callable

from replay.protocol.client import Endpoint
from replay.trace.record import TraceRow


def _stable_hash(value) -> int:
    # Python's hash() of a str differs per process; workers must agree on a session's endpoint.
    return zlib.crc32(str(value).encode())


def make_router(routing: str, endpoints: list[Endpoint]) -> Callable[[TraceRow], Endpoint]:
    if len(endpoints) == 1:
        only = endpoints[0]
        return lambda row: only
    if routing == "round-robin":
        turn = count()
        return lambda row: endpoints[next(turn) % len(endpoints)]
    if routing == "least-inflight":
        return lambda row: min(endpoints, key=lambda e: e.in_flight)
    if routing == "session":
        turn = count()
        return lambda row: endpoints[
            (_stable_hash(row.session_id) if row.session_id is not None else next(turn)) % len(endpoints)
        ]
    if routing == "prefix":
        turn = count()
        return lambda row: endpoints[(_stable_hash(row.hash_ids[0]) if row.hash_ids else next(turn)) % len(endpoints)]
    raise ValueError(f"--routing {routing!r}: expected round-robin, least-inflight, session or prefix")

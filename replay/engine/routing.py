"""Choosing an endpoint of the fleet for each request (`--routing`)."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from itertools import count

from replay.protocol.client import Endpoint
from replay.trace.record import TraceRow


def _stable_hash(value) -> int:
    # Python's hash() of a str differs per process; workers must agree on a session's endpoint.
    return zlib.crc32(str(value).encode())


Router = Callable[[TraceRow], Endpoint]


def _round_robin(endpoints: list[Endpoint]) -> Router:
    turn = count()
    return lambda row: endpoints[next(turn) % len(endpoints)]


def _least_inflight(endpoints: list[Endpoint]) -> Router:
    return lambda row: min(endpoints, key=lambda e: e.in_flight)


def _session(endpoints: list[Endpoint]) -> Router:
    turn = count()
    return lambda row: endpoints[
        (_stable_hash(row.session_id) if row.session_id is not None else next(turn)) % len(endpoints)
    ]


def _prefix(endpoints: list[Endpoint]) -> Router:
    turn = count()
    return lambda row: endpoints[(_stable_hash(row.hash_ids[0]) if row.hash_ids else next(turn)) % len(endpoints)]


# Each --routing choice and its router: the option's choices are this table's names.
ROUTERS: dict[str, Callable[[list[Endpoint]], Router]] = {
    "round-robin": _round_robin, "least-inflight": _least_inflight, "session": _session, "prefix": _prefix,
}
ROUTINGS = tuple(ROUTERS)


def make_router(routing: str, endpoints: list[Endpoint]) -> Router:
    if routing not in ROUTERS:
        raise ValueError(f"--routing {routing!r}: expected one of {', '.join(ROUTINGS)}")
    if len(endpoints) == 1:
        only = endpoints[0]
        return lambda row: only
    return ROUTERS[routing](endpoints)

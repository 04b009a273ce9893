"""Run one generation through the engine and pace its output, whatever the protocol.

A protocol (OpenAI chat, OpenAI completions, TGI) supplies a Frames object that turns
token ranges into bytes; this module does the waiting: FIFO admission, time to first
token, one event per token at the inter-token gap, with the tokens that fall due at the
same instant written together (--itl-ms 0 sends a whole answer in one write, still one
event per token).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import gevent

from replay.sim.engine import Engine, Plan
from replay.sim.errors import ApiError
from replay.sim.http import DropConnection, Response, Stream

# A timer may fire a little early; tokens due within this margin go out with the batch.
EARLY_S = 0.0005


@dataclass
class GenRequest:
    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    order: int | None = None  # the number ending its X-Request-Id: the sender's order (--reorder-ms)
    arrived: float = 0.0  # time.monotonic() when the engine got it, before any wait for a slot (its queue time)
    engine_request_id: str | None = None  # its id in an --otlp-endpoint span: vLLM's prefix + its X-Request-Id


class Frames(Protocol):
    def first(self, plan: Plan) -> bytes: ...
    def tokens(self, plan: Plan, start: int, end: int) -> bytes: ...
    def tail(self, plan: Plan) -> bytes: ...
    def full(self, plan: Plan) -> bytes: ...


def _sleep_until(deadline: float) -> None:
    delay = deadline - time.monotonic()
    if delay > 0:
        gevent.sleep(delay)


def respond(engine: Engine, req: GenRequest, frames: Frames) -> Response | Stream:
    if engine.inject_error():
        raise ApiError("injected fault (--error-rate)", status=engine.options.error_status)
    req.arrived = time.monotonic()
    if req.stream:
        return Stream(_events(engine, req, frames))
    engine.acquire()
    plan = None
    completed = False
    try:
        plan = engine.schedule_in_turn(req.prompt_ids, req.max_tokens, req.ignore_eos, req.min_tokens, order=req.order)
        plan.arrived = req.arrived
        _sleep_until(plan.finished_at)
        plan.last_token_at = time.monotonic()  # a whole answer's tokens are timed by the model: due, not sent
        plan.first_token_at = min(plan.started + plan.ttft_s, plan.last_token_at)
        completed = True
    finally:
        if plan is not None:
            engine.finish(plan, plan.completion_tokens if completed else 0, completed)
            if completed:
                _trace(engine, req, plan)
        engine.release()
    return Response(200, frames.full(plan))


def _trace(engine: Engine, req: GenRequest, plan: Plan) -> None:
    """The finished request's span (replay sim --otlp-endpoint: replay.sim.spans), from the plan's times."""
    if engine.spans is not None and req.engine_request_id is not None:
        engine.spans.add(req.engine_request_id, req.arrived, plan.started - req.arrived, plan.ttft_s, sum(plan.itl_s),
                         plan.prompt_tokens, plan.completion_tokens)


def _events(engine: Engine, req: GenRequest, frames: Frames) -> Iterator[bytes]:
    engine.acquire()
    plan = None
    emitted = 0
    completed = False
    try:
        plan = engine.schedule_in_turn(req.prompt_ids, req.max_tokens, req.ignore_eos, req.min_tokens, stream=True,
                                       order=req.order)
        plan.arrived = req.arrived
        n = plan.completion_tokens
        drop_at = plan.drop_at
        itl = plan.itl_s
        due = plan.started + plan.ttft_s
        while emitted < n:
            _sleep_until(due)
            now = time.monotonic() + EARLY_S
            end = emitted
            while end < n and due <= now:
                if end < n - 1:
                    due += itl[end]
                end += 1
            if end == emitted:
                continue
            if drop_at is not None and end >= drop_at:
                end = drop_at
            data = frames.tokens(plan, emitted, end)
            sent = time.monotonic()
            if emitted == 0:
                data = frames.first(plan) + data
                plan.first_token_at = sent
            if end == n:
                plan.last_token_at = sent
            emitted = end
            yield data
            if drop_at is not None and emitted >= drop_at:
                engine.counters.dropped += 1
                raise DropConnection()
        completed = True
        _trace(engine, req, plan)
        yield frames.tail(plan)
    finally:
        if plan is not None:
            engine.finish(plan, emitted, completed)
        engine.release()

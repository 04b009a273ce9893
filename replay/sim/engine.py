"""What the simulated engine decides for a request: when it runs, what it hits, what it says.

The engine owns the prefix cache, the running/waiting bookkeeping (--max-num-seqs, FIFO
like vLLM's scheduler), the counters behind /metrics and the ledger of request ids behind
/debug/requests. It knows nothing about HTTP.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from dataclasses import dataclass, field

import gevent
from gevent.event import Event

from replay.sim.cache import BlockPool, block_hashes, hit_tokens
from replay.sim.ledger import Ledger
from replay.sim.options import SimOptions, false_metrics, false_usage
from replay.sim.spans import SpanExporter
from replay.sim.vocab import OutputVocabulary
from replay.synth.tokenizer import ServerTokenizer
from replay.synth.tokenizer_source import resolve_tokenizer


@dataclass
class Plan:
    """One scheduled request: its prompt accounting, its output, and its timeline."""

    prompt_tokens: int
    cached_tokens: int
    token_ids: list[int]
    finish_reason: str  # "length" or "stop"
    started: float  # time.monotonic() when it left the waiting queue
    ttft_s: float
    itl_s: list[float]  # gap before token i+1, len(token_ids) - 1 entries
    drop_at: int | None  # close the stream after this many tokens (fault injection)
    seed: int
    blocks: list[int] = field(default_factory=list)  # the pool's blocks it holds (prompt and output), its order
    # time.monotonic() of its arrival (before it waited for a slot), its first and its last token,
    # as the generation timed them: its per-request metrics (--per-request-metrics)
    arrived: float = 0.0
    first_token_at: float = 0.0
    last_token_at: float = 0.0

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def finished_at(self) -> float:
        return self.started + self.ttft_s + sum(self.itl_s)


@dataclass
class _Turn:
    """A request waiting for its --reorder-ms batch to be scheduled."""

    args: tuple
    order: int  # the batch is scheduled from the highest down
    plan: Plan | None = None
    cancelled: bool = False
    done: Event = field(default_factory=Event)


@dataclass
class Counters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cache_queries: int = 0
    cache_hits: int = 0
    success: dict[str, int] = field(default_factory=lambda: {"length": 0, "stop": 0, "abort": 0})
    errors: dict[int, int] = field(default_factory=dict)
    dropped: int = 0
    preemptions: int = 0  # the sim never preempts: a request that is scheduled runs to its end


class Engine:
    def __init__(self, options: SimOptions, tokenizer: ServerTokenizer | None = None):
        self.options = options
        self.false_usage = false_usage(options) if options.false_usage is not None else None
        self.false_metrics = false_metrics(options) if options.false_metrics is not None else None
        # the template compiled when a chat first renders it: as vLLM, a template that does not
        # compile refuses chats (400, its words) and leaves completions served
        self.tokenizer = tokenizer or ServerTokenizer.load(resolve_tokenizer(options.tokenizer), options.chat_template,
                                                           compiled=False)
        self.vocab = OutputVocabulary(self.tokenizer)
        self.cache = BlockPool(options.block_size, options.cache_blocks)
        self.counters = Counters()
        self.ledger = Ledger()
        self.rng = random.Random(options.seed)
        self.running = 0
        self._waiting: deque[Event] = deque()
        self._serial = 0
        self._batch: list[_Turn] | None = None  # --reorder-ms: the requests arrived since the batch opened
        self.spans: SpanExporter | None = None  # --otlp-endpoint's, set by replay.sim.server.start

    # -- identity ---------------------------------------------------------------
    def next_id(self) -> int:
        self._serial += 1
        return self._serial

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_cache_usage(self) -> float:
        """The share of the block pool (--cache-blocks, less vLLM's null block) the running
        requests hold, as vLLM's kv_cache_usage_perc (1 - free / total, where cached blocks
        nobody uses count as free). A request's whole output is counted from its start (vLLM
        allocates it as it goes)."""
        return self.cache.usage()

    # -- faults ----------------------------------------------------------------
    def inject_error(self) -> bool:
        rate = self.options.error_rate
        return rate > 0 and self.rng.random() < rate

    def record_error(self, status: int) -> None:
        self.counters.errors[status] = self.counters.errors.get(status, 0) + 1

    # -- admission: at most max_num_seqs running, the rest wait first-come first-served --
    def acquire(self) -> None:
        if self.running < self.options.max_num_seqs and not self._waiting:
            self.running += 1
            return
        ticket = Event()
        self._waiting.append(ticket)
        try:
            ticket.wait()
        except BaseException:
            if ticket.is_set():  # the slot was handed over just as we were killed
                self.release()
            else:
                self._waiting.remove(ticket)
            raise

    def release(self) -> None:
        if self._waiting:
            # Hand the slot straight to the oldest waiter: `running` stays the same.
            self._waiting.popleft().set()
        else:
            self.running -= 1

    # -- scheduling ---------------------------------------------------------------
    def schedule(self, prompt_ids: list[int], max_tokens: int, ignore_eos: bool, min_tokens: int = 0,
                 stream: bool = False) -> Plan:
        """Called once the request holds a slot: look up and fill the cache, draw the output."""
        opts = self.options
        prompt_len = len(prompt_ids)
        seed = self.rng.getrandbits(63)
        rng = random.Random(seed)
        n = max_tokens
        finish = "length"
        if not ignore_eos and opts.eos_prob > 0 and max_tokens > min_tokens:
            # Geometric draw of the first EOS after min_tokens (same law as a per-token coin).
            u = rng.random()
            extra = 0 if opts.eos_prob >= 1 else int(math.log1p(-u) / math.log1p(-opts.eos_prob))
            if min_tokens + extra + 1 < max_tokens:
                n = min_tokens + extra + 1
                finish = "stop"
        token_ids = rng.choices(self.vocab.ids, k=n)
        hashes = block_hashes(prompt_ids, opts.block_size)
        hit, blocks = self.cache.allocate(hashes, prompt_len, n)
        cached = hit_tokens(hit, opts.block_size, prompt_len)
        c = self.counters
        c.prompt_tokens += prompt_len
        c.cache_queries += prompt_len
        c.cache_hits += cached

        jitter = opts.jitter
        scale = (lambda: 1.0 + jitter * (2.0 * rng.random() - 1.0)) if jitter else (lambda: 1.0)
        uncached = prompt_len - cached
        ttft_ms = opts.ttft_ms + opts.prefill_ms_per_1k * uncached / 1000.0 + opts.stall_ms
        ttft_s = ttft_ms * scale() / 1000.0
        itl = opts.itl_ms / 1000.0
        itl_s = [itl * scale() for _ in range(n - 1)] if jitter else [itl] * (n - 1)
        drop_at = None
        if stream and opts.drop_rate > 0 and rng.random() < opts.drop_rate:
            drop_at = rng.randint(1, n) if n > 1 else 1
        return Plan(prompt_len, cached, token_ids, finish, time.monotonic(), ttft_s, itl_s, drop_at, seed, blocks)

    def schedule_in_turn(self, prompt_ids: list[int], max_tokens: int, ignore_eos: bool, min_tokens: int = 0,
                         stream: bool = False, order: int | None = None) -> Plan:
        """`schedule`; with --reorder-ms, once the batch this request arrived in closes (the
        option's time after its first request), the batch's requests scheduled the last sent
        first (`order`: the number its X-Request-Id ends with; without one, the last to arrive
        first): who caches a shared prefix first is then the reverse of the sending order, as a
        server's scheduler may take requests in flight together."""
        args = (prompt_ids, max_tokens, ignore_eos, min_tokens, stream)
        if self.options.reorder_ms <= 0:
            return self.schedule(*args)
        turn = _Turn(args, order if order is not None else len(self._batch or ()))
        if self._batch is None:
            self._batch = []
            gevent.spawn_later(self.options.reorder_ms / 1000.0, self._schedule_batch)
        self._batch.append(turn)
        try:
            turn.done.wait()
        except BaseException:
            turn.cancelled = True
            if turn.plan is not None:  # scheduled just as its request went: its blocks go back
                self.finish(turn.plan, 0, False)
            raise
        assert turn.plan is not None
        return turn.plan

    def _schedule_batch(self) -> None:
        batch, self._batch = self._batch or [], None
        for turn in sorted(batch, key=lambda turn: turn.order, reverse=True):
            if not turn.cancelled:
                turn.plan = self.schedule(*turn.args)
            turn.done.set()

    def finish(self, plan: Plan, emitted: int, completed: bool) -> None:
        self.cache.free(plan.blocks)
        c = self.counters
        c.generation_tokens += emitted
        if completed:
            c.success[plan.finish_reason] += 1
        else:
            c.success["abort"] += 1

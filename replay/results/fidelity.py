"""Cache fidelity: did the server cache what the replayed trace says it should?

Expected cached tokens per request come from the prompts themselves, not from the trace's
blocks: the prompts are re-synthesized exactly as the run made them (same tokenizer,
template, api, seed and trace block size; PromptSynthesizer is deterministic) and fed, in
the order the server received them, through an infinite cache that counts like vLLM's
(replay.sim.cache: chain hashes of whole server blocks, never the last token). That is
exact where a formula over trace blocks is not: a chat template puts the same P tokens in
front of every prompt, which shifts the server's block boundaries by P against the trace's;
short rows use another message layout; rows with their own messages share whatever their
text shares; and the server's block size need not divide or equal the trace's.

Order: "earlier" means earlier in send order (sent_at). vLLM caches a request's blocks when
it schedules it (a chunked prefill: as each chunk is scheduled), so a request sent while an
earlier one with the same prefix is still in prefill may hit too. But requests in flight
together may reach the scheduler in another order than they were sent (rows due at the same
instant most of all): which of them cached a shared prefix first is the server's scheduling,
not the replay's. So a request's observed value is also explained (`CacheCheck.explained`)
when it lies between what it would see if every request not yet known to be scheduled when
it was sent came after it (`low`), and what it would see if every request sent before it was
known to be scheduled came first (`high`). A request is known to be scheduled once its first
token (or, not streamed, its answer) came back (`answered_at`), and `reorder_window_ms` after
its send at least.

This module holds the rule and its arithmetic, one request at a time in send order, and loads
no tokenizer: a run's whole check streams through it in a child process
(replay/results/cache_child.py, started by replay/results/cache_section.py).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from replay.results.records import Record
from replay.rules.prefix_cache import block_hashes
from replay.trace.pairs import PairIndex
from replay.trace.prefix import IdealHits
from replay.trace.record import TraceRow

if TYPE_CHECKING:
    from replay.synth.prompts import PromptSynthesizer

WORST = 10


@dataclass(slots=True)
class CacheCheck:
    """One sent request: what the server said against what the prompts imply."""

    request_id: int
    sent_at: float
    prompt_tokens: int  # synthesized prompt, as the server counts it
    reported_prompt_tokens: int | None
    expected: int  # send order, infinite cache
    observed: int | None
    low: int  # the range the server's order of requests in flight together can explain (== expected: none)
    high: int

    @property
    def matches(self) -> bool:
        return self.observed == self.expected

    @property
    def explained(self) -> bool:
        return self.observed is not None and self.low <= self.observed <= self.high


class SentPrompt(NamedTuple):
    """A request the server took in, in send order: its record's numbers and its prompt's
    server-block chain hashes."""

    request_id: int
    sent_at: float
    reported_prompt_tokens: int | None
    observed: int | None
    hashes: list[int]
    prompt_tokens: int
    answered_at: float | None = None  # its first token (or answer) came back: the server had scheduled it


def answered_at(record: Record) -> float | None:
    """When the server had certainly scheduled a request: its first token came back (or, not
    streamed, its answer); None when neither did."""
    sent, ttft = record.get("sent_at"), record.get("ttft_ms")
    if sent is not None and ttft is not None:
        return sent + ttft / 1000.0
    return record.get("finished_at")


class BlockSet:
    """A set of block hashes in a PairIndex (about 24 bytes a hash; a Python set of ints costs
    about 75): what an infinite cache holds grows with a run's distinct blocks."""

    def __init__(self) -> None:
        self._index = PairIndex()

    def __contains__(self, block_hash: int) -> bool:
        return self._index.find(0, block_hash) != 0

    def hit_blocks(self, hashes: Sequence[int], num_tokens: int, block_size: int) -> int:
        """rules.prefix_cache.hit_blocks over this set, in one call (the checks' hot loop)."""
        return self._index.leading(0, hashes, max(num_tokens - 1, 0) // block_size)

    def update(self, hashes: Sequence[int], start: int = 0) -> None:
        """Add `hashes` (from `start`: the ones before are held, a hit found them)."""
        self._index.add_new(0, hashes[start:] if start else hashes)


def scheduled(record: Record) -> bool:
    """Did the server take this request in (and so cache its prompt)?"""
    status = record.get("status") or 0
    return record.get("sent_at") is not None and (bool(record.get("ok")) or 200 <= status < 300)


def send_order_checks(sent: Iterable[SentPrompt], server_block_size: int,
                      reorder_window_ms: float = 0.0) -> Iterator[CacheCheck]:
    """A CacheCheck per request of `sent` (in send order), drawn one at a time: only the
    requests in flight around the current one are held (those drawn ahead up to its
    `answered_at`, and the blocks first cached by requests not yet known to be scheduled)."""
    if server_block_size <= 0:
        raise ValueError(f"server block size must be positive, got {server_block_size}")
    cache = BlockSet()  # an infinite cache: every block hash ever scheduled
    unsure = _Unsure()  # blocks of `cache` that no request known to be scheduled holds yet
    window_s = reorder_window_ms / 1000.0
    items = iter(sent)
    ahead = _Ahead()  # drawn, not yet checked: the requests sent after the current one
    size = server_block_size
    while (current := ahead.popleft() if ahead else next(items, None)) is not None:
        t, hashes, length = current.sent_at, current.hashes, current.prompt_tokens
        known_at = max(t + window_s, current.answered_at or t)  # scheduled by then
        unsure.known_until(t)
        expected = cache.hit_blocks(hashes, length, size)
        low = unsure.leading_known(hashes, expected)
        while ahead.last_sent <= known_at and (following := next(items, None)) is not None:
            ahead.append(following)
        high = max(expected, ahead.hit_blocks(hashes, length, size, known_at))
        unsure.add(hashes, expected, cache, known_at, t)
        cache.update(hashes, expected)
        yield CacheCheck(
            request_id=current.request_id, sent_at=t, prompt_tokens=length,
            reported_prompt_tokens=current.reported_prompt_tokens, expected=expected * size,
            observed=current.observed, low=low * size, high=high * size,
        )  # fmt: skip


class _Ahead:
    """The requests drawn past the current one, in send order, and for each block hash the send
    times of those holding it (chain hashes: a request holding a block holds its whole prefix)."""

    def __init__(self) -> None:
        self._queue: deque[SentPrompt] = deque()
        self._sent: dict[int, deque[float]] = {}
        self.last_sent = -math.inf

    def __bool__(self) -> bool:
        return bool(self._queue)

    def append(self, prompt: SentPrompt) -> None:
        self._queue.append(prompt)
        self.last_sent = prompt.sent_at
        for h in prompt.hashes:
            self._sent.setdefault(h, deque()).append(prompt.sent_at)

    def popleft(self) -> SentPrompt:
        prompt = self._queue.popleft()
        for h in prompt.hashes:
            times = self._sent[h]
            times.popleft()
            if not times:
                del self._sent[h]
        if not self._queue:
            self.last_sent = -math.inf
        return prompt

    def hit_blocks(self, hashes: Sequence[int], num_tokens: int, block_size: int, by: float) -> int:
        """The longest prefix of `hashes` one request sent by `by` holds (the hit rule's)."""
        hit = 0
        for h in hashes[: max(num_tokens - 1, 0) // block_size]:
            times = self._sent.get(h)
            if times is None or times[0] > by:  # the first holder is the earliest: none sent by then
                break
            hit += 1
        return hit


class _Unsure:
    """Blocks in the infinite cache that no request known to be scheduled holds yet: each with
    the earliest time a request holding it was known to be scheduled (`known_at`)."""

    def __init__(self) -> None:
        self._known_at: dict[int, float] = {}
        self._heap: list[tuple[float, int]] = []

    def known_until(self, t: float) -> None:
        """Forget the blocks known to be cached before `t`."""
        heap, known_at = self._heap, self._known_at
        while heap and heap[0][0] < t:
            at, h = heapq.heappop(heap)
            if known_at.get(h, math.inf) <= at:
                del known_at[h]

    def leading_known(self, hashes: Sequence[int], hit: int) -> int:
        """How many of the first `hit` blocks are known to be cached."""
        known_at = self._known_at
        if not known_at:
            return hit
        for k in range(hit):
            if hashes[k] in known_at:
                return k
        return hit

    def add(self, hashes: Sequence[int], hit: int, cache: BlockSet, known_at: float, sent_at: float) -> None:
        """A request sent at `sent_at`, known to be scheduled at `known_at`, holding `hashes`
        (the first `hit` found in `cache`): its new blocks are unsure until then, and the unsure
        ones it hit are known from then on."""
        known = self._known_at
        unsure = known_at > sent_at
        if not unsure and not known:
            return
        for k, h in enumerate(hashes):
            if h in known or (unsure and k >= hit and h not in cache):
                self._known(h, known_at)

    def _known(self, h: int, at: float) -> None:
        if at < self._known_at.get(h, math.inf):
            self._known_at[h] = at
            heapq.heappush(self._heap, (at, h))


def check_cache(
    records: Iterable[Record],
    rows: dict[int, TraceRow],
    synth: PromptSynthesizer,
    server_block_size: int,
    reorder_window_ms: float = 0.0,
) -> list[CacheCheck]:
    """A CacheCheck per request the server took in, in send order, from records and rows in memory."""
    if server_block_size <= 0:
        raise ValueError(f"server block size must be positive, got {server_block_size}")
    sent = sorted((r for r in records if scheduled(r)), key=lambda r: (r["sent_at"], r["request_id"]))
    missing = [r["request_id"] for r in sent if r["request_id"] not in rows]
    if missing:
        raise missing_rows(len(missing), missing[0])

    def prompts() -> Iterator[SentPrompt]:
        for r in sent:
            ids = synth.server_ids(rows[r["request_id"]])
            yield SentPrompt(r["request_id"], r["sent_at"], r.get("prompt_tokens"), r.get("cached_tokens"),
                             block_hashes(ids, server_block_size), len(ids), answered_at(r))

    return list(send_order_checks(prompts(), server_block_size, reorder_window_ms))


def missing_rows(count: int, first: int) -> ValueError:
    """The error for records that name rows the trace does not have (`first`: in send order)."""
    return ValueError(f"{count} records name rows the trace does not have (first: request_id {first}); "
                      "is --trace the file the run replayed?")


class CacheTally:
    """The cache section's counts over checks added one at a time (none is kept but the worst)."""

    def __init__(self) -> None:
        self.checked = self.compared = self.expected = self.observed = 0
        self.all_expected = self.all_low = self.all_high = 0  # every request checked, with a count or not
        self.matching = self.explained = self.prompt_mismatch = 0
        self._worst: list[tuple[tuple[int, int], CacheCheck]] = []  # a min-heap of ((|error|, -order), check)

    def add(self, c: CacheCheck) -> None:
        self.checked += 1
        self.all_expected += c.expected
        self.all_low += c.low
        self.all_high += c.high
        if c.reported_prompt_tokens is not None and c.reported_prompt_tokens != c.prompt_tokens:
            self.prompt_mismatch += 1
        if c.observed is None:
            return
        self.compared += 1
        self.expected += c.expected
        self.observed += c.observed
        self.matching += c.matches
        self.explained += c.explained
        if not c.matches:  # the largest errors; of equal ones, the first sent
            item = ((abs(c.observed - c.expected), -self.checked), c)
            if len(self._worst) < WORST:
                heapq.heappush(self._worst, item)
            elif item[0] > self._worst[0][0]:
                heapq.heapreplace(self._worst, item)

    def section(self, method: str, ideal: dict | None = None) -> dict:
        """The cache section (docs/reports.md), plus the counts behind the share and the worst requests."""
        compared, matching = self.compared, self.matching
        worst = [c for key, c in sorted(self._worst, key=lambda item: (-item[0][0], -item[0][1]))]
        section = {
            "expected_cached_tokens": self.expected,
            "observed_cached_tokens": self.observed,
            "ratio": self.observed / self.expected if self.expected else None,
            "requests_matching_share": matching / compared if compared else None,
            "requests_matching": matching,
            "requests_compared": compared,
            "requests_explained_by_reordering": self.explained - matching if self.explained > matching else 0,
            "requests_without_cached_tokens": self.checked - compared,
            "requests_prompt_mismatch": self.prompt_mismatch,
            # every request checked (with a count or without), to set against the server's own counters
            "all_requests": {"requests": self.checked, "expected": self.all_expected, "low": self.all_low,
                             "high": self.all_high},
            "worst": [
                {"request_id": c.request_id, "observed": c.observed, "expected": c.expected,
                 "prompt_tokens": c.prompt_tokens, "low": c.low, "high": c.high}
                for c in worst
            ],  # fmt: skip
            "method": method,
        }
        if ideal:
            section.update(ideal)
        return section


class FingerprintTally:
    """The sent prompts' fingerprints (a record's `prompt_fingerprint`) against the re-synthesis's,
    one request at a time (replay.rules.prompt_fingerprint.agreed_tokens): how many were checked,
    how many differ (the lowest request ids, each with the tokens its prompt agreed to), and how many
    records have none (a run from before the field: nothing is proven either way).
    `unchecked`: why none is compared (the prompts re-synthesized are not provably the run's);
    then every request counts as without."""

    def __init__(self, unchecked: str | None = None) -> None:
        self.checked = self.differ = self.without = 0
        self.examples: list[dict] = []
        self.unchecked = unchecked
        self.compared = unchecked is None

    def add(self, request_id: int, agreed: float | None) -> None:
        if agreed is None:
            self.without += 1
            return
        self.checked += 1
        if agreed != math.inf:  # the lowest request ids: the same whichever order they come in
            self.differ += 1
            if len(self.examples) < WORST or request_id < self.examples[-1]["request_id"]:
                self.examples.append({"request_id": request_id, "agreed_tokens": int(agreed)})
                self.examples.sort(key=lambda e: e["request_id"])
                del self.examples[WORST:]

    def section(self) -> dict:
        section = {"checked": self.checked, "differ": self.differ, "without": self.without, "examples": self.examples}
        if self.unchecked is not None:
            section["unchecked"] = self.unchecked
        return section


def summarize_cache(checks: Iterable[CacheCheck], method: str, ideal: dict | None = None) -> dict:
    """The cache section of `checks` (CacheTally's)."""
    tally = CacheTally()
    for c in checks:
        tally.add(c)
    return tally.section(method, ideal)


def ideal_trace_hits(ideal: IdealHits | None) -> dict:
    """The trace's own ideal (trace blocks, file order; None: the trace has no block size):
    what `replay trace stats` reports."""
    if ideal is None:
        return {}
    tokens, total = ideal.hit_tokens, ideal.total_tokens
    return {"ideal_trace_cached_tokens": tokens, "ideal_trace_hit_ratio_tokens": tokens / total if total else None}


def method_text(*, api: str, token_ids: bool, tokenizer: str, seed: int, trace_block_size: int | None,
                server_block_size: int, reorder_window_ms: float) -> str:
    """How the expected values were made, as the section says it."""
    what = f"{api} token-id" if token_ids else api
    method = (f"re-synthesized {what} prompts ({Path(str(tokenizer)).name}, seed {seed}, trace block "
              f"{trace_block_size}) through an infinite vLLM-style cache of {server_block_size}-token blocks, "
              f"in send order")  # fmt: skip
    if reorder_window_ms:
        method += f"; sends within {reorder_window_ms:g} ms may swap"
    return method

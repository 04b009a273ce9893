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
it schedules it, before the prefill has run, so a request sent while an earlier one with
the same prefix is still in prefill hits too. Two requests sent within a few milliseconds
of each other may still reach the scheduler in the other order; `reorder_window_ms` allows
for that: a request also matches when its observed value lies between what it would see if
every request sent within the window before it came later, and what it would see if every
request sent within the window after it came first.

This module holds the rule and its arithmetic, one request at a time in send order, and loads
no tokenizer: a run's whole check streams through it in a child process
(replay/results/cache_child.py, started by replay/results/cache_section.py).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from replay.results.records import Record
from replay.rules.prefix_cache import block_hashes, hit_blocks
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
    low: int  # the range concurrency can explain (== expected with no reorder window)
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
    requests within the reorder window of the current one are held."""
    if server_block_size <= 0:
        raise ValueError(f"server block size must be positive, got {server_block_size}")
    cache = BlockSet()  # an infinite cache: every block hash ever scheduled
    earlier = BlockSet()  # the same, for requests sent before the window
    window_s = reorder_window_ms / 1000.0
    items = iter(sent)
    ahead: deque[SentPrompt] = deque()  # drawn, not yet checked: the window after the current one
    behind: deque[SentPrompt] = deque()  # checked, not yet in `earlier`
    size = server_block_size
    while (current := ahead.popleft() if ahead else next(items, None)) is not None:
        t, hashes, length = current.sent_at, current.hashes, current.prompt_tokens
        expected = cache.hit_blocks(hashes, length, size)
        low = high = expected
        if window_s > 0:
            while behind and behind[0].sent_at < t - window_s:
                earlier.update(behind.popleft().hashes)
            low = earlier.hit_blocks(hashes, length, size)
            k = 0
            while True:
                if k == len(ahead):
                    following = next(items, None)
                    if following is None:
                        break
                    ahead.append(following)
                if ahead[k].sent_at > t + window_s:
                    break
                # chain hashes: hashes[k] is in another's only as its own k-th, after a common prefix
                high = max(high, hit_blocks(hashes, set(ahead[k].hashes), length, size))
                k += 1
            behind.append(current)
        cache.update(hashes, expected)
        yield CacheCheck(
            request_id=current.request_id, sent_at=t, prompt_tokens=length,
            reported_prompt_tokens=current.reported_prompt_tokens, expected=expected * size,
            observed=current.observed, low=low * size, high=high * size,
        )  # fmt: skip


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
                             block_hashes(ids, server_block_size), len(ids))

    return list(send_order_checks(prompts(), server_block_size, reorder_window_ms))


def missing_rows(count: int, first: int) -> ValueError:
    """The error for records that name rows the trace does not have (`first`: in send order)."""
    return ValueError(f"{count} records name rows the trace does not have (first: request_id {first}); "
                      "is --trace the file the run replayed?")


class CacheTally:
    """The cache section's counts over checks added one at a time (none is kept but the worst)."""

    def __init__(self) -> None:
        self.checked = self.compared = self.expected = self.observed = 0
        self.matching = self.explained = self.prompt_mismatch = 0
        self._worst: list[tuple[tuple[int, int], CacheCheck]] = []  # a min-heap of ((|error|, -order), check)

    def add(self, c: CacheCheck) -> None:
        self.checked += 1
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

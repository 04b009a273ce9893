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
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from replay.protocol.table import sends_token_ids
from replay.results.records import Record
from replay.rules.prefix_cache import block_hashes, hit_blocks
from replay.synth.prompts import PromptSynthesizer
from replay.trace.fields import DEFAULT_BLOCK_SIZE
from replay.trace.prefix import ideal_hits
from replay.trace.record import TraceRow

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


def _scheduled(record: Record) -> bool:
    """Did the server take this request in (and so cache its prompt)?"""
    status = record.get("status") or 0
    return record.get("sent_at") is not None and (bool(record.get("ok")) or 200 <= status < 300)


def check_cache(
    records: Iterable[Record],
    rows: dict[int, TraceRow],
    synth: PromptSynthesizer,
    server_block_size: int,
    reorder_window_ms: float = 0.0,
) -> list[CacheCheck]:
    """A CacheCheck per request the server took in, in send order."""
    if server_block_size <= 0:
        raise ValueError(f"server block size must be positive, got {server_block_size}")
    sent = sorted((r for r in records if _scheduled(r)), key=lambda r: (r["sent_at"], r["request_id"]))
    missing = [r["request_id"] for r in sent if r["request_id"] not in rows]
    if missing:
        raise ValueError(f"{len(missing)} records name rows the trace does not have (first: request_id {missing[0]}); "
                         "is --trace the file the run replayed?")  # fmt: skip
    hashes = []
    lengths = []
    for r in sent:
        ids = synth.server_ids(rows[r["request_id"]])
        lengths.append(len(ids))
        hashes.append(block_hashes(ids, server_block_size))
    cache: set[int] = set()  # an infinite cache: every block hash ever scheduled
    earlier: set[int] = set()  # the same, for requests sent before the window
    window_s = reorder_window_ms / 1000.0
    checks = []
    behind = 0
    for i, r in enumerate(sent):
        t = r["sent_at"]
        expected = hit_blocks(hashes[i], cache, lengths[i], server_block_size)
        low = high = expected
        if window_s > 0:
            while sent[behind]["sent_at"] < t - window_s:
                earlier.update(hashes[behind])
                behind += 1
            low = hit_blocks(hashes[i], earlier, lengths[i], server_block_size)
            j = i + 1
            while j < len(sent) and sent[j]["sent_at"] <= t + window_s:
                # chain hashes: hashes[i][k] is in hashes[j] only as hashes[j][k], after a common prefix
                high = max(high, hit_blocks(hashes[i], set(hashes[j]), lengths[i], server_block_size))
                j += 1
        cache.update(hashes[i])
        checks.append(CacheCheck(
            request_id=r["request_id"], sent_at=t, prompt_tokens=lengths[i],
            reported_prompt_tokens=r.get("prompt_tokens"), expected=expected * server_block_size,
            observed=r.get("cached_tokens"), low=low * server_block_size, high=high * server_block_size,
        ))  # fmt: skip
    return checks


def summarize_cache(checks: list[CacheCheck], method: str, ideal: dict | None = None) -> dict:
    """design.md's cache section, plus the counts behind the share and the worst requests."""
    compared = [c for c in checks if c.observed is not None]
    expected = sum(c.expected for c in compared)
    observed = sum(c.observed for c in compared)
    matching = sum(c.matches for c in compared)
    explained = sum(c.explained for c in compared)
    worst = sorted((c for c in compared if not c.matches), key=lambda c: -abs(c.observed - c.expected))[:WORST]
    section = {
        "expected_cached_tokens": expected,
        "observed_cached_tokens": observed,
        "ratio": observed / expected if expected else None,
        "requests_matching_share": matching / len(compared) if compared else None,
        "requests_matching": matching,
        "requests_compared": len(compared),
        "requests_explained_by_reordering": explained - matching if explained > matching else 0,
        "requests_without_cached_tokens": len(checks) - len(compared),
        "requests_prompt_mismatch": sum(
            1 for c in checks if c.reported_prompt_tokens is not None and c.reported_prompt_tokens != c.prompt_tokens
        ),
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


def ideal_trace_hits(rows: list[TraceRow], block_size: int | None) -> dict:
    """The trace's own ideal (trace blocks, file order): what `replay trace stats` reports."""
    if not block_size:
        return {}
    _, _, tokens, total = ideal_hits(rows, block_size)
    return {"ideal_trace_cached_tokens": tokens, "ideal_trace_hit_ratio_tokens": tokens / total if total else None}


def cache_fidelity(
    records: list[Record],
    rows: list[TraceRow],
    *,
    tokenizer: str,
    chat_template: str | None,
    api: str,
    seed: int,
    trace_block_size: int | None,
    server_block_size: int,
    reorder_window_ms: float = 0.0,
    prompt_format: str = "text",
) -> tuple[dict, list[CacheCheck]]:
    """The cache section and the per-request checks of a run, from the run's own settings
    (what `replay report` and the end of a Locust run both call). `prompt_format` is the run's
    --prompt-format: token-id prompts are built the way the run built them (never encoded and
    fixed up), so the expected ids are the ids that were sent."""
    from replay.synth.tokenizer import ServerTokenizer

    token_ids = sends_token_ids(prompt_format)
    synth = PromptSynthesizer(ServerTokenizer.load(tokenizer, chat_template), api=api,
                              block_size=trace_block_size or DEFAULT_BLOCK_SIZE, seed=seed, token_ids=token_ids)  # fmt: skip
    checks = check_cache(records, {row.request_id: row for row in rows}, synth, server_block_size, reorder_window_ms)
    what = f"{api} token-id" if token_ids else api
    method = (f"re-synthesized {what} prompts ({Path(str(tokenizer)).name}, seed {seed}, trace block "
              f"{trace_block_size}) through an infinite vLLM-style cache of {server_block_size}-token blocks, "
              f"in send order")  # fmt: skip
    if reorder_window_ms:
        method += f"; sends within {reorder_window_ms:g} ms may swap"
    return summarize_cache(checks, method, ideal_trace_hits(rows, trace_block_size)), checks

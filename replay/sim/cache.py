"""A block-granular prefix cache that answers cached_tokens the way vLLM v1 does.

The hit rule (chained full-block hashes, never the last prompt token, whole blocks) is
replay.rules.prefix_cache's, shared with the fidelity check. So a 1978-token prompt sent twice
with block size 32 reports (1977 // 32) * 32 = 1952 cached tokens, as real vLLM on CPU does.

When blocks enter the cache: KVCacheManager.allocate_slots calls cache_blocks() for
every full block of the tokens it schedules, i.e. at scheduling, before the prefill has
run; a request scheduled in a later step already hits them. The sim schedules a whole
prompt at once (no chunked prefill), so all its full prompt blocks are inserted when the
request leaves the waiting queue.

Eviction (kept simple, stated here): the cache is an LRU of at most ``capacity`` block
hashes. Blocks a request uses are touched tail-first, so that, as in vLLM (which frees a
request's blocks in reverse order), the tail of a prefix is evicted before its head.
Blocks of running requests are not pinned, and output tokens are not cached (their
blocks could only match a prompt that repeats the generated text).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from replay.rules.prefix_cache import block_hashes, hit_blocks, hit_tokens

__all__ = ["PrefixCache", "block_hashes", "hit_blocks"]


class PrefixCache:
    def __init__(self, block_size: int, capacity: int):
        self.block_size = block_size
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def cached_tokens(self, token_ids: Sequence[int], hashes: Sequence[int] | None = None) -> int:
        """Tokens a new request would find cached (whole blocks, never the last token)."""
        if hashes is None:
            hashes = block_hashes(token_ids, self.block_size)
        hits = hit_blocks(hashes, self._blocks, len(token_ids), self.block_size)
        return hit_tokens(hits, self.block_size, len(token_ids))

    def schedule(self, token_ids: Sequence[int], hashes: Sequence[int] | None = None) -> int:
        """Look the prompt up, then insert all its full blocks; returns the cached tokens.
        `hashes`: the prompt's block_hashes, when the caller has them already."""
        if hashes is None:
            hashes = block_hashes(token_ids, self.block_size)
        cached = self.cached_tokens(token_ids, hashes)
        if self.capacity <= 0:
            return cached
        blocks = self._blocks
        for h in reversed(hashes[: self.capacity]):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)
        return cached

    def clear(self) -> None:
        self._blocks.clear()

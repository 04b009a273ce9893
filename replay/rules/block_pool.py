"""vLLM v1's KV block pool, the one model of a finite prefix cache: `replay sim` serves from it
and the cache model of a run's certificate (replay/results/cache_model.py) predicts with it, so
the two can be checked against each other.

What vLLM does (vllm/v1/core/block_pool.py BlockPool, kv_cache_utils.py FreeKVCacheBlockQueue,
single_type_kv_cache_manager.py), and so what this does:

- The pool has `num_gpu_blocks` blocks; one is the null block, never handed out, so
  `num_gpu_blocks - 1` hold KV. Every free block is in one queue, in eviction order; at the
  start all of them, in id order.
- A request, when scheduled, finds its cached prefix (replay.rules.prefix_cache's hit rule) and
  `touch`es those blocks: their reference count goes up, and a block nobody held (count 0, in
  the free queue) leaves the queue. Then it takes new blocks from the queue's head; a block
  taken that still holds a cached prefix block loses it (eviction). Its new full prompt blocks
  are cached under their chain hashes (cache_full_blocks), even a hash already cached by
  another block (vLLM does not de-duplicate; a lookup finds the first block cached under it).
- When it finishes, its blocks are freed in reverse order (the free queue's tail gets its last
  block first), so its tail is evicted before its head; a block still held by another request
  (count > 0) stays out of the queue: running requests' blocks are pinned.
- `reset` empties the cache only when no block is held, as vLLM's reset_prefix_cache.

What it simplifies, stated: a request takes all its blocks when scheduled, prompt and output
(vLLM takes decode blocks as it goes); its output blocks and its last partial prompt block are
never found by a later prompt (they could only match a prompt repeating the generated text);
and when the queue is empty it takes blocks beyond the pool (`overflow` counts them) where vLLM
would keep the request waiting.

Memory: a few numbers per block the pool has handed out, bounded by its size.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from replay.rules.prefix_cache import hit_blocks

__all__ = ["BlockPool"]


class BlockPool:
    """A pool of `num_gpu_blocks` KV blocks of `block_size` tokens (one of them vLLM's null
    block); requests `allocate` their blocks and `free` them, cached blocks are found by hash."""

    def __init__(self, block_size: int, num_gpu_blocks: int):
        if block_size < 1:
            raise ValueError(f"block size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.capacity = max(num_gpu_blocks - 1, 0)  # the null block holds nothing
        self.overflow = 0  # blocks handed out beyond the pool (vLLM would have kept a request waiting)
        self.evictions = 0  # cached blocks whose block was taken for another
        self._fresh = 0  # blocks never handed out are ids _fresh.. capacity-1: the queue's head
        self._ref: list[int] = []  # block id -> requests holding it
        self._hash: list[int | None] = []  # block id -> the prompt block it caches (None: nothing)
        self._free: OrderedDict[int, None] = OrderedDict()  # freed blocks, head evicted first
        self._cached: dict[int, int] = {}  # hash -> the first block cached under it
        self._copies: dict[int, list[int]] = {}  # hash -> later blocks cached under it too (rare)
        self._spare: list[int] = []  # ids of blocks taken beyond the pool, given back

    # -- what it holds -------------------------------------------------------------------------
    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._cached

    def __len__(self) -> int:
        """Cached prompt blocks (distinct hashes)."""
        return len(self._cached)

    @property
    def used(self) -> int:
        """Blocks held by requests (the pool's part of vLLM's kv_cache_usage_perc)."""
        return len(self._ref) - len(self._free) - len(self._spare)

    def usage(self) -> float:
        """vLLM's kv_cache_usage_perc: held blocks over the pool's blocks (the null one aside)."""
        return min(1.0, self.used / self.capacity) if self.capacity else 0.0

    def hit_blocks(self, hashes: Sequence[int], num_tokens: int) -> int:
        """Leading blocks of a prompt (`hashes`: its full blocks' chain hashes, `num_tokens` long)
        cached now."""
        return hit_blocks(hashes, self._cached, num_tokens, self.block_size)

    def holds(self, block_hash: int) -> bool:
        """Is the block cached under `block_hash` held by a running request (pinned)?"""
        block = self._cached.get(block_hash)
        return block is not None and self._ref[block] > 0

    # -- a request's life ----------------------------------------------------------------------
    def allocate(self, hashes: Sequence[int], num_tokens: int, total_blocks: int) -> tuple[int, list[int]]:
        """Schedule a request: its prompt is `num_tokens` long with full blocks `hashes`, and it
        needs `total_blocks` blocks in all (prompt and output). Returns (its cached leading
        blocks, the block ids it holds, in its own order: give them back to `free`)."""
        if not self.capacity:  # no pool: nothing is cached (a server without prefix caching)
            return 0, []
        hit = self.hit_blocks(hashes, num_tokens)
        blocks: list[int] = []
        ref, free = self._ref, self._free
        for h in hashes[:hit]:  # touch: before any new block is taken, so none of these is evicted
            block = self._cached[h]
            if ref[block] == 0:
                del free[block]
            ref[block] += 1
            blocks.append(block)
        for k in range(hit, max(total_blocks, len(hashes))):
            block = self._take()
            ref[block] = 1
            if k < len(hashes):
                self._cache(block, hashes[k])
            blocks.append(block)
        return hit, blocks

    def free(self, blocks: Sequence[int]) -> None:
        """A request ended: its blocks back, last first (evicted first). While the pool holds
        more than its size (blocks taken beyond it), a block given back leaves it instead."""
        ref, free = self._ref, self._free
        for block in reversed(blocks):
            ref[block] -= 1
            if ref[block] == 0:
                if len(ref) - len(self._spare) > self.capacity:
                    self._uncache(block, evicted=False)
                    self._spare.append(block)
                else:
                    free[block] = None

    def reset(self) -> bool:
        """Forget every cached block, as vLLM's reset_prefix_cache: only when no block is held
        (False, and nothing forgotten, otherwise)."""
        if self.used:
            return False
        self._cached.clear()
        self._copies.clear()
        self._hash = [None] * len(self._hash)
        return True

    # -- inside --------------------------------------------------------------------------------
    def _take(self) -> int:
        if self._fresh < self.capacity:
            block = self._fresh
            self._fresh += 1
        elif self._free:
            block, _ = self._free.popitem(last=False)
            self._uncache(block)
            return block
        else:
            self.overflow += 1
            if self._spare:
                return self._spare.pop()
            block = len(self._ref)
        self._ref.append(0)
        self._hash.append(None)
        return block

    def _cache(self, block: int, block_hash: int) -> None:
        self._hash[block] = block_hash
        if block_hash in self._cached:
            self._copies.setdefault(block_hash, []).append(block)
        else:
            self._cached[block_hash] = block

    def _uncache(self, block: int, evicted: bool = True) -> None:
        block_hash = self._hash[block]
        if block_hash is None:
            return
        self._hash[block] = None
        self.evictions += evicted
        copies = self._copies.get(block_hash)
        if self._cached.get(block_hash) == block:
            if copies:
                self._cached[block_hash] = copies.pop(0)
            else:
                del self._cached[block_hash]
        elif copies:
            copies.remove(block)
        if copies is not None and not copies:
            del self._copies[block_hash]

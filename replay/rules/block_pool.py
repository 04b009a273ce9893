"""vLLM v1's KV block pool, the one model of a finite prefix cache: `replay sim` serves from it
and the cache model of a run's certificate (replay/results/cache_model.py) predicts with it, so
the two can be checked against each other.

What vLLM does (vllm 0.32: vllm/v1/core/block_pool.py BlockPool, kv_cache_utils.py
FreeKVCacheBlockQueue, single_type_kv_cache_manager.py), and so what this does:

- The pool has `num_gpu_blocks` blocks; one is the null block, never handed out, so
  `num_gpu_blocks - 1` hold KV. Every free block is in one queue, in eviction order; at the
  start all of them, in id order.
- A request, when scheduled, finds its cached prefix (replay.rules.prefix_cache's hit rule) and
  `touch`es those blocks: their reference count goes up, and a block nobody held (count 0, in
  the free queue) leaves the queue. Then it takes new blocks from the queue's head; a block
  taken that still holds a cached block loses it (eviction). Its full blocks are cached under
  their chain hashes (cache_full_blocks), even a hash already cached by another block (vLLM
  does not de-duplicate; a lookup finds the first block cached under it).
- At its end it holds the KV of its prompt and of its output but the last token (the last one
  sampled is never fed back): `slots`. Its full blocks are cached, those holding output tokens
  too (under hashes no replayed prompt can match).
- When it finishes, its blocks are freed in reverse order (its tail first). A block still held
  by another request (count > 0) stays out of the queue: running requests' blocks are pinned.
  A freed block that caches nothing (its last, partial block) goes to the queue's head, to be
  reused first; a cached one to its tail (free_blocks: LIFO for those, LRU for cached ones), so
  a prefix's tail is evicted before its head.
- `reset` empties the cache only when no block is held, as vLLM's reset_prefix_cache.

What it simplifies, stated: a request takes all its blocks when scheduled, prompt and output
(vLLM takes decode blocks as it goes), and when the queue is empty it takes blocks beyond the
pool (`overflow` counts them) where vLLM would keep the request waiting.

Memory: a few numbers per block the pool has handed out, bounded by its size.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Final

from replay.rules.prefix_cache import hit_blocks

__all__ = ["BlockPool", "slots"]

class _Output(enum.Enum):
    OUTPUT = "output"


OUTPUT: Final = _Output.OUTPUT  # what a full block holding output tokens caches: no replayed prompt matches it


def slots(prompt_tokens: int, output_tokens: int) -> int:
    """Tokens whose KV a request holds at its end: its prompt and its output but the last token."""
    return max(prompt_tokens + output_tokens - 1, prompt_tokens)


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
        self.evictions = 0  # cached prompt blocks whose block was taken for another
        # The free queue, head first: blocks freed caching nothing (most recent first), then the
        # blocks never handed out (ids _fresh..capacity-1), then freed cached blocks (oldest first).
        self._head: deque[int] = deque()
        self._fresh = 0
        self._tail: OrderedDict[int, None] = OrderedDict()
        self._ref: list[int] = []  # block id -> requests holding it
        self._hash: list[int | _Output | None] = []  # block id -> the prompt block it caches (an int), OUTPUT, or None
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
        return len(self._ref) - len(self._head) - len(self._tail) - len(self._spare)

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
    def allocate(self, hashes: Sequence[int], num_tokens: int, output_tokens: int,
                 hit: int | None = None) -> tuple[int, list[int]]:
        """Schedule a request: its prompt is `num_tokens` long with full blocks `hashes`, and it
        will generate `output_tokens`. Returns (its cached leading blocks, the block ids it
        holds, in its own order: give them back to `free`). `hit`: its `hit_blocks`, when the
        caller has just asked (the pool unchanged since)."""
        if not self.capacity:  # no pool: nothing is cached (a server without prefix caching)
            return 0, []
        if hit is None:
            hit = self.hit_blocks(hashes, num_tokens)
        held = slots(num_tokens, output_tokens)
        full, total = held // self.block_size, -(-held // self.block_size)
        blocks: list[int] = []
        ref, tail, cached, hash_of = self._ref, self._tail, self._cached, self._hash
        for h in hashes[:hit]:  # touch: before any new block is taken, so none of these is evicted
            block = cached[h]
            if ref[block] == 0:
                del tail[block]
            ref[block] += 1
            blocks.append(block)
        n_hashes = len(hashes)
        head, copies = self._head, self._copies
        for k in range(hit, total):
            # _take, its two usual cases inline (a block freed caching nothing; the LRU cached one
            # whose hash no other block caches): the model's hot loop at heavy eviction
            if head:
                block = head.popleft()
            elif tail and self._fresh >= self.capacity:
                block, _ = tail.popitem(last=False)
                old = hash_of[block]
                if old is not None and old is not OUTPUT and old not in copies and cached.get(old) == block:
                    del cached[old]
                    hash_of[block] = None
                    self.evictions += 1
                else:
                    self._uncache(block)
            else:
                block = self._take()
            ref[block] = 1
            if k < n_hashes:
                h = hashes[k]
                hash_of[block] = h
                if h in cached:
                    self._copies.setdefault(h, []).append(block)
                else:
                    cached[h] = block
            elif k < full:
                hash_of[block] = OUTPUT
            blocks.append(block)
        return hit, blocks

    def free(self, blocks: Sequence[int]) -> None:
        """A request ended: its blocks back, last first. While the pool holds more than its size
        (blocks taken beyond it), a block given back leaves it instead."""
        ref, hash_of, tail, first = self._ref, self._hash, self._tail, []
        beyond = self._spare or len(ref) > self.capacity  # blocks beyond the pool exist (rare)
        for block in reversed(blocks):
            ref[block] -= 1
            if ref[block]:
                continue
            if beyond and len(ref) - len(self._spare) > self.capacity:
                self._uncache(block, evicted=False)
                self._spare.append(block)
                continue
            if hash_of[block] is None:
                first.append(block)
            else:
                tail[block] = None
        if first:
            self._head.extendleft(reversed(first))

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
        if self._head:
            return self._head.popleft()
        if self._fresh < self.capacity:
            block = self._fresh
            self._fresh += 1
        elif self._tail:
            block, _ = self._tail.popitem(last=False)
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

    def _uncache(self, block: int, evicted: bool = True) -> None:
        block_hash = self._hash[block]
        self._hash[block] = None
        if block_hash is None or block_hash is OUTPUT:
            return
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

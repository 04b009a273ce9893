"""replay/rules/block_pool.py's BlockPool (the sim's cache and the cache model's pool) against a
plain reference written the way vLLM's is (one free queue in an OrderedDict, a Python step per
block): a few thousand random requests with heavy eviction, requests running side by side (their
blocks pinned), frees in any order, hashes cached twice, a pool lending beyond its size, and
resets. The two must take, evict and cache exactly the same blocks."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from replay.rules.block_pool import BlockPool, slots
from replay.rules.prefix_cache import hit_blocks

OUT = "output"  # what the reference caches in a full block of output tokens


class ReferencePool:
    """vLLM's BlockPool and FreeKVCacheBlockQueue, step by step: the free queue holds every free
    block in eviction order (at first all, in id order); a request touches its hit blocks (out
    of the queue), takes the rest from the queue's front (uncaching what they cached), and at its
    end gives its blocks back last first: to the front when they cache nothing, to the back
    otherwise. With the queue empty it lends a block beyond the pool, which leaves again when
    given back while the pool holds more than its size."""

    def __init__(self, block_size: int, num_gpu_blocks: int):
        self.block_size, self.capacity = block_size, max(num_gpu_blocks - 1, 0)
        self.queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.capacity))
        self.ids = self.capacity  # block ids made so far
        self.ref: dict[int, int] = {}
        self.hash_of: dict[int, object] = {}
        self.cached: dict[int, list[int]] = {}  # hash -> the blocks caching it, the first one found
        self.spare: list[int] = []
        self.evictions = self.overflow = 0

    def hit(self, hashes, num_tokens: int) -> int:
        return hit_blocks(hashes, self.cached, num_tokens, self.block_size)

    def allocate(self, hashes, num_tokens: int, output_tokens: int) -> tuple[int, list[int]]:
        if not self.capacity:
            return 0, []
        hit = self.hit(hashes, num_tokens)
        held = slots(num_tokens, output_tokens)
        full, total = held // self.block_size, -(-held // self.block_size)
        blocks = []
        for h in hashes[:hit]:
            block = self.cached[h][0]
            if self.ref.get(block, 0) == 0:
                del self.queue[block]
            self.ref[block] = self.ref.get(block, 0) + 1
            blocks.append(block)
        for k in range(hit, total):
            if self.queue:
                block, _ = self.queue.popitem(last=False)
                self.uncache(block, evicted=True)
            else:
                self.overflow += 1
                if self.spare:
                    block = self.spare.pop()
                else:
                    block = self.ids
                    self.ids += 1
            self.ref[block] = 1
            if k < len(hashes):
                self.hash_of[block] = hashes[k]
                self.cached.setdefault(hashes[k], []).append(block)
            elif k < full:
                self.hash_of[block] = OUT
            blocks.append(block)
        return hit, blocks

    def free(self, blocks: list[int]) -> None:
        front = []
        for block in reversed(blocks):
            self.ref[block] -= 1
            if self.ref[block]:
                continue
            if self.ids - len(self.spare) > self.capacity:
                self.uncache(block, evicted=False)
                self.spare.append(block)
            elif self.hash_of.get(block) is None:
                front.append(block)
            else:
                self.queue[block] = None
        for block in reversed(front):
            self.queue[block] = None
            self.queue.move_to_end(block, last=False)

    def uncache(self, block: int, evicted: bool) -> None:
        h = self.hash_of.pop(block, None)
        if h is None or h == OUT:
            return
        self.evictions += evicted
        self.cached[h].remove(block)
        if not self.cached[h]:
            del self.cached[h]

    @property
    def used(self) -> int:
        return sum(1 for r in self.ref.values() if r)

    def reset(self) -> bool:
        if self.used:
            return False
        self.cached.clear()
        self.hash_of.clear()
        return True


def requests(rng: random.Random, count: int, size: int):
    """(hashes, prompt tokens, output tokens) of random requests: prompts on a few shared
    prefixes (chained hashes, so partial hits, and prompts cut inside a block) plus blocks of
    their own, some with a hash another chain has (a block cached twice), 0-12 output tokens."""
    prefixes = [[rng.randrange(1 << 40) for _ in range(rng.randint(1, 12))] for _ in range(30)]
    for i in range(count):
        hashes = rng.choice(prefixes)[: rng.randint(0, 12)] + [(1 << 50) + i * 20 + k for k in range(rng.randrange(6))]
        if hashes and rng.random() < 0.05:
            hashes[rng.randrange(len(hashes))] = rng.choice(rng.choice(prefixes))
        yield hashes, len(hashes) * size + rng.randrange(size), rng.randrange(13)


@pytest.mark.parametrize("seed, num_gpu_blocks", [(0, 40), (1, 150), (2, 400), (3, 1500), (4, 1)])
def test_the_pool_takes_evicts_and_caches_as_the_reference_does(seed, num_gpu_blocks):
    """Each request runs beside up to 12 others, which end in random order; now and then all end
    and the cache is reset (and once tried while requests run)."""
    rng = random.Random(seed)
    pool, ref = BlockPool(4, num_gpu_blocks), ReferencePool(4, num_gpu_blocks)
    running: list[tuple[list[int], list[int]]] = []
    copied = 0

    def end(k: int) -> None:
        mine, theirs = running.pop(k)
        pool.free(mine)
        ref.free(theirs)

    for hashes, tokens, output in requests(rng, 3000, 4):
        assert pool.hit_blocks(hashes, tokens) == ref.hit(hashes, tokens)
        got, want = pool.allocate(hashes, tokens, output), ref.allocate(hashes, tokens, output)
        assert got == want  # the same hit and the same block ids, in the same order
        running.append((got[1], want[1]))
        while len(running) > rng.randint(0, 12):
            end(rng.randrange(len(running)))
        if rng.random() < 0.003:
            assert pool.reset() == ref.reset()
            while running:
                end(rng.randrange(len(running)))
            assert pool.reset() and ref.reset()
        assert (pool.evictions, pool.overflow, pool.used, len(pool)) == (
            ref.evictions, ref.overflow, ref.used, len(ref.cached))
        assert all(h in pool for h in ref.cached)
        copied += bool(pool._copies)
    if num_gpu_blocks > 1:  # what it was meant to exercise happened
        assert pool.evictions > 500 and copied > 0

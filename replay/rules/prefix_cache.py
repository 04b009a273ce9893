"""vLLM v1's prefix-cache hit rule: which leading blocks of a prompt a server finds cached.

vLLM hashes each *full* block of prompt token ids chained to its parent block's hash
(vllm/v1/core/kv_cache_utils.py hash_block_tokens), so a block only matches when the
whole prefix before it matches too. A hit never covers the last prompt token:
vllm/v1/core/kv_cache_manager.py, KVCacheManager.get_computed_blocks sets
``max_cache_hit_length = request.num_tokens - 1`` ("we must recompute the last token to
obtain logits"), and the hit is counted in whole blocks.

Stated once because two stages must agree on it: the sim's cache (`sim/cache.py`) reports
cached_tokens by it, and the cache fidelity check (`results/fidelity.py`) predicts them by it.
"""

from __future__ import annotations

from collections.abc import Sequence


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chain hashes of the full blocks: hash i covers tokens [0, (i+1)*block_size)."""
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return hashes


def hit_blocks(hashes: Sequence[int], cached, num_tokens: int, block_size: int) -> int:
    """Leading blocks of a prompt found in `cached` (anything supporting `in`): the first miss
    ends the hit (chain hashes), and a hit never covers the last prompt token."""
    usable = max(num_tokens - 1, 0) // block_size
    hit = 0
    for h in hashes[:usable]:
        if h not in cached:
            break
        hit += 1
    return hit

"""What a prefix-cache hit is, the one definition: which leading blocks of a prompt a cache holds.

A block hits only when the whole prefix before it hit too: the first miss ends the hit (a
prefix chain, as vLLM's and SGLang's caches match), so a hit is a count of leading blocks, and
its tokens are those blocks' (`hit_tokens`). The same rule is applied to two kinds of block:

- a server's: blocks of prompt token ids (`block_hashes`, `hit_blocks`), below;
- a trace's: its hash ids, one a block (replay/trace/prefix.py: the ideal cache, an infinite one
  over what the trace says repeats, for `replay trace stats`, the live view and the fidelity
  check's ideal figure). A trace's last block may be partial and the hash ids say nothing of a
  last token, so the ideal cache has the chain rule and `hit_tokens`, not the last-token rule.

vLLM hashes each *full* block of prompt token ids chained to its parent block's hash
(vllm/v1/core/kv_cache_utils.py hash_block_tokens), so a block only matches when the
whole prefix before it matches too. A hit never covers the last prompt token:
vllm/v1/core/kv_cache_manager.py, KVCacheManager.get_computed_blocks sets
``max_cache_hit_length = request.num_tokens - 1`` ("we must recompute the last token to
obtain logits"), and the hit is counted in whole blocks.

Stated once because the stages must agree on it: the sim's cache (`sim/cache.py`) reports
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


def hit_tokens(hit_blocks: int, block_size: int, num_tokens: int) -> int:
    """Tokens covered by a prompt's first `hit_blocks` blocks: whole blocks, the last block of a
    prompt holding only the remainder."""
    return min(hit_blocks * block_size, num_tokens)


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

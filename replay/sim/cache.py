"""The sim's prefix cache: vLLM v1's block pool (replay.rules.block_pool), answering
cached_tokens as vLLM does.

The hit rule (chained full-block hashes, never the last prompt token, whole blocks) is
replay.rules.prefix_cache's, shared with the fidelity check. So a 1978-token prompt sent twice
with block size 32 reports (1977 // 32) * 32 = 1952 cached tokens, as real vLLM on CPU does.

When blocks enter the cache: KVCacheManager.allocate_slots calls cache_blocks() for every full
block of the tokens it schedules, i.e. at scheduling, before the prefill has run; a request
scheduled in a later step already hits them. The sim schedules a whole prompt at once (no
chunked prefill), so all its full prompt blocks are cached when the request leaves the waiting
queue, and it holds them (pinned) with its output blocks until it ends (Engine.finish frees
them, last block first, so a prefix's tail is evicted before its head).

`--cache-blocks` is the pool's size as vLLM's num_gpu_blocks: one block is vLLM's null block,
so `--cache-blocks - 1` blocks hold KV; 0 (or 1) caches nothing.
"""

from __future__ import annotations

from replay.rules.block_pool import BlockPool
from replay.rules.prefix_cache import block_hashes, hit_blocks, hit_tokens

__all__ = ["BlockPool", "block_hashes", "hit_blocks", "hit_tokens"]

"""The ideal prefix cache: what an infinite cache would hit, given the trace's block hash ids.

This is the one place that defines a "hit", so stats, the live UI and the cache-fidelity
report agree: block i of a row hits only if an earlier row had the same blocks 0..i
(a prefix chain, as vLLM's and SGLang's prefix caches match), not merely the same id.
"""

from __future__ import annotations

from typing import Iterable, Iterator

from replay.trace.record import TraceRow


def prefix_hits(rows: Iterable[TraceRow]) -> Iterator[int]:
    """For each row in order, how many of its leading blocks an infinite cache would hold.

    Rows without hash_ids yield 0 and add nothing to the cache.
    """
    children: dict[tuple[int, int], int] = {}  # (parent node, hash id) -> node; node 0 = empty prefix
    for row in rows:
        if not row.hash_ids:
            yield 0
            continue
        node = 0
        hits = 0
        ids = row.hash_ids
        for hash_id in ids:
            child = children.get((node, hash_id))
            if child is None:
                break
            node = child
            hits += 1
        for hash_id in ids[hits:]:
            child = len(children) + 1
            children[(node, hash_id)] = child
            node = child
        yield hits


def hit_tokens(row: TraceRow, hits: int, block_size: int) -> int:
    """Tokens covered by a row's first `hits` blocks; the last block holds the remainder."""
    return min(hits * block_size, row.input_length)


def ideal_hits(rows: list[TraceRow], block_size: int) -> tuple[int, int, int, int]:
    """(hit blocks, total blocks, hit tokens, total tokens) of an infinite prefix cache over
    `rows` in order. Rows without hash ids count as all-miss: they share nothing."""
    hit_blocks = total_blocks = hit_tok = total_tok = 0
    for row, hits in zip(rows, prefix_hits(rows)):
        hit_blocks += hits
        total_blocks += len(row.hash_ids) if row.hash_ids is not None else -(-row.input_length // block_size)
        hit_tok += hit_tokens(row, hits, block_size)
        total_tok += row.input_length
    return hit_blocks, total_blocks, hit_tok, total_tok

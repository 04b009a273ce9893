"""The ideal prefix cache: what an infinite cache would hit, given the trace's block hash ids.

A hit is replay.rules.prefix_cache's (its one definition): block i of a row hits only if an
earlier row had the same blocks 0..i, not merely the same id; here the chain is a trie of the
hash-id prefixes seen, and the hit's tokens are `rules.prefix_cache.hit_tokens`. Stats, the live
UI and the cache-fidelity report all count through this module.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from replay.rules import prefix_cache
from replay.trace.pairs import PairIndex
from replay.trace.record import TraceRow


class IdealCache:
    """An infinite prefix cache over hash ids: a trie of the prefixes seen so far, one entry
    per distinct (prefix, next id) pair in a PairIndex (about 24 bytes each), so it grows with
    a trace's distinct prefixes, never with its rows."""

    def __init__(self) -> None:
        self._children = PairIndex()  # (parent node, hash id) -> node; node 0 = empty prefix

    def __len__(self) -> int:
        """Distinct prefixes held (trie nodes other than the empty prefix)."""
        return len(self._children)

    def hits(self, hash_ids: tuple[int, ...]) -> int:
        """How many leading blocks of `hash_ids` the cache holds; then it holds them all."""
        hits, node = self._children.walk(0, hash_ids)
        if hits < len(hash_ids):
            self._children.add_chain(node, hash_ids[hits:])
        return hits


def prefix_hits(rows: Iterable[TraceRow]) -> Iterator[int]:
    """For each row in order, how many of its leading blocks an infinite cache would hold.

    Rows without hash_ids yield 0 and add nothing to the cache.
    """
    cache = IdealCache()
    for row in rows:
        yield cache.hits(row.hash_ids) if row.hash_ids else 0


def hit_tokens(row: TraceRow, hits: int, block_size: int) -> int:
    """Tokens covered by a row's first `hits` blocks (rules.prefix_cache.hit_tokens)."""
    return prefix_cache.hit_tokens(hits, block_size, row.input_length)


class IdealHits:
    """(hit blocks, total blocks, hit tokens, total tokens) of an infinite prefix cache over
    rows added in order, one at a time (a trace need not be held). Rows without hash ids count
    as all-miss: they share nothing."""

    def __init__(self) -> None:
        self.cache = IdealCache()
        self.hit_blocks = self.total_blocks = self.hit_tokens = self.total_tokens = 0

    def add(self, row: TraceRow, block_size: int) -> int:
        """Count `row` in; its hits (the leading blocks the cache held)."""
        hits = self.cache.hits(row.hash_ids) if row.hash_ids else 0
        self.hit_blocks += hits
        self.total_blocks += len(row.hash_ids) if row.hash_ids is not None else -(-row.input_length // block_size)
        self.hit_tokens += hit_tokens(row, hits, block_size)
        self.total_tokens += row.input_length
        return hits


def ideal_hits(rows: Iterable[TraceRow], block_size: int) -> tuple[int, int, int, int]:
    """IdealHits' four counts over `rows` in order."""
    ideal = IdealHits()
    for row in rows:
        ideal.add(row, block_size)
    return ideal.hit_blocks, ideal.total_blocks, ideal.hit_tokens, ideal.total_tokens

"""Blocks: the token ids and text standing for one hash id, the same on every machine.

A block is drawn from the safe vocabulary by SHAKE-256 keyed on (seed, namespace, key,
block_size): a standard extendable-output hash, so every process of every worker derives
the same words without Python's randomised hash() or a version-dependent PRNG. One call
yields the whole block, which keeps cold synthesis cheap.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import itemgetter, rshift

from replay.synth.vocab import SafeVocab

HASHED = b"h"  # blocks named by a trace hash id: shared by every row that carries the id
UNIQUE = b"u"  # blocks of one row only (rows without hash ids, or too few of them)
TOKEN_ID = "I" if array("I").itemsize == 4 else "L"  # array typecode of token ids
DRAWS = 1 << 16  # each token is one 16-bit draw, mapped through a table onto the vocabulary
BIG_ENDIAN = sys.byteorder == "big"


@dataclass(slots=True)
class Block:
    """One draw per token; the first always picks a lead-capable word, so any block can open a prompt.

    The text is made with the block; the token ids only when first asked for (BlockSource.ids),
    since most prompts are sent as text.
    """

    text: str
    draws: array  # the 16-bit draws behind the words
    ids: array | None = None


class _Draws:
    """A block's draws: SHAKE-256 of b"tracereplay-block-v1|seed|namespace|key|block_size", read
    as little-endian 16-bit numbers. The hash state of the material before the key is made
    once per namespace and copied for each block: formatting and hashing that constant prefix
    again for every block was a large share of a cold block's cost."""

    def __init__(self, seed: int, block_size: int) -> None:
        self._before_key = {namespace: hashlib.shake_256(b"tracereplay-block-v1|%d|%s|" % (seed, namespace))
                            for namespace in (HASHED, UNIQUE)}
        self._after_key = b"|%d" % block_size
        self._length = 2 * block_size

    def __call__(self, namespace: bytes, key: bytes) -> array:
        state = self._before_key[namespace].copy()
        state.update(key + self._after_key)
        draws = array("H", state.digest(self._length))
        if BIG_ENDIAN:
            draws.byteswap()
        return draws


_last_tables: tuple[SafeVocab, tuple[Sequence, ...]] | None = None  # a process's BlockSources share one vocabulary


def _tables(vocab: SafeVocab) -> tuple[Sequence, ...]:
    """Draw -> word tables (ids, texts, lead ids, lead texts, lead server ids), built by C-level
    gathers (per-element Python over every draw of 5 tables cost a BlockSource's set-up most
    of its time: docs/bench/2026-11-28-figures.md) and
    shared by the BlockSources of one vocabulary (the run's and the server check's, reseeded).
    The tables are only read, so sharing them is safe. Draw r picks word (r * size) >> 16, each
    computed by `map` over C functions, not a Python loop. The ids' table is an array: a block's
    ids (`BlockSource.ids`, every block a run's end checks) read contiguous numbers from it,
    not int objects strewn over the heap, which the CPU's caches no longer hold by then; the
    others are the gathers' own tuples."""
    global _last_tables
    if _last_tables is not None and _last_tables[0] is vocab:
        return _last_tables[1]
    size, leads = len(vocab), vocab.lead_count
    words = itemgetter(*map(rshift, range(0, DRAWS * size, size), repeat(16)))
    lead_words = itemgetter(*map(rshift, range(0, DRAWS * leads, leads), repeat(16)))
    tables = (array(TOKEN_ID, words(vocab.ids)), words(vocab.texts), lead_words(vocab.ids), lead_words(vocab.texts),
              lead_words(vocab.lead_ids))
    _last_tables = (vocab, tables)
    return tables


class BlockSource:
    """Makes blocks of `block_size` tokens and keeps the recently used hashed ones.

    Lookup tables from a 16-bit draw straight to a word's id and text make a block two
    C-level gathers and a join, with no per-token Python arithmetic.
    """

    def __init__(self, vocab: SafeVocab, block_size: int, seed: int = 0, cache_blocks: int = 8192):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.vocab = vocab
        self.block_size = block_size
        self.seed = seed
        self.cache_blocks = cache_blocks
        self._cache: OrderedDict[int, Block] = OrderedDict()
        self._draws = _Draws(seed, block_size)
        self._ids, self._texts, self._lead_ids, self._lead_texts, self._lead_server_ids = _tables(vocab)
        self.hits = 0
        self.misses = 0

    def make(self, namespace: bytes, key: bytes) -> Block:
        """A fresh block (no cache): the first word from the lead-capable words, the rest from all."""
        draws = self._draws(namespace, key)
        return Block(self.prefix_text_of(draws, len(draws)), draws)

    def ids(self, block: Block, count: int | None = None) -> array:
        """The ids of the block's first `count` tokens (all by default), as they sit inside a prompt."""
        if block.ids is None:
            draws = block.draws
            block.ids = array(TOKEN_ID, map(self._ids.__getitem__, draws))  # one C-level pass
            block.ids[0] = self._lead_ids[draws[0]]
        return block.ids if count is None or count >= len(block.ids) else block.ids[:count]

    def lead_id(self, block: Block) -> int:
        """The id the block's first word has when it opens a prompt (written without its space)."""
        return self._lead_server_ids[block.draws[0]]

    def prefix_text(self, block: Block, count: int) -> str:
        """Text of the block's first `count` tokens: a partial last block is a prefix of the whole."""
        if count >= len(block.draws):
            return block.text
        return self.prefix_text_of(block.draws, count)

    def prefix_text_of(self, draws: array, count: int) -> str:
        if count <= 0:
            return ""
        text = self._lead_texts[draws[0]]
        if count == 1:
            return text
        if count == 2:
            return text + self._texts[draws[1]]
        return text + "".join(itemgetter(*draws[1:count])(self._texts))

    def copy(self, cache_blocks: int) -> BlockSource:
        """A source of the same blocks that starts with this one's cache (the blocks themselves
        shared: they are only read, and each one's ids, made when first asked, are the same
        whoever makes them) and keeps its own from then on, of `cache_blocks`."""
        other = BlockSource(self.vocab, self.block_size, self.seed, cache_blocks)
        other._cache = OrderedDict(self._cache)
        return other

    def hashed(self, hash_id: int) -> Block:
        cache = self._cache
        block = cache.get(hash_id)
        if block is not None:
            self.hits += 1
            cache.move_to_end(hash_id)
            return block
        self.misses += 1
        block = self.make(HASHED, b"%d" % hash_id)
        cache[hash_id] = block
        if len(cache) > self.cache_blocks:
            cache.popitem(last=False)
        return block

    def unique(self, request_id: int, index: int) -> Block:
        """A block no other row can have: keyed on the row and the block's place in it."""
        return self.make(UNIQUE, b"%d.%d" % (request_id, index))

    def clear(self) -> None:
        self._cache.clear()

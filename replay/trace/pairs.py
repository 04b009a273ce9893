"""PairIndex: a set of pairs of integers held in flat arrays, for what grows with a trace's
distinct hash ids (the ideal cache's prefixes, the distinct ids of `replay trace stats`).

A Python set or dict costs 70-200 bytes an entry (the int objects, the tuples, the table); a
2,000,000-row trace has millions of distinct ids. Here a pair costs 16 bytes in two arrays plus
4-8 in the open-addressing table (kept at most half full): 20-24 bytes. Exact: pairs are compared
whole, hashing only picks where to look.
"""

from __future__ import annotations

from array import array

_INITIAL_SLOTS = 1 << 10
_TWO_63 = 1 << 63
_TWO_64 = 1 << 64


class PairIndex:
    """Pairs (a, b), a in [0, 2^62) and b a hash id, which JSON gives in [-2^63, 2^64) (orjson
    reads longer integers as floats, which to_hash_ids refuses), each numbered 1, 2, ... in the
    order added (0: absent). b is held as a signed 64-bit value, its top half folded below zero
    and told apart by a's lowest bit (2a, or 2a + 1 when folded)."""

    def __init__(self) -> None:
        self._first = array("q", [0])  # per number; number 0 is no pair
        self._second = array("q", [0])
        self._slots = array("I", bytes(4 * _INITIAL_SLOTS))  # number of the pair there, 0: empty
        self._mask = _INITIAL_SLOTS - 1

    def __len__(self) -> int:
        return len(self._first) - 1

    def find(self, a: int, b: int) -> int:
        """The number of (a, b), or 0 when it was never added."""
        found, number = self.walk(a, (b,))
        return number if found else 0

    def walk(self, a: int, bs: tuple[int, ...]) -> tuple[int, int]:
        """(how many of `bs` chain from `a`, the number of the last pair found, else a): bs[0]
        pairs with a, each next one with the number of the pair before; the ideal cache's hit
        walk in one call (a call a block was most of the walk's cost)."""
        slots, first, second, mask = self._slots, self._first, self._second, self._mask
        found = 0
        for b in bs:
            key = 2 * a
            if b >= _TWO_63:
                b -= _TWO_64
                key += 1
            slot = hash((key, b)) & mask
            while number := slots[slot]:
                if second[number] == b and first[number] == key:
                    break
                slot = (slot + 1) & mask
            else:
                return found, a
            a = number
            found += 1
        return found, a

    def leading(self, a: int, bs, limit: int) -> int:
        """How many of bs[:limit] pair with `a` (each with the same `a`, not chained), up to the
        first that does not: `walk`'s probe for a set of ids (replay.results.fidelity.BlockSet),
        in one call."""
        slots, first, second, mask = self._slots, self._first, self._second, self._mask
        found = 0
        for b in bs[:limit]:
            key = 2 * a
            if b >= _TWO_63:
                b -= _TWO_64
                key += 1
            slot = hash((key, b)) & mask
            while number := slots[slot]:
                if second[number] == b and first[number] == key:
                    break
                slot = (slot + 1) & mask
            else:
                return found
            found += 1
        return found

    def add_new(self, a: int, bs) -> None:
        """Add each (a, b) of `bs` not held yet: `find` then `add` in one call (a new pair
        goes to the empty slot its search ended at)."""
        first, second = self._first, self._second
        for b in bs:
            key = 2 * a
            if b >= _TWO_63:
                b -= _TWO_64
                key += 1
            slots, mask = self._slots, self._mask
            slot = hash((key, b)) & mask
            while number := slots[slot]:
                if second[number] == b and first[number] == key:
                    break
                slot = (slot + 1) & mask
            else:
                self._place(key, b, slot)

    def add_chain(self, a: int, bs) -> int:
        """Number the pairs of a chain `walk` stopped short of: bs[0] with `a`, each next one
        with the number of the pair before (so none of them is held yet); the last number (`a`
        when `bs` is empty). `add` a pair at a time, in one call."""
        for b in bs:
            key = 2 * a
            if b >= _TWO_63:
                b -= _TWO_64
                key += 1
            slots, mask = self._slots, self._mask
            slot = hash((key, b)) & mask
            while slots[slot]:
                slot = (slot + 1) & mask
            a = self._place(key, b, slot)
        return a

    def _place(self, key: int, b: int, slot: int) -> int:
        """Number the pair (key, b), held as stored, in the empty `slot` its search ended at."""
        number = len(self._first)
        self._first.append(key)
        self._second.append(b)
        if 2 * number > self._mask:
            self._grow()
        else:
            self._slots[slot] = number
        return number

    def second(self, number: int) -> int:
        """The b of pair `number` (1, 2, ...), as it was added."""
        b = self._second[number]
        return b + _TWO_64 if self._first[number] & 1 else b

    def add(self, a: int, b: int) -> int:
        """Number a pair that `find` did not find (adding a pair twice numbers it twice)."""
        return self.add_chain(a, (b,))

    def _grow(self) -> None:
        """Twice the slots, every pair placed again (numbers do not change)."""
        size = 2 * (self._mask + 1)
        slots = self._slots = array("I", bytes(4 * size))
        mask = self._mask = size - 1
        for number, pair in enumerate(zip(self._first, self._second)):
            if number:
                slot = hash(pair) & mask
                while slots[slot]:
                    slot = (slot + 1) & mask
                slots[slot] = number

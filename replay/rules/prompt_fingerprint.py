"""A prompt's fingerprint: direct evidence of what a worker sent, compared with what the trace says.

A worker keeps, in each record (`prompt_fingerprint`, docs/records.md), the CRC-32 of the
prompt's content as it was built into the request body, taken at a few checkpoints: after the
content's first 1, 2, 4, 8, ... trace blocks, and at its end. Each checkpoint is a pair
[server tokens from the prompt's start, CRC-32 of the content up to there], so a 30,000-token
prompt of 16-token blocks keeps a dozen pairs, not a hash per block. The CRC is chained
(zlib's crc32 takes the previous value), so every checkpoint costs one pass over the content.

The cache section's child re-synthesizes the same row from the run's spec (seed, hash ids,
block size, the tokenizer's set-up) and compares (`agreed_tokens`): where every checkpoint
agrees, the sent prompt is the trace's; where one differs, the sent prompt agreed with the
trace's up to the last agreeing checkpoint at least, and differs before the first differing one.

What is hashed: a text prompt's content as UTF-8, a token-id prompt's content ids as 4-byte
little-endian numbers, a row's own messages (and tools) as their JSON; the frame a template puts
around the content is the server's, not the replay's, and is only counted in the positions.
"""

from __future__ import annotations

import math
import sys
import zlib
from array import array
from collections.abc import Sequence

Fingerprint = list[list[int]]  # [[server tokens from the prompt's start, CRC-32 of the content to there], ...]


def checkpoints(count: int) -> list[int]:
    """The block counts a content of `count` blocks is hashed after: 1, 2, 4, ... below `count`, then `count`."""
    out, k = [], 1
    while k < count:
        out.append(k)
        k *= 2
    if count > 0:
        out.append(count)
    return out


def text_fingerprint(parts: Sequence[str], offset: int, block_size: int, tokens: int) -> Fingerprint:
    """The fingerprint of a content made of `parts` (one per trace block of `block_size`
    tokens, the last maybe partial; `tokens` in all), which starts `offset` server tokens into
    the prompt."""
    out, crc, start = [], 0, 0
    for end in checkpoints(len(parts)):
        crc = zlib.crc32("".join(parts[start:end]).encode(), crc)
        out.append([offset + min(end * block_size, tokens), crc])
        start = end
    return out or [[offset, 0]]


def ids_fingerprint(ids: array, offset: int, block_size: int) -> Fingerprint:
    """The fingerprint of a content of token ids `ids` (4-byte items), `offset` server tokens into the prompt."""
    if sys.byteorder == "big":
        ids = array(ids.typecode, ids)
        ids.byteswap()
    view = memoryview(ids)
    out, crc, start = [], 0, 0
    for end in checkpoints(-(-len(ids) // block_size)):
        stop = min(end * block_size, len(ids))
        crc = zlib.crc32(view[start:stop], crc)
        out.append([offset + stop, crc])
        start = stop
    return out or [[offset, 0]]


def whole_fingerprint(data: bytes, tokens: int) -> Fingerprint:
    """One checkpoint at the prompt's end (`tokens`): a prompt with no blocks of the trace's
    (a row's own messages, a content fixed up by encoding)."""
    return [[tokens, zlib.crc32(data)]]


def agreed_tokens(sent: Sequence[Sequence[int]] | None, spec: Sequence[Sequence[int]]) -> float | None:
    """Up to how many server tokens from its start the prompt `sent` (a record's fingerprint) is
    proven to be the trace's (`spec`, the re-synthesis's): math.inf when every checkpoint agrees,
    else the position of the last agreeing checkpoint (0: not even the first). None: the record
    has no fingerprint (a run from before it), so nothing is proven either way. Raises ValueError
    for a fingerprint of another shape (a record edited by hand): no proof either way, said."""
    if sent is None:
        return None
    if not isinstance(sent, list) or not all(
            isinstance(pair, list) and len(pair) == 2 and all(type(x) is int for x in pair) for pair in sent):
        raise ValueError(f"prompt_fingerprint {str(sent)[:60]}: expected [[tokens, crc32], ...], whole numbers")
    agreed = 0
    for mine, theirs in zip(sent, spec):
        if list(mine) != list(theirs):
            return agreed
        agreed = mine[0]
    return math.inf if len(sent) == len(spec) else agreed

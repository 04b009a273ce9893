"""The tokens the sim answers with: ordinary words of the server's own tokenizer.

Only tokens made of the space marker and ASCII letters are used, so every output token
decodes to " word" and re-encodes to itself: a client counting output tokens with the
same tokenizer gets the number the server reports.
"""

from __future__ import annotations

import orjson

from replay.synth.tokenizer import ServerTokenizer
from replay.synth.vocab import word_tokens

MAX_WORDS = 4096


class OutputVocabulary:
    def __init__(self, tokenizer: ServerTokenizer):
        # plain lowercase words of 2 to 12 letters read best as answer text
        words = [(i, text) for i, text in word_tokens(tokenizer.tokenizer) if 3 <= len(text) <= 13 and text.islower()]
        if not words:
            raise ValueError(f"tokenizer {tokenizer.name}: no ordinary word tokens to answer with")
        words = words[:MAX_WORDS]
        self.ids: list[int] = [i for i, _ in words]
        self.text: dict[int, str] = dict(words)
        # JSON string literals (quotes included), so streaming can splice them into fixed frames.
        self.json: dict[int, bytes] = {i: orjson.dumps(t) for i, t in self.text.items()}

    def decode(self, ids: list[int]) -> str:
        text = self.text
        return "".join(text[i] for i in ids)

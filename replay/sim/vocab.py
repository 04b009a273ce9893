"""The tokens the sim answers with: ordinary words of the server's own tokenizer.

Only tokens made of the space marker and ASCII letters are used, so every output token
decodes to " word" and re-encodes to itself: a client counting output tokens with the
same tokenizer gets the number the server reports.
"""

from __future__ import annotations

import re

import orjson

from replay.synth.tokenizer import ServerTokenizer

# Byte-level BPE (GPT-2, Qwen2, Llama 3) marks a leading space with "Ġ"; SentencePiece with "▁".
_WORD = re.compile(r"^[\u0120\u2581][a-z]{2,12}$")
MAX_WORDS = 4096


class OutputVocabulary:
    def __init__(self, tokenizer: ServerTokenizer):
        specials = {t.content for t in tokenizer.tokenizer.get_added_tokens_decoder().values()}
        vocab = tokenizer.tokenizer.get_vocab(with_added_tokens=False)
        words = sorted((i, tok) for tok, i in vocab.items() if _WORD.match(tok) and tok not in specials)
        if not words:
            raise ValueError(f"tokenizer {tokenizer.name}: no ordinary word tokens to answer with")
        words = words[:MAX_WORDS]
        self.ids: list[int] = [i for i, _ in words]
        self.text: dict[int, str] = {i: " " + tok[1:] for i, tok in words}
        # JSON string literals (quotes included), so streaming can splice them into fixed frames.
        self.json: dict[int, bytes] = {i: orjson.dumps(t) for i, t in self.text.items()}

    def decode(self, ids: list[int]) -> str:
        text = self.text
        return "".join(text[i] for i in ids)

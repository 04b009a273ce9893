"""How vLLM counts a prompt's tokens: whether the tokenizer's own special tokens are added.

Chat: the rendered chat template already holds every special token it wants (BOS included),
so vLLM encodes it with add_special_tokens=False. Completions text: vLLM encodes with the
tokenizer's specials (e.g. BOS). synth's ServerTokenizer (the counts the replay promises) and
the sim's encoder (the counts the reference server reports) both ask here.
"""

from __future__ import annotations

CHAT_ADD_SPECIAL_TOKENS = False
TEXT_ADD_SPECIAL_TOKENS = True

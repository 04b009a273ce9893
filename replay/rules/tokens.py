"""How vLLM counts a prompt's tokens: whether the tokenizer's own special tokens are added.

Chat: the rendered chat template already holds every special token it wants (BOS included),
so vLLM encodes it with add_special_tokens=False. Completions text: vLLM encodes with the
tokenizer's specials (e.g. BOS). synth's ServerTokenizer (the counts the replay promises) and
the sim's encoder (the counts the reference server reports) both ask here, as do the readers
of token-id lists (a server's /tokenize answer, the set-up cache).
"""

from __future__ import annotations

from array import array

CHAT_ADD_SPECIAL_TOKENS = False
TEXT_ADD_SPECIAL_TOKENS = True


def are_token_ids(value) -> bool:
    """Whether `value` is a list of non-negative ints, checked at C speed: an array of C ints
    takes only ints that fit in 31 bits and a sign (a vocabulary's ids in a fraction of the time
    a check element by element takes)."""
    try:
        return isinstance(value, list) and (not value or min(array("i", value)) >= 0)
    except (TypeError, OverflowError, ValueError):
        return False

"""Prompt token ids by vLLM's rules, without freezing the server on long prompts.

A prompt of tens of thousands of tokens takes a while to encode; done inline it would stall every stream the
sim is pacing (visible as a fake ITL spike in the replay's records). Long texts are encoded
in gevent's thread pool with encode_batch, which releases the GIL, so the hub keeps
serving. The special-token rule is replay.rules.tokens', as ServerTokenizer's (tests check the
counts agree): chat text is the rendered template without added specials, completions text
gets the specials.
"""

from __future__ import annotations

from gevent import get_hub

from replay.rules.tokens import CHAT_ADD_SPECIAL_TOKENS, TEXT_ADD_SPECIAL_TOKENS
from replay.synth.tokenizer import ServerTokenizer

# Below this many characters the thread hop costs more than the stall it avoids.
OFFLOAD_CHARS = 8000


def _encode(tokenizer: ServerTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    hf = tokenizer.tokenizer
    if len(text) < OFFLOAD_CHARS:
        return hf.encode(text, add_special_tokens=add_special_tokens).ids
    batch = get_hub().threadpool.apply(hf.encode_batch, ([text],), {"add_special_tokens": add_special_tokens})
    return batch[0].ids


def chat_ids(tokenizer: ServerTokenizer, messages: list[dict], tools: list | None,
             chat_template_kwargs: dict | None = None) -> list[int]:
    return _encode(tokenizer, tokenizer.render_chat(messages, tools, chat_template_kwargs),
                   add_special_tokens=CHAT_ADD_SPECIAL_TOKENS)


def text_ids(tokenizer: ServerTokenizer, text: str, add_special_tokens: bool = TEXT_ADD_SPECIAL_TOKENS) -> list[int]:
    """A completions text's ids; `add_special_tokens` other than the rule only where a request asks
    (vLLM's /tokenize takes it)."""
    return _encode(tokenizer, text, add_special_tokens=add_special_tokens)

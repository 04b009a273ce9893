"""What the server puts around a prompt's content, measured once per tokenizer, template and api.

A synthesized prompt counts len(before) + content tokens + len(after) because the frame is
located in a server-encoded probe and then proven on probe contents of many lengths. With the
safe vocabulary, this is everything PromptSynthesizer learns from the tokenizer before its
first prompt (`Measured`): a pure function of the tokenizer.json, the chat template and the
api, which is why replay/synth/setup_cache.py can keep it on disk.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from replay.protocol.table import get_api
from replay.synth.tokenizer import ChatTemplateError, ServerTokenizer
from replay.synth.vocab import SafeVocab

PROBE_LENGTHS = (8, 1, 2, 3, 5, 17, 64, 257)
# How a synthesized chat prompt is laid out as messages. The first is what most clients send;
# the second (an empty system message) replaces a template's default system prompt, which
# lets rows shorter than that prompt still be exact (Qwen's adds 29 tokens, this 13).
USER_ONLY = ("user",)
EMPTY_SYSTEM = ("system", "user")
PROBE_SEED = 0xF4A3E


class PromptError(ValueError):
    """Exact prompts cannot be built for this tokenizer / template / api."""


@dataclass(frozen=True, slots=True)
class Frame:
    """The tokens a server puts around the content: before + content + after, always."""

    before: tuple[int, ...]
    after: tuple[int, ...]
    # an empty content's prompt as the server encodes it (templates may strip or merge): a row
    # shorter than the frame is sent so, and its ids are known without loading the tokenizer
    empty_ids: tuple[int, ...]

    @property
    def overhead(self) -> int:
        return len(self.before) + len(self.after)

    @property
    def empty_tokens(self) -> int:
        """What an empty content really counts."""
        return len(self.empty_ids)


@dataclass(frozen=True, slots=True)
class Measured:
    """A tokenizer + template + api's set-up: the safe vocabulary and the frames.

    frame_error is set when no frame can be proven (a template that touches the content):
    `frame` is then only an estimate of the right size and each prompt must be encoded and
    fixed up. empty_text_ids is the completions prompt of an empty text (its specials).
    """

    vocab: SafeVocab
    frame: Frame
    short_frame: Frame | None  # the empty-system layout's, when smaller (chat only)
    frame_error: str | None
    empty_text_ids: tuple[int, ...]


def chat_messages(layout: tuple[str, ...], content: str) -> list[dict]:
    """The layout's messages, with the content in the user message and empty others."""
    return [{"role": role, "content": content if role == "user" else ""} for role in layout]


def server_encoder(tokenizer: ServerTokenizer, api: str, layout: tuple[str, ...]):
    if get_api(api).chat:
        return lambda content: tokenizer.encode_chat(chat_messages(layout, content))
    return tokenizer.encode_text


def probe(vocab: SafeVocab, rng: random.Random, length: int) -> tuple[str, list[int]]:
    """A random content of `length` safe words: its text (first word bare) and its server ids."""
    first = rng.randrange(vocab.lead_count)
    rest = [rng.randrange(len(vocab)) for _ in range(length - 1)]
    text = vocab.texts[first][1:] + "".join(vocab.texts[i] for i in rest)
    return text, [vocab.lead_ids[first]] + [vocab.ids[i] for i in rest]


def _find(haystack: list[int], needle: list[int]) -> int:
    for start in range(len(haystack) - len(needle) + 1):
        if haystack[start : start + len(needle)] == needle:
            return start
    return -1


def measure_frame(tokenizer: ServerTokenizer, api: str, vocab: SafeVocab, layout: tuple[str, ...] = USER_ONLY) -> Frame:
    """Locate the content inside a server-encoded probe, then prove the frame on other lengths."""
    encode = server_encoder(tokenizer, api, layout)
    rng = random.Random(PROBE_SEED)
    what = _what(tokenizer, api, layout)
    text, ids = probe(vocab, rng, PROBE_LENGTHS[0])
    encoded = encode(text)
    start = _find(encoded, ids)
    if start < 0:
        raise PromptError(f"{what}: the content's tokens change when framed by the server; cannot build exact prompts")
    frame = Frame(tuple(encoded[:start]), tuple(encoded[start + len(ids) :]), tuple(encode("")))
    for length in PROBE_LENGTHS[1:]:
        text, ids = probe(vocab, rng, length)
        if encode(text) != [*frame.before, *ids, *frame.after]:
            raise PromptError(f"{what}: a {length}-word content does not encode to before + content + after")
    return frame


def _what(tokenizer: ServerTokenizer, api: str, layout: tuple[str, ...]) -> str:
    """The tokenizer, api and template a frame is measured for, as messages name them."""
    what = f"{tokenizer.name} ({api}"
    if get_api(api).chat:
        what += f", template {tokenizer.chat_template.sha256[:12]}, messages {'+'.join(layout)}"
    return what + ")"


def _estimated_frame(tokenizer: ServerTokenizer, api: str, vocab: SafeVocab) -> Frame:
    """A frame of the right size with unknown tokens, for templates that touch the content.
    A template that renders none of the content is refused (PromptError): no fix-up can give a
    prompt its row's length, and the replay would send every one of them the template's."""
    encode = server_encoder(tokenizer, api, USER_ONLY)
    text, ids = probe(vocab, random.Random(PROBE_SEED), PROBE_LENGTHS[0])
    framed, empty = len(encode(text)), tuple(encode(""))
    if framed == len(empty):
        raise PromptError(f"the chat template renders none of the messages' content "
                          f"({_what(tokenizer, api, USER_ONLY)}); no prompt can be given its row's length")
    return Frame((), (0,) * max(0, framed - len(ids)), empty)


def _short_frame(tokenizer: ServerTokenizer, api: str, vocab: SafeVocab, frame: Frame) -> Frame | None:
    """The empty-system layout's frame when it is smaller (templates with a default system prompt)."""
    try:
        short = measure_frame(tokenizer, api, vocab, EMPTY_SYSTEM)
    except (PromptError, ChatTemplateError):  # e.g. a template that refuses system messages
        return None
    return short if short.overhead < frame.overhead else None


def measure(tokenizer: ServerTokenizer, api: str, vocab: SafeVocab) -> Measured:
    """Everything a PromptSynthesizer measures of `tokenizer` for `api` (a few ms past the vocabulary)."""
    try:
        frame, error = measure_frame(tokenizer, api, vocab), None
    except PromptError as err:
        frame, error = _estimated_frame(tokenizer, api, vocab), str(err)
    spec = get_api(api)
    short = _short_frame(tokenizer, api, vocab, frame) if spec.chat and error is None else None
    empty = tuple(tokenizer.encode_text("")) if spec.token_ids else ()
    return Measured(vocab, frame, short, error, empty)

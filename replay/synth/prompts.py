"""Prompts of exactly input_length server tokens that share exactly the trace's prefixes.

Exactness comes from construction, not from encoding each prompt (a tokenizer encodes about
300k tokens/s, far below what a load generator must synthesize):

- content is a run of safe-vocabulary words whose text re-encodes to the same ids in any
  concatenation (replay/synth/vocab.py), so each block's text is computed once and joined;
- what the server adds around the content (chat template, BOS) is measured once as fixed
  token lists before and after the content (a `Frame`), and proven on probe contents of
  many lengths, so a prompt's count is len(before) + content tokens + len(after);
- the content is the row's blocks concatenated and cut at the end, so a shared prefix of
  hash ids is a shared prefix of tokens.

`replay prompts check` and the tests re-encode prompts to confirm it. A template that does
touch the content (no frame can be proven) falls back to encoding each prompt and moving the
content's end until the count is right (`verified`, slow); rows shorter than the frame get an
empty content and count in `warnings`. The first word of a content is written without its
space: templates strip content (Llama 3's `| trim`, Llama 2's `.strip()`) and sentencepiece
adds the space back itself.
"""

from __future__ import annotations

import logging
import random
import weakref
from array import array
from dataclasses import dataclass

from replay.synth.blocks import TOKEN_ID, BlockSource
from replay.synth.tokenizer import ChatTemplateError, ServerTokenizer
from replay.synth.vocab import SafeVocab, build_safe_vocab
from replay.trace.record import TraceRow

APIS = ("openai-chat", "openai-completions", "tgi")
PROBE_LENGTHS = (8, 1, 2, 3, 5, 17, 64, 257)
# How a synthesized chat prompt is laid out as messages. The first is what most clients send;
# the second (an empty system message) replaces a template's default system prompt, which
# lets rows shorter than that prompt still be exact (Qwen's adds 29 tokens, this 13).
USER_ONLY = ("user",)
EMPTY_SYSTEM = ("system", "user")
PROBE_SEED = 0xF4A3E
FIX_UP_ROUNDS = 8

log = logging.getLogger(__name__)
_vocab_cache: "weakref.WeakKeyDictionary[ServerTokenizer, SafeVocab]" = weakref.WeakKeyDictionary()


class PromptError(ValueError):
    """Exact prompts cannot be built for this tokenizer / template / api."""


@dataclass(slots=True)
class Prompt:
    messages: list[dict] | None  # openai-chat: [{"role": "user", "content": text}] (or the row's own messages)
    text: str | None  # openai-completions text prompt / tgi inputs
    token_ids: list[int] | None  # openai-completions token-id prompt
    expected_tokens: int  # prompt tokens the server will count
    tools: list | None = None  # the row's own tools (chat), sent along with its messages


@dataclass(frozen=True, slots=True)
class Frame:
    """The tokens a server puts around the content: before + content + after, always."""

    before: tuple[int, ...]
    after: tuple[int, ...]
    empty_tokens: int  # what an empty content really counts (templates may strip or merge)

    @property
    def overhead(self) -> int:
        return len(self.before) + len(self.after)


def safe_vocab(tokenizer: ServerTokenizer) -> SafeVocab:
    """The tokenizer's safe vocabulary, built once per loaded tokenizer (it takes about a second)."""
    vocab = _vocab_cache.get(tokenizer)
    if vocab is None:
        vocab = build_safe_vocab(tokenizer.tokenizer, tokenizer.name)
        _vocab_cache[tokenizer] = vocab
    return vocab


def chat_messages(layout: tuple[str, ...], content: str) -> list[dict]:
    """The layout's messages, with the content in the user message and empty others."""
    return [{"role": role, "content": content if role == "user" else ""} for role in layout]


def _server_encoder(tokenizer: ServerTokenizer, api: str, layout: tuple[str, ...]):
    if api == "openai-chat":
        return lambda content: tokenizer.encode_chat(chat_messages(layout, content))
    return tokenizer.encode_text


def encode_prompt(tokenizer: ServerTokenizer, prompt: Prompt) -> list[int]:
    """A prompt's token ids as vLLM sees them: chat rendered, text with specials, ids as given."""
    if prompt.messages is not None:
        return tokenizer.encode_chat(prompt.messages, prompt.tools)
    if prompt.token_ids is not None:
        return list(prompt.token_ids)
    return tokenizer.encode_text(prompt.text or "")


def server_count(tokenizer: ServerTokenizer, prompt: Prompt) -> int:
    """Prompt tokens as vLLM counts them."""
    return len(encode_prompt(tokenizer, prompt))


def _probe(vocab: SafeVocab, rng: random.Random, length: int) -> tuple[str, list[int]]:
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
    encode = _server_encoder(tokenizer, api, layout)
    rng = random.Random(PROBE_SEED)
    what = f"{tokenizer.name} ({api}"
    if api == "openai-chat":
        what += f", template {tokenizer.chat_template.sha256[:12]}, messages {'+'.join(layout)}"
    what += ")"
    text, ids = _probe(vocab, rng, PROBE_LENGTHS[0])
    encoded = encode(text)
    start = _find(encoded, ids)
    if start < 0:
        raise PromptError(f"{what}: the content's tokens change when framed by the server; cannot build exact prompts")
    frame = Frame(tuple(encoded[:start]), tuple(encoded[start + len(ids) :]), len(encode("")))
    for length in PROBE_LENGTHS[1:]:
        text, ids = _probe(vocab, rng, length)
        if encode(text) != [*frame.before, *ids, *frame.after]:
            raise PromptError(f"{what}: a {length}-word content does not encode to before + content + after")
    return frame


class PromptSynthesizer:
    """Prompts for trace rows, for one tokenizer, api and trace block size.

    Deterministic: the same (seed, hash id, block_size) gives the same words in any process.
    """

    def __init__(
        self,
        tokenizer: ServerTokenizer,
        api: str = "openai-chat",
        block_size: int = 512,
        seed: int = 0,
        token_ids: bool = False,
        cache_blocks: int = 8192,
    ):
        if api not in APIS:
            raise PromptError(f"unknown api {api!r}; expected one of {', '.join(APIS)}")
        if token_ids and api != "openai-completions":
            raise PromptError("token-id prompts are only for openai-completions")
        if api == "openai-chat" and tokenizer.chat_template is None:
            raise PromptError(f"tokenizer {tokenizer.name} has no chat template; pass --chat-template")
        self.tokenizer = tokenizer
        self.api = api
        self.block_size = block_size
        self.seed = seed
        self.token_ids = token_ids
        self.vocab = safe_vocab(tokenizer)
        self.blocks = BlockSource(self.vocab, block_size, seed, cache_blocks)
        # verified: the frame could not be proven, so each prompt is encoded and fixed up (slow)
        self.verified = False
        try:
            self.frame = measure_frame(tokenizer, api, self.vocab)
        except PromptError as err:
            if token_ids:
                raise
            self.frame = self._estimated_frame()
            self.verified = True
            log.warning("%s; each prompt will be encoded and fixed up instead (about 300k tokens/s)", err)
        self.short_frame = self._short_frame() if api == "openai-chat" and not self.verified else None
        self.template_overhead_tokens = self.frame.overhead
        # rows longer than this are always exact; shorter ones get an empty content and a warning
        self.min_overhead_tokens = min(self.frame.overhead, self.short_frame.overhead if self.short_frame else 1 << 30)
        self.warnings = 0

    def _estimated_frame(self) -> Frame:
        """A frame of the right size with unknown tokens, for templates that touch the content."""
        encode = _server_encoder(self.tokenizer, self.api, USER_ONLY)
        text, ids = _probe(self.vocab, random.Random(PROBE_SEED), PROBE_LENGTHS[0])
        overhead = max(0, len(encode(text)) - len(ids))
        return Frame((), (0,) * overhead, len(encode("")))

    def _short_frame(self) -> Frame | None:
        """The empty-system layout's frame when it is smaller (templates with a default system prompt)."""
        try:
            frame = measure_frame(self.tokenizer, self.api, self.vocab, EMPTY_SYSTEM)
        except (PromptError, ChatTemplateError):  # e.g. a template that refuses system messages
            return None
        return frame if frame.overhead < self.frame.overhead else None

    def _layout(self, row: TraceRow) -> tuple[Frame, tuple[str, ...], int]:
        """The frame and message layout a row is built with, and its content tokens (<= 0: the
        row is shorter than any frame). The empty-system layout only serves rows too short for
        the usual one."""
        n = row.input_length - self.frame.overhead
        if n <= 0 and self.short_frame is not None:
            return self.short_frame, EMPTY_SYSTEM, row.input_length - self.short_frame.overhead
        return self.frame, USER_ONLY, n

    def prompt(self, row: TraceRow) -> Prompt:
        if row.messages is not None:
            return self._given(row)
        frame, layout, n = self._layout(row)
        if n <= 0:
            return self._too_short(row)
        if layout is EMPTY_SYSTEM:
            return Prompt(chat_messages(EMPTY_SYSTEM, self._content_text(row, n)), None, None, row.input_length)
        if self.verified:
            return self._fixed_up(row, n)
        if self.token_ids:
            ids = array(TOKEN_ID, frame.before)
            ids += self._content_ids(row, n)
            ids.extend(frame.after)
            return Prompt(None, None, ids.tolist(), len(ids))
        return self.text_prompt(self._content_text(row, n), row.input_length)

    def server_ids(self, row: TraceRow) -> list[int]:
        """The row's prompt as the server's token ids. Built from the proven frame where prompts
        are built that way (as fast as synthesis); encoded otherwise (own messages, rows shorter
        than the frame, templates that touch the content)."""
        if row.messages is None and not self.verified:
            frame, _, n = self._layout(row)
            if n > 0:
                return [*frame.before, *self._content_ids(row, n), *frame.after]
        return encode_prompt(self.tokenizer, self.prompt(row))

    def text_prompt(self, text: str, expected: int) -> Prompt:
        """`text` as the api's prompt: the user message of a chat, or a completions/tgi text."""
        if self.api == "openai-chat":
            return Prompt([{"role": "user", "content": text}], None, None, expected)
        return Prompt(None, text, None, expected)

    def _fixed_up(self, row: TraceRow, n: int) -> Prompt:
        """Encode, then move the content's end by the difference; where a merge at the end makes
        the count jump over the target, try the untried lengths nearest to the last one."""
        tried: set[int] = set()
        best = None
        for _ in range(FIX_UP_ROUNDS):
            tried.add(n)
            prompt = self.text_prompt(self._content_text(row, n), 0)
            prompt.expected_tokens = server_count(self.tokenizer, prompt)
            error = prompt.expected_tokens - row.input_length
            if error == 0:
                return prompt
            if best is None or abs(error) < abs(best.expected_tokens - row.input_length):
                best = prompt
            step = n - error
            if step in tried or step <= 0:
                step = next((c for d in range(1, 4) for c in (n - d, n + d) if c > 0 and c not in tried), 0)
            if step <= 0:
                break
            n = step
        self.warnings += 1
        return best

    def _row_blocks(self, row: TraceRow, n: int):
        """(block, tokens used) for the blocks covering n content tokens; the last may be partial."""
        hash_ids = row.hash_ids or ()
        size = self.blocks.block_size
        full, part = divmod(n, size)
        for index in range(full + (1 if part else 0)):
            if index < len(hash_ids):
                block = self.blocks.hashed(hash_ids[index])
            else:
                block = self.blocks.unique(row.request_id, index)
            yield block, size if index < full else part

    def _content_text(self, row: TraceRow, n: int) -> str:
        size = self.blocks.block_size
        prefix_text = self.blocks.prefix_text
        parts = [block.text if used == size else prefix_text(block, used) for block, used in self._row_blocks(row, n)]
        parts[0] = parts[0][1:]  # the first word goes bare: templates strip, sentencepiece re-adds the space
        return "".join(parts)

    def _content_ids(self, row: TraceRow, n: int) -> array:
        ids = array(TOKEN_ID)
        lead = None
        for block, used in self._row_blocks(row, n):
            if lead is None:
                lead = self.blocks.lead_id(block)
            ids += self.blocks.ids(block, used)
        ids[0] = lead
        return ids

    def _too_short(self, row: TraceRow) -> Prompt:
        frame, layout = self.frame, USER_ONLY
        if self.short_frame is not None:
            frame, layout = self.short_frame, EMPTY_SYSTEM
        expected = frame.empty_tokens
        if expected != row.input_length:
            self.warnings += 1
            if self.warnings == 1:
                log.warning(
                    "row %d (line %d): input_length %d is below the %d tokens the %s frame adds; sending an empty "
                    "content (%d tokens). Further such rows are counted in `warnings`.",
                    row.request_id, row.line, row.input_length, frame.overhead, self.api, expected,
                )
        if self.token_ids:
            ids = self.tokenizer.encode_text("")
            return Prompt(None, None, ids, len(ids))
        if self.api == "openai-chat":
            return Prompt(chat_messages(layout, ""), None, None, expected)
        return Prompt(None, "", None, expected)

    def _given(self, row: TraceRow) -> Prompt:
        """A row with its own messages is sent as it is, counted by the server's rule."""
        tok = self.tokenizer
        tools = row.tools or None  # an empty list is not sent (bodies.py), so the server renders tools=None
        if self.api == "openai-chat":
            return Prompt(row.messages, None, None, tok.count_chat(row.messages, tools), tools)
        if tok.chat_template is not None:
            text = tok.render_chat(row.messages, tools)
        else:
            text = "\n".join(str(m.get("content") or "") for m in row.messages)
        if self.token_ids:
            ids = tok.encode_text(text)
            return Prompt(None, None, ids, len(ids))
        return Prompt(None, text, None, tok.count_text(text))

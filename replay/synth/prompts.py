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

import copy
import logging
import weakref
from array import array
from collections.abc import Callable

import orjson

from replay.protocol.prompt import Prompt
from replay.protocol.table import API_NAMES, APIS, prompt_format_problem
from replay.rules.prompt_fingerprint import Fingerprint, ids_fingerprint, text_fingerprint, whole_fingerprint
from replay.synth import setup_cache
from replay.synth.blocks import TOKEN_ID, BlockSource
from replay.synth.frames import EMPTY_SYSTEM, USER_ONLY, Frame, Measured, PromptError, chat_messages, measure
from replay.synth.tokenizer import ServerTokenizer
from replay.synth.vocab import SafeVocab, build_safe_vocab

__all__ = ["Prompt", "PromptError", "PromptSynthesizer", "encode_prompt", "safe_vocab", "server_count",
           "set_up"]
from replay.trace.fields import DEFAULT_BLOCK_SIZE
from replay.trace.record import TraceRow

FIX_UP_ROUNDS = 8
RESEEDED_CACHE_BLOCKS = 256  # a reseeded synthesizer makes a few dozen prompts
# Test only (docs/testing.md): the hash id whose block a worker's prompts get wrong on purpose
BREAK_BLOCK_ENV = "TRACEREPLAY_TEST_BREAK_BLOCK"

log = logging.getLogger(__name__)
PAUSE_BLOCKS = 32  # a long content is made in runs of this many blocks (~0.5 ms), `pause` called between


_vocab_cache: weakref.WeakKeyDictionary[ServerTokenizer, SafeVocab] = weakref.WeakKeyDictionary()


def safe_vocab(tokenizer: ServerTokenizer) -> SafeVocab:
    """The tokenizer's safe vocabulary, built once per loaded tokenizer (it takes about a second)."""
    vocab = _vocab_cache.get(tokenizer)
    if vocab is None:
        vocab = build_safe_vocab(tokenizer.tokenizer, tokenizer.name)
        _vocab_cache[tokenizer] = vocab
    return vocab


def set_up(tokenizer: ServerTokenizer, api: str) -> tuple[Measured, bool]:
    """The tokenizer's set-up for `api` and whether it came from the disk cache: read from it
    when a verified entry is there, else measured (and saved for the next process), in a child
    process when that spares this one loading the tokenizer (replay/synth/setup_child.py).
    A chat api needs a template: refused here, before a child process is started for nothing."""
    if getattr(APIS.get(api), "chat", False) and tokenizer.chat_template is None:
        raise PromptError(f"tokenizer {tokenizer.name} has no chat template; pass --chat-template")
    measured, from_cache = setup_cache.cached(tokenizer, api, lambda: measure(tokenizer, api, safe_vocab(tokenizer)))
    _vocab_cache.setdefault(tokenizer, measured.vocab)
    return measured, from_cache


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


_FRAME_WARNED: set[str] = set()  # the frame problems this process has warned of


class PromptSynthesizer:
    """Prompts for trace rows, for one tokenizer, api and trace block size.

    Deterministic: the same (seed, hash id, block_size) gives the same words in any process.
    """

    def __init__(
        self,
        tokenizer: ServerTokenizer,
        api: str = "openai-chat",
        block_size: int = DEFAULT_BLOCK_SIZE,
        seed: int = 0,
        token_ids: bool = False,
        cache_blocks: int = 8192,
    ):
        spec = APIS.get(api)
        if spec is None:
            raise PromptError(f"unknown api {api!r}; expected one of {', '.join(API_NAMES)}")
        if token_ids and (problem := prompt_format_problem("token-ids", api)):
            raise PromptError(problem)
        self.tokenizer = tokenizer
        self.api = api
        self.chat = spec.chat  # prompts are a chat's messages (else a text)
        self.block_size = block_size
        self.seed = seed
        self.token_ids = token_ids
        measured, self.set_up_from_cache = set_up(tokenizer, api)
        if measured.frame_error is not None and token_ids:
            raise PromptError(measured.frame_error)
        self.vocab = measured.vocab
        self.blocks = BlockSource(self.vocab, block_size, seed, cache_blocks)
        self.frame = measured.frame
        # verified: the frame could not be proven, so each prompt is encoded and fixed up (slow)
        problem = measured.frame_error
        self.verified = problem is not None
        if problem is not None and problem not in _FRAME_WARNED:  # once a process (a run sets up twice)
            _FRAME_WARNED.add(problem)
            log.warning("%s by reusing one frame; prompts stay exact: each is encoded and fixed up instead "
                        "(slower, about 300k tokens/s)", problem)
        self.short_frame = measured.short_frame
        self._empty_text_ids = list(measured.empty_text_ids)
        self.template_overhead_tokens = self.frame.overhead
        # rows longer than this are always exact; shorter ones get an empty content and a warning
        self.min_overhead_tokens = min(self.frame.overhead, self.short_frame.overhead if self.short_frame else 1 << 30)
        self.warnings = 0

    def reseeded(self, seed: int) -> PromptSynthesizer:
        """The same set-up (vocabulary, frames) with blocks of another seed: prompts of the same
        shapes that share no block with this synthesizer's (the server check's sample)."""
        other = copy.copy(self)
        other.seed = seed
        other.blocks = BlockSource(self.vocab, self.block_size, seed, RESEEDED_CACHE_BLOCKS)
        other.warnings = 0
        return other

    def with_blocks_of(self, cache_blocks: int) -> PromptSynthesizer:
        """The same set-up, seed and blocks, starting from a copy of the blocks this one made
        (BlockSource.copy), without this one's test hook (break_block): a run's end makes the
        spec's prompts again with it, to check the sent ones against, without making every
        block a second time."""
        other = copy.copy(self)
        other.__dict__.pop("_row_blocks", None)  # break_block's swap
        other.blocks = self.blocks.copy(cache_blocks)
        other.warnings = 0
        return other

    def _layout(self, row: TraceRow) -> tuple[Frame, tuple[str, ...], int]:
        """The frame and message layout a row is built with, and its content tokens (<= 0: the
        row is shorter than any frame). The empty-system layout only serves rows too short for
        the usual one."""
        n = row.input_length - self.frame.overhead
        if n <= 0 and self.short_frame is not None:
            return self.short_frame, EMPTY_SYSTEM, row.input_length - self.short_frame.overhead
        return self.frame, USER_ONLY, n

    def prompt(self, row: TraceRow, pause: Callable[[], None] | None = None) -> Prompt:
        """`row`'s prompt. `pause`: called after each PAUSE_BLOCKS blocks of a content made from
        blocks, so that a caller on an event loop lets sends go between parts of a long prompt
        (replay.engine.lookahead); the prompt is the same."""
        if row.messages is not None:
            prompt = self._given(row)
            prompt.fingerprint = whole_fingerprint(orjson.dumps([row.messages, prompt.tools]), prompt.expected_tokens)
            return prompt
        frame, layout, n = self._layout(row)
        if n <= 0:
            prompt = self._too_short(row)
            prompt.fingerprint = whole_fingerprint(b"", prompt.expected_tokens)
            return prompt
        if layout is EMPTY_SYSTEM:
            text, fingerprint = self._content(row, n, len(frame.before), pause)
            prompt = Prompt(chat_messages(EMPTY_SYSTEM, text), None, None, row.input_length)
        elif self.verified:
            prompt = self._fixed_up(row, n)
            fingerprint = whole_fingerprint(self._sent_text(prompt).encode(), prompt.expected_tokens)
        elif self.token_ids:
            content = self._content_ids(row, n, pause)
            fingerprint = ids_fingerprint(content, len(frame.before), self.blocks.block_size)
            ids = array(TOKEN_ID, frame.before)
            ids += content
            ids.extend(frame.after)
            prompt = Prompt(None, None, ids.tolist(), len(ids))
        else:
            text, fingerprint = self._content(row, n, len(frame.before), pause)
            prompt = self.text_prompt(text, row.input_length)
        prompt.fingerprint = fingerprint
        return prompt

    @staticmethod
    def _sent_text(prompt: Prompt) -> str:
        """The text a text prompt sends: its user message's content, or its text."""
        return prompt.messages[-1]["content"] if prompt.messages is not None else prompt.text or ""

    def server_ids(self, row: TraceRow) -> list[int]:
        """The row's prompt as the server's token ids. Built from the proven frame where prompts
        are built that way (as fast as synthesis); encoded otherwise (own messages, rows shorter
        than the frame, templates that touch the content)."""
        if row.messages is None and not self.verified:
            frame, _, n = self._layout(row)
            if n > 0:
                return [*frame.before, *self._content_ids(row, n), *frame.after]
            if self.token_ids:  # shorter than the frame: an empty content (_too_short), known from the set-up
                return list(self._empty_text_ids)
            return list((self.short_frame or self.frame).empty_ids)
        return encode_prompt(self.tokenizer, self.prompt(row))

    def server_ids_and_fingerprint(self, row: TraceRow) -> tuple[list[int], Fingerprint]:
        """(`server_ids(row)`, `prompt(row).fingerprint`): where prompts are made from the
        proven frame, the row's blocks are walked once for both (the cache section checks every
        sent prompt so)."""
        if row.messages is None and not self.verified:
            frame, layout, n = self._layout(row)
            if n > 0:
                offset = len(frame.before)
                if layout is EMPTY_SYSTEM or not self.token_ids:
                    parts, content = self._content_parts_and_ids(row, n)
                    fingerprint = text_fingerprint(parts, offset, self.blocks.block_size, n)
                else:
                    content = self._content_ids(row, n)
                    fingerprint = ids_fingerprint(content, offset, self.blocks.block_size)
                return [*frame.before, *content, *frame.after], fingerprint
            ids = self.server_ids(row)  # shorter than the frame: an empty content (_too_short)
            return ids, whole_fingerprint(b"", len(ids) if self.token_ids else (self.short_frame or self.frame).empty_tokens)
        prompt = self.prompt(row)
        assert prompt.fingerprint is not None  # prompt() sets it on every prompt
        return self.server_ids(row), prompt.fingerprint

    def text_prompt(self, text: str, expected: int) -> Prompt:
        """`text` as the api's prompt: the user message of a chat, or a completions/tgi text."""
        if self.chat:
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

    def break_block(self, hash_id: int) -> None:
        """Test only ($TRACEREPLAY_TEST_BREAK_BLOCK, read once where a worker sets up): block
        `hash_id` gets, in every row, that row's own words of the same length, so the prompts
        keep their lengths but stop sharing it (a replay bug the fidelity certificate must
        catch: prompt-differs). Costs nothing unless called: it swaps the method."""
        plain = self._row_blocks

        def broken(row: TraceRow, n: int, pause: Callable[[], None] | None = None):
            hash_ids = row.hash_ids or ()
            for index, (block, used) in enumerate(plain(row, n, pause)):
                if index < len(hash_ids) and hash_ids[index] == hash_id:
                    block = self.blocks.unique(row.request_id, index)
                yield block, used

        self._row_blocks = broken

    def _row_blocks(self, row: TraceRow, n: int, pause: Callable[[], None] | None = None):
        """(block, tokens used) for the blocks covering n content tokens; the last may be partial.
        `pause()` is called after every PAUSE_BLOCKS blocks (a prompt's steps: `prompt`)."""
        hash_ids = row.hash_ids or ()
        blocks = self.blocks
        size = blocks.block_size
        full, part = divmod(n, size)
        for index in range(full + (1 if part else 0)):
            if index < len(hash_ids):
                block = blocks.hashed(hash_ids[index])
            else:
                block = blocks.unique(row.request_id, index)
            yield block, size if index < full else part
            if pause is not None and (index + 1) % PAUSE_BLOCKS == 0:
                pause()

    def _content_parts(self, row: TraceRow, n: int, pause: Callable[[], None] | None = None) -> list[str]:
        """The content's text, one part per trace block."""
        size = self.blocks.block_size
        prefix_text = self.blocks.prefix_text
        parts = [block.text if used == size else prefix_text(block, used)
                 for block, used in self._row_blocks(row, n, pause)]
        parts[0] = parts[0][1:]  # the first word goes bare: templates strip, sentencepiece re-adds the space
        return parts

    def _content_text(self, row: TraceRow, n: int) -> str:
        return "".join(self._content_parts(row, n))

    def _content(self, row: TraceRow, n: int, offset: int,
                 pause: Callable[[], None] | None = None) -> tuple[str, list]:
        """The content's text and its fingerprint (`offset`: the frame's tokens before it)."""
        parts = self._content_parts(row, n, pause)
        return "".join(parts), text_fingerprint(parts, offset, self.blocks.block_size, n)

    def _content_ids(self, row: TraceRow, n: int, pause: Callable[[], None] | None = None) -> array:
        ids = array(TOKEN_ID)
        lead = None
        for block, used in self._row_blocks(row, n, pause):
            if lead is None:
                lead = self.blocks.lead_id(block)
            ids += self.blocks.ids(block, used)
        ids[0] = lead
        return ids

    def _content_parts_and_ids(self, row: TraceRow, n: int) -> tuple[list[str], array]:
        """`_content_parts` and `_content_ids` of one walk over the blocks."""
        blocks = self.blocks
        size, prefix_text, block_ids = blocks.block_size, blocks.prefix_text, blocks.ids
        parts: list[str] = []
        ids = array(TOKEN_ID)
        lead = 0
        for block, used in self._row_blocks(row, n):
            if not parts:
                lead = blocks.lead_id(block)
            parts.append(block.text if used == size else prefix_text(block, used))
            ids += block_ids(block, used)
        parts[0] = parts[0][1:]
        ids[0] = lead
        return parts, ids

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
            ids = list(self._empty_text_ids)
            return Prompt(None, None, ids, len(ids))
        if self.chat:
            return Prompt(chat_messages(layout, ""), None, None, expected)
        return Prompt(None, "", None, expected)

    def _given(self, row: TraceRow) -> Prompt:
        """A row with its own messages is sent as it is, counted by the server's rule."""
        tok = self.tokenizer
        tools = row.tools or None  # an empty list is not sent (apis/openai.py), so the server renders tools=None
        if self.chat:
            return Prompt(row.messages, None, None, tok.count_chat(row.messages, tools), tools)
        if tok.chat_template is not None:
            text = tok.render_chat(row.messages, tools)
        else:
            text = "\n".join(str(m.get("content") or "") for m in row.messages)
        if self.token_ids:
            ids = tok.encode_text(text)
            return Prompt(None, None, ids, len(ids))
        return Prompt(None, text, None, tok.count_text(text))

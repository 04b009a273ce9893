"""Which session a recorded request belongs to, and its turn.

A chat request whose messages begin with an earlier request's messages followed by that
request's answer is that session's next turn (exact: the client sent the conversation back).
A completions prompt that begins with an earlier prompt followed by its answer is the same.
A client that names its sessions (a header, or the OpenAI `user` field: `replay record
--session-header`, `--session-user`) is taken at its word instead. Only salted digests of the
conversations are held, never their text, and at most MAX_STATES of them (the oldest go first).
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from replay.record.hashing import BlockHasher

MAX_STATES = 1_000_000  # conversations remembered; about 100 bytes each
MAX_PROMPT_LENGTHS = 256  # distinct completions prompt+answer lengths looked for in a new prompt


@dataclass
class Turn:
    session: int
    turn: int
    previous_end: float | None  # when the previous turn's answer ended (unix s); None: first turn


@dataclass
class _State:
    session: int
    turn: int
    end: float


def _text(content) -> str:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def _message_key(message) -> bytes:
    """What of a message makes a conversation the same: its role, text and tool calls (the ids the
    server gave its tool calls are kept: a client sends them back as they came)."""
    if not isinstance(message, dict):
        return orjson.dumps(message, option=orjson.OPT_SORT_KEYS)
    calls = message.get("tool_calls") or None
    if calls is not None:
        calls = [c.get("function", c) if isinstance(c, dict) else c for c in calls]
    return orjson.dumps([message.get("role"), _text(message.get("content")), calls], option=orjson.OPT_SORT_KEYS)


class Sessions:
    """The sessions of one recording. `chat`/`completions` find a request's session and turn;
    `answered` remembers its conversation with the answer, for the next turn to find."""

    def __init__(self, hasher: BlockHasher):
        self.hasher = hasher
        self.states: dict[bytes, _State] = {}
        self.named: dict[bytes, _State] = {}  # by the client's own session name (digest)
        self.prompt_lengths: dict[int, None] = {}  # completions prompt+answer lengths, newest last
        self.count = 0

    def _new(self) -> int:
        self.count += 1
        return self.count - 1

    def _remember(self, table: dict[bytes, _State], key: bytes, state: _State) -> None:
        table.pop(key, None)
        table[key] = state
        if len(table) > MAX_STATES:
            del table[next(iter(table))]

    def by_name(self, name: str, arrival: float) -> tuple[Turn, bytes]:
        """The session the client named: its turns in arrival order."""
        key = self.hasher.digest(b"name\0" + name.encode())
        state = self.named.get(key)
        if state is None:
            turn = Turn(self._new(), 0, None)
        else:
            turn = Turn(state.session, state.turn + 1, state.end)
        self._remember(self.named, key, _State(turn.session, turn.turn, arrival))
        return turn, key

    def named_answered(self, key: bytes, end: float) -> None:
        state = self.named.get(key)
        if state is not None:
            state.end = max(state.end, end)

    def chat(self, messages: list) -> tuple[Turn, bytes]:
        """(the request's session and turn, its conversation's digest for `answered`)."""
        digest = self.hasher.digest(b"chat\0")
        found: _State | None = None
        for message in messages:  # the longest earlier conversation plus its answer that this one begins with
            digest = self.hasher.digest(digest + _message_key(message))
            if isinstance(message, dict) and message.get("role") == "assistant":
                found = self.states.get(digest, found)
        return self._turn(found), digest

    def chat_answered(self, digest: bytes, turn: Turn, answer: dict, end: float) -> None:
        self._remember(self.states, self.hasher.digest(digest + _message_key(answer)),
                       _State(turn.session, turn.turn, end))

    def completions(self, prompt: str) -> tuple[Turn, bytes]:
        found = None
        for length in sorted((n for n in self.prompt_lengths if n <= len(prompt)), reverse=True):
            state = self.states.get(self.hasher.digest(b"text\0" + prompt[:length].encode()))
            if state is not None:
                found = state
                break
        return self._turn(found), prompt.encode()

    def completions_answered(self, prompt: bytes, turn: Turn, answer: str, end: float) -> None:
        whole = prompt + answer.encode()
        length = len(whole.decode())
        self.prompt_lengths.pop(length, None)
        self.prompt_lengths[length] = None
        if len(self.prompt_lengths) > MAX_PROMPT_LENGTHS:
            del self.prompt_lengths[next(iter(self.prompt_lengths))]
        self._remember(self.states, self.hasher.digest(b"text\0" + whole), _State(turn.session, turn.turn, end))

    def _turn(self, found: _State | None) -> Turn:
        if found is None:
            return Turn(self._new(), 0, None)
        return Turn(found.session, found.turn + 1, found.end)

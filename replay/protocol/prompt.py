"""A prompt as the protocol sends it: the one shape synth builds and the request bodies read."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Prompt:
    messages: list[dict] | None  # openai-chat: [{"role": "user", "content": text}] (or the row's own messages)
    text: str | None  # openai-completions text prompt / tgi inputs
    token_ids: list[int] | None  # openai-completions token-id prompt
    expected_tokens: int  # prompt tokens the server will count
    tools: list | None = None  # the row's own tools (chat), sent along with its messages
    fingerprint: list | None = None  # its content's checkpoints (replay.rules.prompt_fingerprint): the records keep it

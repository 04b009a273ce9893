"""Request bodies, serialized ahead of send time so the send path only writes bytes."""

from __future__ import annotations

import orjson

from replay.protocol.prompt import Prompt
from replay.protocol.table import get_api
from replay.rules.usage import max_tokens_asked


def build_body(
    api: str, prompt: Prompt, *, model: str, output_length: int, stream: bool, ignore_eos: bool = True
) -> bytes:
    """The JSON body for `api`, shaped by its entry in the API table (replay/protocol/table.py), asking for
    `max_tokens_asked(output_length)` (replay.rules.usage: an output_length of 0 is sent as 1)."""
    body = get_api(api).body(prompt, model=model, max_tokens=max_tokens_asked(output_length), stream=stream,
                             ignore_eos=ignore_eos)
    return orjson.dumps(body)

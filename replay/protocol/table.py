"""The APIs a replay speaks, each described once: where its requests go, how its request and
/tokenize bodies are shaped, how its replies are read, and where it says what it serves.

Synth builds the bodies ahead of send time, the server check asks /tokenize and the usage
fallback, dispatch picks the path and reads the replies: all from this one table, so an API
cannot be described one way where its bodies are built and another where its replies are
read. Its modules are pure functions (no gevent, no HTTP client, no tokenizer): synth runs
before dispatch and imports it without pulling in the dispatch side.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from replay.protocol import openai, tgi
from replay.protocol.reading import Models, Read, no_metrics

if TYPE_CHECKING:
    from replay.protocol.prompt import Prompt

__all__ = ["API_NAMES", "APIS", "PROMPT_FORMATS", "TOKEN_ID_APIS", "Api", "get_api", "prompt_format_problem", "sends_token_ids"]


@dataclass(frozen=True)
class Api:
    name: str
    stream_path: str
    body_path: str
    chat: bool  # its prompt is a chat's messages, rendered by the server's template; else a text
    token_ids: bool  # it also takes a prompt as token ids (--prompt-format token-ids)
    usage_counts_prompt: bool  # a reply's usage.prompt_tokens counts the prompt (the server check's fallback)
    body: Callable[..., dict]  # (prompt, *, model, max_tokens, stream, ignore_eos) -> the request body
    tokenize_body: Callable[[Prompt, str | None], dict]  # (prompt, model) -> the POST /tokenize body
    read_event: Callable[[dict], Read]  # one streamed event
    read_body: Callable[[dict], Read]  # a whole non-streamed reply
    models_path: str  # GET: what the server serves, asked before the first send (replay.protocol.models)
    read_models: Callable[[object], Models | None]  # its answer read
    # a reply's (or stream event's) per-request timing object, unread (replay.rules.server_timing
    # reads it); None: it has none, or the API never sends one
    read_metrics: Callable[[dict], object] = no_metrics

    def path(self, stream: bool) -> str:
        return self.stream_path if stream else self.body_path


APIS: dict[str, Api] = {
    api.name: api
    for api in (
        Api("openai-chat", "/v1/chat/completions", "/v1/chat/completions", chat=True, token_ids=False,
            usage_counts_prompt=True, body=openai.chat_body, tokenize_body=openai.chat_tokenize_body,
            read_event=openai.read_chat_event, read_body=openai.read_chat_body,
            models_path="/v1/models", read_models=openai.read_models, read_metrics=openai.read_metrics),
        Api("openai-completions", "/v1/completions", "/v1/completions", chat=False, token_ids=True,
            usage_counts_prompt=True, body=openai.completions_body, tokenize_body=openai.completions_tokenize_body,
            read_event=openai.read_completions_event, read_body=openai.read_completions_body,
            models_path="/v1/models", read_models=openai.read_models, read_metrics=openai.read_metrics),
        Api("tgi", "/generate_stream", "/generate", chat=False, token_ids=False,
            usage_counts_prompt=False, body=tgi.generate_body, tokenize_body=tgi.tokenize_body,
            read_event=tgi.read_event, read_body=tgi.read_body,
            models_path="/info", read_models=tgi.read_info),
    )
}
API_NAMES = tuple(APIS)  # the --api choices

# How a prompt is sent (--prompt-format), and whether that form is its token ids: text the server
# encodes, or the ids themselves (exact counts whatever the server's tokenizer does with text),
# which only the APIs whose `token_ids` flag says so take (the bodies: openai.completions_body).
PROMPT_FORMATS: dict[str, bool] = {"text": False, "token-ids": True}
TOKEN_ID_APIS = tuple(name for name, api in APIS.items() if api.token_ids)


def sends_token_ids(prompt_format: str) -> bool:
    """Whether --prompt-format `prompt_format` sends a prompt as its token ids."""
    return PROMPT_FORMATS[prompt_format]


def prompt_format_problem(prompt_format: str, api: str) -> str | None:
    """The one error for a prompt format the API cannot take (token ids to an API whose table entry
    takes none), naming both options; None when they go together."""
    spec = APIS.get(api)
    if not sends_token_ids(prompt_format) or (spec is not None and spec.token_ids):
        return None
    takers = " or ".join(f"--api {name}" for name in TOKEN_ID_APIS)
    return f"--prompt-format {prompt_format}: only with {takers}, not --api {api}"


def get_api(name: str) -> Api:
    try:
        return APIS[name]
    except KeyError:
        raise ValueError(f"--api {name!r}: expected one of {', '.join(API_NAMES)}") from None

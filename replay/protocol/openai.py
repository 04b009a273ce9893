"""The OpenAI-compatible APIs (vLLM, SGLang): openai-chat (a chat's messages, rendered by the
server's template) and openai-completions (a text or token-id prompt).

Both put the model and the prompt first and the generation fields after, in that order on the
wire (the tests and the sim compare bodies byte for byte).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from replay.protocol.reading import Models, Read, Usage, error_text, token_limit
from replay.rules.server_timing import ANSWER_METRICS_FIELD

if TYPE_CHECKING:
    from replay.protocol.prompt import Prompt

# -- requests -----------------------------------------------------------------------------------


def chat_body(prompt: Prompt, *, model: str | None, max_tokens: int, stream: bool, ignore_eos: bool) -> dict:
    """A /v1/chat/completions body; the row's own tools go along with its messages."""
    if prompt.messages is None:
        raise ValueError("an openai-chat body needs messages")
    body = _model(model)
    body["messages"] = prompt.messages
    if prompt.tools:
        body["tools"] = prompt.tools
    return _generation(body, max_tokens, stream, ignore_eos)


def completions_body(prompt: Prompt, *, model: str | None, max_tokens: int, stream: bool, ignore_eos: bool) -> dict:
    """A /v1/completions body: the prompt as token ids where it has them, else as text."""
    if prompt.token_ids is not None:
        given: list[int] | str = prompt.token_ids
    elif prompt.text is not None:
        given = prompt.text
    else:
        raise ValueError("an openai-completions body needs a text or token-id prompt")
    body = _model(model)
    body["prompt"] = given
    return _generation(body, max_tokens, stream, ignore_eos)


def chat_tokenize_body(prompt: Prompt, model: str | None) -> dict:
    """vLLM's POST /tokenize messages form: rendered with the generation prompt, as a chat request is."""
    body = _model(model)
    body.update(messages=prompt.messages, add_generation_prompt=True)
    if prompt.tools:
        body["tools"] = prompt.tools
    body["return_token_strs"] = True  # the server's token texts, for the mismatch message
    return body


def completions_tokenize_body(prompt: Prompt, model: str | None) -> dict:
    """vLLM's and SGLang's POST /tokenize prompt form, with the special tokens a completion gets."""
    body = _model(model)
    body.update(prompt=prompt.text, add_special_tokens=True)
    body["return_token_strs"] = True
    return body


def _model(model: str | None) -> dict:
    """The body's first field; None leaves it out (the server check, asked without --model)."""
    return {"model": model} if model is not None else {}


def _generation(body: dict, max_tokens: int, stream: bool, ignore_eos: bool) -> dict:
    """The fields after the prompt. A streamed reply is asked for its usage in a last event; with
    ignore_eos the servers are also given min_tokens, so the reply has max_tokens whatever the
    model would say."""
    body["max_tokens"] = max_tokens
    body["stream"] = stream
    if stream:
        body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        body["ignore_eos"] = True
        body["min_tokens"] = max_tokens
    return body


# -- responses ----------------------------------------------------------------------------------


def read_chat_event(obj: dict) -> Read:
    """A streamed chunk: a token is content or reasoning (vLLM's reasoning parsers), not a role."""
    count = 0
    for choice in obj.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"):
            count += 1
    return count, _usage(obj), error_text(obj)


def read_chat_body(obj: dict) -> Read:
    choices = obj.get("choices") or ()
    count = 1 if any((c.get("message") or {}).get("content") for c in choices) else 0
    return count, _usage(obj), error_text(obj)


def read_completions_event(obj: dict) -> Read:
    count = sum(1 for choice in obj.get("choices") or () if choice.get("text"))
    return count, _usage(obj), error_text(obj)


def read_completions_body(obj: dict) -> Read:
    count = 1 if any(c.get("text") for c in obj.get("choices") or ()) else 0
    return count, _usage(obj), error_text(obj)


def _usage(obj: dict) -> Usage | None:
    usage = obj.get("usage")
    if not usage:
        return None
    details = usage.get("prompt_tokens_details") or {}
    return {
        "prompt_tokens": usage.get("prompt_tokens"),
        "output_tokens": usage.get("completion_tokens"),
        "cached_tokens": details.get("cached_tokens"),
    }


def read_metrics(obj: dict) -> object:
    """vLLM's per-request timing (`--enable-per-request-metrics`): a `metrics` object beside the
    usage of a whole reply and of a stream's final usage event; read by replay.rules.server_timing."""
    return obj.get(ANSWER_METRICS_FIELD)


# -- what is served -----------------------------------------------------------------------------


def read_models(answer: object) -> Models | None:
    """GET /v1/models: {"data": [{"id", "max_model_len"}, ...]} (vLLM and `replay sim` say
    max_model_len; other servers only the ids). None when the answer is not a model list."""
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list):
        return None
    return {str(m["id"]): token_limit(m.get("max_model_len")) for m in data if isinstance(m, dict) and "id" in m}

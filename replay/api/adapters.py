"""What differs between APIs: the path, and how a response event or body is read.

Each reader returns (content_tokens, usage, error): content_tokens is how many output
tokens the event carries (0 for role-only or usage-only chunks, so TTFT is taken at the first
real token), usage is {prompt_tokens, output_tokens, cached_tokens} when the server said so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from replay.rules.apis import API_NAMES

Usage = dict[str, int | None]
Read = tuple[int, Usage | None, str | None]


def _openai_usage(obj: dict) -> Usage | None:
    usage = obj.get("usage")
    if not usage:
        return None
    details = usage.get("prompt_tokens_details") or {}
    return {
        "prompt_tokens": usage.get("prompt_tokens"),
        "output_tokens": usage.get("completion_tokens"),
        "cached_tokens": details.get("cached_tokens"),
    }


def _error_text(obj: dict) -> str | None:
    err = obj.get("error")
    if err is None:
        return None
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


def _chat_event(obj: dict) -> Read:
    count = 0
    for choice in obj.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"):
            count += 1
    return count, _openai_usage(obj), _error_text(obj)


def _completion_event(obj: dict) -> Read:
    count = sum(1 for choice in obj.get("choices") or () if choice.get("text"))
    return count, _openai_usage(obj), _error_text(obj)


def _chat_body(obj: dict) -> Read:
    choices = obj.get("choices") or ()
    count = 1 if any((c.get("message") or {}).get("content") for c in choices) else 0
    return count, _openai_usage(obj), _error_text(obj)


def _completion_body(obj: dict) -> Read:
    count = 1 if any(c.get("text") for c in obj.get("choices") or ()) else 0
    return count, _openai_usage(obj), _error_text(obj)


def _tgi_usage(details: dict | None) -> Usage | None:
    if not details:
        return None
    prefill = details.get("prefill")
    prompt = details.get("input_length")  # stream details (TGI's StreamDetails)
    if prompt is None and prefill:  # with decoder_input_details
        prompt = len(prefill)
    return {
        "prompt_tokens": prompt,
        "output_tokens": details.get("generated_tokens"),
        "cached_tokens": details.get("cached_tokens"),
    }


def _tgi_event(obj: dict) -> Read:
    token = obj.get("token")
    count = 1 if token is not None and not token.get("special") else 0
    return count, _tgi_usage(obj.get("details")), _error_text(obj)


def _tgi_body(obj: dict | list) -> Read:
    if isinstance(obj, list):  # TGI answers a single request with a one-element list on some versions
        obj = obj[0] if obj else {}
    count = 1 if obj.get("generated_text") else 0
    return count, _tgi_usage(obj.get("details")), _error_text(obj)


@dataclass(frozen=True)
class Adapter:
    name: str
    stream_path: str
    body_path: str
    read_event: Callable[[dict], Read]
    read_body: Callable[[dict], Read]

    def path(self, stream: bool) -> str:
        return self.stream_path if stream else self.body_path


ADAPTERS = {
    "openai-chat": Adapter("openai-chat", "/v1/chat/completions", "/v1/chat/completions", _chat_event, _chat_body),
    "openai-completions": Adapter("openai-completions", "/v1/completions", "/v1/completions", _completion_event, _completion_body),
    "tgi": Adapter("tgi", "/generate_stream", "/generate", _tgi_event, _tgi_body),
}


def get_adapter(api: str) -> Adapter:
    try:
        return ADAPTERS[api]
    except KeyError:
        raise ValueError(f"--api {api!r}: expected one of {', '.join(API_NAMES)}") from None

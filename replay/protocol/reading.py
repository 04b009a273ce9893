"""What every API's response reader returns, and the error field the APIs share.

A reader of a reply returns (content_tokens, usage, error): content_tokens is how many output tokens the
event carries (0 for role-only or usage-only chunks, so TTFT is taken at the first real
token), usage is {prompt_tokens, output_tokens, cached_tokens} when the server said so.
"""

from __future__ import annotations

Usage = dict[str, int | None]
Read = tuple[int, Usage | None, str | None]
Models = dict[str, int | None]  # a server's models by id, each with its prompt limit in tokens (None: not said)


def error_text(obj: dict) -> str | None:
    """The reply's `error`: OpenAI servers send {"message": ...}, TGI a plain string."""
    err = obj.get("error")
    if err is None:
        return None
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


def token_limit(value: object) -> int | None:
    """A server's stated limit in tokens: a positive integer, else None (not said)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def no_metrics(obj: dict) -> None:
    """The per-request timing reader of an API whose replies carry none (TGI)."""
    return None

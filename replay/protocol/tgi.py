"""Hugging Face TGI: /generate and /generate_stream, a text prompt in `inputs`.

TGI takes no model name in a request (it serves one, which GET /info names), has no ignore_eos, and streams by path (/generate_stream), not by a
body field; it reports counts in `details`, asked for in every body.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from replay.protocol.reading import Models, Read, Usage, error_text, token_limit

if TYPE_CHECKING:
    from replay.protocol.prompt import Prompt


def generate_body(prompt: Prompt, *, model: str | None, max_tokens: int, stream: bool, ignore_eos: bool) -> dict:
    """A /generate (or /generate_stream) body; model, stream and ignore_eos have no field here."""
    if prompt.text is None:
        raise ValueError("a tgi body needs a text prompt")
    return {
        "inputs": prompt.text,
        "parameters": {"max_new_tokens": max_tokens, "details": True, "decoder_input_details": False},
    }


def tokenize_body(prompt: Prompt, model: str | None) -> dict:
    """TGI's POST /tokenize takes the inputs alone."""
    return {"inputs": prompt.text}


def read_event(obj: dict) -> Read:
    """A streamed token: special tokens (the EOS) are not output."""
    token = obj.get("token")
    count = 1 if token is not None and not token.get("special") else 0
    return count, _usage(obj.get("details")), error_text(obj)


def read_body(obj: dict | list) -> Read:
    if isinstance(obj, list):  # TGI answers a single request with a one-element list on some versions
        obj = obj[0] if obj else {}
    count = 1 if obj.get("generated_text") else 0
    return count, _usage(obj.get("details")), error_text(obj)


def _usage(details: dict | None) -> Usage | None:
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


def read_info(answer: object) -> Models | None:
    """GET /info (TGI's Info): the one model it serves, `model_id`, and its prompt limit,
    `max_input_tokens` (`max_input_length` before TGI 2). None when the answer says no model."""
    if not isinstance(answer, dict) or not isinstance(answer.get("model_id"), str):
        return None
    limit = answer.get("max_input_tokens", answer.get("max_input_length"))
    return {answer["model_id"]: token_limit(limit)}

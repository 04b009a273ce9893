"""Request bodies, serialized ahead of send time so the send path only writes bytes."""

from __future__ import annotations

import orjson

from replay.synth.prompts import APIS, Prompt


def build_body(
    api: str, prompt: Prompt, *, model: str, output_length: int, stream: bool, ignore_eos: bool = True
) -> bytes:
    """The JSON body for `api`.

    An output_length of 0 is sent as 1: servers reject max_tokens=0, and one token is the
    nearest request that still measures a time to first token. With ignore_eos the OpenAI
    servers (vLLM, SGLang) are also given min_tokens, so the reply has the trace's length
    whatever the model would say. TGI has no ignore_eos, and streams by endpoint path
    (/generate_stream), not by a body field.
    """
    max_tokens = max(1, output_length)
    if api == "tgi":
        if prompt.text is None:
            raise ValueError("a tgi body needs a text prompt")
        return orjson.dumps(
            {
                "inputs": prompt.text,
                "parameters": {"max_new_tokens": max_tokens, "details": True, "decoder_input_details": False},
            }
        )
    if api == "openai-chat":
        if prompt.messages is None:
            raise ValueError("an openai-chat body needs messages")
        body: dict = {"model": model, "messages": prompt.messages}
        if prompt.tools:
            body["tools"] = prompt.tools
    elif api == "openai-completions":
        if prompt.token_ids is not None:
            body = {"model": model, "prompt": prompt.token_ids}
        elif prompt.text is not None:
            body = {"model": model, "prompt": prompt.text}
        else:
            raise ValueError("an openai-completions body needs a text or token-id prompt")
    else:
        raise ValueError(f"unknown api {api!r}; expected one of {', '.join(APIS)}")
    body["max_tokens"] = max_tokens
    body["stream"] = stream
    if stream:
        body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        body["ignore_eos"] = True
        body["min_tokens"] = max_tokens
    return orjson.dumps(body)

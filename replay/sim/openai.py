"""The OpenAI-compatible endpoints, answering as vLLM's do.

Token counting follows vLLM: a chat request is rendered with the chat template
(add_generation_prompt=True) and encoded without added special tokens; a completions
text prompt is encoded with the tokenizer's own specials; token-id prompts are taken as
given. Response and chunk shapes follow vllm/entrypoints/openai/protocol.py. vLLM's
defaults for max_tokens: completions 16 (CompletionRequest.max_tokens = 16), chat the
rest of the context (max_model_len - prompt tokens).
"""

from __future__ import annotations

import time

import orjson

from replay.rules.tokens import TEXT_ADD_SPECIAL_TOKENS
from replay.sim.engine import Engine, Plan
from replay.sim.errors import ApiError, context_length_error
from replay.sim.generation import GenRequest, respond
from replay.sim.http import Request, Response, Stream
from replay.sim.tokens import chat_ids, text_ids
from replay.synth.chat_template import ChatTemplateError

DONE = b"data: [DONE]\n\n"


# -- request parsing ------------------------------------------------------------------
def parse_body(request: Request) -> dict:
    try:
        body = orjson.loads(request.body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object")
    return body


def check_model(engine: Engine, body: dict) -> None:
    model = body.get("model")
    if model is not None and model != engine.options.model:
        raise ApiError(f"The model `{model}` does not exist.", status=404, param="model", err_type="NotFoundError")


def _int_field(body: dict, name: str, default: int | None, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(f"{name} must be an integer, got {value!r}", param=name)
    if value < minimum:
        raise ApiError(f"{name} must be at least {minimum}, got {value}.", param=name)
    return value


def _bool_field(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(f"{name} must be a boolean, got {value!r}", param=name)
    return value


def generation_params(engine: Engine, body: dict, prompt_ids: list[int], default_max: int | None,
                      names: tuple[str, ...] = ("max_tokens",)) -> GenRequest:
    """max_tokens & co, checked against the context length with vLLM's wording."""
    max_tokens = None
    for name in names:
        max_tokens = _int_field(body, name, None, 1)
        if max_tokens is not None:
            break
    max_len = engine.options.max_model_len
    prompt_len = len(prompt_ids)
    if not prompt_ids:
        raise ApiError("The decoder prompt cannot be empty", param="prompt")
    if max_tokens is None:
        if prompt_len >= max_len:
            raise context_length_error(max_len, prompt_len, None)
        max_tokens = default_max if default_max is not None else max_len - prompt_len
    if prompt_len + max_tokens > max_len:
        raise context_length_error(max_len, prompt_len, max_tokens)
    min_tokens = _int_field(body, "min_tokens", 0, 0)
    if min_tokens > max_tokens:
        raise ApiError(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.",
                       param="min_tokens")
    stream = _bool_field(body, "stream")
    return GenRequest(prompt_ids, max_tokens, _bool_field(body, "ignore_eos"), min_tokens, stream)


def include_usage(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise ApiError("Stream options can only be defined when `stream=True`.", param="stream_options")
    if not isinstance(options, dict):
        raise ApiError("stream_options must be an object", param="stream_options")
    return bool(options.get("include_usage"))


def _message_content(message: dict, index: int):
    content = message.get("content")
    if isinstance(content, list):  # vLLM's "string" content format joins text parts with newlines
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(f"messages[{index}].content: only text parts are supported", param="messages")
            texts.append(part["text"])
        return "\n".join(texts)
    if content is not None and not isinstance(content, str):
        raise ApiError(f"messages[{index}].content must be a string, a list of parts or null", param="messages")
    return content


def chat_prompt(engine: Engine, body: dict) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("field 'messages' is required: a non-empty list of messages", param="messages")
    clean = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(f"messages[{i}] must be an object with a string 'role'", param="messages")
        clean.append({**message, "content": _message_content(message, i)})
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ApiError("tools must be a list", param="tools")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ApiError("chat_template_kwargs must be an object", param="chat_template_kwargs")
    try:
        return chat_ids(engine.tokenizer, clean, tools, kwargs)
    except Exception as exc:  # template errors (raise_exception, bad roles) are the client's
        reason = exc.reason if isinstance(exc, ChatTemplateError) else exc  # what vLLM says: no server paths
        raise ApiError(f"chat template failed on these messages: {reason}", param="messages") from None


def completion_prompt(engine: Engine, body: dict) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError("the sim serves one prompt per request; got a batch of "
                           f"{len(prompt)}", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return text_ids(engine.tokenizer, prompt)
    if isinstance(prompt, list):
        vocab = engine.tokenizer.vocab_size
        for i, tok in enumerate(prompt):
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab:
                raise ApiError(f"prompt[{i}]: token id {tok!r} is out of vocabulary (size {vocab})", param="prompt")
        return prompt
    raise ApiError("field 'prompt' is required: a string, a list of token ids, or a list of one of them",
                   param="prompt")


def usage(engine: Engine, plan: Plan) -> dict:
    """The true counts, or with --false-usage the figures it names instead (total_tokens stays true)."""
    answer = {
        "prompt_tokens": plan.prompt_tokens,
        "total_tokens": plan.prompt_tokens + plan.completion_tokens,
        "completion_tokens": plan.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": plan.cached_tokens},
    }
    if engine.false_usage:
        lie = dict(engine.false_usage)
        if "cached_tokens" in lie:
            answer["prompt_tokens_details"]["cached_tokens"] = lie.pop("cached_tokens")
        answer.update(lie)
    return answer


def per_request_metrics(engine: Engine, plan: Plan) -> dict | None:
    """vLLM's per-request `metrics` object (build_per_request_timing_metrics) from the sim's own
    timing of the request, or None without --per-request-metrics. As vLLM's:
    time_to_first_token_ms counts from scheduling (the prefill), generation_time_ms from the
    first token to the last, tokens_per_second over scheduling to the last token; mean_itl_ms
    only with two tokens or more. --false-metrics replaces the figures it names."""
    opts = engine.options
    if not opts.per_request_metrics and engine.false_metrics is None:
        return None
    n = plan.completion_tokens
    metrics: dict[str, object] = {
        "time_to_first_token_ms": (plan.first_token_at - plan.started) * 1000.0,
        "generation_time_ms": (plan.last_token_at - plan.first_token_at) * 1000.0,
        "queue_time_ms": (plan.started - plan.arrived) * 1000.0,
    }
    if n > 1:
        metrics["mean_itl_ms"] = (plan.last_token_at - plan.first_token_at) * 1000.0 / (n - 1)
    if plan.last_token_at > plan.started:
        metrics["tokens_per_second"] = n / (plan.last_token_at - plan.started)
    if engine.false_metrics:
        metrics.update(engine.false_metrics)
    return metrics


# -- frames ----------------------------------------------------------------------------
class _Frames:
    """Fixed byte frames with the token text spliced in: serializing 50k events/s in JSON would not keep up."""

    object_stream = ""

    def __init__(self, engine: Engine, rid: str, with_usage: bool):
        self.engine = engine
        self.rid = rid
        self.created = int(time.time())
        self.with_usage = with_usage
        self.model = engine.options.model
        self.header = orjson.dumps({"id": rid, "object": self.object_stream, "created": self.created,
                                    "model": self.model})[:-1]

    def tokens(self, plan: Plan, start: int, end: int) -> bytes:
        js = self.engine.vocab.json
        ids = plan.token_ids
        pre, mid = self.pre, self.mid
        out = [pre + js[t] + mid for t in ids[start:end]]
        if end == len(ids):
            out[-1] = pre + js[ids[-1]] + self.last(plan.finish_reason)
        return b"".join(out)

    def tail(self, plan: Plan) -> bytes:
        if not self.with_usage:
            return DONE
        answer = orjson.dumps(usage(self.engine, plan))
        metrics = per_request_metrics(self.engine, plan)
        if metrics is not None:
            answer += b',"metrics":' + orjson.dumps(metrics)
        return b"data: " + self.header + b',"choices":[],"usage":' + answer + b"}\n\n" + DONE


class ChatFrames(_Frames):
    object_stream = "chat.completion.chunk"

    def __init__(self, engine: Engine, rid: str, with_usage: bool):
        super().__init__(engine, rid, with_usage)
        self.pre = b"data: " + self.header + b',"choices":[{"index":0,"delta":{"content":'
        self.mid = b'},"logprobs":null,"finish_reason":null}]}\n\n'

    def last(self, reason: str) -> bytes:
        return b'},"logprobs":null,"finish_reason":"%s"}]}\n\n' % reason.encode()

    def first(self, plan: Plan) -> bytes:
        # vLLM's first chat chunk carries the role and no text.
        return (b"data: " + self.header
                + b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
                  b'"finish_reason":null}]}\n\n')

    def full(self, plan: Plan) -> bytes:
        return orjson.dumps({
            "id": self.rid, "object": "chat.completion", "created": self.created, "model": self.model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": self.engine.vocab.decode(plan.token_ids),
                            "tool_calls": []},
                "logprobs": None, "finish_reason": plan.finish_reason, "stop_reason": None,
            }],
            "usage": usage(self.engine, plan),
            "prompt_logprobs": None,
            **_metrics_field(self.engine, plan),
        })


class CompletionFrames(_Frames):
    object_stream = "text_completion"

    def __init__(self, engine: Engine, rid: str, with_usage: bool):
        super().__init__(engine, rid, with_usage)
        self.pre = b"data: " + self.header + b',"choices":[{"index":0,"text":'
        self.mid = b',"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'

    def last(self, reason: str) -> bytes:
        return b',"logprobs":null,"finish_reason":"%s","stop_reason":null}]}\n\n' % reason.encode()

    def first(self, plan: Plan) -> bytes:
        return b""

    def full(self, plan: Plan) -> bytes:
        return orjson.dumps({
            "id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
            "choices": [{
                "index": 0, "text": self.engine.vocab.decode(plan.token_ids), "logprobs": None,
                "finish_reason": plan.finish_reason, "stop_reason": None, "prompt_logprobs": None,
            }],
            "usage": usage(self.engine, plan),
            **_metrics_field(self.engine, plan),
        })


def _metrics_field(engine: Engine, plan: Plan) -> dict:
    """A whole answer's `metrics` field, or nothing (vLLM leaves an unset field out)."""
    metrics = per_request_metrics(engine, plan)
    return {} if metrics is None else {"metrics": metrics}


def sender_order(request: Request) -> int | None:
    """The number an `X-Request-Id: <run id>-<request id>` ends with (the replay's row), or None."""
    tail = (request.headers.get("x-request-id") or "").rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else None


def vllm_request_id(form: str, request: Request) -> str | None:
    """The request's id in vLLM's engine (its spans' gen_ai.request.id): `form` around the
    X-Request-Id (chat: chatcmpl-{}; completions: cmpl-{}-<prompt index>); None without one."""
    sent = request.headers.get("x-request-id")
    return form.format(sent) if sent else None


# -- endpoints -------------------------------------------------------------------------
def chat_completions(engine: Engine, request: Request) -> Response | Stream:
    body = parse_body(request)
    check_model(engine, body)
    prompt_ids = chat_prompt(engine, body)
    gen = generation_params(engine, body, prompt_ids, None, ("max_completion_tokens", "max_tokens"))
    gen.order = sender_order(request)
    gen.engine_request_id = vllm_request_id("chatcmpl-{}", request)
    frames = ChatFrames(engine, f"chatcmpl-{engine.next_id():032x}", include_usage(body, gen.stream))
    return respond(engine, gen, frames)


def completions(engine: Engine, request: Request) -> Response | Stream:
    body = parse_body(request)
    check_model(engine, body)
    prompt_ids = completion_prompt(engine, body)
    gen = generation_params(engine, body, prompt_ids, 16)
    gen.order = sender_order(request)
    gen.engine_request_id = vllm_request_id("cmpl-{}-0", request)
    frames = CompletionFrames(engine, f"cmpl-{engine.next_id():032x}", include_usage(body, gen.stream))
    return respond(engine, gen, frames)


def models(engine: Engine, request: Request) -> Response:
    opts = engine.options
    card = {"id": opts.model, "object": "model", "created": int(time.time()), "owned_by": "vllm",
            "root": opts.model, "parent": None, "max_model_len": opts.max_model_len}
    return Response(200, orjson.dumps({"object": "list", "data": [card]}))


def tokenize(engine: Engine, request: Request) -> Response:
    """vLLM's POST /tokenize: a completions prompt (`add_special_tokens`, default true) or chat
    `messages` (`add_generation_prompt`, default true), counted as a generation request of the
    same form would be; the replay's --verify-server asks it before a run."""
    body = parse_body(request)
    check_model(engine, body)
    if "messages" in body:
        kwargs = {**(body.get("chat_template_kwargs") or {}),
                  "add_generation_prompt": _bool_field(body, "add_generation_prompt", True)}
        ids = chat_prompt(engine, {**body, "chat_template_kwargs": kwargs})
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ApiError("field 'prompt' is required: a string", param="prompt")
        ids = text_ids(engine.tokenizer, prompt, _bool_field(body, "add_special_tokens", TEXT_ADD_SPECIAL_TOKENS))
    strs = [engine.tokenizer.tokenizer.id_to_token(i) for i in ids] if _bool_field(body, "return_token_strs") else None
    return Response(200, orjson.dumps({"count": len(ids), "max_model_len": engine.options.max_model_len,
                                       "tokens": ids, "token_strs": strs}))

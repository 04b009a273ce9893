"""TGI's /generate and /generate_stream (router/src/lib.rs GenerateResponse, StreamResponse),
and its GET /info (Info: the served model and its limits).

TGI tokenizes `inputs` with the tokenizer's special tokens, like a completions prompt.
Its stream events are `data:{...}` (axum writes no space after the colon), one per token,
with `index` counting from 1; only the last carries `generated_text` and `details`
(finish_reason "length" | "eos_token", generated_tokens, seed, input_length). There is no
[DONE]. Validation errors are 422 {"error", "error_type": "validation"}.
"""

from __future__ import annotations

import orjson

from replay.sim.engine import Engine, Plan
from replay.sim.errors import ApiError
from replay.sim.generation import GenRequest, respond
from replay.sim.http import Request, Response, Stream
from replay.sim.openai import parse_body
from replay.sim.tokens import text_ids

FINISH = {"length": "length", "stop": "eos_token"}
LOGPROB = b"-0.5"


def _params(engine: Engine, body: dict, stream: bool) -> tuple[GenRequest, dict]:
    inputs = body.get("inputs")
    if not isinstance(inputs, str):
        raise ApiError("field 'inputs' is required: a string", status=422, param="inputs")
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise ApiError("'parameters' must be an object", status=422, param="parameters")
    prompt_ids = text_ids(engine.tokenizer, inputs)
    if not prompt_ids:
        raise ApiError("`inputs` cannot be empty", status=422, param="inputs")
    max_total = engine.options.max_model_len
    max_new = params.get("max_new_tokens")
    if max_new is None:
        max_new = max_total - len(prompt_ids)
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
        raise ApiError("`max_new_tokens` must be strictly positive", status=422, param="max_new_tokens")
    if len(prompt_ids) + max_new > max_total:
        raise ApiError(
            f"`inputs` tokens + `max_new_tokens` must be <= {max_total}. Given: {len(prompt_ids)} `inputs` tokens "
            f"and {max_new} `max_new_tokens`", status=422, param="inputs")
    ignore_eos = bool(params.get("ignore_eos", False))  # not TGI's: lets a replay ask for exact lengths
    return GenRequest(prompt_ids, max_new, ignore_eos, 0, stream), params


def _token(engine: Engine, tid: int) -> bytes:
    return b'{"id":%d,"text":%s,"logprob":%s,"special":false}' % (tid, engine.vocab.json[tid], LOGPROB)


class TgiFrames:
    def __init__(self, engine: Engine, want_details: bool):
        self.engine = engine
        self.want_details = want_details

    def first(self, plan: Plan) -> bytes:
        return b""

    def tokens(self, plan: Plan, start: int, end: int) -> bytes:
        ids = plan.token_ids
        last = len(ids)
        out = []
        for i in range(start, end):
            tok = _token(self.engine, ids[i])
            if i + 1 == last:
                details = orjson.dumps({"finish_reason": FINISH[plan.finish_reason], "generated_tokens": last,
                                        "seed": None, "input_length": plan.prompt_tokens})
                text = orjson.dumps(self.engine.vocab.decode(ids))
                out.append(b'data:{"index":%d,"token":%s,"generated_text":%s,"details":%s}\n\n'
                           % (i + 1, tok, text, details))
            else:
                out.append(b'data:{"index":%d,"token":%s,"generated_text":null,"details":null}\n\n' % (i + 1, tok))
        return b"".join(out)

    def tail(self, plan: Plan) -> bytes:
        return b""

    def full(self, plan: Plan) -> bytes:
        answer: dict = {"generated_text": self.engine.vocab.decode(plan.token_ids)}
        if self.want_details:
            vocab = self.engine.vocab
            answer["details"] = {
                "finish_reason": FINISH[plan.finish_reason],
                "generated_tokens": plan.completion_tokens,
                "seed": None,
                "prefill": [],
                "tokens": [{"id": t, "text": vocab.text[t], "logprob": -0.5, "special": False}
                           for t in plan.token_ids],
            }
        return orjson.dumps(answer)


def generate(engine: Engine, request: Request) -> Response | Stream:
    gen, params = _params(engine, parse_body_tgi(request), stream=False)
    return respond(engine, gen, TgiFrames(engine, bool(params.get("details"))))


def generate_stream(engine: Engine, request: Request) -> Response | Stream:
    gen, _ = _params(engine, parse_body_tgi(request), stream=True)
    return respond(engine, gen, TgiFrames(engine, True))


def info(engine: Engine, request: Request) -> Response:
    """TGI's Info, the fields a client reads: `model_id` (the sim's --model), and the prompt
    limit `max_input_tokens`, a token under `max_total_tokens` (--max-model-len) as TGI's own."""
    opts = engine.options
    return Response(200, orjson.dumps({
        "model_id": opts.model, "model_sha": None, "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": opts.max_num_seqs, "max_best_of": 1, "max_stop_sequences": 4,
        "max_input_tokens": opts.max_model_len - 1, "max_total_tokens": opts.max_model_len,
        "validation_workers": 1, "max_client_batch_size": 1, "router": "text-generation-router", "version": "sim",
    }))  # fmt: skip


def parse_body_tgi(request: Request) -> dict:
    try:
        return parse_body(request)
    except ApiError as exc:
        raise ApiError(exc.message, status=422) from None

"""The sim's settings, shared by the command line and the in-process API."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, fields

from replay.bounds import BLOCK_SIZE, CACHE_BLOCKS, HOUR_S, SEED, SHARE, Bound
from replay.synth.tokenizer_source import TOKENIZER_HELP


@dataclass
class SimOptions:
    tokenizer: str
    chat_template: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    model: str = "sim"
    block_size: int = 16
    cache_blocks: int = 100_000
    max_model_len: int = 32768
    ttft_ms: float = 20.0
    prefill_ms_per_1k: float = 5.0
    itl_ms: float = 10.0
    jitter: float = 0.0
    max_num_seqs: int = 256
    error_rate: float = 0.0
    error_status: int = 500
    stall_ms: float = 0.0
    drop_rate: float = 0.0
    eos_prob: float = 0.002
    seed: int = 0
    tokenize_endpoint: bool = True
    reset_endpoint: bool = True
    metrics: bool = True
    require_authorization: str | None = None
    false_usage: str | None = None
    reorder_ms: float = 0.0
    per_request_metrics: bool = False
    false_metrics: str | None = None
    otlp_endpoint: str | None = None


HELP = {
    "tokenizer": TOKENIZER_HELP,
    "chat_template": "tokenizer_config.json or .jinja file overriding the tokenizer's chat template",
    "host": "address to bind",
    "port": "port to bind (0 = pick a free one)",
    "model": "the served model name; requests naming another model get 404 as from vLLM",
    "block_size": "prefix-cache block size in tokens",
    "cache_blocks": "prefix-cache capacity in blocks (LRU beyond it)",
    "max_model_len": "context length: prompt + max_tokens must fit",
    "ttft_ms": "base time to first token",
    "prefill_ms_per_1k": "extra time to first token per 1000 uncached prompt tokens",
    "itl_ms": "time between output tokens",
    "jitter": "multiplicative jitter: each delay is scaled by a factor uniform in [1-j, 1+j]",
    "max_num_seqs": "requests running at once; the rest wait in FIFO order",
    "error_rate": "fraction of requests answered with --error-status",
    "error_status": "HTTP status of injected errors",
    "stall_ms": "extra delay before the first token of every request",
    "drop_rate": "fraction of streams whose connection is closed mid-way",
    "eos_prob": "per-token chance of an early stop when the request does not set ignore_eos",
    "seed": "seed of every random choice (faults, jitter, output tokens and lengths)",
    "tokenize_endpoint": "serve vLLM's POST /tokenize (--no-tokenize-endpoint: answer 404, as a server without one)",
    "reset_endpoint": "serve vLLM's dev-mode POST /reset_prefix_cache (--no-reset-endpoint: answer 404, as vLLM "
                      "without VLLM_SERVER_DEV_MODE=1)",
    "metrics": "serve /metrics (--no-metrics: 404, as a server without Prometheus metrics)",
    "require_authorization": "answer 401, as a server behind a key, to every request but /health and /debug/requests "
                             "whose Authorization header is not exactly this (e.g. 'Bearer KEY', 'Basic BASE64')",
    "false_usage": "a lying server: a JSON object whose keys replace the OpenAI APIs' usage figures "
                   "(prompt_tokens, completion_tokens, cached_tokens; any JSON value), "
                   "e.g. '{\"completion_tokens\": 99999}'",
    "reorder_ms": "schedule the requests that arrive within this many ms of the first of them together, at its "
                  "end, the last sent first (by the number ending their X-Request-Id; without one, the last to "
                  "arrive first): a scheduler that takes concurrent requests in another order than they were sent; "
                  "0: in arrival order",
    "per_request_metrics": "add vLLM's per-request `metrics` object (its --enable-per-request-metrics) to every "
                           "OpenAI answer and to a stream's final usage event: the queue, prefill and decode "
                           "times of the request as the sim timed them",
    "false_metrics": "a server whose timing lies: a JSON object whose keys replace figures of the `metrics` object "
                     "(queue_time_ms, time_to_first_token_ms, generation_time_ms, mean_itl_ms, tokens_per_second; "
                     "any JSON value, e.g. '{\"queue_time_ms\": \"12\"}'); implies --per-request-metrics",
    "otlp_endpoint": "export one vLLM llm_request span per finished request (its queue, prefill and decode times "
                     "from the sim's model, vLLM's attribute names, seconds) to this OTLP/HTTP trace endpoint, e.g. "
                     "a replay's --otlp-receiver: http://HOST:PORT/v1/traces",
}


MAX_DELAY_MS = HOUR_S * 1000  # a sim that waits longer than this for a token is a typo
DELAY_MS = Bound(0.0, MAX_DELAY_MS, unit="ms")
# Each number's range: its flag's type, and what `validate` holds the in-process API's values to.
BOUNDS = {
    "port": Bound(0, 65535, integer=True),
    "block_size": BLOCK_SIZE,
    "cache_blocks": CACHE_BLOCKS,
    "max_model_len": Bound(1, 1 << 30, integer=True, unit="tokens"),
    "ttft_ms": DELAY_MS,
    "prefill_ms_per_1k": DELAY_MS,
    "itl_ms": DELAY_MS,
    "jitter": Bound(0.0, 0.99),  # a factor of 1 - j: j = 1 could make a delay 0
    "max_num_seqs": Bound(1, 1_000_000, integer=True, unit="requests"),
    "error_rate": SHARE,
    "error_status": Bound(100, 599, integer=True, why="an HTTP status"),
    "stall_ms": DELAY_MS,
    "reorder_ms": DELAY_MS,
    "drop_rate": SHARE,
    "eos_prob": SHARE,
    "seed": SEED,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for f in fields(SimOptions):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "tokenizer":
            parser.add_argument(flag, required=True, help=HELP[f.name])
            continue
        if str(f.type) == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                help=f"{HELP[f.name]} (default: {'on' if f.default else 'off'})")
            continue
        kind = BOUNDS[f.name] if str(f.type) in ("int", "float") else str  # a number without a range: KeyError
        parser.add_argument(flag, type=kind, default=f.default, help=f"{HELP[f.name]} (default: {f.default})")


def from_namespace(args: argparse.Namespace) -> SimOptions:
    return SimOptions(**{f.name: getattr(args, f.name) for f in fields(SimOptions)})


def validate(options: SimOptions) -> None:
    """Reject settings the engine cannot honour, before binding a port (a flag's value was
    checked when parsed; the in-process API's were not)."""
    for name, bound in BOUNDS.items():
        value = getattr(options, name)
        if problem := bound.problem(value):
            raise ValueError(f"--{name.replace('_', '-')} {value}: {problem}")
    if options.false_usage is not None:
        false_usage(options)
    if options.false_metrics is not None:
        false_metrics(options)


FALSE_USAGE_KEYS = ("prompt_tokens", "completion_tokens", "cached_tokens")


def false_usage(options: SimOptions) -> dict:
    """--false-usage read: {key: value} for some of FALSE_USAGE_KEYS (ValueError otherwise)."""
    return _json_object("--false-usage", options.false_usage, FALSE_USAGE_KEYS)


FALSE_METRICS_KEYS = ("queue_time_ms", "time_to_first_token_ms", "generation_time_ms", "mean_itl_ms",
                      "tokens_per_second")


def false_metrics(options: SimOptions) -> dict:
    """--false-metrics read: {key: value} for some of FALSE_METRICS_KEYS (ValueError otherwise)."""
    return _json_object("--false-metrics", options.false_metrics, FALSE_METRICS_KEYS)


def _json_object(flag: str, text: str | None, keys: tuple[str, ...]) -> dict:
    """A JSON object option whose keys are some of `keys` (none given: {}); ValueError naming `flag`."""
    try:
        value = json.loads(text or "{}")
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag}: not JSON: {e}") from None
    if not isinstance(value, dict) or not set(value) <= set(keys):
        raise ValueError(f"{flag}: expected a JSON object of {', '.join(keys)}")
    return value

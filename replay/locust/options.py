"""The replay's command-line options, added to Locust's own parser (design.md's list).

Every option is also a key of `--replay-config FILE.yaml` (keys = option names without
dashes); `apply_config_file` is the hook where that file is merged, flags winning.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from replay.api.adapters import API_NAMES
from replay.api.ask import check_url
from replay.api.headers import parse_headers
from replay.api.models import served_max_model_len
from replay.results.report import parse_slo
from replay.trace.fields import DEFAULT_MAX_PROMPT_TOKENS

ROUTINGS = ("round-robin", "least-inflight", "session", "prefix")
PARTITIONS = ("round-robin", "session")
# How a completions prompt is sent: text the server encodes, or the token ids themselves
# (exact counts whatever the server's tokenizer does with text; openai-completions only).
PROMPT_FORMATS = ("text", "token-ids")
TOKEN_ID_API = "openai-completions"
# Before the first send, ask each server to count a sample of prompts (replay.synth.server_check):
# auto checks where the server offers a way, require refuses a server that offers none.
VERIFY_SERVER = ("auto", "require", "off")


def add_arguments(parser) -> None:
    group = parser.add_argument_group("trace replay")
    group.add_argument("--trace", help="trace file to replay")
    group.add_argument("--trace-format", default=None, help="mooncake, bailian, jsonl, azure, burstgpt (auto-detected)")
    group.add_argument("--block-size", type=int, default=None, help="tokens per hash id block (format default)")
    group.add_argument("--tokenizer", help="tokenizer.json or a folder holding it (and tokenizer_config.json)")
    group.add_argument("--chat-template", default=None, help="tokenizer_config.json or .jinja; overrides the tokenizer's")
    group.add_argument("--api", choices=API_NAMES, default="openai-chat")
    group.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="text",
                       help=f"send the prompt as text or as a list of token ids (token-ids: --api {TOKEN_ID_API} only)")
    group.add_argument("--verify-server", choices=VERIFY_SERVER, default="auto",
                       help="before the first send, compare this tokenizer's prompt counts with the server's own "
                            "(auto: where the server offers a way; require: refuse a server that offers none)")
    group.add_argument("--model", default=None, help="model name sent in request bodies")
    group.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True, help="stream responses (default on)")
    group.add_argument("--scale", type=float, default=1.0, help="time scale: 2 replays twice as fast")
    group.add_argument("--start", type=float, default=None, help="start of the trace window, trace seconds")
    group.add_argument("--duration", type=float, default=None, help="length of the trace window, trace seconds")
    group.add_argument("--max-requests", type=int, default=None, help="replay at most N rows of the window")
    group.add_argument("--seed", type=int, default=0, help="prompt synthesis seed")
    group.add_argument("--output", default=None, help="merged per-request JSONL (default results/replay-<time>.jsonl)")
    group.add_argument("--overwrite", action="store_true",
                       help="replace an earlier run's --output (and its .meta.json, .worker-N.jsonl); default: refuse")
    group.add_argument("--endpoints", default=None, help="comma-separated server URLs (a fleet); default --host")
    group.add_argument("--routing", choices=ROUTINGS, default="round-robin")
    group.add_argument("--max-prompt-tokens", type=int, default=None,
                       help="rows with longer prompts are recorded, never sent (default: the server's max_model_len "
                            f"from /v1/models, else {DEFAULT_MAX_PROMPT_TOKENS}; 0: no limit)")
    group.add_argument("--partition", choices=PARTITIONS, default="round-robin", help="how rows are split across workers")
    group.add_argument("--drain-timeout", type=float, default=60.0, help="seconds to wait for answers after the last send")
    group.add_argument("--no-ignore-eos", action="store_true", help="let the model stop early (default: exact output length)")
    group.add_argument("--on-bad-line", choices=("fail", "skip"), default="fail")
    group.add_argument("--slo", default=None, help="ttft_ms=..,tpot_ms=..,e2e_ms=..")
    group.add_argument("--header", action="append", default=[], help="'Name: value' ($VAR expanded); repeatable")
    group.add_argument("--request-id-header", action=argparse.BooleanOptionalAction, default=True,
                       help="send X-Request-Id: <run id>-<request_id> with every request (default on)")
    group.add_argument("--server-metrics-interval", type=float, default=1.0, metavar="S",
                       help="scrape every endpoint's Prometheus /metrics every S seconds, from the master "
                            "(default 1; 0: off); samples in OUTPUT.server-metrics.jsonl")
    group.add_argument("--server-metric", action="append", default=[], metavar="NAME",
                       help="also keep this /metrics series (a sample name, e.g. vllm:num_requests_swapped); repeatable")
    group.add_argument("--server-block-size", type=int, default=None, metavar="N",
                       help="the server's KV-cache block size: the end-of-run summary adds the cache fidelity section")
    group.add_argument("--web-user", default=None, metavar="USER:PASSWORD",
                       help="the web UI's login (turns on --web-login); $VAR in it is read from the environment")
    group.add_argument("--replay-config", default=None, help="YAML file of these options (flags win)")


# Option names (argparse dests) that travel from the master to workers in the plan.
OPTION_NAMES = (
    "trace", "trace_format", "block_size", "tokenizer", "chat_template", "api", "prompt_format", "verify_server", "model", "stream",
    "scale", "start", "duration", "max_requests", "seed", "output", "overwrite", "endpoints", "routing",
    "partition", "max_prompt_tokens", "drain_timeout", "no_ignore_eos", "on_bad_line", "slo", "header",
    "request_id_header", "server_metrics_interval", "server_metric", "server_block_size",
)  # fmt: skip

# Options the master (or a single process) uses itself: never shipped to workers nor written
# to the run's metadata, since the web UI's login holds a password (replay.locust.webauth).
LOCAL_OPTION_NAMES = ("web_user",)


@dataclass
class ReplayOptions:
    trace: str | None = None
    trace_format: str | None = None
    block_size: int | None = None
    tokenizer: str | None = None
    chat_template: str | None = None
    api: str = "openai-chat"
    prompt_format: str = "text"
    verify_server: str = "auto"
    model: str | None = None
    stream: bool = True
    scale: float = 1.0
    start: float | None = None
    duration: float | None = None
    max_requests: int | None = None
    seed: int = 0
    output: str | None = None
    overwrite: bool = False
    endpoints: str | None = None
    routing: str = "round-robin"
    partition: str = "round-robin"
    max_prompt_tokens: int | None = None
    drain_timeout: float = 60.0
    no_ignore_eos: bool = False
    on_bad_line: str = "fail"
    slo: str | None = None
    header: list | None = None
    request_id_header: bool = True
    server_metrics_interval: float = 1.0
    server_metric: list | None = None
    server_block_size: int | None = None

    @classmethod
    def from_parsed(cls, parsed) -> "ReplayOptions":
        apply_config_file(parsed)
        return cls(**{name: getattr(parsed, name, getattr(cls, name, None)) for name in OPTION_NAMES})

    @classmethod
    def from_dict(cls, data: dict) -> "ReplayOptions":
        return cls(**{name: data[name] for name in OPTION_NAMES if name in data})

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in OPTION_NAMES}

    def endpoint_urls(self, host: str | None) -> list[str]:
        urls = [u.strip() for u in (self.endpoints or "").split(",") if u.strip()]
        option = "--endpoints" if urls else "--host"
        if not urls and host:
            urls = [host]
        if not urls:
            raise ValueError("no server to send to: pass --host URL or --endpoints URL,...")
        for url in urls:
            check_url(option, url)
        return urls

    def check(self) -> None:
        """Errors a user can fix, found before any worker starts."""
        if not self.trace:
            raise ValueError("--trace is required")
        if not self.tokenizer:
            raise ValueError("--tokenizer is required (the prompts are synthesized to exact token counts)")
        if self.prompt_format == "token-ids" and self.api != TOKEN_ID_API:
            raise ValueError(f"--prompt-format token-ids: only with --api {TOKEN_ID_API}, not --api {self.api}")
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"--scale {self.scale}: must be a finite number > 0")
        if not (math.isfinite(self.drain_timeout) and self.drain_timeout >= 0):
            raise ValueError(f"--drain-timeout {self.drain_timeout}: must be a finite number of seconds >= 0")
        if self.start is not None and not math.isfinite(self.start):
            raise ValueError(f"--start {self.start}: must be a finite number of trace seconds")
        if self.duration is not None and not (math.isfinite(self.duration) and self.duration >= 0):
            raise ValueError(f"--duration {self.duration}: must be a finite number of seconds >= 0")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 0:
            raise ValueError(f"--max-prompt-tokens {self.max_prompt_tokens}: must be >= 0 (0: no limit)")
        if self.max_requests is not None and self.max_requests < 0:
            raise ValueError(f"--max-requests {self.max_requests}: must be >= 0")
        if not (math.isfinite(self.server_metrics_interval) and self.server_metrics_interval >= 0):
            raise ValueError(f"--server-metrics-interval {self.server_metrics_interval}: must be a finite number of "
                             "seconds >= 0 (0: off)")
        if self.server_block_size is not None and self.server_block_size < 1:
            raise ValueError(f"--server-block-size {self.server_block_size}: must be >= 1")
        if self.slo:
            parse_slo(self.slo)  # a bad --slo fails here, before any worker starts
        parse_headers(self.header)  # here, not on every worker


def prompt_token_limit(options: ReplayOptions, urls: list[str]) -> int | None:
    """--max-prompt-tokens, or the served model's max_model_len, or the default; None: no limit."""
    if options.max_prompt_tokens is not None:
        return options.max_prompt_tokens or None
    return served_max_model_len(urls, options.model, parse_headers(options.header)) or DEFAULT_MAX_PROMPT_TOKENS


def apply_config_file(parsed) -> None:
    """Merge --replay-config into `parsed` (YAML keys = option names without dashes; flags win)."""
    from replay.locust.config import apply_config  # config builds its key list from add_arguments

    apply_config(parsed)

"""The replay's options (docs/options.md lists them): what the engine runs with, and their flags.

Plain argparse and a dataclass, no Locust: the adapter adds the flags to Locust's own parser
(replay.locust.plugin), and the master ships the values to its workers in the plan. One list:
the fields of `ReplayOptions` (and `LocalOptions`) carry each flag's help and choices;
`add_arguments`, `OPTION_NAMES` and the config keys are derived from them. Every option is
also a key of `--replay-config FILE.yaml` (keys = option names without dashes);
replay.run.config merges that file, flags winning.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import Field, dataclass, field, fields
from typing import Any

from replay.engine.capacity import MAX_COOLDOWN_S, SEARCH_BY, check_search
from replay.engine.error_rate import DEFAULT_MAX_ERROR_RATE, MIN_ANSWERS
from replay.engine.error_rate import WINDOW_S as ERROR_WINDOW_S
from replay.engine.plan import PARTITIONS
from replay.engine.routing import ROUTINGS
from replay.engine.scraper import MIN_INTERVAL_S as MIN_SCRAPE_INTERVAL_S
from replay.errors import OptionError
from replay.protocol.ask import check_url
from replay.protocol.headers import parse_headers
from replay.protocol.models import Served, prompt_limit
from replay.protocol.table import API_NAMES, PROMPT_FORMATS, TOKEN_ID_APIS, prompt_format_problem
from replay.results.report import parse_slo
from replay.rules.send_time import TURN_FAILURES, TURN_TIMINGS
from replay.synth.tokenizer_source import TOKENIZER_HELP
from replay.trace.fields import DEFAULT_MAX_PROMPT_TOKENS, MAX_INT, block_size_problem

# Before the first send, ask each server to count a sample of prompts (replay.synth.server_check):
# auto checks where the server offers a way, require refuses a server that offers none.
VERIFY_SERVER = ("auto", "require", "off")


def _option(default: Any = None, help: str | None = None, *, parser_default: Any = None, **argparse_kwargs: Any) -> Any:
    """A field of the options and its flag, --<field name with dashes>. The field's type implies
    the argparse type or action (`_implied`); `help` and what the type cannot say (choices,
    metavar, `parser_default` where the parser's differs from the field's) ride in its metadata."""
    if parser_default is not None:
        argparse_kwargs["default"] = parser_default
    return field(default=default, metadata={"help": help, **argparse_kwargs})


def _implied(f: Field) -> dict[str, Any]:
    """The argparse keywords a field's type and default imply: int/float parse as such, a bool
    defaulting on gets --x/--no-x, one defaulting off is a plain switch, a list repeats."""
    base = str(f.type).split("|")[0].strip()
    if base == "bool":
        return {"action": argparse.BooleanOptionalAction if f.default else "store_true", "default": f.default}
    if base == "list":
        return {"action": "append", "default": f.default}
    return {"type": {"int": int, "float": float}.get(base), "default": f.default}


@dataclass
class ReplayOptions:
    """The replay's options, in `--help` order: each field is a flag, a key of --replay-config
    and a name of the plan the master ships to its workers (`OPTION_NAMES`)."""

    trace: str | None = _option(help="trace file to replay")
    trace_format: str | None = _option(help="mooncake, bailian, jsonl, azure, burstgpt (auto-detected)")
    block_size: int | None = _option(help="tokens per hash id block (format default)")
    tokenizer: str | None = _option(help=TOKENIZER_HELP)
    chat_template: str | None = _option(help="tokenizer_config.json or .jinja; overrides the tokenizer's")
    api: str = _option("openai-chat", "the protocol the servers speak: its request paths, bodies and replies", choices=API_NAMES)
    prompt_format: str = _option("text", "send the prompt as text or as a list of token ids (token-ids: --api "
                                         f"{' or '.join(TOKEN_ID_APIS)} only)", choices=tuple(PROMPT_FORMATS))
    verify_server: str = _option("auto", "before the first send, compare this tokenizer's prompt counts with the "
                                         "server's own (auto: where the server offers a way; require: refuse a server "
                                         "that offers none)", choices=VERIFY_SERVER)
    model: str | None = _option(help="model name sent in request bodies; every endpoint must serve it (GET /v1/models, "
                                     "TGI: /info) before the first send (default: the one model every endpoint serves)")
    stream: bool = _option(True, "stream responses (default on)")
    scale: float = _option(1.0, "time scale: 2 replays twice as fast")
    start: float | None = _option(help="start of the trace window, trace seconds")
    duration: float | None = _option(help="length of the trace window, trace seconds")
    max_requests: int | None = _option(help="replay at most N rows of the window")
    seed: int = _option(0, "prompt synthesis seed")
    output: str | None = _option(help="merged per-request JSONL (default results/replay-<time>.jsonl)")
    overwrite: bool = _option(False, "replace an earlier run's --output (and its .meta.json, .worker-N.jsonl); "
                                     "default: refuse")
    endpoints: str | None = _option(help="comma-separated server URLs (a fleet); default --host")
    routing: str = _option("round-robin", "how a worker picks the endpoint of each request among --endpoints", choices=ROUTINGS)
    max_prompt_tokens: int | None = _option(help="rows with longer prompts are recorded, never sent (default: the "
                                                 "served model's limit: max_model_len from GET /v1/models, TGI's "
                                                 "max_input_tokens from /info; else "
                                                 f"{DEFAULT_MAX_PROMPT_TOKENS}; 0: no limit)")
    partition: str = _option("round-robin", "how rows are split across workers", choices=PARTITIONS)
    turn_timing: str = _option("trace", "when a session's later turn is sent: at its trace time (trace); at its trace "
                                        "time but never before the previous turn's answer ended (not-before-answer); "
                                        "the trace's gap after that answer ended (after-answer). A closed-loop timing "
                                        "needs --partition session", choices=TURN_TIMINGS)
    on_turn_failure: str = _option("continue", "with a closed-loop --turn-timing, a failed turn: the session goes on "
                                               "(continue), or its remaining turns are recorded, never sent "
                                               "(stop-session)", choices=TURN_FAILURES)
    drain_timeout: float = _option(60.0, "seconds to wait for answers after the last send")
    max_error_rate: float = _option(DEFAULT_MAX_ERROR_RATE, "stop the run (exit 1) when more than this share of the "
                                    f"servers' answers fail, over the last {ERROR_WINDOW_S:g} s and at least the last "
                                    f"{MIN_ANSWERS} answers (default {DEFAULT_MAX_ERROR_RATE:g}; 1: never)",
                                    metavar="R")
    no_ignore_eos: bool = _option(False, "let the model stop early (default: exact output length)")
    on_bad_line: str = _option("fail", "a trace row that cannot be read: fail the run (exit 2), or skip it and count it",
                               choices=("fail", "skip"))
    slo: str | None = _option(help="ttft_ms=..,tpot_ms=..,e2e_ms=..")
    # A repeatable flag's parser default is [] (append adds to it); ReplayOptions() has None.
    header: list | None = _option(help="'Name: value' ($VAR expanded); repeatable", parser_default=[])
    request_id_header: bool = _option(True, "send X-Request-Id: <run id>-<request_id> with every request "
                                            "(default on)")
    session_header: str | None = _option(help="send each row's session id in this request header (for a "
                                              "recording proxy: `replay record --session-header NAME`)", metavar="NAME")
    server_metrics_interval: float = _option(1.0, "scrape every endpoint's Prometheus /metrics every S seconds, "
                                                  "from the master (default 1; 0: off); samples in "
                                                  "OUTPUT.server-metrics.jsonl", metavar="S")
    server_metric: list | None = _option(help="also keep this /metrics series (a sample name, e.g. "
                                              "vllm:num_requests_swapped); repeatable", parser_default=[],
                                         metavar="NAME")
    metrics_endpoint: list | None = _option(help="also scrape this Prometheus exporter's page (its URL; /metrics "
                                                 "when it has no path) with the servers' /metrics, into "
                                                 "OUTPUT.server-metrics.jsonl: GPU telemetry from NVIDIA "
                                                 "dcgm-exporter, charted per GPU (docs/reports.md#gpu-telemetry); "
                                                 "repeatable", parser_default=[], metavar="URL")
    server_block_size: int | None = _option(help="the server's KV-cache block size (default: what its /metrics "
                                                 "vllm:cache_config_info says): the end-of-run summary adds the "
                                                 "cache fidelity section", metavar="N")
    require_faithful: bool = _option(False, "exit 1 when the run's fidelity certificate (OUTPUT.fidelity.json, "
                                            "docs/fidelity.md) says unfaithful")
    server_cache_blocks: int | None = _option(help="the server's KV-cache size in blocks, as vLLM's num_gpu_blocks "
                                                   "(default: what its /metrics vllm:cache_config_info says): the "
                                                   "size of the cache model that explains cache misses",
                                              metavar="N")
    reset_server_cache: bool = _option(False, "empty every endpoint's prefix cache (POST /reset_prefix_cache: vLLM "
                                              "with VLLM_SERVER_DEV_MODE=1, replay sim) before the first send, so "
                                              "the run starts cold; a server that refuses: exit 2")
    capacity_search: bool = _option(False, "replay the window at a sequence of load factors and report the largest "
                                           "that meets --slo (docs/capacity.md)")
    goodput_target: float = _option(0.99, "a search's probe passes when this share of its rows is ok and meets every "
                                          "--slo limit", metavar="F")
    search_by: str = _option("amplify", "how a search's probe raises the load: amplify sends the window's sessions k "
                             "times at the trace's pace (as `replay trace amplify`); scale compresses its time",
                             choices=SEARCH_BY)
    search_range: str = _option("0.25:64", "the load factors a search tries, LO:HI", metavar="LO:HI")
    search_precision: float = _option(0.05, "a search ends when its bracket's HI/LO is within 1+P", metavar="P")
    probe_duration: float = _option(120.0, "the trace seconds each probe of a search replays", metavar="S")
    cooldown: float | None = _option(help="seconds between a search's probes (default: until the servers' /metrics "
                                          f"show nothing running nor waiting, at most {MAX_COOLDOWN_S:g} s)",
                                     metavar="S")

    @classmethod
    def from_parsed(cls, parsed) -> ReplayOptions:
        """The options as parsed; a --replay-config file is merged first by the caller
        (replay.run.config.replay_options), so this module needs nothing from config."""
        return cls(**{name: getattr(parsed, name, getattr(cls, name, None)) for name in OPTION_NAMES})

    @classmethod
    def from_dict(cls, data: dict) -> ReplayOptions:
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
        for f in fields(self):  # the plan travels to workers as msgpack, whose integers are 64-bit
            value = getattr(self, f.name)
            if type(value) is int and not -MAX_INT - 1 <= value <= MAX_INT:
                raise OptionError(f"--{f.name.replace('_', '-')} {value}: an integer beyond 64 bits")
        if not self.trace:
            raise ValueError("--trace is required")
        if not self.tokenizer:
            raise ValueError("--tokenizer is required (the prompts are synthesized to exact token counts)")
        if problem := prompt_format_problem(self.prompt_format, self.api):
            raise ValueError(problem)
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"--scale {self.scale}: must be a finite number > 0")
        if not (math.isfinite(self.drain_timeout) and self.drain_timeout >= 0):
            raise ValueError(f"--drain-timeout {self.drain_timeout}: must be a finite number of seconds >= 0")
        if not 0.0 <= self.max_error_rate <= 1.0:  # NaN fails every comparison
            raise OptionError(f"--max-error-rate {self.max_error_rate}: must be a number from 0 to 1 (1: never stop)")
        if self.start is not None and not math.isfinite(self.start):
            raise ValueError(f"--start {self.start}: must be a finite number of trace seconds")
        if self.duration is not None and not (math.isfinite(self.duration) and self.duration >= 0):
            raise ValueError(f"--duration {self.duration}: must be a finite number of seconds >= 0")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 0:
            raise ValueError(f"--max-prompt-tokens {self.max_prompt_tokens}: must be >= 0 (0: no limit)")
        if self.max_requests is not None and self.max_requests < 0:
            raise ValueError(f"--max-requests {self.max_requests}: must be >= 0")
        interval = self.server_metrics_interval
        if not (interval == 0 or (math.isfinite(interval) and interval >= MIN_SCRAPE_INTERVAL_S)):
            raise OptionError(f"--server-metrics-interval {interval}: must be 0 (off) or a finite number of seconds "
                              f">= {MIN_SCRAPE_INTERVAL_S}")
        for flag, size in (("--block-size", self.block_size), ("--server-block-size", self.server_block_size)):
            if size is not None and (problem := block_size_problem(size)):
                raise OptionError(f"{flag} {size}: {problem}")
        if self.server_cache_blocks is not None and self.server_cache_blocks < 0:
            raise OptionError(f"--server-cache-blocks {self.server_cache_blocks}: must be >= 0")
        if self.turn_timing != "trace" and self.partition != "session":  # each session's turns on one worker
            raise OptionError(f"--turn-timing {self.turn_timing} needs --partition session (a session's turns on one "
                              f"worker, which waits for each answer itself); got --partition {self.partition}")
        if self.slo:
            parse_slo(self.slo)  # a bad --slo fails here, before any worker starts
        if self.capacity_search:
            check_search(self)
        parse_headers(self.header)  # here, not on every worker
        for url in self.metrics_endpoint or ():
            check_url("--metrics-endpoint", url)


@dataclass
class LocalOptions:
    """Options the master (or a single process) uses itself: never shipped to workers nor
    written to the run's metadata, since the web UI's login holds a password
    (replay.locust.webauth), and what the master prints is nothing of what the run is. A
    dataclass only so their flags are declared as the others are."""

    web_user: str | None = _option(help="the web UI's login (turns on --web-login); $VAR in it is read from the "
                                        "environment", metavar="USER:PASSWORD")
    progress: bool = _option(True, "in a headless run, a progress line on stderr every few seconds: rows sent, "
                                   "ok and failed, trace time, elapsed, ETA, drift p99, in flight (default on)")


# Option names (argparse dests) that travel from the master to workers in the plan.
OPTION_NAMES = tuple(f.name for f in fields(ReplayOptions))
LOCAL_OPTION_NAMES = tuple(f.name for f in fields(LocalOptions))
CONFIG_FLAG = "--replay-config"  # not an option but a file of them (replay.run.config)


def add_arguments(parser) -> None:
    """The replay's flags on Locust's parser (or any argparse parser), from the two dataclasses."""
    group = parser.add_argument_group("trace replay")
    for f in (*fields(ReplayOptions), *fields(LocalOptions)):
        kwargs = {**_implied(f), **{k: v for k, v in f.metadata.items() if v is not None}}
        if kwargs.get("type") is None:
            kwargs.pop("type", None)
        group.add_argument("--" + f.name.replace("_", "-"), **kwargs)
    group.add_argument(CONFIG_FLAG, default=None, help="YAML file of these options (flags win)")


def prompt_token_limit(options: ReplayOptions, served: tuple[Served, ...]) -> int | None:
    """--max-prompt-tokens, or the served model's limit (replay.protocol.models), or the
    default; None: no limit."""
    if options.max_prompt_tokens is not None:
        return options.max_prompt_tokens or None
    return prompt_limit(served, options.model) or DEFAULT_MAX_PROMPT_TOKENS

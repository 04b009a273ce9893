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
from dataclasses import Field, dataclass, field, fields
from typing import Any

from replay.bounds import (
    BLOCK_SIZE,
    CACHE_BLOCKS,
    COUNT,
    DEFAULT_MAX_PROMPT_TOKENS,
    DURATION,
    HOUR_S,
    PROMPT_TOKENS,
    SCALE,
    SEED,
    START,
    WEEK_S,
    Bound,
)
from replay.engine.capacity import MAX_COOLDOWN_S, ON_OUTAGE, SEARCH_BY, check_search
from replay.engine.error_rate import DEFAULT_MAX_ERROR_RATE, MIN_ANSWERS
from replay.engine.error_rate import WINDOW_S as ERROR_WINDOW_S
from replay.engine.plan import PARTITIONS
from replay.engine.routing import ROUTINGS
from replay.engine.scraper import MIN_INTERVAL_S as MIN_SCRAPE_INTERVAL_S
from replay.errors import OptionError
from replay.output_claim import INPUT
from replay.protocol.ask import check_url
from replay.protocol.headers import parse_headers
from replay.protocol.models import Served, prompt_limit
from replay.protocol.table import API_NAMES, PROMPT_FORMATS, TOKEN_ID_APIS, prompt_format_problem
from replay.results.output import RUN_OUTPUT
from replay.results.report import parse_slo
from replay.rules.send_time import TURN_FAILURES, TURN_TIMINGS
from replay.synth.tokenizer_source import TOKENIZER_HELP

# Before the first send, ask each server to count a sample of prompts (replay.synth.server_check):
# auto checks where the server offers a way, require refuses a server that offers none.
VERIFY_SERVER = ("auto", "require", "off")

# The ranges of the run's own numbers (replay.bounds has those other commands share).
DRAIN_TIMEOUT = Bound(0.0, WEEK_S, unit="seconds")
MAX_ERROR_RATE = Bound(0.0, 1.0, why="1: never stop")
SCRAPE_INTERVAL = Bound(MIN_SCRAPE_INTERVAL_S, HOUR_S, unit="seconds", off=0)
GOODPUT_TARGET = Bound(0.01, 1.0)  # a probe judged by under 1% of its rows says nothing
SEARCH_PRECISION = Bound(0.001, 1.0, why="a bracket narrower than 0.1% is noise between probes")
PROBE_DURATION = Bound(0.001, WEEK_S, unit="trace seconds")
COOLDOWN = Bound(0.0, HOUR_S, unit="seconds")
OTLP_WAIT = Bound(0.0, HOUR_S, unit="seconds")  # a server's exporter sends its batch every few seconds


def _option(default: Any = None, help: str | None = None, *, parser_default: Any = None, bound: Bound | None = None,
            **argparse_kwargs: Any) -> Any:
    """A field of the options and its flag, --<field name with dashes>. The field's type implies
    the argparse type or action (`_implied`); `help` and what the type cannot say (choices,
    metavar, `parser_default` where the parser's differs from the field's) ride in its metadata.
    A number's `bound` (replay.bounds) is its flag's type, and `check` holds a value that came
    another way (the config file, the web UI's form) to it."""
    if parser_default is not None:
        argparse_kwargs["default"] = parser_default
    if bound is not None:
        argparse_kwargs["type"] = bound
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

    trace: str | None = _option(help="trace file to replay", type=INPUT)
    trace_format: str | None = _option(help="mooncake, bailian, jsonl, azure, burstgpt (auto-detected)")
    block_size: int | None = _option(help="tokens per hash id block (format default)", bound=BLOCK_SIZE)
    tokenizer: str | None = _option(help=TOKENIZER_HELP, type=INPUT)
    chat_template: str | None = _option(help="tokenizer_config.json or .jinja; overrides the tokenizer's", type=INPUT)
    api: str = _option("openai-chat", "the protocol the servers speak: its request paths, bodies and replies", choices=API_NAMES)
    prompt_format: str = _option("text", "send the prompt as text or as a list of token ids (token-ids: --api "
                                         f"{' or '.join(TOKEN_ID_APIS)} only)", choices=tuple(PROMPT_FORMATS))
    verify_server: str = _option("auto", "before the first send, compare this tokenizer's prompt counts with the "
                                         "server's own (auto: where the server offers a way; require: refuse a server "
                                         "that offers none)", choices=VERIFY_SERVER)
    model: str | None = _option(help="model name sent in request bodies; every endpoint must serve it (GET /v1/models, "
                                     "TGI: /info) before the first send (default: the one model every endpoint serves)")
    stream: bool = _option(True, "stream responses (default on)")
    scale: float = _option(1.0, "time scale: 2 replays twice as fast", bound=SCALE)
    start: float | None = _option(help="start of the trace window, trace seconds (default: the trace's beginning)", bound=START)
    duration: float | None = _option(help="length of the trace window, trace seconds from --start, else from the first row's time (a trace not in time order needs --start)", bound=DURATION)
    max_requests: int | None = _option(help="replay at most N rows of the window", bound=COUNT)
    seed: int = _option(0, "prompt synthesis seed", bound=SEED)
    output: str | None = _option(help="merged per-request JSONL (default results/replay-<time>.jsonl)", type=RUN_OUTPUT)
    overwrite: bool = _option(False, "replace an earlier run's --output (and its .meta.json, .worker-N.jsonl); "
                                     "default: refuse")
    endpoints: str | None = _option(help="comma-separated server URLs (a fleet); default --host", metavar="URL,...")
    routing: str = _option("round-robin", "how a worker picks the endpoint of each request among --endpoints", choices=ROUTINGS)
    max_prompt_tokens: int | None = _option(help="rows with longer prompts are recorded, never sent (default: the "
                                                 "served model's limit: max_model_len from GET /v1/models, TGI's "
                                                 "max_input_tokens from /info; else "
                                                 f"{DEFAULT_MAX_PROMPT_TOKENS}; 0: no limit)", bound=PROMPT_TOKENS)
    partition: str = _option("round-robin", "how rows are split across workers", choices=PARTITIONS)
    turn_timing: str = _option("trace", "when a session's later turn is sent: at its trace time (trace); at its trace "
                                        "time but never before the previous turn's answer ended (not-before-answer); "
                                        "the trace's gap after that answer ended (after-answer). A closed-loop timing "
                                        "needs --partition session", choices=TURN_TIMINGS)
    on_turn_failure: str = _option("continue", "with a closed-loop --turn-timing, a failed turn: the session goes on "
                                               "(continue), or its remaining turns are recorded, never sent "
                                               "(stop-session)", choices=TURN_FAILURES)
    drain_timeout: float = _option(60.0, "seconds to wait for answers after the last send", bound=DRAIN_TIMEOUT)
    max_error_rate: float = _option(DEFAULT_MAX_ERROR_RATE, "stop the run (exit 1) when more than this share of the "
                                    f"servers' answers fail, over the last {ERROR_WINDOW_S:g} s and at least the last "
                                    f"{MIN_ANSWERS} answers (default {DEFAULT_MAX_ERROR_RATE:g}; 1: never)",
                                    metavar="R", bound=MAX_ERROR_RATE)
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
                                                  "OUTPUT.server-metrics.jsonl", metavar="S",
                                                  bound=SCRAPE_INTERVAL)
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
                                                 "cache fidelity section", metavar="N", bound=BLOCK_SIZE)
    require_faithful: bool = _option(False, "exit 1 when the run's fidelity certificate (OUTPUT.fidelity.json, "
                                            "docs/fidelity.md) says other than faithful (unfaithful, warm-cache, "
                                            "busy-host)")
    server_cache_blocks: int | None = _option(help="the server's KV-cache size in blocks, as vLLM's num_gpu_blocks "
                                                   "(default: what its /metrics vllm:cache_config_info says): the "
                                                   "size of the cache model that explains cache misses",
                                              metavar="N", bound=CACHE_BLOCKS)
    reset_server_cache: bool = _option(False, "empty every endpoint's prefix cache (POST /reset_prefix_cache: vLLM "
                                              "with VLLM_SERVER_DEV_MODE=1, replay sim) before the first send, so "
                                              "the run starts cold; a server that refuses: exit 2")
    check_server_timing: bool = _option(False, "before the first send, ask each endpoint with one request (one output "
                                             "token) whether its answers carry its own per-request timing (vLLM's "
                                             "--enable-per-request-metrics) and say so; off by default, because that "
                                             "request reaches the server (a recording proxy records it). The records "
                                             "keep what the answers carry either way")
    capacity_search: bool = _option(False, "replay the window at a sequence of load factors and report the largest "
                                           "that meets --slo (docs/capacity.md)")
    goodput_target: float = _option(0.99, "a search's probe passes when this share of its rows is ok and meets every "
                                          "--slo limit", metavar="F", bound=GOODPUT_TARGET)
    search_by: str = _option("amplify", "how a search's probe raises the load: amplify sends the window's sessions k "
                             "times at the trace's pace (as `replay trace amplify`); scale compresses its time",
                             choices=SEARCH_BY)
    search_range: str = _option("0.25:64", "the load factors a search tries, LO:HI", metavar="LO:HI")
    search_precision: float = _option(0.05, "a search ends when its bracket's HI/LO is within 1+P", metavar="P",
                                      bound=SEARCH_PRECISION)
    probe_duration: float = _option(120.0, "the trace seconds each probe of a search replays", metavar="S",
                                    bound=PROBE_DURATION)
    cooldown: float | None = _option(help="seconds between a search's probes (default: until the servers' /metrics "
                                          f"show nothing running nor waiting, at most {MAX_COOLDOWN_S:g} s)",
                                     metavar="S", bound=COOLDOWN)
    on_outage: str = _option("stop", "when a search's probe fails because the servers stopped answering or answered "
                                     "errors, not because of the load: stop the search (exit 1), or retry the probe "
                                     "once they answer again (docs/capacity.md)", choices=ON_OUTAGE)
    otlp_receiver: str | None = _option(help="receive the servers' OTLP/HTTP trace spans on HOST:PORT (POST "
                                             "/v1/traces; vLLM: --otlp-traces-endpoint http://THIS_HOST:PORT/v1/"
                                             "traces) and join each request's span to its record by X-Request-Id: "
                                             "the server's queue, prefill and decode times (docs/otlp.md)",
                                        metavar="HOST:PORT")
    otlp_wait: float = _option(15.0, "with --otlp-receiver, at the end, wait at most S seconds for the spans of the "
                                     "ok records that have none yet (default 15: exporters send every few seconds)",
                               metavar="S", bound=OTLP_WAIT)

    @classmethod
    def from_parsed(cls, parsed) -> ReplayOptions:
        """The options as parsed; a --replay-config file is merged first by the caller
        (replay.run.config.replay_options), so this module needs nothing from config."""
        values: dict[str, Any] = {name: getattr(parsed, name, getattr(cls, name, None)) for name in OPTION_NAMES}
        return cls(**values)

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
        for f in fields(self):  # a flag's value was checked when parsed; the config file's, the web UI's were not
            value = getattr(self, f.name)
            bound = f.metadata.get("type")
            if isinstance(bound, Bound) and value is not None and (problem := bound.problem(value)):
                raise OptionError(f"--{f.name.replace('_', '-')} {value}: {problem}")
        if not self.trace:
            raise ValueError("--trace is required")
        if not self.tokenizer:
            raise ValueError("--tokenizer is required (the prompts are synthesized to exact token counts)")
        if problem := prompt_format_problem(self.prompt_format, self.api):
            raise ValueError(problem)
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

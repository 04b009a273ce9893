"""Where a run starts: every check and every load before anything is sent, in two steps.

1. `load(options, host)` -> RunSpec (replay.engine.spec): the options checked, the output claimed
   (replay.results.output), the tokenizer resolved (a path, or a Hugging Face id in this
   host's cache: replay.synth.tokenizer_source) and loaded once for its fingerprint
   (replay.engine.same_tokenizer), the endpoints asked what they serve (replay.protocol.models:
   the model when --model is not given, and the prompt limit,
   replay.engine.options.prompt_token_limit) and their KV caches (replay.protocol.server_cache:
   block size and pool size, for the cache model), the trace read, validated and spooled into the
   Schedule (replay.engine.plan), its hash, the bad lines logged, and a window with no rows,
   with none under the prompt limit, or longer than any replay refused; --otlp-receiver started
   (replay.results.otlp_receiver: a port in use is refused here).
2. `check_servers(spec)`: every endpoint answered and serves the model, or ServersRefused;
   then the verdict of --verify-server (replay.synth.server_check), which the caller hands to
   the Coordinator for the meta file.

They are two because a stop can come between them: once the trace is read, the caller builds
the Coordinator (replay.engine.coordinator) before the server check, so that a signal during
the check finds the rows and records every one as "run stopped" (replay.locust.plugin's
`_stop_on_signals`), and a ServersRefused records every one as refused. Every refusal is one
line (TraceError, ValueError or OSError; OptionError names the option) that the caller turns
into exit code 2. The run ends in replay.run.finish.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence

from replay.engine.capacity import MIN_PROBE_ROWS, parse_range
from replay.engine.dispatcher import build_off_loop
from replay.engine.options import ReplayOptions, prompt_token_limit
from replay.engine.plan import Schedule, check_replay_length
from replay.engine.same_tokenizer import master_fingerprint, master_tokenizer
from replay.engine.spec import RunSpec, TraceFacts
from replay.engine.threads import off_loop
from replay.errors import OptionError
from replay.output_claim import Read, Written, declared_inputs
from replay.protocol.headers import parse_headers
from replay.protocol.models import Served, ask_served, only_model, prompt_limit, refusal
from replay.protocol.server_cache import CacheNotReset, reset_prefix_caches, server_caches
from replay.protocol.table import sends_token_ids
from replay.protocol.timing_check import SENT as TIMING_SENT
from replay.protocol.timing_check import ask_server_timing
from replay.results.metadata import file_sha256, versions
from replay.results.otlp_receiver import SpanReceiver
from replay.results.output import claim_output
from replay.results.records import OVERSIZED
from replay.rules.run_files import spans_path
from replay.synth.server_check import Verdict, skip_reason, verify_servers
from replay.trace.amplify import Clones
from replay.trace.reader import TraceStream

logger = logging.getLogger(__name__)

MAX_SKIPPED_SHOWN = 20  # --on-bad-line skip: lines listed in the log (all are counted)


def default_output() -> str:
    return time.strftime("results/replay-%Y%m%d-%H%M%S.jsonl", time.gmtime())


def load(options: ReplayOptions, host: str | None, others: Sequence[Written] = (),
         reads: Sequence[Read] = ()) -> RunSpec:
    """Check and load everything a run needs before a worker gets anything (see the module's
    docstring); `host` is the runner's target host (--host; --endpoints wins). The output stays claimed (locked) for this process's life; on a refusal
    here it is released. Sets `options.output` to the output claimed. `others` and `reads`: the
    files the run writes and reads that are not its options' (replay.locust.outputs: Locust's
    reports, --replay-config), claimed with --output."""
    options.check()
    urls = options.endpoint_urls(host)
    # The output is decided and locked here (held until this process exits), before anything
    # could write it; an earlier run's files go now, only with --overwrite.
    claim = claim_output(options.output or default_output(), overwrite=options.overwrite,
                         default=options.output is None, inputs=[*declared_inputs(options), *reads],
                         others=others)
    spans = None
    try:
        options.output = claim.output
        # --otlp-receiver listens from here on (a port in use: refused now, exit 2), its file the run's own
        spans = SpanReceiver.start(options.otlp_receiver, spans_path(claim.output)) if options.otlp_receiver else None
        return _load(options, host, urls, claim, spans)
    except BaseException:
        if spans is not None:
            spans.stop()
        claim.release()
        raise


def _load(options: ReplayOptions, host: str | None, urls: list[str], claim, spans: SpanReceiver | None) -> RunSpec:
    # Loaded here (unless this host's set-up cache shows it loaded before), so an unloadable
    # --tokenizer is refused before any worker starts; the fingerprint goes in the plan, for
    # each worker to prove it has the same (same_tokenizer). Off the event loop: a cold load
    # makes the set-up, a second or more of CPU, and workers' messages keep coming meanwhile.
    assert options.trace is not None and options.tokenizer is not None  # options.check() refused a run without
    tokenizer = master_tokenizer(options.tokenizer)  # a Hugging Face id: its snapshot; the options keep the id
    fingerprint = off_loop(master_fingerprint, tokenizer, options.chat_template, options.api)
    read_started = time.perf_counter()
    trace = TraceStream(options.trace, options.trace_format, options.block_size, options.on_bad_line)
    served = ask_served(urls, options.api, parse_headers(options.header))
    if options.model is None and (model := only_model(served)) is not None:
        options.model = model  # in the request bodies, the server check's and the plan's options
        logger.info("no --model: every endpoint serves %r, the run's model", model)
    max_prompt_tokens = prompt_token_limit(options, served)
    answering = [url for url, s in zip(urls, served) if s.problem is None]  # a dead one is refused later
    server_cache = server_caches(answering, block_size=options.server_block_size,
                                 cache_blocks=options.server_cache_blocks, headers=parse_headers(options.header))
    # a capacity search's probe replays the first --probe-duration seconds of the window
    duration = options.probe_duration if options.capacity_search else options.duration
    schedule = Schedule(trace, options.start, duration, options.max_requests, max_prompt_tokens)
    try:
        for bad in trace.skipped[:MAX_SKIPPED_SHOWN]:
            logger.warning("skipped %s", bad)
        if len(trace.skipped) > MAX_SKIPPED_SHOWN:
            logger.warning("... and %d more bad rows skipped", len(trace.skipped) - MAX_SKIPPED_SHOWN)
        facts = TraceFacts(path=trace.path, format=trace.format, block_size=trace.block_size,
                           sha256=off_loop(file_sha256, trace.path),  # for both metas: the first and the end's
                           skipped=tuple(str(bad) for bad in trace.skipped))
        versions()  # known now: its first call yields, and the run's begin must not (a second Start would come in)
        spec = RunSpec(options=options, output=claim.output, run_id=uuid.uuid4().hex[:12], schedule=schedule,
                       trace=facts, max_prompt_tokens=max_prompt_tokens, tokenizer_fingerprint=fingerprint,
                       tokenizer_path=tokenizer,
                       host=host, claim=claim, served=served, server_cache=server_cache, spans=spans)
        if not spec.total:  # a run of nothing would "succeed" with no record at all
            length = (f"--probe-duration {options.probe_duration:g}" if options.capacity_search
                      else f"--duration {options.duration}")  # the window a search's probe replays
            raise ValueError(f"{trace.path}: no rows to replay in the window (--start {options.start}, "
                             f"{length}, --max-requests {options.max_requests}; "
                             f"the trace has {schedule.trace_rows} rows)")
        if not len(schedule):  # every row over the prompt limit: the run would send nothing
            raise _nothing_under_the_limit(options, schedule, max_prompt_tokens, served)
        check_replay_length(schedule.window_s, options.scale, options.start)
        check_turn_timing(options, schedule, trace)
        if options.capacity_search and schedule.latest - schedule.origin < options.probe_duration:
            raise OptionError(f"--probe-duration {options.probe_duration:g}: longer than the window (the trace has "
                              f"{max(schedule.latest - schedule.origin, 0.0):g} s from the window's start)")
        if options.capacity_search and spec.total < MIN_PROBE_ROWS:
            raise OptionError(f"--probe-duration {options.probe_duration:g}: a probe would replay {spec.total} rows of "
                              f"the trace; judging its goodput takes at least {MIN_PROBE_ROWS}")
        if options.capacity_search and options.search_by == "amplify":
            check_lowest_probe(options, schedule)
    except BaseException:
        schedule.close()
        raise
    logger.info(
        "trace %s (%s, block %s): %d rows, %d in the window, %.1f s at scale %g (read in %.1f s)",
        trace.path, trace.format, trace.block_size, schedule.trace_rows, spec.total,
        spec.window_seconds, options.scale, time.perf_counter() - read_started,
    )  # fmt: skip
    if schedule.oversized:
        logger.warning("%d rows have prompts over --max-prompt-tokens %d: recorded as %r, never sent",
                       len(schedule.oversized), max_prompt_tokens, OVERSIZED)
    return spec


def _nothing_under_the_limit(options: ReplayOptions, schedule: Schedule, limit: int | None,
                             served: tuple[Served, ...]) -> ValueError:
    """The refusal of a window whose every row is over the prompt limit, naming where the limit
    came from and the shortest row, the limit that would let one through."""
    shortest = min(row.input_length for row in schedule.oversized_rows())
    if options.max_prompt_tokens:
        where = f"--max-prompt-tokens {options.max_prompt_tokens}"
    elif prompt_limit(served, options.model) == limit:
        where = f"the served model's prompt limit, {limit} (its max_model_len; --max-prompt-tokens sets another)"
    else:
        where = f"the default prompt limit, {limit} (--max-prompt-tokens sets another)"
    return OptionError(f"{where}: every one of the {len(schedule.oversized)} rows in the window has a longer prompt "
                       f"(the shortest: {shortest} tokens); nothing would be sent")


def check_lowest_probe(options: ReplayOptions, schedule: Schedule) -> None:
    """A search by amplify samples whole sessions below 1x: at the range's low end a probe may
    keep too few rows to judge, or none (a probe that would wait for answers that never come).
    Refused here, naming the options, rather than found by the search."""
    low = parse_range(options.search_range)[0]
    if low >= 1:
        return
    rows = Clones(schedule.found_sessions(), low, options.seed).rows()
    if rows < MIN_PROBE_ROWS:
        raise OptionError(f"--search-range {options.search_range}: at {low:g}x a probe replays {rows} rows of the "
                          f"window (--probe-duration {options.probe_duration:g}); judging its goodput takes at least "
                          f"{MIN_PROBE_ROWS}: raise the range's low end or lengthen --probe-duration")


def check_turn_timing(options: ReplayOptions, schedule: Schedule, trace: TraceStream) -> None:
    """A closed-loop --turn-timing on a window with no session of two turns or more would send
    every row at its trace time, as `trace` does, while the run's options (its meta file, and a
    `replay compare` of it) said its turns waited for their answers: refused, naming the remedy.
    A search's amplified probes have sessions of their own, inferred from the hash ids."""
    if options.turn_timing == "trace" or schedule.has_turns():
        return
    if options.capacity_search and options.search_by == "amplify":
        return
    n = schedule.sessions
    why = (f"each of its sessions has one turn in the window ({n} session{'s' if n > 1 else ''})" if n
           else f"its rows ({trace.format}) carry no session")
    raise OptionError(f"--turn-timing {options.turn_timing}: {trace.path}: {why}, so every row would be sent at its "
                      f"trace time, as with --turn-timing trace; to give its conversations sessions: replay trace "
                      f"amplify {trace.path} OUT.jsonl --factor 1 (sessions inferred from shared hash ids), then "
                      f"--trace OUT.jsonl; or leave out --turn-timing")


class ServersRefused(ValueError):
    """An endpoint did not answer what it serves, or does not serve the run's model: refused
    before the first send, with every row recorded (the caller's Coordinator.refuse)."""


def check_servers(spec: RunSpec) -> dict:
    """Every endpoint answered what it serves and serves the model (replay.protocol.models), or
    ServersRefused; then --verify-server: the servers count a sample of this run's prompts as
    the tokenizer does, or the run is refused here (ServerCountsDiffer, a ValueError), before any
    worker starts (replay.synth.server_check). Returns the verdict for the meta file."""
    options, urls = spec.options, spec.endpoint_urls()
    if problem := refusal(spec.served, options.model):
        raise ServersRefused(problem)
    if options.reset_server_cache:  # the last question before the workers start: the run's first send follows
        try:
            reset_prefix_caches(urls, parse_headers(options.header))
        except CacheNotReset as e:
            raise ServersRefused(str(e)) from None
        for cache in (spec.server_cache or {}).values():
            cache["reset"] = True
    timing = {"server_timing": server_timing(urls, options)} if options.check_server_timing else {}
    skipped = skip_reason(options.verify_server, sends_token_ids(options.prompt_format))
    if skipped or not urls:
        return {**Verdict(skipped=skipped or "no server").to_dict(), **timing}
    synth = build_off_loop(options, spec.trace.block_size, tokenizer_path=spec.tokenizer_path).synth
    assert options.tokenizer is not None  # a spec's options were checked: they name one
    verdict = verify_servers(urls, synth, spec.tokenizer_path or options.tokenizer, mode=options.verify_server,
                             model=options.model, headers=parse_headers(options.header),
                             lengths=spec.schedule.input_lengths,
                             max_len=prompt_limit(spec.served, options.model) or spec.max_prompt_tokens).to_dict()
    return {**verdict, **timing}


def server_timing(urls: list[str], options: ReplayOptions) -> dict[str, str]:
    """--check-server-timing: whether each endpoint tells its own per-request timing
    (replay.protocol.timing_check), logged; one that does not leaves its records' server fields
    null, never a refused run."""
    said = ask_server_timing(urls, options.api, options.model, parse_headers(options.header))
    for endpoint, answer in said.items():
        if answer == TIMING_SENT:
            logger.info("%s sends its per-request timing: the records get its queue, prefill and decode times",
                        endpoint)
        else:
            logger.warning("%s per-request timing: %s; its records' server_* fields stay null (vLLM: start it "
                           "with --enable-per-request-metrics)", endpoint, answer)
    return said

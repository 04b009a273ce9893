"""Where a run ends: once the engine has a record for every row (replay.engine.coordinator's
`_finalize` fills the rows left without one with their labels), `finish` merges the records
(the RecordStore's sorted rewrite), builds the summary (replay.results.report) with its server
and cache sections and the fidelity certificate (replay.results.certificate, from the same pass
over the merged file: the finish reads what the run wrote), writes OUTPUT.summary.json and
OUTPUT.fidelity.json, prints the summary, writes the last meta file
(OUTPUT.meta.json, naming any file a failed write left incomplete) and returns the exit code.

Everything it needs comes in as values: the run's spec (replay.engine.spec, made by
replay.run.preflight), the store, what the engine learned (RunFacts), and the files found
incomplete so far. A file that cannot be written here (a full disk) goes to `on_fault`, which
adds it to `incomplete` (replay.results.files): the run's other files are still written.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from replay.engine.capacity import with_server_timing
from replay.engine.spec import RunFacts, RunSpec
from replay.engine.threads import off_loop
from replay.errors import OutputError
from replay.results.cache_section import (
    CacheJob,
    CacheStream,
    cache_job,
    cache_section,
    cache_section_here,
    cache_skipped,
)
from replay.results.certificate import FAITHFUL, CertificateBuilder
from replay.results.metadata import trace_notes, write_capacity, write_fidelity, write_run_metadata, write_summary
from replay.results.records import Record, is_failure
from replay.results.report import ReportBuilder, format_report, parse_slo
from replay.results.server_metrics import judge_usage, read_server_section
from replay.results.server_time import ServerTimeBuilder
from replay.results.span_join import format_section
from replay.results.store import RecordStore
from replay.rules.capacity_result import NO_ANSWER, quotable_line
from replay.rules.run_files import meta_path, tmp_path
from replay.run.spans import join_spans

if TYPE_CHECKING:
    from replay.synth.prompts import PromptSynthesizer

logger = logging.getLogger(__name__)
CACHE_FOLLOW_ENV = "TRACEREPLAY_CACHE_FOLLOW"
# A single-process run of at most this many rows computes its cache section at its end, in its
# own process (`cache_here`): a fraction of a second of work with the worker's set-up at hand.
CACHE_HERE_ROWS = 500
CACHE_HERE_TOKENS = 1_000_000  # and of at most this many prompt tokens (rows x the longest): a second or less


def finish(spec: RunSpec, store: RecordStore, facts: RunFacts, incomplete: dict[str, str],
           on_fault: Callable[[OutputError], None], listeners: Iterable[Callable[[Record], None]] = (),
           summary_listeners: Iterable[Callable[[dict], None]] = (), least_code: int = 0,
           capacity: dict | None = None, cache_stream: CacheStream | None = None, cache_here: bool = False,
           run_synth: PromptSynthesizer | None = None) -> int:
    """End the run whose every row has a record in `store`; returns the exit code: 1 when any
    row failed for a reason other than the user's stop, or a file of the run is not whole, else 0;
    never under `least_code` (2: a run refused before the first send, whose rows all fail).
    `incomplete` ({file: why}) is the engine's, which `on_fault` adds to; `listeners` see every
    record of the merged file, `summary_listeners` the summary as printed and written (the live
    Replay view's final counts and figures: one computation of each, the summary's).

    A capacity search's (`capacity`: replay.engine.capacity.capacity_report) goes to
    OUTPUT.capacity.json and the summary's last line; its exit code is the search's (1: no
    capacity found: below LO, client-limited, workers lost, outage, server errors, stopped), not
    its rows' (a failing probe's rows fail by design). With --require-faithful, a certificate
    not faithful makes it 1 too. `cache_here`: the cache section is computed in this process
    (`cache_here` below), not in a child, from the blocks of `run_synth` (the worker's
    PromptSynthesizer) when given."""
    builder = ReportBuilder(parse_slo(spec.options.slo))
    fidelity = CertificateBuilder(ignore_eos=not spec.options.no_ignore_eos)
    failed = 0

    def each(record: Record) -> None:
        nonlocal failed
        builder.add(record)
        fidelity.add(record)
        failed += is_failure(record)
        for listener in listeners:
            listener(record)

    spans = join_spans(spec, store)  # --otlp-receiver's: each record's server fields filled from its span
    probe_times: dict[int, ServerTimeBuilder] = {}  # a search's probes' splits, spans' fields included

    def add_probe_time(record: Record) -> None:
        probe = record.get("probe")
        if probe is not None:
            probe_times.setdefault(probe, ServerTimeBuilder()).add(record)

    if capacity is not None and spans is not None:
        listeners = [*listeners, add_probe_time]
    count = store.finish(each, fill=spans.fill if spans is not None else None)
    if probe_times and capacity is not None:
        capacity = with_server_timing(capacity, {probe: b.section() for probe, b in probe_times.items()})
    spec.schedule.close()
    whole = not incomplete and not store.unwritten  # every record in the appended file the stream read
    report = builder.report(_cache_section(spec, facts, cache_stream if whole else None, cache_here, run_synth))
    if cache_stream is not None:
        cache_stream.stop()
    if spans is not None:
        report["spans"] = spans.section()
    report["server"] = read_server_section(spec.output, report["endpoints"], spec.options.server_metric or ())
    report["fidelity"] = certificate = fidelity.certificate(report["drift_ms"], report["cache"], report["server"],
                                                            facts.host_load,
                                                            cache_skipped({"options": spec.options.to_dict()}))
    judge_usage(report["server"], certificate.get("usage"))
    for listener in summary_listeners:
        listener(report)
    for write, document in ((write_summary, report), (write_fidelity, certificate)):
        try:
            write(spec.output, document)
        except OutputError as e:
            on_fault(e)
    tail = ""
    if capacity is not None:
        report["capacity"] = capacity
        try:
            write_capacity(spec.output, capacity)
        except OutputError as e:
            on_fault(e)
        tail = quotable_line(capacity) + "\n"
    spans_lines = format_section(report["spans"], spans.path) if spans is not None else ""
    sys.stdout.write(format_report(report) + f"\nrecords: {count} -> {spec.output}\n" + _trace_notes(spec, store)
                     + spans_lines + tail)
    sys.stdout.flush()
    code = max(_write_last_meta(spec, store, facts, incomplete), least_code)
    if capacity is not None:
        if capacity["result"] in NO_ANSWER:
            code = max(code, 1)
            logger.error("capacity search: %s: exit code %d", capacity["result"], code)
    elif failed:
        code = max(code, 1)
        logger.error("%d of %d rows failed: exit code %d", failed, count, code)
    if spec.options.require_faithful and certificate["verdict"] != FAITHFUL:
        code = max(code, 1)
        logger.error("fidelity: %s (%s), --require-faithful: exit code %d", certificate["verdict"],
                     "; ".join(certificate["failing"]), code)
    return code


def _cache_job(spec: RunSpec, facts: RunFacts, *, check_trace: bool = True) -> CacheJob | None:
    """The run's cache job (replay.results.cache_section.cache_job); None without a server block size."""
    return cache_job(spec.output, spec.metadata(facts), server_block_size=spec.options.server_block_size,
                     server_cache_blocks=spec.options.server_cache_blocks, check_trace=check_trace, out=None)


def cache_here(spec: RunSpec, single_process: bool) -> bool:
    """Whether the run's end computes the cache section in this process, with no follower and no
    child: a single-process run (its worker's tokenizer and set-up are in this process already)
    of at most CACHE_HERE_ROWS rows and CACHE_HERE_TOKENS prompt tokens. A child would load them
    again, and its memory would add to this process's while both live (the run's peak); the
    end's work is a fraction of a second. Longer prompts are made again by the follower while
    the run sends, not at its end. $TRACEREPLAY_CACHE_FOLLOW=1 starts the follower whatever the
    run (its tests)."""
    longest = spec.schedule.input_lengths[1] if spec.schedule.input_lengths else 0
    return (single_process and spec.total <= CACHE_HERE_ROWS and spec.total * longest <= CACHE_HERE_TOKENS
            and os.environ.get(CACHE_FOLLOW_ENV) != "1")


def start_cache_stream(spec: RunSpec, facts: RunFacts, first_request_id: int) -> CacheStream | None:
    """Start computing the run's cache section while it replays (replay.results.cache_section.
    CacheStream), called at the go: its records file is open and the servers' first counters
    are read. None when the run has no cache section (no server block size) or its job cannot
    be made (the end says why, as before), or $TRACEREPLAY_CACHE_FOLLOW is 0 (benchmarks: the
    end computes the section, docs/testing.md). `first_request_id`: the run's lowest (its
    record store's first)."""
    if os.environ.get(CACHE_FOLLOW_ENV) == "0":
        return None
    try:
        job = _cache_job(spec, facts, check_trace=False)  # the trace is hashed at the end, off the event loop
    except (ValueError, OSError):
        return None
    if job is None:
        return None
    stream = CacheStream()
    stream.start(job, first_request_id=first_request_id)
    return stream


def _cache_section(spec: RunSpec, facts: RunFacts, stream: CacheStream | None = None,
                   here: bool = False, run_synth: PromptSynthesizer | None = None) -> dict | None:
    """The Prefix Cache Fidelity section, with the cache model's miss attribution, as `replay
    report` makes it, from the merged file in a child process (replay.results.cache_section:
    this process never loads the tokenizer, and the event loop turns meanwhile), whenever the
    server's block size is known (what its /metrics said before the run, or
    --server-block-size); a failure to compute it is logged and leaves the summary without it.
    The run's metadata it reads is made only then. `stream`'s section (computed while the run
    replayed) is taken when it is the same job's; `here`: computed in this process (`cache_here`)."""
    try:
        job = _cache_job(spec, facts)
        if job is None:
            return None
        if stream is not None and (section := off_loop(stream.section, job)) is not None:
            return section
        if here:
            return off_loop(cache_section_here, job, run_synth)
        return off_loop(cache_section, job)[0]
    except (ValueError, OSError) as e:
        logger.error("cache fidelity: %s", e)
        return None


def _trace_notes(spec: RunSpec, store: RecordStore) -> str:
    """Rows of the trace the run left out, or whose record the disk did not take, said where the summary is read."""
    return trace_notes(len(spec.trace.skipped), len(spec.schedule.oversized), spec.max_prompt_tokens, store.unwritten)


def _write_last_meta(spec: RunSpec, store: RecordStore, facts: RunFacts, incomplete: dict[str, str]) -> int:
    """The meta, last: it names every file a failed write left incomplete (the records as
    appended when the sorted rewrite failed: whole, each row once, not sorted); with any, the
    exit code is 1 (returned) and one line says where that is written, or that it could not be."""
    output = spec.output
    incomplete = dict(incomplete)
    if store.unwritten:
        incomplete[str(output)] = (incomplete.get(str(output), "") +
                                   f"; {store.unwritten} rows have no record in it").lstrip("; ")
    tmp = str(tmp_path(output))
    if tmp in incomplete:
        incomplete[tmp] += (f"; {output} is kept as appended: each row once, not sorted by request_id"
                            if Path(output).exists() else f"; {output} was removed during the run")
    try:
        write_run_metadata(output, spec.metadata(facts, incomplete))
        where = f"(listed in {meta_path(output)})"
    except OutputError as e:
        where = f"and the meta could not be written either ({e})"
    if not incomplete:
        return 0
    logger.error("replay: the run's files are not complete: %s %s: exit code 1",
                 "; ".join(f"{file}: {why}" for file, why in incomplete.items()), where)
    return 1

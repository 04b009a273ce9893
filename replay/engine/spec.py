"""What a run is, once its preflight (replay.run.preflight) has checked and loaded everything:
a frozen `RunSpec` the engine (replay.engine.coordinator) runs and its driver (replay.run.driver)
ends from the engine's `Outcome`.

The spec holds values, not places to look them up: the options as checked, the output as
claimed, the tokenizer's fingerprint, the rows of the window (spooled, replay.engine.plan's
Schedule), the trace's facts and the prompt limit. The runner's host (`host`, Locust's
`--host`) is one of them: the preflight asked its /v1/models for the prompt limit and checked it
(--verify-server), so a run sends where its preflight looked; the web UI's Host field is
read-only for that reason (replay.locust.webui).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from replay.engine.options import ReplayOptions
from replay.results.metadata import run_metadata
from replay.rules.send_time import replay_seconds

if TYPE_CHECKING:
    from replay.engine.plan import Schedule
    from replay.protocol.models import Served
    from replay.results.otlp_receiver import SpanReceiver
    from replay.results.output import OutputClaim
    from replay.results.store import RecordStore


@dataclass(frozen=True)
class TraceFacts:
    """The trace as the preflight read it."""

    path: str
    format: str
    block_size: int | None
    sha256: str | None = None  # None: past file_sha256's size limit, or unreadable
    skipped: tuple[str, ...] = ()  # the bad lines --on-bad-line skip dropped, as logged


@dataclass(frozen=True)
class RunSpec:
    options: ReplayOptions
    output: str
    run_id: str  # X-Request-Id: <run id>-<request_id>
    schedule: Schedule  # the rows of the window, spooled; closed by replay.run.finish
    trace: TraceFacts
    max_prompt_tokens: int | None  # rows with longer prompts are recorded, never sent; None: no limit
    tokenizer_fingerprint: str | None = None  # each worker proves it has the same (same_tokenizer); None: no check
    tokenizer_path: str | None = None  # --tokenizer as this host resolved it (a Hugging Face id: its snapshot)
    host: str | None = None  # the runner's target host (--host), credentials included; --endpoints wins
    served: tuple[Served, ...] = ()  # what each endpoint said it serves (replay.protocol.models); (): not asked
    server_cache: dict | None = None  # each endpoint's KV cache (replay.protocol.server_cache); None: not asked
    claim: OutputClaim | None = field(default=None, compare=False, repr=False)  # the output's lock, this process's
    spans: SpanReceiver | None = field(default=None, compare=False, repr=False)  # --otlp-receiver's, this process's

    @property
    def total(self) -> int:
        """Rows the run must record: those it sends and those over the prompt limit."""
        return len(self.schedule) + len(self.schedule.oversized)

    @property
    def window_seconds(self) -> float:
        """Wall seconds from the first send to the last (the window at --scale)."""
        return replay_seconds(self.schedule.window_s, self.options.scale)

    def endpoint_urls(self) -> list[str]:
        """The servers this run sends to: --endpoints, or the runner's host."""
        return self.options.endpoint_urls(self.host)

    def metadata(self, facts: RunFacts, incomplete: dict[str, str] | None = None) -> dict:
        """The run's metadata (OUTPUT.meta.json, replay.results.metadata.run_metadata) from this
        spec and what the engine learned (`facts`); `incomplete`: {file: why} of the files not whole."""
        return run_metadata(
            self.options.to_dict(),
            trace_path=str(self.trace.path),
            trace_format=self.trace.format,
            block_size=self.trace.block_size,
            rows=self.total,
            origin=self.schedule.origin,
            window_s=self.window_seconds,
            endpoints=self.endpoint_urls(),
            workers=facts.workers,
            epoch=facts.epoch,
            started_at=facts.started_at,
            run_id=self.run_id,
            trace_rows=self.schedule.trace_rows,
            skipped=list(self.trace.skipped),
            max_prompt_tokens=self.max_prompt_tokens,
            oversized=len(self.schedule.oversized),
            server_check=facts.server_check,
            trace_sha256=self.trace.sha256,
            incomplete=[{"file": file, "error": why} for file, why in (incomplete or {}).items()],
            tokenizer_path=self.tokenizer_path,
            server_cache=self.server_cache,
            host_load=facts.host_load,
            tokenizer_fingerprint=self.tokenizer_fingerprint,
        )


@dataclass
class RunFacts:
    """What the engine learned while the run went, for the meta file: its workers, when it
    began and started sending, and the servers' check (replay.run.preflight.check_servers)."""

    workers: list[dict]  # [{index, client_id, host, clock_offset_ms, rtt_ms, rows_assigned, lost}], by index
    epoch: float | None
    started_at: float | None
    server_check: dict | None
    host_load: dict | None = None  # the host while the run sent (replay.results.host_load.figures)


@dataclass(frozen=True)
class Outcome:
    """What the engine hands its driver once every row of the run has a record (the
    Coordinator's `end`): the run's end (replay.run.driver, replay.run.finish) is made of these
    values alone."""

    spec: RunSpec
    store: RecordStore  # every row's record, on disk, not yet merged
    facts: RunFacts
    incomplete: dict[str, str]  # file -> why it is not whole; the end's own faults are added to it
    capacity: dict | None = None  # a capacity search's report (replay.engine.capacity.capacity_report)
    least_code: int = 0  # the least exit code: 2 for a run refused before the first send

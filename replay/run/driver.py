"""Where a run starts and ends, in one file: preflight -> RunSpec -> engine -> finish.

    spec = preflight.load(options, host, ...)   # every check and load before anything is sent (exit 2)
    coordinator = driver.start(spec, link, ...) # the engine, with this run's listeners
    coordinator.begin(workers)                  # the runner's part: the workers replay, records come back
    coordinator.end()                           # every row accounted for: its Outcome goes to `end` below

The engine imports nothing of this package: it calls the listeners `start` hands it, at the go
(the cache section's follower, replay.results.cache_section.CacheStream, started while the run
replays) and once every row has a record (`end`: the merged file, the summary, the fidelity
certificate and the last meta, replay.run.finish, whose exit code the coordinator sets).
"""

from __future__ import annotations

from typing import Any

from replay.engine.clock import SYSTEM_CLOCK, Clock
from replay.engine.coordinator import Coordinator
from replay.engine.spec import Outcome, RunFacts, RunSpec
from replay.engine.transport import Link
from replay.results.cache_section import CacheStream
from replay.run.finish import cache_here, finish, start_cache_stream


def start(spec: RunSpec, link: Link, clock: Clock = SYSTEM_CLOCK, **runner: Any) -> Coordinator:
    """The engine's master side for `spec` over `link`, wired to this run's start and end;
    `runner`: what the Coordinator takes of its runner (local_part, heard, worker_gone,
    worker_host, on_exit_code, worker_cpu)."""
    followers: list[CacheStream] = []
    local = runner.get("local_part")  # a single-process run's Dispatcher
    here = cache_here(spec, single_process=local is not None)

    def follow_cache(facts: RunFacts, first_request_id: int) -> None:
        stream = start_cache_stream(spec, facts, first_request_id)
        if stream is not None:
            followers.append(stream)

    def end(outcome: Outcome) -> int:
        return finish(outcome.spec, outcome.store, outcome.facts, outcome.incomplete, coordinator.on_output_error,
                      coordinator.final_listeners, coordinator.summary_listeners, least_code=outcome.least_code,
                      capacity=outcome.capacity, cache_stream=followers[0] if followers else None,
                      cache_here=here, run_synth=local.synth if local is not None else None)

    coordinator = Coordinator(spec, link, clock, on_end=end, **runner)
    if not spec.options.capacity_search and not here:  # a search's probes are rows of their own, which no trace holds
        coordinator.go_listeners.append(follow_cache)
    return coordinator

"""Wiring into Locust's events: options, the master/worker objects, start and end of a run."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

from locust import events
from locust.runners import LocalRunner, MasterRunner, WorkerRunner

from replay.locust import messages
from replay.locust.coordinator import Coordinator
from replay.locust.options import ReplayOptions, add_arguments
from replay.locust.worker import WorkerPart
from replay.results.records import RUN_STOPPED
from replay.trace.record import TraceError

logger = logging.getLogger(__name__)


@dataclass
class Replay:
    """What this process plays: the coordinator (master/local), the part (worker/local)."""

    coordinator: Coordinator | None = None
    part: WorkerPart | None = None


@events.init_command_line_parser.add_listener
def _add_options(parser) -> None:
    add_arguments(parser)


def _coordinator(environment, link: messages.Link, part: WorkerPart | None = None) -> Coordinator:
    try:
        options = ReplayOptions.from_parsed(environment.parsed_options)
        options.check()
        options.endpoint_urls(environment.host)
        return Coordinator(environment, link, options, local_part=part)
    except (TraceError, ValueError, OSError) as e:
        logger.error("replay: %s", e)
        sys.exit(2)


@events.init.add_listener
def _on_init(environment, runner=None, **kwargs) -> None:
    runner = runner or environment.runner
    if isinstance(runner, MasterRunner):
        link = messages.RunnerLink(runner)
        environment.replay = Replay(coordinator=_coordinator(environment, link))
    elif isinstance(runner, WorkerRunner):
        environment.replay = Replay(part=WorkerPart(environment, messages.RunnerLink(runner)))
    elif isinstance(runner, LocalRunner):
        link = messages.LocalLink()
        part = WorkerPart(environment, link, local=True)
        environment.replay = Replay(coordinator=_coordinator(environment, link, part), part=part)
    else:
        environment.replay = Replay()


def _participants(runner) -> list[tuple[str, int]]:
    if isinstance(runner, MasterRunner):
        return [(c.id, runner.get_worker_index(c.id)) for c in runner.clients.all if c.state != "missing"]
    return [(messages.LOCAL_CLIENT, 0)]


@events.test_start.add_listener
def _on_test_start(environment, **kwargs) -> None:
    replay = getattr(environment, "replay", None)
    if replay is not None and replay.coordinator is not None:
        replay.coordinator.begin(_participants(environment.runner))


@events.test_stopping.add_listener
def _on_test_stopping(environment, **kwargs) -> None:
    replay = getattr(environment, "replay", None)
    if replay is not None and replay.part is not None and replay.coordinator is None:
        replay.part.abort(RUN_STOPPED)


@events.test_stop.add_listener
def _on_test_stop(environment, **kwargs) -> None:
    replay = getattr(environment, "replay", None)
    if replay is not None and replay.coordinator is not None:
        replay.coordinator.finalize()


# The Replay view registers its listeners after this module's: its init listener needs
# environment.replay, its test_stop listener a finalized coordinator.
from replay.locust import webui  # noqa: E402,F401

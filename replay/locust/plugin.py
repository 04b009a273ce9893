"""Wiring the replay engine into Locust's events: options, the master/worker objects, start
and end of a run, signals, and a worker's watch on its master.

The engine (replay.engine) never sees a Locust object: what it needs of the runner is handed
to it here as values and callbacks. The web UI's login and Replay view are set up from this
module's init listener too, after `environment.replay` is set, so no listener order depends
on which module was imported first."""

from __future__ import annotations

import logging
import signal
import sys
import time
from dataclasses import dataclass
from typing import Callable

import gevent
from locust import events
from locust.runners import LocalRunner, MasterRunner, WorkerRunner

from replay.engine import live, messages, transport
from replay.engine.coordinator import Coordinator, default_output
from replay.engine.dispatcher import Dispatcher
from replay.locust import webauth, webui
from replay.locust.link import RunnerLink
from replay.engine.config import replay_options
from replay.engine.options import add_arguments
from replay.results.output import OutputClaim, claim_output
from replay.results.records import MASTER_LOST, RUN_STOPPED
from replay.trace.record import TraceError

logger = logging.getLogger(__name__)

MASTER_LOST_S = 6.0  # a worker stops sending when the master has not answered a heartbeat for this long


@dataclass
class Replay:
    """What this process plays: the coordinator (master/local), the part (worker/local)."""

    coordinator: Coordinator | None = None
    part: Dispatcher | None = None


@events.init_command_line_parser.add_listener
def _add_options(parser) -> None:
    add_arguments(parser)


def _coordinator(environment, link: transport.Link, part: Dispatcher | None = None) -> Coordinator:
    """The master's preflight, before any worker gets anything: every error is one line, exit 2."""
    claim: OutputClaim | None = None
    try:
        options = replay_options(environment.parsed_options)
        options.check()
        web_user = getattr(environment.parsed_options, "web_user", None)
        if web_user:  # refused as the web UI refuses it, with or without one (--headless)
            webauth.parse_web_user(web_user)
        urls = options.endpoint_urls(environment.host)
        # The output is decided and locked here (held until this process exits), before the
        # coordinator could write it; an earlier run's files go now, only with --overwrite.
        claim = claim_output(options.output or default_output(), overwrite=options.overwrite,
                             default=options.output is None)
        options.output = claim.output
        runner = environment.runner
        return Coordinator(link, options, local_part=part, endpoints=urls, host=lambda: environment.host,
                           worker_gone=lambda client_id: _worker_gone(runner, client_id),
                           worker_host=lambda client_id: _worker_host(runner, client_id),
                           on_exit_code=lambda code: setattr(environment, "process_exit_code", code))
    except (TraceError, ValueError, OSError) as e:
        if claim is not None:
            claim.release()
        logger.error("replay: %s", e)
        sys.exit(2)


def _worker_gone(runner, client_id: str) -> bool:
    """Whether the master runner lost this worker (Locust marks it missing, or dropped it)."""
    clients = getattr(runner, "clients", None)
    if clients is None:  # local runner
        return False
    node = clients.get(client_id)
    return node is None or node.state == "missing"


def _worker_host(runner, client_id: str) -> str | None:
    clients = getattr(runner, "clients", None)
    return getattr(clients.get(client_id), "hostname", None) if clients is not None else None


def _request_stats(environment) -> Callable[[dict], None]:
    """Each answered request into Locust's own statistics (its UI's table, --csv)."""
    fire = environment.events.request.fire

    def on_request(record: dict) -> None:
        fire(
            request_type=record["api"],
            name=record["endpoint"],
            response_time=record["e2e_ms"] or 0.0,
            response_length=record["output_tokens"] or 0,
            exception=None if record["ok"] else RuntimeError(record["error"] or f"HTTP {record['status']}"),
            context={"request_id": record["request_id"]},
        )

    return on_request


@events.init.add_listener
def _on_init(environment, runner=None, web_ui=None, **kwargs) -> None:
    runner = runner or environment.runner
    if isinstance(runner, MasterRunner):
        link = RunnerLink(runner)
        environment.replay = Replay(coordinator=_coordinator(environment, link))
        _stop_on_signals(environment.replay.coordinator)
    elif isinstance(runner, WorkerRunner):
        link = RunnerLink(runner)
        part = Dispatcher(link, on_request=_request_stats(environment))
        environment.replay = Replay(part=part)
        link.to_master(messages.HELLO, messages.Hello())
        gevent.spawn(_watch_master, environment, runner, part)
        gevent.spawn(live.report_loop, part)  # the master's live view: one small message a second
    elif isinstance(runner, LocalRunner):
        link = transport.LocalLink()
        part = Dispatcher(link, local=True, on_request=_request_stats(environment))
        environment.replay = Replay(coordinator=_coordinator(environment, link, part), part=part)
        _stop_on_signals(environment.replay.coordinator)
    else:
        environment.replay = Replay()
    # In this order, after environment.replay is set: the login first, then the Replay view,
    # whose test_stop listener, added now, runs after this module's (the coordinator has finalized).
    webauth.register(environment, runner, web_ui)
    webui.register(environment, runner, web_ui)


def _stop_on_signals(coordinator: Coordinator) -> None:
    """SIGTERM (docker stop, Kubernetes, `timeout`) stops a run exactly as Ctrl-C does: a
    KeyboardInterrupt in the main greenlet, where Locust's headless run turns it into a stop.
    Locust installs its own SIGTERM handler only after a headless run is over, so without this
    the default action killed the process with no records, meta or summary. A signal that
    arrives while the records are being written is ignored: it would cut them off."""
    hub = gevent.get_hub()

    def stop() -> None:
        if coordinator.ending:
            logger.warning("signal received while the run's records are being written: finishing them first")
            return
        hub.handle_system_error(KeyboardInterrupt, KeyboardInterrupt())

    for signum in (signal.SIGTERM, signal.SIGINT):
        gevent.signal_handler(signum, stop)


def _watch_master(environment, runner: WorkerRunner, part: Dispatcher) -> None:
    """Stop sending within seconds of losing the master (Locust's own check waits 60 s, and
    the worker would replay its whole part to nobody): record what is left as "master lost"
    and quit with exit code 1."""
    while True:
        gevent.sleep(1.0)
        last = runner.last_heartbeat_timestamp
        if part.options is None or last is None or time.time() - last < MASTER_LOST_S:
            continue
        if part.finished.is_set():
            return
        logger.error("no heartbeat from the master for %.0f s: stopping this worker's replay", time.time() - last)
        part.abort(MASTER_LOST)
        environment.process_exit_code = 1
        runner.quit()
        return


def _participants(runner) -> list[tuple[str, int]]:
    if isinstance(runner, MasterRunner):
        return [(c.id, runner.get_worker_index(c.id)) for c in runner.clients.all if c.state != "missing"]
    return [(transport.LOCAL_CLIENT, 0)]


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
    _end(environment)


@events.quitting.add_listener
def _on_quitting(environment, **kwargs) -> None:
    # Locust can quit without test_stop (the last worker lost, SIGTERM in the web UI's mode)
    _end(environment)


def _end(environment) -> None:
    replay = getattr(environment, "replay", None)
    if replay is not None and replay.coordinator is not None:
        replay.coordinator.end()

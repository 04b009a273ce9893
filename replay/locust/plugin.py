"""Wiring the replay engine into Locust's events: options, the master/worker objects, start
and end of a run, signals, and a worker's watch on its master.

The engine (replay.engine) never sees a Locust object: what it needs of the runner is handed
to it here as values and callbacks. The web UI's login and Replay view are set up from this
module's init listener too, after `environment.replay` is set, so no listener order depends
on which module was imported first; so is a headless run's progress line."""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import gevent
from locust import events
from locust.runners import CPU_MONITOR_INTERVAL, LocalRunner, MasterRunner, WorkerRunner

from replay.engine import live, messages, transport
from replay.engine.coordinator import Coordinator, listen_for_hellos
from replay.engine.dispatcher import Dispatcher
from replay.engine.options import add_arguments
from replay.engine.progress import ProgressLine
from replay.engine.spec import RunSpec
from replay.errors import OptionError
from replay.locust import stop_caller
from replay.locust.link import RunnerLink, flush_on_exit
from replay.locust.outputs import config_input, locust_outputs
from replay.protocol.urls import shown
from replay.results.records import (
    MASTER_LOST,
    REFUSED,
    RUN_STOPPED,
    WORKER_LOST,
    WORKER_STOPPED,
    Record,
    output_tokens_of,
)
from replay.run import driver, preflight
from replay.run.config import replay_options
from replay.trace.record import TraceError

logger = logging.getLogger(__name__)
stop_caller.install()  # Runner.stop's debug line without reading every frame's source

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # each stops a run (SIGHUP: its terminal closed)
MASTER_STOP_GRACE_S = 10.0  # a worker in the master's process group waits this long for the master's stop
MASTER_LOST_S = 6.0  # a worker stops sending when the master has not answered a heartbeat for this long
QUIT_GRACE_S = 5.0  # a worker whose master left before the plan exits if Locust's quit has not ended it by then
WORKERS_WATCH_S = 1.0  # how often a master that waits for --expect-workers checks on those connected


@dataclass
class Replay:
    """What this process plays: the coordinator (master/local), the part (worker/local)."""

    coordinator: Coordinator | None = None
    part: Dispatcher | None = None
    progress: ProgressLine | None = None  # a headless master's (or single process's)


@events.init_command_line_parser.add_listener
def _add_options(parser) -> None:
    add_arguments(parser)


def _coordinator(environment, link: transport.Link, part: Dispatcher | None = None) -> Coordinator:
    """The master's preflight (replay.run.preflight), before any worker gets anything: every
    error is one line, exit 2. `environment.replay` is set as soon as the trace is read, before
    the server check: a signal from then on records every row (`_stop_on_signals`), and so do
    servers that cannot take the run (`_refuse`)."""
    spec: RunSpec | None = None
    coordinator: Coordinator | None = None
    try:
        heard = listen_for_hellos(link)  # workers that connect while the preflight loads
        options = replay_options(environment.parsed_options)
        if options.capacity_search and getattr(environment.parsed_options, "run_time", None):
            raise OptionError("--run-time: not with --capacity-search (the search ends when its answer is known)")
        web_user = getattr(environment.parsed_options, "web_user", None)
        if web_user:  # refused as the web UI refuses it, with or without one (--headless)
            from replay.locust.webauth import parse_web_user

            parse_web_user(web_user)
        spec = preflight.load(options, _hide_host_credentials(environment),  # Locust's files with the run's
                              locust_outputs(environment.parsed_options), config_input(environment.parsed_options))
        _show_endpoints(environment, spec)
        runner = environment.runner
        coordinator = driver.start(spec, link, local_part=part, heard=heard,
                                   worker_gone=lambda client_id: _worker_gone(runner, client_id),
                                   worker_host=lambda client_id: _worker_host(runner, client_id),
                                   worker_cpu=lambda client_id: _worker_cpu(runner, client_id),
                                   cpu_lag_s=CPU_MONITOR_INTERVAL,
                                   on_exit_code=lambda code: setattr(environment, "process_exit_code", code))
        environment.replay = Replay(coordinator=coordinator, part=part)
        coordinator.server_check = preflight.check_servers(spec)
        return coordinator
    except preflight.ServersRefused as e:
        _refuse(environment, coordinator, str(e))
    except (TraceError, ValueError, OSError) as e:
        if spec is not None and spec.claim is not None:
            spec.claim.release()
        logger.error("replay: %s", e)
        _workers_quit(environment)
        sys.exit(2)


def _workers_quit(environment) -> None:
    """A master that ends before its run began tells the workers already connected to quit:
    left alone, they wait for Locust's own 60 s check on a master that is gone."""
    runner = environment.runner
    if isinstance(runner, MasterRunner) and runner.clients.all:
        runner.quit()


def _run_asked(environment) -> bool:
    """Whether a run was asked for at start (--headless, --autostart); else the web UI waits
    for its Start."""
    options = environment.parsed_options
    return bool(getattr(options, "headless", False) or getattr(options, "autostart", False))


def _refuse(environment, coordinator: Coordinator, reason: str) -> NoReturn:
    """Servers that cannot take the run, found before the first send: one line, exit 2, and,
    when a run was asked for, every row recorded as refused with the run's files written (as a
    stop before the start). The web UI's mode asked for no run yet: nothing is recorded."""
    if _run_asked(environment):
        logger.error("replay: %s: nothing was sent; every row is recorded as %r", reason, REFUSED)
        coordinator.refuse(reason)
        environment.runner.quit()  # workers already connected quit too
    else:
        logger.error("replay: %s: nothing was sent", reason)
        if coordinator.spec.claim is not None:
            coordinator.spec.claim.release()
        _workers_quit(environment)
    sys.exit(2)


def _hide_host_credentials(environment) -> str | None:
    """Locust shows `environment.host` (its web UI, its HTML report) and sends it to workers:
    it gets the URL as shown (replay.protocol.urls); the full one, credentials included, is
    returned for the run to connect with."""
    full = environment.host
    if full is not None:
        environment.host = shown(full)
    return full


def _show_endpoints(environment, spec: RunSpec) -> None:
    """What Locust's Host field and header show: where this run sends, as shown, comma-separated
    (--endpoints, or the host). The field is read-only (replay.locust.webui): the preflight
    asked these servers, and the run is theirs."""
    environment.host = ",".join(shown(url) for url in spec.endpoint_urls())


def _worker_gone(runner, client_id: str) -> bool:
    """Whether the master runner lost this worker (Locust marks it missing, or dropped it)."""
    clients = getattr(runner, "clients", None)
    if clients is None:  # local runner
        return False
    node = clients.get(client_id)
    return node is None or node.state == "missing"


def _worker_cpu(runner, client_id: str) -> float | None:
    """The CPU use (% of a core) the worker last reported in its heartbeat; a local runner's own.
    None (not known) while it is 0: Locust reports 0 until its first sample, and that sample is
    psutil's first reading, 0.0 by design; a worker sending a probe's rows never used none."""
    clients = getattr(runner, "clients", None)
    if clients is None:  # local runner: this process sends
        cpu = getattr(runner, "current_cpu_usage", None)
    else:
        cpu = getattr(clients.get(client_id), "cpu_usage", None)
    return cpu or None


def _worker_host(runner, client_id: str) -> str | None:
    clients = getattr(runner, "clients", None)
    return getattr(clients.get(client_id), "hostname", None) if clients is not None else None


def _request_stats(environment) -> Callable[[Record], None]:
    """Each answered request into Locust's own statistics (its UI's table, --csv)."""
    fire = environment.events.request.fire

    def on_request(record: Record) -> None:
        fire(
            request_type=record["api"],
            name=record["endpoint"],
            response_time=record["e2e_ms"] or 0.0,
            response_length=output_tokens_of(record),
            exception=None if record["ok"] else RuntimeError(record["error"] or f"HTTP {record['status']}"),
            context={"request_id": record["request_id"]},
        )

    return on_request


@events.init.add_listener
def _on_init(environment, runner=None, web_ui=None, **kwargs) -> None:
    # Locust, gevent and Flask are all imported by now, and their objects (~50k) live as long as
    # the process: frozen, the collector never walks them again.
    gc.freeze()
    runner = runner or environment.runner
    if isinstance(runner, MasterRunner):
        _stop_on_signals(environment)  # before the preflight: a signal during it ends it cleanly
        link = RunnerLink(runner)
        early = _EarlyWorkers(environment, link)  # before the preflight: workers connect meanwhile
        coordinator = _coordinator(environment, link)
        if _run_asked(environment):
            gevent.spawn(_end_on_a_worker_gone_before_the_run, environment, runner, coordinator, early,
                         _take_over_max_wait(environment))
    elif isinstance(runner, WorkerRunner):
        link = RunnerLink(runner)
        part = Dispatcher(link, on_request=_request_stats(environment))
        environment.replay = Replay(part=part)
        _stop_worker_on_signals(environment, link, part)
        environment.events.quit.add_listener(lambda **kwargs: flush_on_exit(runner))  # the last messages leave
        link.to_master(messages.HELLO, messages.Hello())
        # From here a stop signal is this worker's own (before it, the OS's default ends the
        # process, and the master records its rows as a lost worker's)
        logger.info("replay: worker connected to the master at %s:%s, waiting for its part of the run",
                    runner.master_host, runner.master_port)
        gevent.spawn(_watch_master, environment, runner, part)
        gevent.spawn(live.report_loop, part)  # the master's live view: one small message a second
    elif isinstance(runner, LocalRunner):
        _stop_on_signals(environment)
        link = transport.LocalLink()
        _coordinator(environment, link, Dispatcher(link, local=True, on_request=_request_stats(environment)))
    else:
        environment.replay = Replay()
    # In this order, after environment.replay is set: the login first, then the Replay view,
    # whose test_stop listener, added now, runs after this module's (the coordinator has finalized).
    # Imported only for a web UI: a headless run needs neither, nor flask_login.
    if web_ui is not None:
        from replay.locust import webauth, webui

        webauth.register(environment, runner, web_ui)
        webui.register(environment, runner, web_ui)
    _progress(environment, runner, web_ui)


def _progress(environment, runner, web_ui) -> None:
    """A headless run's progress line (replay.engine.progress), printed by the master or the
    single process from the live figures the Replay view would show; `--no-progress` turns it
    off. A master without it still takes the workers' reports, and drops them."""
    replay = environment.replay
    coordinator = replay.coordinator
    if web_ui is not None or coordinator is None:
        return  # a worker, or the web UI's Replay view (replay.locust.webui)
    master = isinstance(runner, MasterRunner)
    if not getattr(environment.parsed_options, "progress", True):
        if master:
            coordinator.link.on(messages.LIVE, lambda data, sender: None)
        return
    stats = live.LiveStats(coordinator, local_part=None if master else replay.part, view=False)
    if master:
        coordinator.link.on(messages.LIVE, stats.on_report)
    replay.progress = ProgressLine(stats, sys.stderr, coordinator.clock)


def _stop_on_signals(environment) -> None:
    """SIGTERM (docker stop, Kubernetes, `timeout`) stops a run exactly as Ctrl-C does, at
    every moment of the master's (or a single process's) life. Locust installs its own SIGTERM
    handler only after a headless run is over, so without this the default action killed the
    process with no records, meta or summary.

    - Before the trace is read (options, output, tokenizer): nothing to record; one line, and the
      exit code a shell gives a process ended by that signal (128 + its number).
    - Once it is read, before the run began (the server check, the wait for --expect-workers,
      which Locust does not guard: a KeyboardInterrupt there was a traceback): every row is
      recorded "run stopped" here, the workers told to quit, and the exit code is a user stop's.
      In the web UI's mode no run was asked for yet: Locust just quits.
    - Once begun: a KeyboardInterrupt in the main greenlet, where Locust's run turns it into a
      stop; once only: a second one landed in Locust's own stop (a traceback, records cut off).
    - While the records are being written: ignored, it would cut them off.
    SIGHUP (the terminal closed) is a stop too, not a death with nothing written."""
    hub = gevent.get_hub()
    run_asked = _run_asked(environment)
    interrupted = False

    def stop(signum: int) -> None:
        nonlocal interrupted
        name = signal.Signals(signum).name
        replay = getattr(environment, "replay", None)
        coordinator = replay.coordinator if replay is not None else None
        if coordinator is not None:
            coordinator.stop_signal_received()  # a worker in this process group may have got it too
        if coordinator is None:
            logger.error("replay: %s before the trace was read: nothing was sent or recorded", name)
            _workers_quit(environment)
            hub.handle_system_error(SystemExit, SystemExit(128 + signum))
        elif coordinator.ending:
            logger.warning("%s received while the run's records are being written: finishing them first", name)
        elif interrupted:
            logger.warning("%s received while the run stops: it is stopping already", name)
        elif coordinator.store is None and run_asked:
            logger.warning("replay: %s before the run began: every row is recorded as %r", name, RUN_STOPPED)
            coordinator.cancel()
            environment.runner.quit()  # workers already connected quit too
            hub.handle_system_error(SystemExit, SystemExit(environment.process_exit_code or 0))
        else:
            interrupted = True
            hub.handle_system_error(KeyboardInterrupt, KeyboardInterrupt())

    for signum in STOP_SIGNALS:
        gevent.signal_handler(signum, stop, signum)


class _EarlyWorkers:
    """The workers that connect to a master, and those that say a signal of their own stopped
    them, from before the preflight on (until the Coordinator takes STOPPED, a message no
    handler takes is dropped)."""

    def __init__(self, environment, link: transport.Link):
        self.connected: set[str] = set()
        self.stopped: set[str] = set()
        environment.events.worker_connect.add_listener(lambda client_id, **kwargs: self.connected.add(client_id))
        link.on(messages.STOPPED, self._on_stopped)

    def _on_stopped(self, data: messages.Stopped, sender: str) -> None:
        if not data.get("shared"):
            self.stopped.add(sender)


def _forked_workers_missing(environment) -> int:
    """--processes N: how many of the N workers this master forked are no longer running (a child
    of this process running this process's command; gevent reaps a child that exits, so there is
    no exit status to ask for). 0 without --processes, or where /proc does not list children.
    Before the run begins the master has no other child of its command (the preflight's set-up
    child runs another, and is waited for)."""
    processes = getattr(environment.parsed_options, "processes", None)
    if not processes:
        return 0
    try:
        command = Path("/proc/self/cmdline").read_bytes()
        children = [pid for task in Path("/proc/self/task").iterdir()
                    for pid in (task / "children").read_text().split()]
    except OSError:
        return 0
    running = 0
    for pid in children:
        try:
            running += Path(f"/proc/{pid}/cmdline").read_bytes() == command
        except OSError:
            continue  # it ended meanwhile
    return max(0, processes - running)


def _take_over_max_wait(environment) -> float:
    """--expect-workers-max-wait, taken from Locust (returned; 0: none): its own gives up with
    `sys.exit(1)` from its wait, before any listener of its runs, so nothing of the run was
    recorded. The watch on the workers (`_end_on_a_worker_gone_before_the_run`) ends it instead."""
    options = environment.parsed_options
    max_wait = float(getattr(options, "expect_workers_max_wait", 0) or 0)
    if max_wait:
        options.expect_workers_max_wait = 0
    return max_wait


def _end_on_a_worker_gone_before_the_run(environment, runner: MasterRunner, coordinator: Coordinator,
                                         early: _EarlyWorkers, max_wait: float = 0.0) -> None:
    """A worker that connected and is gone before the run began (it quit on a signal of its own,
    died, or went missing: Locust dropped it or marked it so) while Locust waits for
    --expect-workers: nothing replaces it (--processes forks its workers once), and Locust's wait
    has no end. The run ends as a fault instead: one line naming the worker, every row recorded
    "worker stopped" (it said its own signal stopped it) or "worker lost", never sent; the
    workers left quit, exit 1. So does a --processes worker that exited before it connected
    (killed as it started: Locust never knew of it), and a wait past `max_wait` s (--expect-workers-max-wait) with
    too few workers: every row "run refused before the first send: N of M workers connected ...".
    Once the run began (or was stopped), the Coordinator's own supervision has its workers."""
    hub = gevent.get_hub()
    started = time.monotonic()
    expected = int(getattr(environment.parsed_options, "expect_workers", 1) or 1)
    missing = 0  # forked workers not running, at the last look
    while coordinator.store is None and not coordinator.ending:
        gone = next((client_id for client_id in sorted(early.connected) if _worker_gone(runner, client_id)), None)
        ready = len(runner.clients.ready)
        # one that connected and exited is said by Locust's quit (or heartbeat) first: a look later
        missing, missing_before = _forked_workers_missing(environment), missing
        if gone is None and missing and missing_before:
            label = WORKER_LOST
            logger.error("replay: %d of the --processes workers exited before they connected: ending the run; every "
                         "row is recorded as %r", missing, label)
        elif gone is not None:
            stopped = gone in early.stopped or gone in coordinator.stopped_before_begin
            label = WORKER_STOPPED if stopped else WORKER_LOST
            logger.error("replay: worker %d (%s) %s before the run began: ending the run; every row is recorded as "
                         "%r", runner.get_worker_index(gone), gone, "was stopped by a signal of its own" if stopped
                         else "was lost", label)
        elif max_wait and time.monotonic() - started > max_wait and ready < expected:
            label = (f"{REFUSED}: {ready} of {expected} workers connected within --expect-workers-max-wait "
                     f"{max_wait:g} s")
            logger.error("replay: %d of %d workers connected within --expect-workers-max-wait %g s: ending the run; "
                         "every row is recorded as %r", ready, expected, max_wait, label)
        else:
            gevent.sleep(WORKERS_WATCH_S)
            continue
        coordinator.abandon(label)
        runner.quit()  # the workers left quit too
        hub.handle_system_error(SystemExit, SystemExit(environment.process_exit_code or 1))
        return


def _stop_worker_on_signals(environment, link: transport.Link, part: Dispatcher) -> None:
    """A worker that gets a SIGTERM, SIGINT or SIGHUP of its own is not the user stopping the
    run: its unanswered rows are recorded "worker stopped" (a failure: the master exits 1), and
    the master is told, for the rows it never shipped. A worker in the master's process group on
    its host (`--processes`, or one shell that started both) may have got a signal the master got
    too (a terminal's Ctrl-C or hang-up), and only the master knows: the worker tells it and
    goes on meanwhile; the master's abort says whose stop it is ("run stopped": the master got
    it too; "worker stopped": it did not), and if none comes in MASTER_STOP_GRACE_S the stop is
    the worker's own. Then Locust quits as it does on a signal: SIGTERM by its own handler, which
    runs beside this one and is held at its quitting event until the labels are known; the
    others by a KeyboardInterrupt, unless the master's stop ends this worker with its quit."""
    hub = gevent.get_hub()
    signalled = False
    deciding: gevent.Greenlet | None = None

    def stopped_alone(name: str) -> None:
        if part.replay is None:
            logger.error("%s: this worker stops before it got its part of the run", name)
        else:
            logger.error("%s: this worker stops; its unanswered rows are recorded as %r", name, WORKER_STOPPED)
        link.to_master(messages.STOPPED, messages.Stopped())
        part.abort(WORKER_STOPPED)
        environment.process_exit_code = 1

    def ask_the_master(name: str, signum: int) -> None:
        link.to_master(messages.STOPPED, messages.Stopped(shared=True))
        deadline = time.monotonic() + MASTER_STOP_GRACE_S
        while not part.stopping and time.monotonic() < deadline:
            gevent.sleep(0.1)
        if not part.stopping:
            stopped_alone(name)
        elif part.stop_reason == WORKER_STOPPED:
            logger.error("%s: the master got no stop: this worker stops; its unanswered rows are recorded as %r",
                         name, WORKER_STOPPED)
            environment.process_exit_code = 1
        else:
            return  # the master's stop: its quit ends this worker
        if signum != signal.SIGTERM:
            hub.handle_system_error(KeyboardInterrupt, KeyboardInterrupt())

    def stop(signum: int) -> None:
        nonlocal signalled, deciding
        name = signal.Signals(signum).name
        if signalled:  # a second KeyboardInterrupt would land in Locust's own shutdown
            logger.warning("%s received while this worker stops: it is stopping already", name)
            return
        signalled = True
        if not part.finished.is_set() and not part.stopping:
            if not part.with_master:
                stopped_alone(name)
            else:
                logger.warning("%s: this worker is in the master's process group; asking the master whether it "
                               "got it too", name)
                deciding = gevent.spawn(ask_the_master, name, signum)
                return
        if signum != signal.SIGTERM:
            hub.handle_system_error(KeyboardInterrupt, KeyboardInterrupt())

    def hold_sigterm_quit(**kwargs) -> None:
        gevent.sleep(0)  # a SIGTERM's two handlers run in the same turn of the loop, in either order
        if deciding is not None:
            deciding.join()

    for signum in STOP_SIGNALS:
        gevent.signal_handler(signum, stop, signum)
    environment.events.quitting.add_listener(hold_sigterm_quit)


def _watch_master(environment, runner: WorkerRunner, part: Dispatcher) -> None:
    """Stop sending within seconds of losing the master (Locust's own check waits 60 s, and
    the worker would replay its whole part to nobody): record what is left as "master lost"
    and quit with exit code 1. A silence that was this worker's own (it did not run for
    MASTER_LOST_S: SIGSTOP, a paused host) is not the master's: the master counted it lost by
    then, so what is left is recorded as "worker lost", not sent late in a burst."""
    turn = time.monotonic()
    while True:
        gevent.sleep(1.0)
        stalled, turn = time.monotonic() - turn, time.monotonic()
        if stalled >= MASTER_LOST_S and part.replay is not None and not part.finished.is_set():
            logger.error("this worker did not run for %.0f s (stopped, or its host paused): the master counts it "
                         "lost; its unanswered rows are recorded as %r", stalled, WORKER_LOST)
            environment.process_exit_code = 1
            part.abort(WORKER_LOST)
            runner.quit()
            return
        last = runner.last_heartbeat_timestamp
        if last is None or time.time() - last < MASTER_LOST_S:
            continue
        if part.finished.is_set():
            return
        environment.process_exit_code = 1
        if part.replay is None:
            _quit_before_the_plan(runner, time.time() - last)
            return
        logger.error("no heartbeat from the master for %.0f s: stopping this worker's replay", time.time() - last)
        part.abort(MASTER_LOST)
        runner.quit()
        return


def _quit_before_the_plan(runner: WorkerRunner, silent_s: float) -> None:
    """The master went silent before it sent this worker a plan (it ended before its run began,
    and its quit message was lost or never acted on): nothing was sent or recorded here, so the
    worker ends, exit 1, within seconds instead of waiting out Locust's 60 s check. If Locust's
    own quit does not return (a worker once hung after "Got quit message" under heavy load), the
    process exits anyway: there is nothing of a run to lose."""
    logger.error("no heartbeat from the master for %.0f s and no run from it: this worker quits", silent_s)
    with gevent.Timeout(QUIT_GRACE_S, False):
        runner.quit()
        return
    logger.error("Locust's quit did not end this worker within %.0f s: exiting", QUIT_GRACE_S)
    logging.shutdown()
    os._exit(1)


def _participants(runner) -> list[tuple[str, int]]:
    if isinstance(runner, MasterRunner):
        return [(c.id, runner.get_worker_index(c.id)) for c in runner.clients.all if c.state != "missing"]
    return [(transport.LOCAL_CLIENT, 0)]


@events.test_start.add_listener
def _on_test_start(environment, **kwargs) -> None:
    replay = getattr(environment, "replay", None)
    if replay is not None and replay.coordinator is not None:
        replay.coordinator.begin(_participants(environment.runner))
        if replay.progress is not None:
            replay.progress.start()


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
        try:
            if replay.progress is not None:
                replay.progress.stop()  # its last line, finished before the summary is printed
        finally:
            replay.coordinator.end()  # whatever the line did: the records come first

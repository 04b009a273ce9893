"""What `replay run` spares Locust's start and stop: one read of the installed distributions'
entry points while importing Locust (replay.locust.cli.entry_points_read_once), and a stop whose
debug line names its caller without reading source files (replay.locust.stop_caller); and a
run's metadata that names the platform without a child process (replay.results.metadata)."""

import importlib.metadata
import inspect
import logging
import re
import subprocess
import sys

import gevent
import locust.runners
from locust import User, task
from locust.env import Environment

from replay.locust import stop_caller
from replay.locust.cli import entry_points_read_once

IMPORT_LOCUST = """
import importlib.metadata as metadata
import sys
from replay.locust.cli import entry_points_read_once
standard, reads, asked = metadata.entry_points, [], []
metadata.distributions = (lambda real: lambda *a, **k: reads.append(1) or real(*a, **k))(metadata.distributions)
with entry_points_read_once():
    memo = metadata.entry_points
    metadata.entry_points = lambda **params: asked.append(params) or memo(**params)
    import locust.main
    metadata.entry_points = memo
import socket, gevent.socket
assert socket.socket is gevent.socket.socket, "gevent patched the standard library"
assert metadata.entry_points is standard, "the standard function again after the import"
print(len(asked), len(reads))
"""


def test_importing_locust_reads_the_entry_points_once_and_restores_the_standard_function():
    done = subprocess.run([sys.executable, "-c", IMPORT_LOCUST], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    asked, reads = map(int, done.stdout.split())
    assert asked > 5  # gevent's plugin look-ups, before and after each module it patches
    assert reads == 1


RUN_HELP = """
import gc, io, sys
from contextlib import redirect_stdout
from replay.locust.cli import run
loaded_at_first_collection = []
gc.callbacks.append(lambda phase, info: loaded_at_first_collection or loaded_at_first_collection.append(
    "replay.locust.plugin" in sys.modules))
with redirect_stdout(io.StringIO()) as shown:
    try:
        run(["--help"])
    except SystemExit as e:
        assert e.code in (0, None), e.code
assert "trace replay:" in shown.getvalue()
print(gc.isenabled(), gc.get_freeze_count(), loaded_at_first_collection)
"""


def test_replay_run_imports_locust_and_the_plugin_without_a_collection_then_freezes_them():
    """The objects of those imports live as long as the process: collections while importing
    found next to none to free, and each frozen one is never walked again."""
    done = subprocess.run([sys.executable, "-c", RUN_HELP], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    enabled, frozen, first_collection = done.stdout.strip().split(maxsplit=2)
    assert enabled == "True" and int(frozen) > 0
    assert first_collection in ("[]", "[True]")  # none before the plugin was imported


def test_the_memo_answers_as_the_standard_function():
    def names(entry_points) -> set[tuple[str, str, str]]:
        return {(ep.group, ep.name, ep.value) for ep in entry_points}

    standard = importlib.metadata.entry_points
    expected = names(standard(group="console_scripts"))
    assert ("console_scripts", "replay", "replay.cli:main") in expected
    with entry_points_read_once():
        assert importlib.metadata.entry_points is not standard
        assert names(importlib.metadata.entry_points(group="console_scripts")) == expected
        assert names(importlib.metadata.entry_points(group="console_scripts", name="replay")) == {
            ("console_scripts", "replay", "replay.cli:main")}
        assert names(importlib.metadata.entry_points(group="no such group")) == set()
    assert importlib.metadata.entry_points is standard


class Idle(User):
    @task
    def wait(self):
        gevent.sleep(1.0)


def test_a_runner_stops_and_logs_its_caller_without_reading_source(monkeypatch, caplog):
    def no_source(*args, **kwargs):
        raise AssertionError("Runner.stop read a source file")

    stop_caller.install()
    stop_caller.install()  # idempotent: the plugin's import and a test's
    monkeypatch.setattr(inspect, "findsource", no_source)
    monkeypatch.setattr(inspect, "getmodule", no_source)
    runner = Environment(user_classes=[Idle]).create_local_runner()
    runner.start(1, spawn_rate=100)
    runner.spawning_greenlet.join(timeout=10)
    assert runner.user_count == 1
    with caplog.at_level(logging.DEBUG, logger="locust.runners"):
        runner.stop()
    assert runner.user_count == 0 and runner.state == "stopped"
    # Runner.stop's caller is LocalRunner.stop, which calls it with super()
    assert re.search(rf"Stopping all users \(called from {re.escape(locust.runners.__file__)}:\d+\)", caplog.text)
    runner.quit()
    assert locust.runners.inspect is not inspect and inspect.stack.__module__ == "inspect"  # only Locust's runners


def test_the_plugin_leaves_the_web_uis_modules_to_a_run_with_a_web_ui():
    """A headless run imports neither the login nor the Replay view."""
    code = ("import sys, locust, replay.locust.plugin; "
            "print(sorted(m for m in ('replay.locust.webauth', 'replay.locust.webui') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


PLATFORM_WITHOUT_A_CHILD = """
import os, subprocess, sys
import gevent.monkey
import gevent.subprocess
gevent.monkey.patch_all()  # as a replay runs: gevent's subprocess forks the whole process


children = []


def refused(*args, **kwargs):
    children.append(args)
    raise OSError("no child process here")


subprocess.Popen = gevent.subprocess.Popen = os.fork = os.posix_spawn = refused
from replay.results.metadata import versions
print(versions()["platform"])
assert not children, f"a child process was asked for: {children}"
"""


def test_the_runs_metadata_names_the_platform_without_a_child_process():
    """platform.platform() runs `uname -p`: a fork of the replaying process, counted twice in the
    host's memory while it lives. Linux's own uname says the same without one."""
    import platform

    done = subprocess.run([sys.executable, "-c", PLATFORM_WITHOUT_A_CHILD], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    named = done.stdout.strip()
    processor = platform.uname().processor
    if sys.platform == "linux" and processor in ("", "unknown"):
        assert named == platform.platform()
    assert named.startswith(f"{platform.system()}-{platform.release()}-{platform.machine()}")

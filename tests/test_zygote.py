"""The test zygote (tests/support/zygote.py): a forked `replay run` is the process a new one would
have been, as far as the tests can tell: its output, exit code, working folder, environment,
scheduling, signals by its own pid, and its end when the test that asked for it is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import requests

from support.ports import free_port
from support.processes import LOCUST, ZYGOTE_ENV, ForkedRun, fork_replay_run, run_replay, spawn_locust, web_args
from support.traces import mooncake_trace
from support.waiting import wait_for

pytestmark = pytest.mark.skipif(os.environ.get(ZYGOTE_ENV) == "0", reason=f"{ZYGOTE_ENV}=0: no zygote to test")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _said(stderr: str) -> list[str]:
    return [line.split("replay: ", 1)[1] for line in stderr.splitlines() if "replay: " in line]  # not the times


def test_a_forked_run_says_what_a_new_process_says(tmp_path, toy_tokenizer_dir, monkeypatch):
    args = ["--host", "http://127.0.0.1:9", "--tokenizer", str(toy_tokenizer_dir), "--trace", "missing.jsonl"]
    forked = run_replay(["--headless", *args], tmp_path)
    real = subprocess.run([*LOCUST, "--headless", *args], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert forked.returncode == real.returncode == 2
    assert _said(forked.stderr) == _said(real.stderr) and "missing.jsonl" in _said(forked.stderr)[0]
    monkeypatch.setenv("LOCUST_HEADLESS", "true")  # the environment at the request, not at the zygote's start
    assert _said(run_replay(args, tmp_path).stderr) == _said(forked.stderr)


def test_signals_reach_the_run_and_its_exit_is_reported(tmp_path, toy_tokenizer_dir, fast_sim):
    """The web UI waits for its user: a run that lasts until it is stopped."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=3, gap_ms=10)
    port = free_port()
    proc = spawn_locust(web_args(trace, toy_tokenizer_dir, fast_sim.url, tmp_path / "run.jsonl", port), tmp_path,
                        tmp_path / "run.log")  # fmt: skip
    assert isinstance(proc, ForkedRun) and proc.poll() is None
    wait_for(lambda: requests.get(f"http://127.0.0.1:{port}", timeout=2).ok, "the web UI")
    assert os.sched_getscheduler(proc.pid) == os.sched_getscheduler(0)
    assert os.sched_getaffinity(proc.pid) == os.sched_getaffinity(0)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.1)
    proc.kill()
    assert proc.wait(30) == -signal.SIGKILL and not _alive(proc.pid)


def test_a_run_ends_with_the_connection_that_asked_for_it(tmp_path, toy_tokenizer_dir, fast_sim):
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=3, gap_ms=10)
    port = free_port()
    with open(tmp_path / "run.log", "w") as log:
        proc = fork_replay_run(web_args(trace, toy_tokenizer_dir, fast_sim.url, tmp_path / "run.jsonl", port),
                               tmp_path, log.fileno(), log.fileno())  # fmt: skip
    assert proc is not None
    wait_for(lambda: requests.get(f"http://127.0.0.1:{port}", timeout=2).ok, "the web UI")
    proc._sock.close()  # as when the test's process ends
    deadline = time.monotonic() + 30
    while _alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(proc.pid)

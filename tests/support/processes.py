"""Real Locust processes running the replay: one local process, a master and its workers, the
web UI; their arguments, and waiting for them to end."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from support.ports import free_port
from support.traces import BLOCK

LOCUST = [sys.executable, "-m", "replay", "run"]  # Locust with the package's locustfile, as users start it


def replay_args(trace: Path, tokenizer: Path, url: str, output: Path, *extra: str) -> list[str]:
    """A headless replay of a hand-built trace against a sim (model "sim", block size BLOCK)."""
    return ["--headless", "--host", url, "--trace", str(trace), "--block-size", str(BLOCK), "--tokenizer",
            str(tokenizer), "--model", "sim", "--output", str(output), "--loglevel", "INFO", *extra]


def run_locust(args: list[str], cwd: Path, timeout: float = 90, exit_code: int | None = 0) -> subprocess.CompletedProcess:
    """Run locust to the end and check its exit code (None: any; the failure shows both logs' tails)."""
    proc = subprocess.run([*LOCUST, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert exit_code is None or proc.returncode == exit_code, f"locust exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def spawn_locust(args: list[str], cwd: Path, log: Path, env: dict[str, str] | None = None,
                 new_session: bool = False, locustfile: list[str] | None = None) -> subprocess.Popen:
    """`env`: the process's whole environment (default: this one's). `new_session`: in a process
    group of its own, as a process started from another terminal or host is (by default it shares
    pytest's, and the master's). `locustfile`: the command before `args` (default LOCUST)."""
    return subprocess.Popen([*(locustfile or LOCUST), *args], cwd=cwd, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=new_session)


def spawn_worker(tmp_path: Path, port: int, name: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    """A worker running in `tmp_path` (relative paths in the plan resolve there), log `tmp_path/name.log`;
    `kwargs` as spawn_locust's."""
    return spawn_locust(["--worker", "--master-host", "127.0.0.1", "--master-port", str(port)], tmp_path,
                        tmp_path / f"{name}.log", env, **kwargs)


def master_and_workers(tmp_path: Path, master_args: list[str], workers: int = 2, port: int | None = None):
    """A `locust --master` (log: master.log) and `workers` workers (worker0.log, ...)."""
    port = port or free_port()
    master = spawn_locust([*master_args, "--master", "--expect-workers", str(workers), "--master-bind-host",
                           "127.0.0.1", "--master-bind-port", str(port)], tmp_path, tmp_path / "master.log")
    return master, [spawn_worker(tmp_path, port, f"worker{i}") for i in range(workers)]


def finish(procs: list[subprocess.Popen], timeout: float = 90) -> None:
    """Wait for every process to exit within `timeout` s in all; kill those still running."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def web_args(trace: Path, tokenizer: Path, url: str, output: Path, port: int) -> list[str]:
    """replay_args without --headless, with the web UI on 127.0.0.1:`port`."""
    args = [a for a in replay_args(trace, tokenizer, url, output) if a != "--headless"]
    return [*args, "--web-host", "127.0.0.1", "--web-port", str(port)]


def start_web_locust(tmp_path: Path, args: list[str], workers: int) -> list:
    """workers=0: one local process (logs to master.log); else a master and its workers."""
    if workers == 0:
        return [spawn_locust(args, tmp_path, tmp_path / "master.log")]
    master, procs = master_and_workers(tmp_path, args, workers)
    return [master, *procs]

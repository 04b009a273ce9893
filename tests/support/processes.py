"""Real Locust processes running the replay: one local process, a master and its workers, the
web UI; their arguments, and waiting for them to end.

`replay run` processes are forked from a zygote that has imported Locust and the replay
(tests/support/zygote.py), where the process they would have been can be made that way: the
environment as this process's (env=None), in this session, the replay's own locustfile. The others
start as processes of their own; TRACEREPLAY_TEST_ZYGOTE=0 starts every one that way.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from support.ports import free_port
from support.traces import BLOCK
from support.zygote import TESTS, send_request

LOCUST = [sys.executable, "-m", "replay", "run"]  # Locust with the package's locustfile, as users start it
ZYGOTE_ENV = "TRACEREPLAY_TEST_ZYGOTE"


def _interpreter_env(env) -> dict[str, str]:
    """The variables that shape an interpreter (or gevent, or Locust) as it starts, which a forked
    process cannot take from its request."""
    return {k: v for k, v in env.items() if k.startswith(("PYTHON", "GEVENT", "LOCUST_SKIP", "LOCUST_PLAYWRIGHT"))}


class _Zygote:
    """This process's zygote (each pytest-xdist worker has its own), started at its first use.
    It says "ready" once it listens, and ends with this process."""

    def __init__(self) -> None:
        self.owner = os.getpid()  # a process forked from this one has its own
        self.folder = tempfile.TemporaryDirectory(prefix="zygote-")
        self.path = os.path.join(self.folder.name, "socket")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))}
        self.started_with = _interpreter_env(os.environ)
        self.proc = subprocess.Popen([sys.executable, "-m", "support.zygote", self.path], env=env,
                                     stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the test zygote did not start (tests/support/zygote.py; its error is above)")
        atexit.register(self.stop)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.folder.cleanup()

    def fork(self, args: list[str], cwd: Path, stdout: int, stderr: int) -> ForkedRun | None:
        if _interpreter_env(os.environ) != self.started_with:
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(self.path)
        send_request(sock, {"args": list(args), "cwd": str(Path(cwd).resolve()), "env": dict(os.environ),
                            "umask": _umask()}, [0, stdout, stderr])
        return ForkedRun([*LOCUST, *args], sock)


_zygote: _Zygote | None = None


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def fork_replay_run(args: list[str], cwd: Path, stdout: int, stderr: int) -> ForkedRun | None:
    """`replay run ARGS` forked from this process's zygote, its stdout and stderr onto these fds;
    None where it must be a process of its own (then start one)."""
    global _zygote
    if os.environ.get(ZYGOTE_ENV) == "0":
        return None
    if _zygote is None or _zygote.owner != os.getpid():
        _zygote = _Zygote()
    return _zygote.fork(args, cwd, stdout, stderr)


class ForkedRun:
    """A forked `replay run` with the subprocess.Popen methods the tests use: signals go to its
    own pid; its wait status comes from its keeper (tests/support/zygote.py)."""

    def __init__(self, args: list[str], sock: socket.socket) -> None:
        self.args, self._sock, self._pending = args, sock, b""
        self.returncode: int | None = None
        self.pid = int(self._message(None)["pid"])

    def _message(self, timeout: float | None) -> dict:
        self._sock.settimeout(timeout)
        while b"\n" not in self._pending:
            try:
                chunk = self._sock.recv(4096)
            except (TimeoutError, BlockingIOError):
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            if not chunk:
                raise RuntimeError("the test zygote's keeper ended without the run's status")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(self._message(timeout)["status"])
            self._sock.close()
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def replay_args(trace: Path, tokenizer: Path, url: str, output: Path, *extra: str) -> list[str]:
    """A headless replay of a hand-built trace against a sim (model "sim", block size BLOCK)."""
    return ["--headless", "--host", url, "--trace", str(trace), "--block-size", str(BLOCK), "--tokenizer",
            str(tokenizer), "--model", "sim", "--output", str(output), "--loglevel", "INFO", *extra]


def run_replay(args: list[str], cwd: Path, timeout: float = 90, stderr_to_stdout: bool = False) -> subprocess.CompletedProcess:
    """`replay run ARGS` to its end, its output captured as text (subprocess.run's, capture_output=True,
    text=True, timeout=timeout; stderr_to_stdout: stderr=STDOUT)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = fork_replay_run(args, cwd, out.fileno(), (out if stderr_to_stdout else err).fileno())
        if proc is None:
            proc = subprocess.Popen([*LOCUST, *args], cwd=cwd, stdout=out, stderr=out if stderr_to_stdout else err)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        out.seek(0)
        err.seek(0)
        text = (out.read().decode(errors="replace"), None if stderr_to_stdout else err.read().decode(errors="replace"))
    return subprocess.CompletedProcess([*LOCUST, *args], proc.returncode, *text)


def run_locust(args: list[str], cwd: Path, timeout: float = 90, exit_code: int | None = 0) -> subprocess.CompletedProcess:
    """Run locust to the end and check its exit code (None: any; the failure shows both logs' tails)."""
    proc = run_replay(args, cwd, timeout)
    assert exit_code is None or proc.returncode == exit_code, f"locust exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def spawn_locust(args: list[str], cwd: Path, log: Path, env: dict[str, str] | None = None,
                 new_session: bool = False, locustfile: list[str] | None = None) -> subprocess.Popen | ForkedRun:
    """`env`: the process's whole environment (default: this one's). `new_session`: in a process
    group of its own, as a process started from another terminal or host is (by default it shares
    pytest's, and the master's). `locustfile`: the command before `args` (default LOCUST)."""
    with open(log, "w") as out:
        if env is None and not new_session and locustfile is None:
            forked = fork_replay_run(args, cwd, out.fileno(), out.fileno())
            if forked is not None:
                return forked
        return subprocess.Popen([*(locustfile or LOCUST), *args], cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                text=True, env=env, start_new_session=new_session)


def spawn_worker(tmp_path: Path, port: int, name: str, env: dict[str, str] | None = None,
                 **kwargs) -> subprocess.Popen | ForkedRun:
    """A worker running in `tmp_path` (relative paths in the plan resolve there), log `tmp_path/name.log`;
    `kwargs` as spawn_locust's."""
    return spawn_locust(["--worker", "--master-host", "127.0.0.1", "--master-port", str(port)], tmp_path,
                        tmp_path / f"{name}.log", env, **kwargs)


def spawn_master(tmp_path: Path, master_args: list[str], port: int, workers: int = 2,
                 log: str = "master.log") -> subprocess.Popen | ForkedRun:
    """A `locust --master` expecting `workers` workers on 127.0.0.1:`port`, log `tmp_path/log`."""
    return spawn_locust([*master_args, "--master", "--expect-workers", str(workers), "--master-bind-host",
                         "127.0.0.1", "--master-bind-port", str(port)], tmp_path, tmp_path / log)


def master_and_workers(tmp_path: Path, master_args: list[str], workers: int = 2, port: int | None = None):
    """A `locust --master` (log: master.log) and `workers` workers (worker0.log, ...)."""
    port = port or free_port()
    master = spawn_master(tmp_path, master_args, port, workers)
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

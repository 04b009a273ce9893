"""Start `replay sim` as a child process and learn its URL: for tests, benches and demos.

The child prints exactly one line, `replay sim listening on http://HOST:PORT`, once it
accepts connections; reading that line is the only synchronisation needed.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence

READY_PREFIX = "replay sim listening on "


class SimProcess:
    def __init__(self, tokenizer: str | os.PathLike, args: Sequence[str] = (), cpu: int | None = None,
                 startup_timeout: float = 30.0):
        cmd = [sys.executable, "-m", "replay", "sim", "--tokenizer", str(tokenizer), *map(str, args)]
        preexec = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
        # stderr goes to a file: a pipe nobody reads would block the server once full.
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.stderr, text=True, preexec_fn=preexec)
        self.url = self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        out = self.proc.stdout
        assert out is not None  # stdout=PIPE
        while time.monotonic() < deadline:
            ready, _, _ = select.select([out], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            line = out.readline()
            if not line:  # exited before listening
                self.proc.wait(5)
                raise RuntimeError(f"replay sim exited with {self.proc.returncode}: {self.errors()[-2000:]}")
            if line.startswith(READY_PREFIX):
                return line[len(READY_PREFIX):].strip()
        self.stop()
        raise RuntimeError(f"replay sim did not print its address within {timeout} s")

    def errors(self) -> str:
        """What the server wrote to stderr so far."""
        self.stderr.seek(0)
        return self.stderr.read()

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def stop(self, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        if self.proc.stdout:
            self.proc.stdout.close()
        return self.proc.returncode


@contextlib.contextmanager
def sim_process(tokenizer: str | os.PathLike, *args: str, cpu: int | None = None) -> Iterator[SimProcess]:
    """`with sim_process(tok, "--itl-ms", "0") as sim: requests.post(sim.url + ...)`; stopped on exit."""
    sim = SimProcess(tokenizer, args, cpu=cpu)
    try:
        yield sim
    finally:
        sim.stop()

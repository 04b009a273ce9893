"""A real `replay record` process in front of a server, as users start it."""

from __future__ import annotations

import atexit
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

READY = "replay record listening on "


class RecordProcess:
    """`replay record --upstream URL --output OUTPUT --port 0 ARGS`; `url` once it listens."""

    def __init__(self, upstream: str, output: Path, *args: str, timeout: float = 30.0, log: Path | None = None):
        """`log`: where its stderr goes (default: OUTPUT.log)."""
        self.output = Path(output)
        self.log = log or self.output.with_name(self.output.name + ".log")
        self.proc = subprocess.Popen([sys.executable, "-m", "replay", "record", "--upstream", upstream, "--output",
                                      str(output), "--port", "0", *args], stdout=subprocess.PIPE,
                                     stderr=open(self.log, "w"), text=True)
        atexit.register(self._kill)  # a test that failed before stopping it leaves no proxy behind
        deadline = time.monotonic() + timeout
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = self.proc.stdout.readline() if ready else ""
            if line.startswith(READY):
                self.url = line[len(READY):].split()[0]
                return
            if not line or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"replay record did not start: {self.errors()}")

    def _kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def errors(self) -> str:
        return self.log.read_text()

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, as a supervisor stops it; its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.stdout.close()

    def __enter__(self) -> RecordProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

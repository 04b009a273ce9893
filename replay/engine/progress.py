"""The progress line of a headless run, printed by the master (or the single process) on stderr.

Its figures are the Replay view's (replay.engine.live's LiveStats: rows sent, records, trace
time reached, elapsed, ETA, drift p99 over the last records, requests in flight), read, never
computed a second way; `progress_line` only words them.

stderr, not stdout: Locust writes its log and its own stats table there, and stdout carries
the run's summary, which users redirect and tests parse. On a terminal (the stream a tty) the
line is redrawn in place every TTY_INTERVAL_S, Locust's own console cadence, cut to the
terminal's width (a line that wraps cannot be redrawn in place); a log record
first erases it (a filter on the log handlers that write to the same stream), and the next tick
draws it again under the record. Anywhere else (a file, a pipe, a container's log) each
line is a plain line every LOG_INTERVAL_S with the wall time in front, as Locust's log lines
have it: the issue that asked for the line promises one at least every 5 s, and 4 s keeps that
promise with a second to spare for an event loop that runs late. `stop` writes the last line,
finished by a newline, before the run's end prints its summary.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TextIO

import gevent

from replay.engine.clock import SYSTEM_CLOCK, Clock

TTY_INTERVAL_S = 2.0
LOG_INTERVAL_S = 4.0
ERASE = "\r\x1b[K"  # back to the line's start, and clear it to its end
NONE = "-"
DEFAULT_WIDTH = 80  # a terminal whose size cannot be read


def clock_time(seconds: float | None) -> str:
    """Seconds as m:ss, or h:mm:ss from an hour on (as the Replay view shows them)."""
    if seconds is None:
        return NONE
    s = max(round(seconds), 0)
    h, m, sec = s // 3600, s % 3600 // 60, s % 60
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def milliseconds(value: float | None) -> str:
    if value is None:
        return NONE
    return f"{value:.1f} ms" if abs(value) < 100 else f"{value:.0f} ms"


def progress_line(f: dict) -> str:
    """The line, from `figures`' dict: what a pure function of them can say."""
    total = f["rows_total"]
    share = f" ({100 * f['rows_sent'] / total:.1f}%)" if total else ""
    return " | ".join((
        f"progress: {f['state']}",
        f"sent {f['rows_sent']}/{total}{share}",
        f"ok {f['ok']} failed {f['failed']}",
        f"trace {clock_time(f['trace_time_s'])}/{clock_time(f['trace_duration_s'])}",
        f"elapsed {clock_time(f['elapsed_s'])}",
        f"ETA {clock_time(f['eta_s'])}",
        f"drift p99 {milliseconds(f['drift_p99_ms'])}",
        f"in flight {f['in_flight']}",
    ))  # fmt: skip


def figures(stats, now: float) -> dict:
    """The line's figures at `now`, from the live figures `stats` (a LiveStats) hold: rows sent
    and the trace time its `progress`, elapsed, ETA (to the last send due) and state its
    `run_info`, drift p99 (last records) and in flight its `latest`; failed: the records that
    are not ok, among the rows done."""
    stats.tick(now)
    progress, run, latest = stats.progress(now), stats.run_info(now), stats.latest
    done, failed = progress["rows_done"], sum(stats.errors.values())
    return {
        "state": "done" if done >= progress["rows_total"] else run["state"],
        "rows_sent": progress["rows_sent"],
        "rows_total": progress["rows_total"],
        "ok": max(done - failed, 0),
        "failed": failed,
        "trace_time_s": progress["trace_time_s"],
        "trace_duration_s": progress["trace_duration_s"],
        "elapsed_s": run["elapsed_s"],
        "eta_s": run["eta_s"],
        "drift_p99_ms": latest["drift_p99_ms"],
        "in_flight": latest["in_flight"] or 0,
    }


def stamp(t: float) -> str:
    """Wall time as Locust's log lines show it (logging's asctime: 2026-01-02 15:04:05,123)."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f",{int(t * 1000) % 1000:03d}"


class _EraseFirst(logging.Filter):
    """On a log handler writing to the terminal the line is on: the line is erased before a
    record is written (it comes back at the next tick)."""

    def __init__(self, printer: ProgressLine):
        super().__init__()
        self.printer = printer

    def filter(self, record: logging.LogRecord) -> bool:
        self.printer.erase()
        return True


def terminal_width(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):  # no file descriptor, or not a terminal's
        return DEFAULT_WIDTH


def _handlers_on(stream: TextIO) -> list[logging.Handler]:
    loggers = [logging.getLogger(), *(x for x in logging.root.manager.loggerDict.values()
                                      if isinstance(x, logging.Logger))]
    return [h for x in loggers for h in x.handlers if getattr(h, "stream", None) is stream]


class ProgressLine:
    """`stats`' progress line on `stream` from `start` to `stop`, read on `clock`; `tty` (default:
    whether the stream is a terminal) picks the redrawn line over plain lines."""

    def __init__(self, stats, stream: TextIO, clock: Clock = SYSTEM_CLOCK, tty: bool | None = None):
        self.stats, self.stream, self.clock = stats, stream, clock
        self.tty = stream.isatty() if tty is None else tty
        self.interval = TTY_INTERVAL_S if self.tty else LOG_INTERVAL_S
        self.drawn = False  # a terminal line is on screen, not finished by a newline
        self.stopped = False
        self._greenlet: gevent.Greenlet | None = None
        self._filter = _EraseFirst(self)
        self._filtered: list[logging.Handler] = []

    def start(self) -> None:
        """From the run's start: a line now, then one every interval."""
        if self._greenlet is not None or self.stopped:
            return
        if self.tty:
            self._filtered = _handlers_on(self.stream)
            for handler in self._filtered:
                handler.addFilter(self._filter)
        self._greenlet = gevent.spawn(self._loop)

    def _loop(self) -> None:
        due = self.clock.now()
        while True:
            self.write()
            due += self.interval
            now = self.clock.now()
            if due <= now:  # late by a whole interval: the next one from now, no burst
                due = now + self.interval
            self.clock.sleep(due - now)

    def write(self) -> None:
        now = self.clock.now()
        line = progress_line(figures(self.stats, now))
        if self.tty:
            self._put(ERASE + line[: max(terminal_width(self.stream) - 1, 1)])
            self.drawn = True
        else:
            self._put(f"[{stamp(now)}] {line}\n")

    def erase(self) -> None:
        if self.drawn:
            self.drawn = False
            self._put(ERASE)

    def _put(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # the stream is closed, or its reader gone (`| head`): no one to tell
            pass

    def stop(self) -> None:
        """The last line, finished: called as the run stops, before its summary is printed."""
        if self.stopped:
            return
        self.stopped = True
        if self._greenlet is None:
            return
        self._greenlet.kill()
        for handler in self._filtered:
            handler.removeFilter(self._filter)
        self.write()
        if self.tty:
            self._put("\n")
            self.drawn = False

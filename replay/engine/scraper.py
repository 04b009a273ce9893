"""The master's scraper of the servers' Prometheus `/metrics` (the server's side of the run).

One greenlet for the whole fleet, on the master (or the local runner), never on a worker: a
scrape round asks every endpoint at once, each on a kept-alive connection of its own with a
short timeout, so a slow or dead server delays neither the others nor anything else the master does.
Each round writes one line per endpoint to OUTPUT.server-metrics.jsonl (the format is
replay.results.server_metrics'), all with the round's `t` (the master's time.time()), and
hands the round to `listeners` (the Replay view).

The first round is taken before the first request is sent (the coordinator waits for it), and
a last one after the last answer, so counters' changes cover exactly the run. A server without
`/metrics`, or one that fails, is logged once (and again once it answers); the run goes on.
An endpoint is written, logged and handed on by its URL as shown (replay.protocol.urls); its
credentials go only into the scrape's Authorization header.

The `--metrics-endpoint` exporters (GPU telemetry: dcgm-exporter, node exporters) are asked in
the same rounds, at the URL given (its path, or /metrics without one), and written whole
(replay.protocol.prometheus.parse_series) with `"exporter": true`; they go to `exporter_listeners`, never
to `listeners`, whose readers count running requests and cache hits of LLM servers. A round that cannot be written
(a full disk) goes to `on_fault`, which ends the run: the file keeps whole lines only.
"""

from __future__ import annotations

import http.client
import logging
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import gevent
from gevent.event import Event
from geventhttpclient import HTTPClient

from replay.errors import OutputError
from replay.protocol.client import close_with_reset
from replay.protocol.gevent_pool import PoolInternals
from replay.protocol.prometheus import parse_series
from replay.protocol.urls import shown, with_credentials
from replay.results.files import AppendFile
from replay.results.server_metrics import KNOWN, parse, sample_line
from replay.rules.run_files import metrics_path

logger = logging.getLogger(__name__)

MAX_TIMEOUT_S = 2.0  # a scrape's own limit: never more than this, never more than the interval
MIN_INTERVAL_S = 0.1  # --server-metrics-interval's least (besides 0, off): 1e-300 scraped ~4,000 times a second


class Scraper:
    def __init__(self, endpoints: list[str], output: str | Path, interval: float, extra: list[str] | None = None,
                 on_fault: Callable[[OutputError], None] | None = None, exporters: list[str] | None = None):
        """`on_fault` hears of a round that could not be written (None: it is raised)."""
        self.on_fault = on_fault
        self.endpoints = list(endpoints)
        self.exporters = list(exporters or ())
        self.shown = [shown(url) for url in self.endpoints + self.exporters]
        self.interval = interval
        self.names = tuple(dict.fromkeys((*KNOWN, *(extra or ()))))
        self.timeout = min(MAX_TIMEOUT_S, max(interval, 0.5))
        self.path = metrics_path(output)
        self.listeners: list[Callable[[float, dict[str, dict | None]], None]] = []  # (t, {shown url: metrics or None})
        self.exporter_listeners: list[Callable[[float, dict[str, dict | None]], None]] = []  # the same, exporters
        self.first_round = Event()  # set once the first round is written
        self._failing: dict[str, str] = {}  # endpoint -> the error last logged
        self._file: AppendFile | None = None
        self._loop: gevent.Greenlet | None = None
        self._stopping = Event()
        self._clients: dict[str, tuple[HTTPClient, str, dict[str, str]]] = {}

    def _client(self, url: str) -> tuple[HTTPClient, str, dict[str, str]]:
        """A kept-alive connection per endpoint (geventhttpclient retries a GET on one the server
        closed): a fresh connection, headers parsed by http.client, each second was most of an
        idle process's CPU."""
        if url not in self._clients:
            client = HTTPClient.from_url(url, concurrency=1, connection_timeout=self.timeout,
                                         network_timeout=self.timeout)  # the host and port only
            path = urlsplit(url).path
            page = (path or "/metrics") if url in self.exporters else path.rstrip("/") + "/metrics"
            self._clients[url] = (client, page, with_credentials(url, None))
        return self._clients[url]

    def start(self) -> None:
        try:
            self._file = AppendFile(self.path)
        except OutputError as e:
            self._fault(e)
        self._loop = gevent.spawn(self._run)

    def _fault(self, error: OutputError) -> None:
        if self.on_fault is None:
            raise error
        self.on_fault(error)

    def _run(self) -> None:
        while not self._stopping.is_set():
            started = time.monotonic()
            self.scrape()
            self._stopping.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def _one(self, url: str) -> tuple[dict | None, str | None]:
        try:
            client, path, headers = self._client(url)
            response = client.get(path, headers=headers)
            try:
                data = response.read()
            finally:
                response.release()
            if response.status_code != 200:
                raise ValueError(f"HTTP {response.status_code}")
            text = data.decode("utf-8", "replace")
            return (parse_series(text) if url in self.exporters else parse(text, self.names)), None
        except (OSError, http.client.HTTPException, ValueError, gevent.Timeout) as e:
            return None, f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)

    def scrape(self) -> None:
        """One round: every endpoint and exporter at once, written in that order."""
        t = time.time()
        jobs = [gevent.spawn(self._one, url) for url in self.endpoints + self.exporters]
        gevent.joinall(jobs, timeout=self.timeout + 1.0)
        results: dict[str, dict | None] = {}
        exported: dict[str, dict | None] = {}
        lines = bytearray()
        for i, (name, job) in enumerate(zip(self.shown, jobs)):
            metrics, error = job.value if job.successful() else (None, "no answer in time")
            if not job.ready():
                job.kill(block=False)
            exporter = i >= len(self.endpoints)
            self._log(name, error, exporter)
            (exported if exporter else results)[name] = metrics
            lines += sample_line(t, name, metrics, error, exporter)
        if self._file is not None:
            try:
                self._file.append(lines)
            except OutputError as e:
                self._fault(e)
        self.first_round.set()
        for listener in self.listeners:
            listener(t, results)
        for listener in self.exporter_listeners:
            listener(t, exported)

    def _log(self, url: str, error: str | None, exporter: bool = False) -> None:
        page = url if exporter else f"{url}/metrics"
        if error is None:
            if self._failing.pop(url, None) is not None:
                logger.info("server metrics: %s answers again", page)
            return
        if url not in self._failing:
            logger.warning("server metrics: %s: %s (the run goes on; noted once)", page, error)
            self._failing[url] = error

    def stop(self) -> None:
        """Take a last round, end the loop and close the file, complete and flushed."""
        if self._loop is None:
            return
        self._stopping.set()
        self._loop.join(timeout=self.timeout + 2.0)
        self._loop.kill()
        self.scrape()
        if self._file is not None:
            self._file.close()
            self._file = None
        self._loop = None
        for client, _, _ in self._clients.values():  # by reset: a FIN would leave a port in TIME_WAIT
            pool = PoolInternals(client)
            while (sock := pool.pop_idle()) is not None:
                close_with_reset(sock)
            client.close()
        self._clients.clear()

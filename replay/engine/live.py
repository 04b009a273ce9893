"""Live figures of a running replay, for the Replay view (`/replay/stats`).

Everything is computed on the master (or the local runner), once a second, from what it
already has: the records the workers ship in batches, plus one small message a second from
each worker with what only the worker knows (rows sent, requests in flight). Nothing here
runs on a worker's dispatch path.

Latencies, token rates and drift (also each worker's) are over the records that arrived in
the last WINDOW_S seconds. Once the run has ended they are the whole run's: the summary's own
figures (OUTPUT.summary.json, handed over by replay.run.finish, so each is computed one way),
and each worker's drift p99 over its records of the merged file, so that with one worker its
row and the run's agree. The cache hit ratios are cumulative over the run so far. Per endpoint (`servers`, in
--endpoints order) the view adds the server's own figures from the master's /metrics scraper, and per GPU
(`gpus`) the --metrics-endpoint exporters' DCGM series (replay.engine.gpu_view). The ideal ratio is the
trace's own (replay.trace.prefix, an infinite cache over trace blocks, starting empty at the
window's first row) taken over exactly the rows behind the observed ratio: answered rows
whose server reported both prompt_tokens and cached_tokens.
"""

from __future__ import annotations

import logging
import socket
import time
from array import array
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import gevent

from replay.engine import messages
from replay.engine.gpu_view import GpuView
from replay.protocol.urls import shown
from replay.results.records import Record, output_tokens_of, prompt_tokens_of
from replay.results.server_metrics import COUNTERS, GAUGES, pick
from replay.results.summary import failure_reason, percentile
from replay.rules.send_time import trace_seconds_reached
from replay.trace.prefix import hit_tokens, prefix_hits

logger = logging.getLogger(__name__)

TICK_S = 1.0
WINDOW_S = 10.0
HISTORY = 3600  # points kept (an hour at one a second); older ones drop off
IDEAL_MAX_ROWS = 500_000  # windows up to this many rows get the ideal cache line

LATEST_KEYS = (
    "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "e2e_p50_ms", "e2e_p99_ms", "output_tokens_per_s",
    "input_tokens_per_s", "in_flight", "drift_p50_ms", "drift_p99_ms", "cache_hit_ratio", "ideal_cache_hit_ratio",
    "servers", "gpus", "server_queue_p50_ms", "server_queue_p99_ms",
)  # fmt: skip
# the whole run's figures once it has ended: LATEST_KEYS -> where the summary (replay.results.report) has them
SUMMARY_FIGURES = {
    "ttft_p50_ms": ("ttft_ms", "p50"), "ttft_p99_ms": ("ttft_ms", "p99"), "tpot_p50_ms": ("tpot_ms", "p50"),
    "e2e_p50_ms": ("e2e_ms", "p50"), "e2e_p99_ms": ("e2e_ms", "p99"), "output_tokens_per_s": ("output_token_throughput",),
    "input_tokens_per_s": ("input_token_throughput",), "drift_p50_ms": ("drift_ms", "p50"),
    "drift_p99_ms": ("drift_ms", "p99"),
    # the server's own queue time (replay.results.server_time's E2E split: every ok record with the server's times)
    "server_queue_p50_ms": ("server_timing", "e2e_ms", "queue", "p50"),
    "server_queue_p99_ms": ("server_timing", "e2e_ms", "queue", "p99"),
}  # fmt: skip


def worker_report(part) -> messages.Live:
    """What only the worker knows: requests written but not yet answered (no record yet)."""
    return messages.Live(worker=part.index, host=socket.gethostname(), sent=part.sent, in_flight=len(part.in_flight),
                         failed=part.failed)


def report_loop(worker) -> None:
    """Worker side (a Dispatcher): once a second from the start of the run to its end, then once more."""
    worker.go.wait()
    part = worker.replay  # built by the plan, before the go
    while True:
        done = part.dispatch_pos >= part.total and not part.more and not part.in_flight
        part.link.to_master(messages.LIVE, worker_report(part))
        if done:
            return
        gevent.sleep(TICK_S)


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


@dataclass
class Reported:
    """The last figures a worker sent about itself."""

    host: str | None = None
    sent: int = 0
    in_flight: int = 0
    failed: int = 0


class LiveStats:
    """The master's live view of the run. `snapshot()` is what `/replay/stats` serves.
    `view` False (the headless progress line, replay.engine.progress): without what only the
    Replay view shows, the ideal cache line (its per-row table is built from the whole window
    before the run) and the exact figures after the end (a recount of the merged file)."""

    def __init__(self, coordinator, local_part=None, view: bool = True):
        self.coordinator = coordinator
        self.local_part = local_part
        self.reported: dict[str, Reported] = {}
        self.sent: Counter[int | None] = Counter()  # records with a sent_at, by worker
        self.failed: Counter[int | None] | None = None  # by worker, recounted at the end
        self.worker_drift_p99: dict[int | None, float | None] = {}  # last WINDOW_S during the run, whole run at the end
        self.recent: deque[tuple[float, Record]] = deque()
        self.history: deque[dict] = deque(maxlen=HISTORY)
        self.errors: Counter[str] = Counter()
        self.cached = self.prompt = self.ideal_cached = self.ideal_prompt = 0
        self.ideal = ideal_hit_tokens(coordinator) if view else {}
        self.servers = ServerView([shown(url) for url in coordinator.endpoint_urls()])
        coordinator.scrape_listeners.append(self.servers.on_round)  # the scraper is made as the run begins
        self.gpus = GpuView()
        coordinator.exporter_listeners.append(self.gpus.on_round)
        self._final = FinalCounts()
        if view:
            coordinator.final_listeners.append(self._final.add)
        self.summary: dict | None = None  # the run's summary, once it has ended
        coordinator.summary_listeners.append(self.on_summary)
        self.latest: dict = dict.fromkeys(LATEST_KEYS)
        self.stopped = False
        self.final: dict | None = None
        coordinator.listeners.append(self.add_records)

    # -- input ----------------------------------------------------------------------------------

    def on_report(self, data: messages.Live, sender: str) -> None:
        self.reported[sender] = Reported(data["host"], data["sent"], data["in_flight"], data["failed"])

    def add_records(self, records: list[Record]) -> None:
        now = time.time()
        for r in records:
            if r["sent_at"] is not None:  # a row never sent has no latency or drift for the window,
                self.recent.append((now, r))  # and a stopped run's end records them all at once
                self.sent[r["worker"]] += 1
            if not r["ok"]:
                self.errors[failure_reason(r)] += 1
            if r["ok"] and r["prompt_tokens"] is not None and r["cached_tokens"] is not None:
                ideal = self.ideal.get(r["request_id"], 0)
                self.cached += r["cached_tokens"]
                self.prompt += r["prompt_tokens"]
                self.ideal_cached += ideal
                self.ideal_prompt += r["input_length"] or 0  # a row of its own prompt: no ideal
                self.servers.add_record(r, ideal)

    def on_summary(self, summary: dict) -> None:
        self.summary = summary

    def on_stop(self) -> None:
        """After the coordinator's finalize: the figures become exact and stop changing."""
        self.stopped = True
        self.tick()

    # -- output ---------------------------------------------------------------------------------

    def tick(self, now: float | None = None) -> None:
        if self.final is not None:
            return
        now = time.time() if now is None else now
        while self.recent and self.recent[0][0] < now - WINDOW_S:
            self.recent.popleft()
        if self.coordinator.epoch is not None and now >= self.coordinator.epoch:
            self.latest = self._latest(now)
            self.history.append({"t": round(now, 3), **self.latest})
        if self.stopped and self.coordinator.recorded >= self.coordinator.total:
            self.final = self._exact()

    def _latest(self, now: float) -> dict:
        window = [r for _, r in self.recent]
        ok = [r for r in window if r["ok"]]
        span = min(WINDOW_S, max(now - self.coordinator.epoch, 1e-3))

        def values(key: str, rows: list[Record]) -> list[float]:
            found = (cast(Mapping[str, Any], r)[key] for r in rows)  # a field named by a variable
            return sorted(v for v in found if v is not None)

        ttft, e2e, drift = values("ttft_ms", ok), values("e2e_ms", ok), values("drift_ms", window)
        queue = values("server_queue_ms", ok)  # the servers' own word (replay.rules.server_timing), where they gave it
        by_worker: dict[int | None, list[float]] = {}
        for r in window:
            if r["drift_ms"] is not None:
                by_worker.setdefault(r["worker"], []).append(r["drift_ms"])
        self.worker_drift_p99 = {w: _round(percentile(sorted(d), 99)) for w, d in by_worker.items()}
        return {
            "ttft_p50_ms": _round(percentile(ttft, 50)), "ttft_p99_ms": _round(percentile(ttft, 99)),
            "tpot_p50_ms": _round(percentile(values("tpot_ms", ok), 50)),
            "e2e_p50_ms": _round(percentile(e2e, 50)), "e2e_p99_ms": _round(percentile(e2e, 99)),
            "output_tokens_per_s": round(sum(output_tokens_of(r) for r in ok) / span, 3),
            "input_tokens_per_s": round(sum(prompt_tokens_of(r) for r in ok) / span, 3),
            "in_flight": self._in_flight(),
            "drift_p50_ms": _round(percentile(drift, 50)), "drift_p99_ms": _round(percentile(drift, 99)),
            "cache_hit_ratio": _round(_ratio(self.cached, self.prompt), 4),
            "ideal_cache_hit_ratio": _round(_ratio(self.ideal_cached, self.ideal_prompt), 4),
            "servers": self.servers.latest(),
            "gpus": self.gpus.latest(),
            "server_queue_p50_ms": _round(percentile(queue, 50)), "server_queue_p99_ms": _round(percentile(queue, 99)),
        }  # fmt: skip

    def _in_flight(self) -> int:
        if self.local_part is not None:
            replay = self.local_part.replay  # None before its plan
            return 0 if replay is None else len(replay.in_flight)
        live = {s.client_id for s in self.coordinator.workers.values() if not s.lost}
        return sum(r.in_flight for cid, r in self.reported.items() if cid in live)

    def _exact(self) -> dict:
        """Per-worker counts and errors recounted from the complete merged records (they now
        include the rows the master accounted for itself: worker lost, run stopped), and the
        whole run's figures from its summary."""
        final = self._final
        self.sent, self.failed, self.errors = final.sent, final.failed, final.errors
        self.worker_drift_p99 = {w: _round(percentile(sorted(d), 99)) for w, d in final.drift.items()}
        self.latest = {**self.latest, **whole_run(self.summary), "in_flight": 0}
        return {"progress": self.progress(time.time()), "workers": self.workers()}

    def progress(self, now: float) -> dict:
        c = self.coordinator
        duration = c.schedule.window_s
        reached = 0.0 if c.epoch is None else min(max(trace_seconds_reached(now, c.epoch, c.options.scale), 0.0), duration)
        sent = sum(self.sent.values()) if self.stopped else sum(w["rows_sent"] for w in self.workers())
        return {
            "rows_total": c.total,
            "rows_sent": min(sent, c.total),
            "rows_done": c.recorded,
            "trace_time_s": round(reached, 3),
            "trace_duration_s": round(duration, 3),
        }

    def workers(self) -> list[dict]:
        out = []
        for state in sorted(self.coordinator.workers.values(), key=lambda s: s.index):
            reported = self._reported(state.client_id)
            sent = self.sent[state.index]
            if self.failed is not None:  # exact, from the merged records
                failed = self.failed[state.index]
            else:
                sent = max(reported.sent, sent)
                failed = max(reported.failed, state.failed)
            out.append({
                "index": state.index,
                "host": reported.host or host_of(state.client_id),
                "clock_offset_ms": _round(state.clock_offset_ms),
                "rows_assigned": len(state.positions),
                "rows_sent": sent,
                "in_flight": 0 if self.stopped or state.lost else reported.in_flight,
                "failed": failed,
                "drift_p99_ms": self.worker_drift_p99.get(state.index),
                "lost": state.lost,
                "ready": state.ready,
            })  # fmt: skip
        return out

    def _reported(self, client_id: str) -> Reported:
        if self.local_part is not None:
            p = self.local_part.replay  # None before its plan
            if p is None:
                return Reported(socket.gethostname())
            return Reported(socket.gethostname(), p.sent, len(p.in_flight), p.failed)
        return self.reported.get(client_id, Reported())

    def run_info(self, now: float) -> dict:
        c = self.coordinator
        if c.started_at is None:
            state = "waiting"
        elif self.final is not None:
            state = "finished"
        elif self.stopped:
            state = "stopping"
        elif c.epoch is None:
            state = "preparing"
        elif c.last_due is not None and now > c.last_due:
            state = "draining"
        else:
            state = "running"
        eta = None
        if c.epoch is not None and self.final is None:
            eta = round(max((c.last_due or now) - now, 0.0), 1)
        return {
            "state": state,
            "trace": str(c.trace.path),
            "format": c.trace.format,
            "scale": c.options.scale,
            "output": c.output,
            "epoch": c.epoch,
            "elapsed_s": None if c.epoch is None else round(max(now - c.epoch, 0.0), 1),
            "eta_s": eta,
            "window_s": WINDOW_S,
            "latest_over": "window" if self.final is None or self.summary is None else "run",
        }

    def snapshot(self, since: float | None = None) -> dict:
        now = time.time()
        final = self.final
        history = list(self.history)
        if since is not None:
            history = [h for h in history if h["t"] > since]
        return {
            "progress": final["progress"] if final else self.progress(now),
            "workers": final["workers"] if final else self.workers(),
            "latest": self.latest,
            "history": history,
            "errors": dict(self.errors.most_common()),
            "run": self.run_info(now),
            "servers": self.servers.info(self.coordinator.scrapes),
            "gpus": self.gpus.info(),
            "capacity": self.coordinator.policy.live(),
        }

    def run_ticks(self) -> None:
        while self.final is None:
            gevent.sleep(TICK_S)
            self.tick()


class ServerView:
    """Per endpoint, in --endpoints order: the server's own figures from the master's last
    /metrics scrape (replay.engine.scraper) beside the clients' view of its prefix cache.

    Three hit ratios, cumulative over the run: the server's counters (prefix-cache hits over
    queried tokens since the first scrape), the records' cached_tokens over prompt_tokens, and
    the trace's ideal over the same records (as the run-wide ideal line)."""

    def __init__(self, endpoints: list[str]):
        self.endpoints = endpoints
        self.metrics: dict[str, dict | None] = {}  # the last scrape, None: it failed
        self.first: dict[str, tuple[float, float]] = {}  # counters at the first scrape: hits, queries
        self.clients: dict[str | None, list[int]] = {url: [0, 0, 0, 0] for url in endpoints}  # cached, prompt, ideal x2

    def on_round(self, t: float, results: dict[str, dict | None]) -> None:
        for url, metrics in results.items():
            self.metrics[url] = metrics
            hits = pick(metrics or {}, COUNTERS["prefix_cache_hits"])
            queries = pick(metrics or {}, COUNTERS["prefix_cache_queries"])
            if url not in self.first and hits is not None and queries is not None:
                self.first[url] = (hits, queries)

    def add_record(self, r: Record, ideal: int) -> None:
        counts = self.clients.setdefault(r["endpoint"], [0, 0, 0, 0])
        counts[0] += r["cached_tokens"] or 0  # both known: add_records adds only such records
        counts[1] += r["prompt_tokens"] or 0
        counts[2] += ideal
        counts[3] += r["input_length"] or 0

    def latest(self) -> list[dict]:
        out = []
        for url in self.endpoints:
            m = self.metrics.get(url) or {}
            hits, queries = pick(m, COUNTERS["prefix_cache_hits"]), pick(m, COUNTERS["prefix_cache_queries"])
            server_ratio = None
            if url in self.first and hits is not None and queries is not None:
                server_ratio = _ratio(hits - self.first[url][0], queries - self.first[url][1])
            cached, prompt, ideal, ideal_prompt = self.clients.get(url, [0, 0, 0, 0])
            out.append({
                "running": pick(m, GAUGES["running"]), "waiting": pick(m, GAUGES["waiting"]),
                "kv_cache_usage": _round(pick(m, GAUGES["kv_cache_usage"]), 4),
                "server_hit_ratio": _round(server_ratio, 4),
                "cache_hit_ratio": _round(_ratio(cached, prompt), 4),
                "ideal_cache_hit_ratio": _round(_ratio(ideal, ideal_prompt), 4),
            })  # fmt: skip
        return out

    def info(self, scraped: bool) -> list[dict]:
        """Which endpoint each `latest()["servers"]` entry is, and whether its /metrics answers."""
        return [{"endpoint": url, "scraped": scraped, "metrics": self.metrics.get(url) is not None}
                for url in self.endpoints]  # fmt: skip


class FinalCounts:
    """Per-worker counts and errors over the merged records, fed one record at a time as the
    coordinator writes the merged file (the records are not kept)."""

    def __init__(self):
        self.sent: Counter[int | None] = Counter()
        self.failed: Counter[int | None] = Counter()
        self.errors: Counter[str] = Counter()
        self.drift: dict[int | None, array] = {}

    def add(self, r: Record) -> None:
        self.sent[r["worker"]] += r["sent_at"] is not None
        if not r["ok"]:
            self.failed[r["worker"]] += 1
            self.errors[failure_reason(r)] += 1
        if r["drift_ms"] is not None:
            self.drift.setdefault(r["worker"], array("d")).append(r["drift_ms"])


def whole_run(summary: dict | None) -> dict:
    """The `latest` figures the summary has, as it has them (rounded as the live ones); none
    without a summary (the run's end failed before it: the last window's stay)."""
    if summary is None:
        return {}
    out = {}
    for key, path in SUMMARY_FIGURES.items():
        value: Any = summary
        for part in path:
            value = value[part]
        out[key] = _round(value)
    return out


def ideal_hit_tokens(coordinator) -> dict[int, int]:
    """Per request id, the prompt tokens an infinite cache would hit (replay.trace.prefix), for
    the ideal line of the cache chart. Skipped above IDEAL_MAX_ROWS rows: it needs every block
    of the trace in memory (the chart then shows no ideal line)."""
    block = coordinator.trace.block_size or 0
    schedule = coordinator.schedule
    if not block or len(schedule) > IDEAL_MAX_ROWS:
        if block:
            logger.info("Replay view: no ideal cache line for a window of more than %d rows", IDEAL_MAX_ROWS)
        return {}
    rows = list(schedule.rows(range(len(schedule))))
    return {row.request_id: hit_tokens(row, hits, block) for row, hits in zip(rows, prefix_hits(rows))}


def host_of(client_id: str) -> str:
    """Locust names a worker '<hostname>_<uuid hex>'."""
    return client_id.rsplit("_", 1)[0]

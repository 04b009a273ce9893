"""The master's side of the replay (also the local runner's): read the trace, split it across
workers, ship the rows, set the shared start, collect the records, and account for every row.

The master knows what it assigned and what came back, so it can always write a complete
merged file: rows of a worker that went missing become "worker lost" records, rows still
open when the run is stopped become "run stopped" records.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import Iterator

import gevent
from gevent.event import Event

from replay.locust import messages
from replay.locust.clock import answer_ping
from replay.locust.options import ReplayOptions
from replay.locust.plan import encode_row, partition, schedule_rows, send_offset_s
from replay.results.records import RUN_STOPPED, WORKER_LOST, RecordWriter, unsent_record, write_records
from replay.results.metadata import coordinator_metadata, write_run_metadata
from replay.results.report import build_report, format_report, parse_slo
from replay.trace import read_trace
from replay.trace.record import TraceRow

logger = logging.getLogger(__name__)

CHUNK_ROWS = 500  # rows per message
GO_LEAD_S = 0.5  # from the go message to the first send: enough for it to reach every worker
READY_TIMEOUT_S = 300.0  # workers that are not ready by then are started anyway
DRAIN_GRACE_S = 10.0  # beyond --drain-timeout, for the workers' last records to arrive
ABORT_WAIT_S = 5.0  # at a stop, how long workers get to send what they still hold
TICK_S = 0.25


@dataclass
class WorkerState:
    client_id: str
    index: int
    rows: list[TraceRow]
    window: messages.Window
    ready: bool = False
    lost: bool = False
    clock_offset_ms: float | None = None
    rtt_ms: float | None = None
    failed: int = 0


def row_chunks(rows: list[TraceRow]) -> Iterator[dict]:
    """One worker's rows as ROWS payloads, encoded only when the window has room for them.

    A function, not a generator expression in `begin`'s loop: an expression's body reads the
    loop variable late, when it already names the last worker's rows.
    """
    for i in range(0, len(rows), CHUNK_ROWS):
        yield {"rows": [encode_row(r) for r in rows[i : i + CHUNK_ROWS]]}


def default_output() -> str:
    return time.strftime("results/replay-%Y%m%d-%H%M%S.jsonl", time.gmtime())


class Coordinator:
    def __init__(self, environment, link: messages.Link, options: ReplayOptions, local_part=None):
        self.environment = environment
        self.link = link
        self.options = options
        self.local_part = local_part
        trace = read_trace(options.trace, options.trace_format, options.block_size, options.on_bad_line)
        for bad in trace.skipped:
            logger.warning("skipped %s", bad)
        self.trace = trace
        self.rows, self.origin = schedule_rows(trace.rows, options.start, options.duration, options.max_requests)
        self.output = options.output or default_output()
        self.workers: dict[str, WorkerState] = {}
        self.owner: dict[int, WorkerState] = {}
        self.records: dict[int, dict] = {}
        self.placeholders: set[int] = set()  # records the master made up (worker lost)
        self.epoch: float | None = None
        self.last_due: float | None = None
        self.started_at: float | None = None
        self.finished = Event()
        self._writer: RecordWriter | None = None
        self._finalized = False
        self._supervisor: gevent.Greenlet | None = None
        self.listeners: list = []  # called with each batch of new records (the live Replay view)
        link.on(messages.ROWS_ACK, self.on_rows_ack)
        link.on(messages.PING, lambda data, sender: answer_ping(link, data, sender))
        link.on(messages.READY, self.on_ready)
        link.on(messages.RECORDS, self.on_records)
        logger.info(
            "trace %s (%s, block %s): %d rows, %d in the window, %.1f s at scale %g",
            trace.path, trace.format, trace.block_size, len(trace.rows), len(self.rows),
            self.window_seconds(), options.scale,
        )  # fmt: skip

    def window_seconds(self) -> float:
        if not self.rows:
            return 0.0
        return send_offset_s(self.rows[-1], self.origin, self.options.scale)

    # -- start --------------------------------------------------------------------------------------

    def begin(self, workers: list[tuple[str, int]]) -> None:
        """Split the rows across `workers` [(client id, index)] and start shipping them."""
        if self.started_at is not None:
            return
        self.started_at = time.time()
        self._writer = RecordWriter(self.output)
        parts = partition(self.rows, len(workers), self.options.partition)
        for (client_id, index), rows in zip(sorted(workers, key=lambda w: w[1]), parts):
            chunks = row_chunks(rows)
            window = messages.Window(
                lambda payload, cid=client_id: self.link.to_worker(cid, messages.ROWS, payload), source=chunks
            )
            state = WorkerState(client_id, index, rows, window)
            self.workers[client_id] = state
            for row in rows:
                self.owner[row.request_id] = state
            self.link.to_worker(
                client_id,
                messages.PLAN,
                {
                    "worker": index,
                    "rows": len(rows),
                    "origin": self.origin,
                    "block_size": self.trace.block_size,
                    "output": self.output,
                    "endpoints": self.options.endpoint_urls(self.environment.host),
                    "options": self.options.to_dict(),
                },
            )
            window.start()
        logger.info("replay: %d rows across %d worker(s), output %s", len(self.rows), len(workers), self.output)
        self._supervisor = gevent.spawn(self._supervise)

    def on_rows_ack(self, data: dict, sender: str) -> None:
        state = self.workers.get(sender)
        if state is not None:
            state.window.ack(data["seq"])

    def on_ready(self, data: dict, sender: str) -> None:
        state = self.workers.get(sender)
        if state is None:
            return
        if data.get("error"):
            logger.error("worker %d cannot replay: %s", state.index, data["error"])
            state.lost = True
            state.window.close()
            self._fill(state.rows, state.index, f"worker failed: {data['error']}")
            self._maybe_go()
            return
        state.ready = True
        state.clock_offset_ms = data.get("clock_offset_ms")
        state.rtt_ms = data.get("rtt_ms")
        logger.info("worker %d ready (clock offset %.3f ms, rtt %.3f ms)", state.index, state.clock_offset_ms or 0.0, state.rtt_ms or 0.0)
        self._maybe_go()

    def _maybe_go(self, force: bool = False) -> None:
        if self.epoch is not None:
            return
        live = [w for w in self.workers.values() if not w.lost]
        if not force and not all(w.ready for w in live):
            return
        self.epoch = time.time() + GO_LEAD_S
        self.last_due = self.epoch + self.window_seconds()
        for w in live:
            self.link.to_worker(w.client_id, messages.GO, {"epoch": self.epoch})
        logger.info("replay starts at %.3f; last send due in %.1f s", self.epoch, self.last_due - time.time())

    # -- records ------------------------------------------------------------------------------------

    def on_records(self, data: dict, sender: str) -> None:
        self.link.to_worker(sender, messages.RECORDS_ACK, {"seq": data["seq"]})
        self.ingest(data["records"])

    def ingest(self, records: list[dict]) -> None:
        fresh = []
        for record in records:
            rid = record["request_id"]
            if rid in self.records and rid not in self.placeholders:
                continue  # a resent batch
            self.placeholders.discard(rid)
            self.records[rid] = record
            fresh.append(record)
            state = self.owner.get(rid)
            if state is not None:
                state.failed += 0 if record["ok"] else 1
        if self._writer is not None:
            self._writer.write(fresh)
        for listener in self.listeners:
            listener(fresh)
        if len(self.records) >= len(self.rows):
            self.finished.set()

    def _fill(self, rows: list[TraceRow], worker: int | None, reason: str) -> list[int]:
        """Records for `rows` that have none yet; returns their request ids."""
        filled = []
        for row in rows:
            if row.request_id in self.records:
                continue
            scheduled = self.epoch + send_offset_s(row, self.origin, self.options.scale) if self.epoch else None
            self.records[row.request_id] = unsent_record(
                row, worker=worker, api=self.options.api, scheduled_at=scheduled, reason=reason
            )
            filled.append(row.request_id)
        return filled

    # -- supervision --------------------------------------------------------------------------------

    def _worker_gone(self, state: WorkerState) -> bool:
        clients = getattr(self.environment.runner, "clients", None)
        if clients is None:  # local runner
            return False
        node = clients.get(state.client_id)
        return node is None or node.state == "missing"

    def _supervise(self) -> None:
        while not self.finished.is_set():
            gevent.sleep(TICK_S)
            for state in self.workers.values():
                if not state.lost and self._worker_gone(state):
                    state.lost = True
                    state.window.close()
                    lost = self._fill(state.rows, state.index, WORKER_LOST)
                    self.placeholders.update(lost)  # replaced if the worker's own records still arrive
                    logger.warning("worker %d lost: %d of its rows recorded as %r", state.index, len(lost), WORKER_LOST)
            if self.epoch is None and time.time() - self.started_at > READY_TIMEOUT_S:
                logger.warning("not every worker got ready in %.0f s; starting anyway", READY_TIMEOUT_S)
                self._maybe_go(force=True)
            self._maybe_go()
            if all(w.lost for w in self.workers.values()):
                logger.error("every worker is lost; ending the run")
                self.finished.set()
            if len(self.records) >= len(self.rows):
                self.finished.set()
            if self.last_due is not None and time.time() > self.last_due + self.options.drain_timeout + DRAIN_GRACE_S:
                logger.warning("drain timeout: ending the run with %d rows unanswered", len(self.rows) - len(self.records))
                self.finished.set()

    # -- end ----------------------------------------------------------------------------------------

    def finalize(self) -> dict | None:
        """Account for every row, write the merged file sorted by request_id, print the summary."""
        if self._finalized or self.started_at is None:
            return None
        self._finalized = True
        if self._supervisor is not None:
            self._supervisor.kill(block=False)
        if self.local_part is not None:
            self.local_part.abort(RUN_STOPPED)
            self.ingest(self.local_part.take_records())
        elif len(self.records) < len(self.rows):
            live = [w for w in self.workers.values() if not w.lost]
            for w in live:
                self.link.to_worker(w.client_id, messages.ABORT, {})
            deadline = time.time() + ABORT_WAIT_S
            while len(self.records) < len(self.rows) and time.time() < deadline:
                gevent.sleep(0.1)
        for state in self.workers.values():
            self._fill(state.rows, state.index, WORKER_LOST if state.lost else RUN_STOPPED)
        self._fill(self.rows, None, RUN_STOPPED)  # rows never assigned (no worker at all)
        if self._writer is not None:
            self._writer.close()
        count = write_records(self.output, self.records.values())
        write_run_metadata(self.output, coordinator_metadata(self))
        report = build_report(list(self.records.values()), parse_slo(self.options.slo))
        sys.stdout.write(format_report(report) + f"\nrecords: {count} -> {self.output}\n")
        sys.stdout.flush()
        return report

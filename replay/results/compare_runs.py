"""A run as `replay compare` reads it: its records read once, as a stream, and kept as columns
(one entry a record, 8 bytes a figure), so that runs of millions of rows are compared in a
few hundred MB rather than as millions of dicts.

It also says what compare needs to know before it trusts a run: which rows the servers
answered, which the run left unanswered and why (a stop, a lost worker, a file that could
not be written: the records' labels, replay.results.records), and whether its files are
whole (OUTPUT.meta.json's `complete`, and one record for every row the meta says it had).
"""

from __future__ import annotations

import math
from array import array
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from replay.results.metadata import read_run_metadata
from replay.results.records import (
    DRAIN_TIMEOUT,
    ERROR_RATE,
    OUTPUT_ERROR,
    OVERSIZED,
    SESSION_STOPPED,
    TURN_NEVER_DUE,
    USER_STOPPED,
    Record,
    is_answer,
    parse_record,
    prompt_tokens_of,
)
from replay.results.report import ReportBuilder, meets_slo
from replay.results.server_metrics import read_server_section
from replay.results.server_time import timing_of
from replay.rules.server_timing import (
    SERVER_DECODE_MS,
    SERVER_PREFILL_MS,
    SERVER_QUEUE_MS,
    SERVER_TTFT_MS,
)

ITL_CAP = 20_000  # inter-token gaps a run keeps (each request's evenly spaced order statistics)
OK, FAILED, UNANSWERED = 0, 1, 2  # a record's state: answered ok, answered not ok, no answer
# Unanswered rows that the run made as asked, the same whatever the server does about them:
# they are counted apart but do not make the run incomplete.
AS_ASKED = (OVERSIZED, SESSION_STOPPED, TURN_NEVER_DUE)
# Labels that stopped the whole run: every row from the first of them on is the stop's, not
# the server's (the rows still in flight there are the slow ones: keeping the fast ones that
# finished after it would make the stopped run look faster).
RUN_STOPS = (*USER_STOPPED, ERROR_RATE, OUTPUT_ERROR)


class RunFileError(ValueError):
    """A run file compare cannot use: the message names the file and the line."""


def state_of(record: Record) -> int:
    """OK, FAILED (an answer that was not ok, or no answer before --drain-timeout: the server
    held it that long) or UNANSWERED (never sent, or cut off by the client's own end)."""
    if record.get("ok"):
        return OK
    if is_answer(record) or record.get("error") == DRAIN_TIMEOUT:
        return FAILED
    return UNANSWERED


def _float(value: float | None) -> float:
    return math.nan if value is None else value


def _thin(gaps: list[float], keep: int) -> tuple[list[float], float]:
    """At most `keep` of a request's gaps: its evenly spaced order statistics, each standing
    for len/keep gaps (the weight), so a quantile over the kept gaps weighs requests as every
    gap would."""
    if len(gaps) <= keep:
        return gaps, 1.0
    s = sorted(gaps)
    return [s[int((i + 0.5) * len(s) / keep)] for i in range(keep)], len(s) / keep


class RunRows:
    """One run's records as columns, in the file's order (index i is the i-th record)."""

    def __init__(self, path: str, meta: dict | None, slo: dict[str, float] | None, expected_rows: int) -> None:
        self.path, self.meta = path, meta
        self.ids = array("q")
        self.state = bytearray()
        self.good = bytearray()
        self.ttft, self.tpot, self.e2e = array("d"), array("d"), array("d")
        # the server's own parts of an ok record's time (replay.results.server_time), nan where it did not say
        self.server = {part: array("d") for part in SERVER_PARTS}
        self.server_timed = 0  # ok records with the server's own times
        self.scheduled = array("d")  # scheduled_at, for the HTML's plot over trace time
        self.cached, self.prompt = array("q"), array("q")  # cached -1: not reported
        self.itl_sum, self.itl_count = array("d"), array("q")
        # the kept gaps (replay.results.compare_runs._thin): value, weight, record index
        self.gap_value, self.gap_weight, self.gap_record = array("d"), array("d"), array("q")
        self.gaps_total = 0
        self.unanswered: Counter[str] = Counter()  # unanswered records by label
        self.first_stop: int | None = None  # the least request id a run-wide stop left unanswered
        self._keep = max(1, ITL_CAP // max(1, expected_rows))
        self._slo = slo
        self._seen = bytearray()
        self._line_of: dict[int, int] = {}  # only ids past _seen's reach
        self._lines = array("q")
        self._report = ReportBuilder(None)
        self.figures: dict[str, float | None] = {}

    def add(self, record: Record, line: int) -> None:
        rid = record["request_id"]
        if type(rid) is not int or rid < 0:
            raise RunFileError(f"{self.path}:{line}: request_id {rid!r} is not a row index (an integer >= 0)")
        self._check_once(rid, line)
        state = state_of(record)
        i = len(self.ids)
        self.ids.append(rid)
        self._lines.append(line)
        self.state.append(state)
        self.good.append(1 if self._slo and meets_slo(record, self._slo) else 0)
        self.scheduled.append(_float(record.get("scheduled_at")))
        # the run-level figures need no gaps, and a run's gaps are its largest part by far
        self._report.add({**record, "itl_ms": None} if record.get("itl_ms") else record)
        ok = state == OK
        for column, key in ((self.ttft, "ttft_ms"), (self.tpot, "tpot_ms"), (self.e2e, "e2e_ms")):
            column.append(_float(record.get(key)) if ok else math.nan)
        parts = server_parts(record) if ok else {}
        self.server_timed += bool(parts)
        for part, column in self.server.items():
            column.append(_float(parts.get(part)))
        cached = record.get("cached_tokens") if ok else None
        self.cached.append(-1 if cached is None else cached)
        self.prompt.append(prompt_tokens_of(record) if ok else 0)
        gaps = record.get("itl_ms") if ok else None
        self.itl_sum.append(sum(gaps) if gaps else 0.0)
        self.itl_count.append(len(gaps) if gaps else 0)
        if gaps:
            self.gaps_total += len(gaps)
            kept, weight = _thin(gaps, self._keep)
            self.gap_value.extend(kept)
            self.gap_weight.extend([weight] * len(kept))
            self.gap_record.extend([i] * len(kept))
        if state == UNANSWERED:
            label = str(record.get("error"))
            self.unanswered[label] += 1
            if label.startswith(RUN_STOPS) and (self.first_stop is None or rid < self.first_stop):
                self.first_stop = rid

    def _check_once(self, rid: int, line: int) -> None:
        if rid < 1 << 27:  # a byte a row up to 128M rows; ids beyond (a window far into a trace) in a dict
            if rid >= len(self._seen):
                self._seen.extend(bytes(max(rid + 1 - len(self._seen), len(self._seen))))
            if self._seen[rid]:
                first = self._lines[self.ids.index(rid)]
                raise RunFileError(f"{self.path}:{line}: request_id {rid} again (first on line {first}): "
                                   "a run has one record a row; this file is not one run's --output")
            self._seen[rid] = 1
        elif rid in self._line_of:
            raise RunFileError(f"{self.path}:{line}: request_id {rid} again (first on line {self._line_of[rid]}): "
                               "a run has one record a row; this file is not one run's --output")
        else:
            self._line_of[rid] = line

    def finish(self) -> RunRows:
        """Ends the reading: the run-level figures, as `replay report` computes them."""
        report = self._report.report()
        server = read_server_section(self.path, report["endpoints"])
        total = (server or {}).get("total") or {}
        self.figures = {"request_throughput": report["request_throughput"],
                        "output_throughput": report["output_token_throughput"],
                        "kv_usage_peak": total.get("peak_kv_cache_usage"), "queue_peak": total.get("peak_waiting"),
                        "preemptions": total.get("preemptions")}  # fmt: skip
        self._report = None  # type: ignore[assignment]  # its arrays are the run's size: freed now
        self._seen = bytearray()
        self._line_of = {}
        return self

    def __len__(self) -> int:
        return len(self.ids)

    def incomplete(self) -> list[str]:
        """Why this run is not a whole run, one phrase each (empty: it is whole)."""
        out = []
        if self.meta is not None and self.meta.get("complete") is False:
            files = "; ".join(f"{i.get('file')}: {i.get('error')}" for i in self.meta.get("incomplete") or ())
            out.append(f"its files are not whole ({files or 'OUTPUT.meta.json says complete: false'})")
        rows = ((self.meta or {}).get("trace") or {}).get("rows")
        if isinstance(rows, int) and len(self) < rows:
            out.append(f"{len(self)} records for the {rows} rows its meta names ({rows - len(self)} missing)")
        stops = {label: n for label, n in self.unanswered.items() if not label.startswith(AS_ASKED)}
        if stops:
            out.append(f"{sum(stops.values())} of {len(self)} rows unanswered: "
                       + ", ".join(f"{n} {label!r}" for label, n in sorted(stops.items(), key=lambda x: -x[1])))
        return out


SERVER_PARTS = ("queue", "prefill", "decode", "rest")  # compared row by row, as the latencies


def server_parts(record: Mapping[str, Any]) -> dict[str, float | None]:
    """The parts of a record's time `replay compare` compares: the server's queue, prefill and
    decode, and the rest of its TTFT (the client's less the server's: network, client, router);
    empty when the server told none, or times over the client's own (replay.results.server_time:
    no evidence, which a queue "regression" of a lying server would otherwise be)."""
    timing = timing_of(record)
    if timing is None or timing[3]:
        return {}
    ttft, server_ttft = record.get("ttft_ms"), record.get(SERVER_TTFT_MS)
    return {"queue": record.get(SERVER_QUEUE_MS), "prefill": record.get(SERVER_PREFILL_MS),
            "decode": record.get(SERVER_DECODE_MS),
            "rest": None if ttft is None or server_ttft is None else ttft - server_ttft}


def count_lines(path: str | Path) -> int:
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


def read_run(path: str, slo: dict[str, float] | None) -> RunRows:
    """A run file read as a stream into columns; RunFileError (file and line) on what is not
    one run's records, ValueError/OSError as reading raises them."""
    run = RunRows(path, read_run_metadata(path), slo, count_lines(path))
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                run.add(parse_record(line, path, number), number)
    if not len(run):
        raise RunFileError(f"{path}: no records: expected the per-request JSONL a replay writes (its --output)")
    return run.finish()


def run_of_records(path: str, meta: dict | None, records: Iterable[Record],
                   slo: dict[str, float] | None = None) -> RunRows:
    """A run from records in memory (the same reading as read_run's, for tests and benches)."""
    records = list(records)
    run = RunRows(path, meta, slo, len(records))
    for number, record in enumerate(records, 1):
        run.add(record, number)
    return run.finish()

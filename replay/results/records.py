"""Per-request records: one JSONL line per scheduled trace row, failures and unsent rows included.

Fields and their meaning are listed in docs/records.md; every record carries all of them (null when
unknown), so that records + trace rows always add up and tools can rely on the keys.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TypedDict

import orjson

from replay.errors import OutputError
from replay.results.files import AppendFile
from replay.results.output import fresh_fd
from replay.rules.server_timing import SERVER_TIMING_PROBLEM
from replay.rules.server_timing import empty as empty_server_timing
from replay.rules.usage import disagreements, output_tokens_believed


class Record(TypedDict):
    """One request's record: the one field list (docs/records.md), in the order written to disk. A
    type for readers and checkers only: records stay plain dicts, on disk and on the wire."""

    request_id: int  # the row's index in the trace file
    session_id: str | None
    worker: int | None
    endpoint: str | None
    api: str
    scheduled_at: float | None  # epoch seconds: the row's trace time
    due_at: float | None  # when the rule allowed the send (--turn-timing: a closed-loop turn's may be later)
    sent_at: float | None
    finished_at: float | None
    drift_ms: float | None  # sent_at - due_at: the client's own lag, never the server's
    waited_ms: float | None  # due_at - scheduled_at: how long a session's turn waited for its previous answer
    ttft_ms: float | None
    tpot_ms: float | None
    e2e_ms: float | None
    itl_ms: list[float] | None  # every gap of a streamed answer
    status: int
    ok: bool
    error: str | None  # a failure's reason, or why the row has no answer (the labels below)
    input_length: int | None  # the trace's counts (null: a row of its own messages, which says no length)
    output_length: int
    prompt_tokens: int | None  # the server's counts (usage), when it gave them
    output_tokens: int | None
    cached_tokens: int | None
    received_tokens: int | None  # content events received in the stream (null: not streamed)
    usage_mismatch: str | None  # the usage claims that cannot be true (replay.rules.usage), "; "-joined
    probe: int | None  # a capacity search's probe (docs/capacity.md), in the merged file; null: no search
    factor: float | None  # that probe's load factor
    prompt_fingerprint: list[list[int]] | None  # the prompt as sent: [[tokens, crc32], ...] (replay.rules.prompt_fingerprint)
    # The server's own times (replay.rules.server_timing, whose names these are): ms, null when unknown.
    server_queue_ms: float | None
    server_prefill_ms: float | None
    server_decode_ms: float | None
    server_ttft_ms: float | None
    server_e2e_ms: float | None
    server_mean_itl_ms: float | None
    server_timing_source: str | None  # "answer" | "span" | null
    server_timing_problem: str | None  # the answer's timing figures dropped (not durations), "; "-joined


RECORD_FIELDS = tuple(Record.__annotations__)

# Why a row has no answer. Only the first two come from the user's own stop (Stop, --run-time,
# Ctrl-C, SIGTERM); every other label is a failure and makes the exit code non-zero.
RUN_STOPPED = "run stopped"  # never sent: the run was stopped first
STOPPED_IN_FLIGHT = "run stopped before the answer"  # sent; the stop cut its answer off
DRAIN_TIMEOUT = "no answer before drain timeout"  # sent; still open --drain-timeout after the last send
WORKER_LOST = "worker lost"  # its worker went missing before it recorded the row
WORKER_FAILED = "worker failed"  # its worker could not start (": reason" follows)
MASTER_LOST = "master lost"  # the worker stopped sending when the master stopped answering
WORKER_STOPPED = "worker stopped"  # its worker got a signal of its own (SIGTERM, SIGINT, SIGHUP), not the master's stop
OUTPUT_ERROR = "output error"  # a file of the run could not be written (a full disk): the run was stopped
NO_RECORD = "no record from worker"  # the worker held the row but never returned its record
OVERSIZED = "prompt over --max-prompt-tokens"  # never synthesized nor sent (" (limit)" follows)
REFUSED = "run refused before the first send"  # the servers' check refused the run (": reason" follows)
ERROR_RATE = "run aborted: error rate over"  # --max-error-rate stopped the run (" R" follows: error_rate_label)
PROBE_CUT = "probe failed early"  # a capacity search's probe could no longer meet its target: never sent
PROBE_INVALID = "probe invalid"  # a worker was lost during a capacity search's probe: it is repeated, these never sent
SESSION_STOPPED = "session stopped after a failed turn"  # --on-turn-failure stop-session: never sent
TURN_NEVER_DUE = "previous turn unanswered at drain timeout"  # a closed-loop turn whose previous turn never ended: never sent
USER_STOPPED = (RUN_STOPPED, STOPPED_IN_FLIGHT)


def error_rate_label(limit: float) -> str:
    """The label of the rows a run stopped by --max-error-rate `limit` left unanswered."""
    return f"{ERROR_RATE} {limit:g}"


def is_answer(record: Record) -> bool:
    """Whether the record is a server's answer to a sent request (ok, an HTTP error, a broken
    stream or connection): the client read its outcome. A label's record has no `finished_at`."""
    return record["finished_at"] is not None


def prompt_tokens_of(record: Record) -> int:
    """A record's prompt tokens: the server's count, else the trace's (a server that reports no
    usage); 0 when neither is known."""
    return record.get("prompt_tokens") or record.get("input_length") or 0


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def sent_record(row, *, worker: int, endpoint: str, api: str, scheduled_at: float, outcome,
                due_at: float | None = None, prompt_fingerprint: list | None = None) -> Record:
    """The record of a request that was sent; `outcome` is a replay.protocol.Outcome; `due_at`:
    when the turn timing let it go (None: at `scheduled_at`); `prompt_fingerprint`: its prompt's,
    as its body was built (replay.synth.prompts)."""
    if due_at is None:
        due_at = scheduled_at
    received = outcome.events_tokens if outcome.streamed else None
    found = [*(outcome.usage_notes or ()),
             *disagreements(input_length=row.said_input_length, output_length=row.output_length, received_tokens=received,
                            prompt_tokens=outcome.prompt_tokens, output_tokens=outcome.output_tokens,
                            cached_tokens=outcome.cached_tokens)]
    believed = output_tokens_believed(output_tokens=outcome.output_tokens, received_tokens=received,
                                      output_length=row.output_length)
    return {
        "request_id": row.request_id,
        "session_id": row.session_id,
        "worker": worker,
        "endpoint": endpoint,
        "api": api,
        "scheduled_at": scheduled_at,
        "due_at": due_at,
        "sent_at": outcome.sent_at,
        "finished_at": outcome.finished_at,
        "drift_ms": _ms((outcome.sent_at - due_at) * 1000.0),
        "waited_ms": _ms((due_at - scheduled_at) * 1000.0),
        "ttft_ms": _ms(outcome.ttft_ms),
        "tpot_ms": _ms(outcome.tpot_ms_over(believed if believed is not None else outcome.events_tokens)),
        "e2e_ms": _ms(outcome.e2e_ms),
        "itl_ms": [round(x, 3) for x in outcome.itl_ms] if outcome.streamed else None,  # always kept: no opt-out
        "status": outcome.status,
        "ok": outcome.ok,
        "error": outcome.error,
        "input_length": row.said_input_length,
        "output_length": row.output_length,
        "prompt_tokens": outcome.prompt_tokens,
        "output_tokens": outcome.output_tokens,
        "cached_tokens": outcome.cached_tokens,
        "received_tokens": received,
        "usage_mismatch": "; ".join(found) or None,
        "probe": None,
        "factor": None,
        "prompt_fingerprint": prompt_fingerprint,
        **(outcome.server_timing or empty_server_timing()),  # type: ignore[typeddict-item]  # its keys: the fields above
        SERVER_TIMING_PROBLEM: "; ".join(outcome.server_timing_problems or ()) or None,
    }


def unsent_record(row, *, worker: int | None, api: str, scheduled_at: float | None, reason: str,
                  endpoint: str | None = None, sent_at: float | None = None, due_at: float | None = None) -> Record:
    """The record of a row that never got an answer: ok=false and the reason as error. A request
    that was sent keeps when and where (`sent_at`, `endpoint`, `drift_ms`): it loaded the server.
    `due_at`: when the turn timing let it go, where known (None: at `scheduled_at`)."""
    if due_at is None:
        due_at = scheduled_at
    record: Record = dict.fromkeys(RECORD_FIELDS)  # type: ignore[assignment]  # every field present, null when unknown
    record.update(
        request_id=row.request_id, session_id=row.session_id, worker=worker, endpoint=endpoint, api=api,
        scheduled_at=scheduled_at, due_at=due_at, status=0, ok=False, error=reason,
        input_length=row.said_input_length, output_length=row.output_length,
    )
    if due_at is not None and scheduled_at is not None:
        record["waited_ms"] = _ms((due_at - scheduled_at) * 1000.0)
    if sent_at is not None:
        record["sent_at"] = sent_at
        if due_at is not None:
            record["drift_ms"] = _ms((sent_at - due_at) * 1000.0)
    return record


def is_failure(record: Record) -> bool:
    """Not ok for a reason other than the user's own stop: what makes a run's exit code 1."""
    return not record["ok"] and record["error"] not in USER_STOPPED


class RecordWriter:
    """Writes records to a fresh JSONL file batch by batch, each batch whole or not at all
    (replay.results.files.AppendFile), so the file survives a crash and a full disk with whole
    lines only. Raises OutputError when a batch cannot be written (or the file made)."""

    def __init__(self, path: str | Path, output: str | Path | None = None):
        """`output`: the run's --output, named in the error when `path` is not a file to write."""
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(self.path.parent, e) from None
        self._file = AppendFile(self.path, fd=fresh_fd(str(output or path), self.path))
        self.count = 0

    def write(self, records: Iterable[Record]) -> None:
        # Each line straight into one buffer: a list of orjson.dumps results would hold about
        # 4 KB apiece (orjson's smallest buffer), 10 KB a row at a stop of 20,000 rows.
        batch, count = bytearray(), 0
        for record in records:
            batch += orjson.dumps(record)
            batch += b"\n"
            count += 1
        if count:
            self._file.append(batch)
            self.count += count

    def close(self) -> None:
        self._file.close()


# What makes a line a record: every record a replay ever wrote has these (the other fields
# came over time); a trace row, a summary or any other JSON has not both.
IDENTIFYING_FIELDS = ("request_id", "ok")


def read_records(path: str | Path) -> Iterator[Record]:
    """The records of a run's JSONL (--output, or a worker's file). Raises ValueError naming the
    file and line at a line that is not a record (a trace, a summary, any other JSON): a
    report of another file would be a summary of nothing that looks like one."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                yield parse_record(line, path, number)


def parse_record(line: bytes, path: str | Path, number: int) -> Record:
    """The record on line `number` of `path`; raises the ValueError read_records says."""
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        raise ValueError(f"{path}:{number}: not a JSON record: {e}") from None
    if type(record) is not dict or not all(key in record for key in IDENTIFYING_FIELDS):
        raise ValueError(f"{path}:{number}: not a run's record: expected the per-request JSONL a "
                         f"replay writes (its --output), whose every line has "
                         f"{' and '.join(map(repr, IDENTIFYING_FIELDS))}")
    return record


def output_tokens_of(record: Record) -> int:
    """A record's output tokens as a run counts them (replay.rules.usage.output_tokens_believed):
    the server's claim unless it cannot be true; 0 when nothing is known."""
    return output_tokens_believed(output_tokens=record.get("output_tokens"), received_tokens=record.get("received_tokens"),
                                  output_length=record["output_length"]) or 0

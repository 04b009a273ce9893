"""The servers' spans joined to the run's records by request id (`--otlp-receiver`, docs/otlp.md).

The receiver (replay.results.otlp_receiver) writes every span it is sent to OUTPUT.spans.jsonl;
at the end of the run `SpanTable` reads that file (as it grows, while the end waits for late
spans) and keeps, per row of the run, the server's latency split of the row's `llm_request`
span in arrays (48 bytes a row, whatever the run's size); the merge of the records
(replay.results.store's rewrite) then fills each record's server fields from it.

The matching rule: vLLM's span carries `gen_ai.request.id`, its engine's id of the request,
which is the client's X-Request-Id with vLLM's prefix: `chatcmpl-<id>` (chat completions),
`cmpl-<id>-<n>` (completions: `-<n>` the prompt's index in the request), and the replay sends
`X-Request-Id: <run id>-<request_id>` (the run id: 12 hex digits). So a span belongs to row R
of this run when its id ends in `<this run id>-R`, optionally followed by `-<digits>`, with
the run id at the start of the id or after a `-`. An id of the same shape with another run id
is another run's request (counted, ignored); an id of no such shape is not a replay's request
(counted, ignored); this run's id for a row with no record, or a second span for a row, is
counted too. Nothing is dropped silently: every count is in the summary's "spans" section.

A record's server fields (replay.rules.server_timing) come from its answer first (the server's
per-request `metrics` object); a span fills only those still null, and the span-only ones
(e2e), and replaces a TTFT that was the answer's queue + prefill: `server_timing_source` stays "answer" when the answer gave any, else becomes "span".
"""

from __future__ import annotations

import math
import re
from array import array
from collections.abc import Callable
from pathlib import Path

import orjson

from replay.protocol.otlp import (
    COMPLETION_TOKENS,
    DECODE,
    E2E,
    LLM_REQUEST,
    PREFILL,
    REQUEST_ID,
    TIME_IN_QUEUE,
    TIME_TO_FIRST_TOKEN,
)
from replay.rules.server_timing import (
    SERVER_DECODE_MS,
    SERVER_E2E_MS,
    SERVER_PREFILL_MS,
    SERVER_QUEUE_MS,
    SERVER_TIMING_FIELDS,
    SERVER_TTFT_MS,
    fill_missing,
    is_duration,
    span_fields,
)

# Each field a span gives directly: (record field, span attribute in seconds).
SPAN_SECONDS = ((SERVER_QUEUE_MS, TIME_IN_QUEUE), (SERVER_PREFILL_MS, PREFILL), (SERVER_DECODE_MS, DECODE),
                (SERVER_TTFT_MS, TIME_TO_FIRST_TOKEN), (SERVER_E2E_MS, E2E))

# "<run id>-<request_id>" at the end of a span's request id, after vLLM's prefix; a completion's
# "-<prompt index>" may follow.
REPLAY_ID = re.compile(r"(?:^|-)([0-9a-f]{12})-(\d{1,18})(?:-\d+)?$")


def replay_request(span_request_id: str) -> tuple[str, int] | None:
    """(run id, request_id) of a span's `gen_ai.request.id` (the rule above), or None: not a replay's."""
    match = REPLAY_ID.search(span_request_id)
    return (match.group(1), int(match.group(2))) if match else None


class SpanTable:
    """This run's spans by row, read from the receiver's file as it grows; the counts of every
    span and body the receiver heard (`tally`). `first`..`first + rows - 1`: the run's request
    ids; `recorded(request_id)`: whether the row has a record; `answered`: per row, 1 for a
    record answered ok (the rows whose span the end waits for)."""

    def __init__(self, path: str | Path, run_id: str, first: int, answered: bytearray,
                 recorded: Callable[[int], bool]):
        self.path = Path(path)
        self.run_id = run_id
        self.first = first
        self.rows = len(answered)
        self.answered = answered
        self.recorded = recorded
        self.expected = answered.count(1)  # ok records: each should get its span
        self.has = bytearray(self.rows)
        self.values = {name: array("d", [math.nan]) * self.rows for name, _ in SPAN_SECONDS}
        self.output_tokens = array("q", [0]) * self.rows
        self._offset = 0
        self.tally = {"spans": 0, "llm_request": 0, "joined": 0, "joined_ok": 0, "other_run": 0, "not_replay": 0,
                      "no_record": 0, "duplicate": 0, "other_name": 0, "bodies_too_large": 0, "bodies_bad": 0}

    @property
    def waiting(self) -> int:
        """Ok records still without their span."""
        return self.expected - self.tally["joined_ok"]

    def read(self) -> None:
        """Take the lines the receiver added since the last read (whole lines only)."""
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        self._offset += end
        for line in data[:end].splitlines():
            if line.strip():
                self._take(orjson.loads(line))

    def _take(self, line: dict) -> None:
        tally = self.tally
        if "rejected" in line:
            tally["bodies_too_large" if line.get("status") == 413 else "bodies_bad"] += 1
            return
        tally["spans"] += 1
        if line.get("name") != LLM_REQUEST:
            tally["other_name"] += 1
            return
        tally["llm_request"] += 1
        attributes = line.get("attributes") or {}
        found = replay_request(str(attributes.get(REQUEST_ID, "")))
        if found is None:
            tally["not_replay"] += 1
            return
        run_id, request_id = found
        if run_id != self.run_id:
            tally["other_run"] += 1
            return
        index = request_id - self.first
        if not (0 <= index < self.rows) or not self.recorded(request_id):
            tally["no_record"] += 1
            return
        if self.has[index]:
            tally["duplicate"] += 1
            return
        self.has[index] = 1
        tally["joined"] += 1
        tally["joined_ok"] += self.answered[index]
        for name, attribute in SPAN_SECONDS:
            seconds = attributes.get(attribute)
            if isinstance(seconds, int | float) and is_duration(seconds * 1000.0):  # a string, a negative: null
                self.values[name][index] = seconds * 1000.0
        tokens = attributes.get(COMPLETION_TOKENS)
        if isinstance(tokens, int) and not isinstance(tokens, bool):
            self.output_tokens[index] = tokens

    def fill(self, record: dict) -> bool:
        """Give `record` its server fields (replay.rules.server_timing): the answer's kept, the
        span's where null, every field present (null when neither has it). True when the record
        changed."""
        changed = False
        for name in SERVER_TIMING_FIELDS:
            if name not in record:
                record[name] = None
                changed = True
        index = record["request_id"] - self.first
        if not (0 <= index < self.rows) or not self.has[index]:
            return changed
        ms = {name: None if math.isnan(value := self.values[name][index]) else value for name, _ in SPAN_SECONDS}
        decode, tokens = ms[SERVER_DECODE_MS], self.output_tokens[index]
        fields = span_fields(queue_ms=ms[SERVER_QUEUE_MS], prefill_ms=ms[SERVER_PREFILL_MS], decode_ms=decode,
                             ttft_ms=ms[SERVER_TTFT_MS], e2e_ms=ms[SERVER_E2E_MS],
                             mean_itl_ms=decode / (tokens - 1) if decode is not None and tokens > 1 else None)
        return fill_missing(record, fields) or changed

    def section(self) -> dict:
        """The summary's "spans" section: every count, and the ok records left without a span."""
        return {**{k: v for k, v in self.tally.items() if k != "joined_ok"}, "ok_records": self.expected,
                "ok_records_without_span": self.waiting}


def format_section(section: dict, path: str | Path) -> str:
    """The summary's lines for the spans (after the records line)."""
    ignored = [f"{section[key]} {words}" for key, words in (
        ("other_run", "of another run"), ("not_replay", "not a replay's request"),
        ("no_record", "for a row without a record"), ("duplicate", "a row's second"),
        ("other_name", "not llm_request")) if section[key]]
    refused = [f"{section[key]} {words}" for key, words in (
        ("bodies_too_large", "too large (413)"), ("bodies_bad", "not OTLP (400)")) if section[key]]
    text = (f"server spans: {section['joined']} joined of {section['ok_records']} ok records; "
            f"{section['ok_records_without_span']} ok records without a span -> {path}\n")
    if ignored:
        text += f"server spans ignored: {', '.join(ignored)}\n"
    if refused:
        text += f"OTLP bodies refused: {', '.join(refused)}\n"
    return text

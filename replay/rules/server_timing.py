"""The server's own side of a request: its queue, prefill and decode times, named once.

A record's client-side times (ttft_ms, e2e_ms) include everything between the client and the
server's engine: the network, a router, the server's HTTP front end, the client's own lag. The
server knows how long the request waited in its queue, how long its prefill took and how long
it decoded; a record carries those as the fields below (float milliseconds, null when unknown),
so a run can say where the time went. Two sources fill them:

- the answer: vLLM with `--enable-per-request-metrics` (and `replay sim --per-request-metrics`)
  adds a `metrics` object to a non-streamed answer and to a stream's final usage event
  (`answer_fields` reads it);
- a trace span: vLLM's `llm_request` span, exported to the run's OTLP receiver and joined to
  the record by its X-Request-Id at the end of the run (`span_fields`).

The answer's values are kept; a span fills only what is still null (`fill_missing`), so a run
with both sources has one value per field, never two that disagree. The one exception is
`server_ttft_ms`: an answer states no TTFT (its queue + prefill leave out the server's front
end), so a span's TTFT, from the server's arrival, replaces that sum; `ttft_source` says which
a record's TTFT is.

Field meanings (docs/records.md states them for users):

- `server_queue_ms`: from the engine's receipt of the request to its first scheduling;
- `server_prefill_ms`: from that scheduling to the first output token;
- `server_decode_ms`: from the first output token to the last;
- `server_ttft_ms`: the server's own time to first token. From an answer, queue + prefill
  (vLLM's answer has no arrival time of its own); from a span, its `time_to_first_token`,
  counted from the server's arrival (so it also holds the front end's tokenization);
- `server_e2e_ms`: the server's arrival to its last token (a span's `e2e`; an answer has none);
- `server_mean_itl_ms`: the server's mean gap between output tokens;
- `server_timing_source`: "answer", "span" (only a span gave them), or null (no source did).
  A record whose answer gave any field says "answer" even where a span filled the rest.

A figure a server sends that is not a duration (a string, a bool, a negative or non-finite
number, one over a week) is dropped: its field stays null and the record's `server_timing_problem` names it, the
way `usage_mismatch` names a usage claim dropped. It never fails a request.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

SERVER_QUEUE_MS = "server_queue_ms"
SERVER_PREFILL_MS = "server_prefill_ms"
SERVER_DECODE_MS = "server_decode_ms"
SERVER_TTFT_MS = "server_ttft_ms"
SERVER_E2E_MS = "server_e2e_ms"
SERVER_MEAN_ITL_MS = "server_mean_itl_ms"
SERVER_TIMING_SOURCE = "server_timing_source"

# The durations, in the record's order, then the source: every record carries all of them.
SERVER_DURATION_FIELDS = (SERVER_QUEUE_MS, SERVER_PREFILL_MS, SERVER_DECODE_MS, SERVER_TTFT_MS, SERVER_E2E_MS,
                          SERVER_MEAN_ITL_MS)
SERVER_TIMING_FIELDS = (*SERVER_DURATION_FIELDS, SERVER_TIMING_SOURCE)
# What the answer's metrics dropped (not a duration), "; "-joined; null when nothing was dropped.
SERVER_TIMING_PROBLEM = "server_timing_problem"

FROM_ANSWER = "answer"
FROM_SPAN = "span"
SOURCES = (FROM_ANSWER, FROM_SPAN)

# vLLM's per-request `metrics` object (PerRequestMetrics), key -> our field. Its
# time_to_first_token_ms counts from scheduling, so it is the prefill, not a TTFT.
ANSWER_METRICS_KEYS = {
    "queue_time_ms": SERVER_QUEUE_MS,
    "time_to_first_token_ms": SERVER_PREFILL_MS,
    "generation_time_ms": SERVER_DECODE_MS,
    "mean_itl_ms": SERVER_MEAN_ITL_MS,
}
# Where the answer's object is, in a non-streamed answer and in a stream's final usage event.
ANSWER_METRICS_FIELD = "metrics"

# How far apart a record's server_ttft_ms and its server_queue_ms + server_prefill_ms may be.
# From an answer they are the same figures (only the records' rounding to 0.001 ms between);
# from a span the TTFT also holds the front end's time before the engine's queue.
ANSWER_TTFT_SUM_BOUND_MS = 0.01
# A server's time for a request over the client's own measure of it (its TTFT, its E2E) by more
# than this cannot be true (the client's clock starts before the server's and stops after it):
# those times are not evidence of where the time went.
SERVER_OVER_CLIENT_MS = 1.0
# The longest duration a server figure can be: no request waits or runs a week. A figure over it
# (1e300, a clock's epoch sent for a duration) is dropped as not a duration, not summed.
MAX_DURATION_MS = 7 * 24 * 3600 * 1000.0

ServerTiming = dict[str, float | str | None]


def is_duration(value: object) -> bool:
    """A server figure that can be a duration in ms: an int or float (no bool) from 0 to MAX_DURATION_MS."""
    return (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            and 0 <= value <= MAX_DURATION_MS)


def empty() -> ServerTiming:
    """The fields of a record no source filled: all null."""
    return dict.fromkeys(SERVER_TIMING_FIELDS)


def server_fields(*, source: str, queue_ms: float | None = None, prefill_ms: float | None = None,
                  decode_ms: float | None = None, ttft_ms: float | None = None, e2e_ms: float | None = None,
                  mean_itl_ms: float | None = None) -> ServerTiming:
    """The record's fields from one source's durations (ms, each already checked with
    `is_duration` or None); a TTFT the source did not state is queue + prefill where both are
    known. All null (source too) when the source gave nothing."""
    if source not in SOURCES:
        raise ValueError(f"server timing source {source!r}: expected one of {', '.join(SOURCES)}")
    if ttft_ms is None and queue_ms is not None and prefill_ms is not None:
        ttft_ms = queue_ms + prefill_ms
    values = (queue_ms, prefill_ms, decode_ms, ttft_ms, e2e_ms, mean_itl_ms)
    if all(v is None for v in values):
        return empty()
    fields: ServerTiming = {name: None if v is None else round(float(v), 3) for name, v in zip(SERVER_DURATION_FIELDS, values)}
    fields[SERVER_TIMING_SOURCE] = source
    return fields


def answer_fields(metrics: object) -> tuple[ServerTiming, list[str]]:
    """The fields an answer's `metrics` object gives, and what it sent that is not a duration
    (one phrase each, for the record's server_timing_problem). Anything but an object: all null,
    one phrase. Keys it does not send stay null without a phrase (vLLM leaves out what it could
    not time)."""
    if metrics is None:
        return empty(), []
    if not isinstance(metrics, Mapping):
        return empty(), [f"metrics {metrics!r:.40} is not an object"]
    found: dict[str, float | None] = {}
    problems = []
    for key, name in ANSWER_METRICS_KEYS.items():
        value = metrics.get(key)
        if value is None:
            continue
        if is_duration(value):
            found[name] = float(value)
        else:
            problems.append(f"metrics {key} {value!r:.40} is not a duration")
    fields = server_fields(source=FROM_ANSWER, queue_ms=found.get(SERVER_QUEUE_MS),
                           prefill_ms=found.get(SERVER_PREFILL_MS), decode_ms=found.get(SERVER_DECODE_MS),
                           mean_itl_ms=found.get(SERVER_MEAN_ITL_MS))
    return fields, problems


def span_fields(*, queue_ms: float | None = None, prefill_ms: float | None = None, decode_ms: float | None = None,
                ttft_ms: float | None = None, e2e_ms: float | None = None,
                mean_itl_ms: float | None = None) -> ServerTiming:
    """The fields a trace span gives (its latency attributes converted to ms, each checked with
    `is_duration` or None)."""
    return server_fields(source=FROM_SPAN, queue_ms=queue_ms, prefill_ms=prefill_ms, decode_ms=decode_ms,
                         ttft_ms=ttft_ms, e2e_ms=e2e_ms, mean_itl_ms=mean_itl_ms)


def fill_missing(record: dict, fields: Mapping[str, float | str | None]) -> bool:
    """Fill the record's null server fields from `fields` (a span's), keeping every value the
    record has (its answer's). The source becomes `fields`' only where the record had none.
    Returns whether any field was filled."""
    filled = False
    span_ttft = fields.get(SERVER_TTFT_MS) if fields.get(SERVER_TIMING_SOURCE) == FROM_SPAN else None
    if span_ttft is not None and ttft_source(record) == FROM_ANSWER:
        record[SERVER_TTFT_MS] = None  # the answer's queue + prefill: the span's arrival-based TTFT replaces it
    for name in SERVER_DURATION_FIELDS:
        value = fields.get(name)
        if value is not None and record.get(name) is None:
            record[name] = value
            filled = True
    if filled and record.get(SERVER_TIMING_SOURCE) is None:
        record[SERVER_TIMING_SOURCE] = fields.get(SERVER_TIMING_SOURCE)
    return filled


def ttft_source(record: Mapping) -> str | None:
    """Where the record's server_ttft_ms came from: FROM_ANSWER when it is its answer's queue +
    prefill (which leaves out the server's front end), FROM_SPAN when a span's (from the server's
    arrival), None without one. An answer's record whose span gave its TTFT is a span's."""
    ttft, source = record.get(SERVER_TTFT_MS), record.get(SERVER_TIMING_SOURCE)
    if ttft is None or source is None:
        return None
    if source == FROM_ANSWER:
        queue, prefill = record.get(SERVER_QUEUE_MS), record.get(SERVER_PREFILL_MS)
        if queue is not None and prefill is not None and abs(ttft - (queue + prefill)) <= ANSWER_TTFT_SUM_BOUND_MS:
            return FROM_ANSWER
        return FROM_SPAN
    return str(source)


def has_server_timing(record: Mapping) -> bool:
    """Whether any source filled the record's server fields."""
    return record.get(SERVER_TIMING_SOURCE) is not None


def server_work_ms(record: Mapping) -> float | None:
    """The server's own share of the record's E2E: its e2e where a span gave it, else queue +
    prefill + decode where all three are known, else None."""
    e2e = record.get(SERVER_E2E_MS)
    if e2e is not None:
        return e2e
    parts = [record.get(name) for name in (SERVER_QUEUE_MS, SERVER_PREFILL_MS, SERVER_DECODE_MS)]
    if any(p is None for p in parts):
        return None
    return sum(parts)  # type: ignore[arg-type]  # none is None (checked above)

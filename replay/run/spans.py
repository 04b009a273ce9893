"""The end of a run with --otlp-receiver: wait (at most --otlp-wait seconds) for the spans of
the ok records that have none yet, stop the receiver, and hand finish the table its records are
filled from (replay.results.span_join); the wait ends as soon as every ok record has its span.
A server's exporter sends its spans in batches every few seconds (vLLM's: 5 s), so the last
requests' spans come after their answers."""

from __future__ import annotations

import logging
import time

import gevent

from replay.engine.spec import RunSpec
from replay.engine.threads import off_loop
from replay.results.span_join import SpanTable
from replay.results.store import RecordStore

logger = logging.getLogger(__name__)
POLL_S = 0.1


def join_spans(spec: RunSpec, store: RecordStore) -> SpanTable | None:
    """The run's spans by row, once the late ones came or --otlp-wait passed; None without a receiver."""
    receiver = spec.spans
    if receiver is None:
        return None
    table = SpanTable(receiver.spans_path, spec.run_id, store.first, store.answered, store.has)
    deadline = time.monotonic() + spec.options.otlp_wait
    off_loop(table.read)
    if table.waiting:
        logger.info("waiting up to %g s for the servers' spans of %d ok records", spec.options.otlp_wait,
                    table.waiting)
    while table.waiting and time.monotonic() < deadline:
        gevent.sleep(POLL_S)
        off_loop(table.read)
    receiver.stop()
    off_loop(table.read)  # what came while it stopped
    if table.waiting:
        logger.warning("%d of %d ok records got no server span within --otlp-wait %g s: their server fields "
                       "stay null", table.waiting, table.expected, spec.options.otlp_wait)
    return table

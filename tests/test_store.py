"""The master's record store (replay/results/store.py) at the end of a run."""

from __future__ import annotations

import random

from replay.results.records import read_records
from replay.results.store import RecordStore
from support.records import ok_record


def test_records_that_arrive_after_the_end_are_not_taken(tmp_path):
    """A worker's late RECORDS may be handled while the run's end is written: the sorted file is
    final by then, and a write to its closed file raised in Locust's message handler."""
    output = tmp_path / "run.jsonl"
    rng = random.Random(0)
    store = RecordStore(output, 0, 2)
    assert len(store.add([ok_record(0, rng), ok_record(1, rng)])) == 2
    assert store.finish() == 2
    assert store.add([ok_record(2, rng)]) == [] and store.count == 2
    assert [r["request_id"] for r in read_records(output)] == [0, 1]

"""A replay of T' paired with the replay of T it was recorded from (docs/compare.md, docs/record.md).

`replay record --id-header X-Request-Id` in front of a replay of T writes a trace T' whose rows
carry the replay's request id, `<run id>-<request id>`: which row of T each row of T' is. T'
is in arrival order, and rows T sends at the same instant may arrive either way round, so T'
row k need not be T row k, and pairing the two replays by their own request ids would pair
different requests. A run of T' whose every row names one other run of the comparison (by that
run's `run_id`) and every row of it once is paired with that run through those ids instead:
its request ids are renumbered to T's. The trace files differ (so their fingerprints and
windows are not compared), but they are one experiment's two sides by construction. T' holds
the recording's wall-clock times, so only its replay at --scale 1 replays the recorded pace.
"""

from __future__ import annotations

from array import array
from pathlib import Path

import orjson

from replay.results.compare_runs import RunRows
from replay.results.metadata import file_sha256


def recorded_pairs(runs: list[RunRows]) -> dict[int, tuple[int, str]]:
    """The runs (by index) whose trace was recorded from another run of `runs`, each renumbered
    to that run's request ids in place: (that run's index, one line saying so). Runs that do not
    qualify are left as they are (the usual comparability checks then speak for them)."""
    by_id = {run.meta["run_id"]: k for k, run in enumerate(runs) if run.meta and run.meta.get("run_id")}
    paired: dict[int, tuple[int, str]] = {}
    for k, run in enumerate(runs):
        found = _source_rows(run, by_id)
        if found is None:
            continue
        source, rows = found
        source_rows = ((runs[source].meta or {}).get("trace") or {}).get("rows")
        if source == k or source in paired or source_rows != len(rows) \
                or not all(0 <= rid < len(rows) for rid in run.ids):
            continue
        mapping = array("q", rows)
        run.ids = array("q", (mapping[rid] for rid in run.ids))
        if run.first_stop is not None and 0 <= run.first_stop < len(mapping):
            run.first_stop = mapping[run.first_stop]
        source_id = (runs[source].meta or {}).get("run_id")
        paired[k] = source, (f"{run.path} replays {(run.meta or {}).get('trace', {}).get('path')}, recorded from "
                             f"{runs[source].path} (run {source_id}): rows paired by the recording's "
                             "client_request_id")
    return paired


def _source_rows(run: RunRows, by_id: dict[str, int]) -> tuple[int, list[int]] | None:
    """(the run its trace was recorded from, T' row -> that run's request id), or None. The
    trace must be the file the run replayed (its fingerprint), whole (no window)."""
    trace = (run.meta or {}).get("trace") or {}
    path = trace.get("path")
    if not path or trace.get("start") is not None or trace.get("duration") is not None \
            or trace.get("max_requests") is not None or not trace.get("sha256") \
            or file_sha256(path) != trace["sha256"]:
        return None
    rows: list[int] = []
    source_id = None
    try:
        with open(Path(path), "rb") as f:
            for line in f:
                if not line.strip():
                    continue
                named = orjson.loads(line).get("client_request_id")
                if not isinstance(named, str) or "-" not in named:
                    return None
                run_id, _, number = named.rpartition("-")
                if source_id is None:
                    source_id = run_id
                if run_id != source_id or not number.isdigit():
                    return None
                rows.append(int(number))
    except (OSError, ValueError, AttributeError):
        return None
    if source_id not in by_id or len(rows) != trace.get("rows") or sorted(rows) != list(range(len(rows))):
        return None
    return by_id[source_id], rows


__all__ = ["recorded_pairs"]

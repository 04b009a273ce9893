"""The names of a run's files, stated once: each is OUTPUT (the merged records) plus a suffix,
beside it, so one name finds a run's every file. The run writes them, `--overwrite` removes
them, the report and `replay compare` read them; each asks here, so they cannot disagree on a name.

- OUTPUT: the merged records, one JSON line a row;
- OUTPUT.meta.json: the run's metadata, written last;
- OUTPUT.summary.json: the end-of-run summary (`replay report --json`'s);
- OUTPUT.fidelity.json: the run's fidelity certificate (docs/fidelity.md);
- OUTPUT.server-metrics.jsonl: the servers' scraped metrics;
- OUTPUT.capacity.json: a capacity search's probes and answer (docs/capacity.md);
- OUTPUT.spans.jsonl: the spans the servers exported to --otlp-receiver (docs/otlp.md);
- OUTPUT.worker-N.jsonl: worker N's own copy of its records;
- OUTPUT.lock: held while a run writes OUTPUT;
- FILE.tmp: a file being written, renamed over FILE when whole.
"""

from __future__ import annotations

import re
from pathlib import Path

META_SUFFIX = ".meta.json"
SUMMARY_SUFFIX = ".summary.json"
FIDELITY_SUFFIX = ".fidelity.json"
METRICS_SUFFIX = ".server-metrics.jsonl"
CAPACITY_SUFFIX = ".capacity.json"
SPANS_SUFFIX = ".spans.jsonl"
LOCK_SUFFIX = ".lock"
TMP_SUFFIX = ".tmp"


def meta_path(output: str | Path) -> Path:
    return Path(f"{output}{META_SUFFIX}")


def summary_path(output: str | Path) -> Path:
    return Path(f"{output}{SUMMARY_SUFFIX}")


def fidelity_path(output: str | Path) -> Path:
    return Path(f"{output}{FIDELITY_SUFFIX}")


def capacity_path(output: str | Path) -> Path:
    return Path(f"{output}{CAPACITY_SUFFIX}")


def spans_path(output: str | Path) -> Path:
    return Path(f"{output}{SPANS_SUFFIX}")


def metrics_path(output: str | Path) -> Path:
    return Path(f"{output}{METRICS_SUFFIX}")


def worker_path(output: str | Path, worker: int) -> Path:
    """Where worker `worker` keeps its own copy of its records."""
    return Path(f"{output}.worker-{worker}.jsonl")


def worker_name_pattern(output: str | Path) -> re.Pattern[str]:
    """Matches the file names (not paths) of every worker's copy of `output`'s records, any N."""
    return re.compile(re.escape(Path(output).name) + r"\.worker-\d+\.jsonl")


def run_files(output: str | Path) -> list[Path]:
    """Every file of a run on `output` but the lock and the temporary ones: the records, the
    files beside them, and the workers' copies that exist now (any N)."""
    out = Path(output)
    files = [out, meta_path(out), summary_path(out), fidelity_path(out), metrics_path(out), capacity_path(out),
             spans_path(out)]
    pattern = worker_name_pattern(out)
    if out.parent.is_dir():
        files += sorted(p for p in out.parent.iterdir() if pattern.fullmatch(p.name))
    return files


def lock_path(output: str | Path) -> Path:
    return Path(f"{output}{LOCK_SUFFIX}")


def tmp_path(path: str | Path) -> Path:
    """Where `path` is written before it is renamed over `path` (a reader never sees half a file)."""
    path = Path(path)
    return path.with_name(path.name + TMP_SUFFIX)

"""Trace reading and stats speed on the shared traces (median of 5 runs)."""

from __future__ import annotations

import gzip
import shutil
import sys
import tempfile
from pathlib import Path

from common import median_seconds

from replay.trace import read_trace
from replay.trace.stats import trace_stats

SHARED = Path(__file__).resolve().parent.parent.parent / "shared"


def main() -> int:
    traces = SHARED / "traces"
    if not traces.exists():
        print(f"bench/trace_read.py: skipped, {traces} is absent")
        return 0
    paths = [traces / "mooncake_synthetic_trace.jsonl", traces / "azure_conv_2023.csv"]
    with tempfile.TemporaryDirectory() as tmp:
        gz = Path(tmp) / "mooncake_synthetic_trace.jsonl.gz"
        with open(paths[0], "rb") as src, gzip.open(gz, "wb") as dst:
            shutil.copyfileobj(src, dst)
        for path in paths + [gz]:
            trace = read_trace(path)
            read_s = median_seconds(lambda path=path: read_trace(path))
            stats_s = median_seconds(lambda trace=trace: trace_stats(trace))
            print(f"{path.name}: {len(trace.rows)} rows, read {read_s * 1000:.1f} ms "
                  f"({len(trace.rows) / read_s:,.0f} rows/s), stats {stats_s * 1000:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the live Replay view costs the master: the per-record hook on the coordinator, the
once-a-second tick (window percentiles, token rates, cache ratios) and one /replay/stats
answer, at several record rates. Prints the median of --runs.

    .venv/bin/python bench/webui.py [--trace FILE] [--runs 5]

Workers pay only one message a second (five numbers); nothing runs on their dispatch path.
Records are made up (bench/report.py's records_for); the coordinator is the real one.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import orjson
from report import records_for

from replay.bounds import DEFAULT_MAX_PROMPT_TOKENS
from replay.engine.coordinator import Coordinator, WorkerState
from replay.engine.live import WINDOW_S, LiveStats
from replay.engine.options import ReplayOptions
from replay.engine.transport import LocalLink, Window
from replay.results.store import RecordStore
from replay.run import preflight
from replay.synth.toy import build_toy_tokenizer

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"


def coordinator_for(trace: Path, folder: Path, workers: int = 4) -> Coordinator:
    tokenizer = build_toy_tokenizer(folder / "tok")
    options = ReplayOptions(trace=str(trace), tokenizer=str(tokenizer), output=str(folder / "run.jsonl"),
                            max_prompt_tokens=DEFAULT_MAX_PROMPT_TOKENS)  # as with no server to ask
    c = Coordinator(preflight.load(options, "http://127.0.0.1:9"), LocalLink())
    c.store = RecordStore(folder / "run.jsonl", *c.schedule.request_id_range())
    for i, positions in enumerate(c.schedule.partition(workers)):
        state = WorkerState(f"host{i}_abc", i, positions, Window(lambda payload: None), plan=None,
                            plan_window=Window(lambda payload: None), go_window=Window(lambda payload: None))
        c.workers[state.client_id] = state
    c.started_at = c.epoch = time.time() - 60
    return c


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trace", default=None)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    trace = Path(args.trace) if args.trace else SHARED if SHARED.exists() else REPO / "replay/data/sample_trace.jsonl"
    folder = Path(tempfile.mkdtemp(prefix="bench-webui-"))
    started = time.perf_counter()
    c = coordinator_for(trace, folder)
    init_s = time.perf_counter() - started
    started = time.perf_counter()
    LiveStats(c)
    print(f"trace {trace.name}: {len(c.schedule)} rows; ideal prefix hits precomputed in "
          f"{1000 * (time.perf_counter() - started):.1f} ms (coordinator itself {1000 * init_s:.0f} ms)")
    base = records_for(list(c.schedule.rows(range(len(c.schedule)))))
    for rate in (100, 1000, 5000):
        window = int(rate * WINDOW_S)
        records = [dict(base[i % len(base)], request_id=i % len(base), worker=i % 4) for i in range(window)]
        ticks, answers, per_record = [], [], []
        for _ in range(args.runs):
            c.store = RecordStore(folder / "run.jsonl", *c.schedule.request_id_range())
            stats = LiveStats(c)
            started = time.perf_counter()
            for i in range(0, len(records), 500):
                stats.add_records(records[i : i + 500])
            per_record.append((time.perf_counter() - started) / len(records) * 1e6)
            for k in range(3):  # three seconds of history
                stats.tick(time.time() + 0.001 * k)
            started = time.perf_counter()
            stats.tick()
            ticks.append((time.perf_counter() - started) * 1000)
            started = time.perf_counter()
            body = orjson.dumps(stats.snapshot())
            answers.append((time.perf_counter() - started) * 1000)
        print(f"{rate:>5} records/s ({window} in the {WINDOW_S:.0f} s window):"
              f" hook {statistics.median(per_record):.2f} us/record, tick {statistics.median(ticks):.1f} ms,"
              f" /replay/stats {statistics.median(answers):.1f} ms ({len(body)} bytes)")


if __name__ == "__main__":
    main()

"""`replay trace amplify` in bounded memory, and what it keeps of a trace.

1. A --rows-row Mooncake-format trace (bench/big_trace.py's) amplified x--factor by the real
   command, --runs times: peak RSS of the process (wait4 on the reaped child: exact), wall time,
   rows written (median of the runs). With --against TREE (another checkout, e.g. the main one),
   TREE's command amplifies the same trace too, --against-runs times, and the two OUTs must be the same
   bytes (sha256).
2. With --compare: `replay trace stats IN OUT` figures (rows, rate, lengths, turns per session,
   ideal hit ratio) for ../shared's Mooncake and Azure traces and a Bailian-style trace built
   here (sessions as parent_chat_id chains, each turn's hash ids extending the last's, a system
   prompt shared by every session), amplified x--factor.

    .venv/bin/python bench/amplify.py [--rows 2000000] [--factor 4] [--runs 3] [--compare] [--against TREE]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
from big_trace import write_trace
from scale import BLOCK

from replay.trace.amplify import amplify_trace
from replay.trace.reader import TraceStream
from replay.trace.sessions import DEFAULT_GLOBAL_MIN_ROWS
from replay.trace.stats import inferred_sessions, trace_stats

SHARED = Path(os.environ.get("TRACEREPLAY_SHARED", Path(__file__).resolve().parents[2] / "shared"))


def measure(trace: Path, out: Path, factor: float, tree: Path | None = None) -> tuple[float, float, int]:
    """(peak RSS MiB, seconds, rows written) of one `replay trace amplify` process (the code of
    checkout `tree`, when given)."""
    env = None if tree is None else {**os.environ, "PYTHONPATH": str(tree)}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "replay", "trace", "amplify", str(trace), str(out), "--factor",
                             str(factor), "--block-size", str(BLOCK)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env, cwd=tree)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    err = proc.stderr.read().decode()
    proc.stdout.close()
    proc.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"amplify failed: {err}")
    with open(out, "rb") as f:
        rows = sum(1 for _ in f)
    return usage.ru_maxrss / 1024.0, seconds, rows


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def bailian_style(path: Path, sessions: int = 3000, span_s: float = 3600.0, seed: int = 0) -> Path:
    """Bailian rows (16-token blocks): sessions of 1-8 turns, a shared 4-block system prompt,
    each turn's ids extending the conversation so far, starts denser in the middle hour."""
    rng = random.Random(seed)
    rows, chat, next_id = [], 0, 1000
    system = [0, 1, 2, 3]
    for _ in range(sessions):
        start = min(max(rng.gauss(span_s / 2, span_s / 5), 0.0), span_s)
        hashes, parent, time_s = list(system), -1, start
        for turn in range(1, rng.choice([1, 1, 1, 2, 2, 3, 4, 8]) + 1):
            added = rng.randint(2, 40)
            hashes = hashes + list(range(next_id, next_id + added))
            next_id += added
            rows.append({"chat_id": chat, "parent_chat_id": parent, "timestamp": round(time_s, 3),
                         "input_length": len(hashes) * 16 - rng.randrange(16), "output_length": rng.randint(1, 600),
                         "type": "text", "turn": turn, "hash_ids": hashes})
            parent, chat = chat, chat + 1
            time_s += rng.expovariate(1 / 30.0)
    rows.sort(key=lambda r: r["timestamp"])
    with open(path, "wb") as f:
        f.writelines(orjson.dumps(r) + b"\n" for r in rows)
    return path


def compare(name: str, trace: Path, out: Path, factor: float) -> None:
    def stats_of(path: Path) -> dict:
        stats = trace_stats(TraceStream(path))
        if stats["sessions"] is None:
            stats.update(inferred_sessions(lambda: TraceStream(path), DEFAULT_GLOBAL_MIN_ROWS))
        return stats

    amplify_trace(lambda: TraceStream(trace), out, factor)
    a, b = stats_of(trace), stats_of(out)
    same = all(a[k] == b[k] for k in ("input_length", "output_length", "turns_per_session"))
    hit = ("n/a" if a["ideal_prefix_hit_ratio"] is None else
           f"{a['ideal_prefix_hit_ratio']:.4f} -> {b['ideal_prefix_hit_ratio']:.4f} "
           f"({100 * (b['ideal_prefix_hit_ratio'] - a['ideal_prefix_hit_ratio']):+.2f} pt)")
    print(f"{name}: rows {a['requests']} -> {b['requests']}, sessions {a['sessions']} -> {b['sessions']}, "
          f"rate x{b['mean_rps'] / a['mean_rps']:.3f}, lengths and turns/session same: {same}, ideal hit {hit}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--factor", type=float, default=4.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--against", type=Path, metavar="TREE", help="another checkout to run and compare OUT with")
    parser.add_argument("--against-runs", type=int, default=1, metavar="N", help="runs of --against's (default 1)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        if args.compare:
            for name, trace in (("mooncake", SHARED / "traces" / "mooncake_synthetic_trace.jsonl"),
                                ("azure", SHARED / "traces" / "azure_conv_2023.csv"),
                                ("bailian-style", bailian_style(folder / "bailian.jsonl"))):
                compare(name, trace, folder / "out.jsonl", args.factor)
        trace = folder / "big.jsonl"
        write_trace(trace, args.rows, 200.0)
        for name, tree in (("this checkout", None), (str(args.against), args.against)):
            if name != "this checkout" and tree is None:
                continue
            out = folder / ("big-out.jsonl" if tree is None else "big-out-against.jsonl")
            count = args.runs if tree is None else args.against_runs
            runs = [measure(trace, out, args.factor, tree) for _ in range(count)]
            for rss, seconds, rows in runs:
                print(f"run ({name}): peak RSS {rss:.0f} MiB, {seconds:.1f} s, {rows} rows")
            print(f"{name}: {args.rows} rows x{args.factor:g}: peak RSS {statistics.median(r[0] for r in runs):.0f} "
                  f"MiB, {statistics.median(r[1] for r in runs):.1f} s (median of {count})")
        if args.against is not None:
            same = sha256(folder / "big-out.jsonl") == sha256(folder / "big-out-against.jsonl")
            print(f"OUT the same bytes as {args.against}'s: {same}")
            if not same:
                raise SystemExit(1)


if __name__ == "__main__":
    main()

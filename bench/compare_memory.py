"""`replay compare` of big runs: peak RSS and wall time (`/usr/bin/time -v`) at --rows rows.

The run files are made the way runs write them: two real runs of a --template-rows trace
against `replay sim` (each its own sim seed, answers of 16-64 tokens), then each tiled to
--rows records: record i is template record i mod T with request_id i, its times moved on by
whole template spans, and its latencies (TTFT, TPOT, E2E, every inter-token gap) scaled by
one factor drawn per record (so rows differ as a real run's do), in the field order and
format the replay writes (orjson lines, its OUTPUT.meta.json with the trace's rows set).

Prints per size the median of --runs of `replay compare BASE NEW --json OUT` (default
options: 1,000 resamples): peak RSS (MiB) and wall (s), and checks the JSON says every row
matched. --repo runs another checkout's code (e.g. the code before a change) on the same files.

    .venv/bin/python bench/compare_memory.py [--rows 300000 2000000] [--runs 3] [--repo /tmp/base]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import orjson
from compare_aa import BLOCK, replay

from replay.results.records import read_records
from replay.synth.toy import build_toy_tokenizer

REPO = Path(__file__).resolve().parent.parent
SCALED = ("ttft_ms", "tpot_ms", "e2e_ms")


def write_template_trace(path: Path, rows: int, gap_ms: float = 100.0, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(rows):
            blocks = rng.randint(4, 32)
            f.write(json.dumps({"timestamp": round(i * gap_ms, 3), "input_length": blocks * BLOCK,
                                "output_length": rng.randint(16, 64),
                                "hash_ids": [100_000 * (i + 1) + k for k in range(blocks)]}) + "\n")
    return path


def tile(template: Path, out: Path, rows: int, seed: int) -> Path:
    """`rows` records from the template run's (see the module's docstring), and its meta."""
    records = list(read_records(template))
    span = max(r["scheduled_at"] for r in records) - min(r["scheduled_at"] for r in records) + 1.0
    rng = random.Random(seed)
    with open(out, "wb") as f:
        batch = bytearray()
        for i in range(rows):
            r = dict(records[i % len(records)])
            shift = (i // len(records)) * span
            r["request_id"] = i
            for key in ("scheduled_at", "due_at", "sent_at", "finished_at"):
                if r[key] is not None:
                    r[key] += shift
            factor = rng.lognormvariate(0.0, 0.1)
            for key in SCALED:
                if r[key] is not None:
                    r[key] = round(r[key] * factor, 3)
            if r["itl_ms"]:
                r["itl_ms"] = [round(g * factor, 3) for g in r["itl_ms"]]
            batch += orjson.dumps(r)
            batch += b"\n"
            if len(batch) > 1 << 22:
                f.write(batch)
                batch = bytearray()
        f.write(batch)
    meta = orjson.loads(Path(f"{template}.meta.json").read_bytes())
    meta["trace"]["rows"] = rows
    Path(f"{out}.meta.json").write_bytes(orjson.dumps(meta, option=orjson.OPT_INDENT_2))
    return out


def measure(repo: Path, base: Path, new: Path, out: Path) -> dict:
    """One `replay compare` under /usr/bin/time -v, from `repo`'s code."""
    env = {**os.environ, "PYTHONPATH": str(repo)}
    proc = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-m", "replay", "compare", str(base), str(new),
                           "--json", str(out)], capture_output=True, text=True, cwd=repo, env=env)  # fmt: skip
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)", proc.stderr)
    if proc.returncode != 0 or not rss or not wall:
        raise SystemExit(f"replay compare failed ({proc.returncode}): {proc.stderr[-2000:]}")
    h, m, s = wall.groups()
    return {"rss_mib": int(rss.group(1)) / 1024, "wall_s": int(h or 0) * 3600 + int(m) * 60 + float(s),
            "rows_matched": json.loads(out.read_text())["rows_matched"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[300_000, 2_000_000])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--template-rows", type=int, default=200)
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose code compares (default: this)")
    parser.add_argument("--dir", type=Path, default=None, help="keep the run files here (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = args.dir or Path(tmp)
        d.mkdir(parents=True, exist_ok=True)
        for old in d.glob("template-*"):  # an earlier invocation's, in a --dir kept
            old.unlink()
        tokenizer = build_toy_tokenizer(d / "tok")
        trace = write_template_trace(d / "trace.jsonl", args.template_rows)
        templates = [replay(tokenizer, trace, d / f"template-{side}.jsonl", 10.0, seed, "--itl-ms", "5")
                     for seed, side in ((1, "base"), (2, "new"))]  # fmt: skip
        for rows in args.rows:
            base = tile(templates[0], d / f"base-{rows}.jsonl", rows, 1)
            new = tile(templates[1], d / f"new-{rows}.jsonl", rows, 2)
            size = (base.stat().st_size + new.stat().st_size) / 2**20
            results = []
            for i in range(args.runs):
                results.append(measure(args.repo, base, new, d / "out.json"))
                assert results[-1]["rows_matched"] == rows, results[-1]
                print(f"  {rows:,} rows, run {i + 1}: {results[-1]['rss_mib']:.0f} MiB {results[-1]['wall_s']:.1f} s",
                      flush=True)
            print(f"{rows:,} rows ({size:,.0f} MiB of records in all), {args.repo}: "
                  f"peak RSS {statistics.median(r['rss_mib'] for r in results):,.0f} MiB, "
                  f"wall {statistics.median(r['wall_s'] for r in results):.1f} s (median of {args.runs}: "
                  + ", ".join(f"{r['rss_mib']:.0f} MiB {r['wall_s']:.1f} s" for r in results) + ")", flush=True)
            base.unlink()
            new.unlink()


if __name__ == "__main__":
    main()

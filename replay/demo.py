"""`make demo`: replay the bundled sample trace against the built-in reference server.

Needs nothing outside the project: the tokenizer is trained here (replay.synth.toy), the
trace ships in replay/data/, the server is `replay sim`. Exits non-zero when any request
failed or any record is missing, so the demo doubles as a smoke test.
"""

from __future__ import annotations

import math
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parent.parent
SAMPLE_TRACE = Path(__file__).resolve().parent / "data" / "sample_trace.jsonl"
SAMPLE_BLOCK_SIZE = 16


def make_sample_trace(path: Path, seconds: float = 60.0, rate: float = 4.0, seed: int = 7) -> int:
    """A mooncake-format trace with production-like sharing, at SAMPLE_BLOCK_SIZE-token blocks.
    Each row says so in its own "block_size" (the readers honour it): the file is read right,
    by every command, with no --block-size (Mooncake's default, 512, would make every row bad).

    A few "applications" each own a system prompt of several blocks; conversations grow turn
    by turn, each turn's hash ids extending the previous turn's (multi-turn reuse), and some
    one-shot requests share only the system prompt. Poisson arrivals.
    """
    rng = random.Random(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    apps = [fresh(rng.randint(4, 10)) for _ in range(5)]
    conversations: list[list[int]] = []
    rows = []
    t = 0.0
    while t < seconds:
        t += rng.expovariate(rate)
        if conversations and rng.random() < 0.5:
            i = rng.randrange(len(conversations))
            conversations[i] = conversations[i] + fresh(rng.randint(2, 6))
            hash_ids = conversations[i]
            if len(hash_ids) > 48:
                conversations.pop(i)
        else:
            hash_ids = rng.choice(apps) + fresh(rng.randint(1, 6))
            if rng.random() < 0.5:
                conversations.append(hash_ids)
        input_length = (len(hash_ids) - 1) * SAMPLE_BLOCK_SIZE + rng.randint(1, SAMPLE_BLOCK_SIZE)
        assert len(hash_ids) == math.ceil(input_length / SAMPLE_BLOCK_SIZE)
        rows.append({"timestamp": int(t * 1000), "input_length": input_length,
                     "output_length": rng.randint(8, 64), "hash_ids": hash_ids, "block_size": SAMPLE_BLOCK_SIZE})
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return len(rows)


def main() -> int:
    from replay.results.records import read_records
    from replay.synth.toy import build_toy_tokenizer
    from replay.trace import read_trace

    work = Path(tempfile.mkdtemp(prefix="replay-demo-"))
    tokenizer_dir = build_toy_tokenizer(work / "tokenizer")
    output = REPO / "results" / "demo.jsonl"
    output.parent.mkdir(exist_ok=True)
    sim = subprocess.Popen(
        [sys.executable, "-m", "replay", "sim", "--tokenizer", str(tokenizer_dir), "--port", "0",
         "--block-size", str(SAMPLE_BLOCK_SIZE), "--model", "sim"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        line = sim.stdout.readline()
        if "listening on" not in line:
            print(f"replay sim did not start (exit {sim.poll()})", file=sys.stderr)
            return 1
        url = line.rsplit(" ", 1)[-1].strip()
        print(f"demo: replaying {SAMPLE_TRACE.name} against replay sim at {url}", flush=True)
        cmd = [sys.executable, "-m", "locust", "-f", str(REPO / "locustfile.py"), "--headless",
               "--host", url, "--trace", str(SAMPLE_TRACE), "--block-size", str(SAMPLE_BLOCK_SIZE),
               "--tokenizer", str(tokenizer_dir), "--api", "openai-chat", "--model", "sim",
               "--output", str(output), "--overwrite", "--only-summary", "--loglevel", "WARNING"]  # rerun at will
        rc = subprocess.run(cmd, cwd=REPO).returncode
    finally:
        sim.terminate()
        sim.wait(timeout=10)
    if rc != 0:
        print(f"demo: locust exited {rc}", file=sys.stderr)
        return rc
    records = list(read_records(output))
    expected = len(read_trace(SAMPLE_TRACE, block_size=SAMPLE_BLOCK_SIZE).rows)
    ok = sum(1 for r in records if r.get("ok"))
    print(f"demo: {len(records)}/{expected} records, {ok} ok; results in {output}")
    return 0 if len(records) == expected and ok == expected else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "make-sample":
        print(make_sample_trace(SAMPLE_TRACE), "rows written to", SAMPLE_TRACE)
        sys.exit(0)
    sys.exit(main())

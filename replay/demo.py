"""`python -m replay.demo` (`make demo`): replay the bundled sample trace against the built-in reference server.

Needs nothing outside the installed package, and runs from any folder: the tokenizer is trained
into a temporary folder it removes (replay.synth.toy), the trace ships in replay/data/, the server
is `replay sim`, the replay is `replay run`. The run's files go under the current folder
(results/demo.jsonl by default, as every replay writes its --output there), never into the
package. Exits non-zero when any request failed or any record is missing, so the demo doubles as
a smoke test.
"""

from __future__ import annotations

import argparse
import math
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import orjson

SAMPLE_TRACE = Path(__file__).resolve().parent / "data" / "sample_trace.jsonl"
SAMPLE_BLOCK_SIZE = 16
DEFAULT_OUTPUT = "results/demo.jsonl"


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


def main(argv: list[str] | None = None) -> int:
    from replay.results.records import read_records
    from replay.sim.process import sim_process
    from replay.synth.toy import build_toy_tokenizer
    from replay.trace import read_trace

    args = parse_args(argv)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="replay-demo-") as work:
        tokenizer_dir = build_toy_tokenizer(Path(work) / "tokenizer")
        with sim_process(tokenizer_dir, "--port", "0", "--block-size", str(SAMPLE_BLOCK_SIZE), "--model", "sim") as sim:
            print(f"demo: replaying {SAMPLE_TRACE.name} against replay sim at {sim.url}", flush=True)
            cmd = [sys.executable, "-m", "replay", "run", "--headless", "--host", sim.url, "--trace", str(SAMPLE_TRACE),
                   "--block-size", str(SAMPLE_BLOCK_SIZE), "--tokenizer", str(tokenizer_dir), "--api", "openai-chat",
                   "--model", "sim", "--scale", str(args.scale), "--output", str(output),
                   "--overwrite", "--only-summary", "--loglevel", "WARNING"]  # rerun at will
            rc = subprocess.run(cmd).returncode
    if rc != 0:
        print(f"demo: replay run exited {rc}", file=sys.stderr)
        return rc
    records = list(read_records(output))
    expected = len(read_trace(SAMPLE_TRACE, block_size=SAMPLE_BLOCK_SIZE).rows)
    ok = sum(1 for r in records if r.get("ok"))
    print(f"demo: {len(records)}/{expected} records, {ok} ok; results in {output}")
    return 0 if len(records) == expected and ok == expected else 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m replay.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=DEFAULT_OUTPUT,
                        help="the run's JSONL, relative to the current folder (default %(default)s; its "
                             ".meta.json and .summary.json beside it)")
    parser.add_argument("--scale", type=float, default=1.0, help="time scale: 2 replays twice as fast (default 1)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    if sys.argv[1:] == ["make-sample"]:  # the maintainers' command that wrote replay/data/sample_trace.jsonl
        print(make_sample_trace(SAMPLE_TRACE), "rows written to", SAMPLE_TRACE)
        sys.exit(0)
    sys.exit(main())

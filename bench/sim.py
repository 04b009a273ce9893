"""How fast `replay sim` serves: non-streaming requests/s and streamed tokens/s on one core.

The sim runs in a child process pinned to one core, the gevent load generator
(geventhttpclient, keep-alive connections) on another, latencies set to zero so the
figures are the server's own cost. Each figure is the median of several runs.
Targets: >= 1,000 requests/s non-streaming, >= 50,000 streamed tokens/s.

    .venv/bin/python bench/sim.py [--tokenizer DIR] [--runs 3] [--seconds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import gevent
import orjson
from common import split_cores
from geventhttpclient import HTTPClient

from replay.sim.process import sim_process

REPO = Path(__file__).resolve().parent.parent
SHARED_QWEN = REPO.parent / "shared" / "tokenizers" / "qwen2"


def load(port: int, body: bytes, connections: int, seconds: float, count_tokens: bool) -> tuple[float, float]:
    """(requests/s, tokens/s) from `connections` keep-alive clients posting `body` for `seconds`."""
    client = HTTPClient("127.0.0.1", port, concurrency=connections, connection_timeout=10, network_timeout=60)
    headers = {"content-type": "application/json"}
    done = [0, 0]
    stop_at = time.monotonic() + seconds

    def worker() -> None:
        while time.monotonic() < stop_at:
            resp = client.post("/v1/chat/completions", body=body, headers=headers)
            data = resp.read()
            if resp.status_code != 200:
                raise RuntimeError(f"status {resp.status_code}: {data[:200]!r}")
            done[0] += 1
            if count_tokens:
                # Every event but the role chunk, the usage chunk and [DONE] is one token.
                done[1] += data.count(b"data: ") - 3

    t0 = time.monotonic()
    gevent.joinall([gevent.spawn(worker) for _ in range(connections)], raise_error=True)
    elapsed = time.monotonic() - t0
    client.close()
    return done[0] / elapsed, done[1] / elapsed


def many_streams(port: int, body: bytes, streams: int) -> tuple[float, int]:
    """Wall time for `streams` concurrent paced streams, and how many finished whole."""
    client = HTTPClient("127.0.0.1", port, concurrency=streams, connection_timeout=30, network_timeout=120)
    ok = [0]

    def one() -> None:
        resp = client.post("/v1/chat/completions", body=body, headers={"content-type": "application/json"})
        if resp.status_code == 200 and resp.read().endswith(b"data: [DONE]\n\n"):
            ok[0] += 1

    t0 = time.monotonic()
    gevent.joinall([gevent.spawn(one) for _ in range(streams)], raise_error=True)
    elapsed = time.monotonic() - t0
    client.close()
    return elapsed, ok[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: ../shared qwen2, else the toy)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--streams", type=int, default=2000, help="concurrent paced streams for the scale check")
    parser.add_argument("--stream-tokens", type=int, default=1000, help="max_tokens of each streamed answer")
    args = parser.parse_args()

    tokenizer = args.tokenizer
    if tokenizer is None:
        if SHARED_QWEN.exists():
            tokenizer = str(SHARED_QWEN)
        else:
            from replay.synth.toy import build_toy_tokenizer

            tokenizer = str(build_toy_tokenizer(tempfile.mkdtemp(prefix="toy-tokenizer-")))
    client_core, server_core = split_cores()
    if client_core is not None:
        os.sched_setaffinity(0, {client_core})
    print(f"tokenizer {tokenizer}; server on core {server_core}, load generator on core {client_core}; "
          f"{args.connections} connections, {args.runs} runs x {args.seconds:.0f} s; "
          f"load average {os.getloadavg()[0]:.1f}")

    short = {"model": "sim", "messages": [{"role": "user", "content": "Hello, how are you?"}],
             "max_tokens": 4, "ignore_eos": True}
    streamed = {**short, "max_tokens": args.stream_tokens, "stream": True, "stream_options": {"include_usage": True}}
    sim_args = ("--ttft-ms", "0", "--itl-ms", "0", "--prefill-ms-per-1k", "0", "--max-num-seqs", "100000")
    rps_runs, tps_runs = [], []
    with sim_process(tokenizer, *sim_args, cpu=server_core) as sim:
        load(sim.port, orjson.dumps(short), 8, 0.5, False)  # warm up
        for _ in range(args.runs):
            rps_runs.append(load(sim.port, orjson.dumps(short), args.connections, args.seconds, False)[0])
        for _ in range(args.runs):
            tps_runs.append(load(sim.port, orjson.dumps(streamed), args.connections, args.seconds, True)[1])
    rps, tps = statistics.median(rps_runs), statistics.median(tps_runs)
    print(f"non-streaming requests/s: median {rps:,.0f}  runs {[round(r) for r in rps_runs]}  (target >= 1,000)")
    print(f"streamed tokens/s:        median {tps:,.0f}  runs {[round(t) for t in tps_runs]}  (target >= 50,000)")
    # Scale: thousands of concurrent streams, each 40 tokens 50 ms apart (ideal: 1.95 s + TTFT 20 ms),
    # i.e. 40,000 paced tokens/s for 2,000 streams.
    paced = {**short, "max_tokens": 40, "stream": True}
    with sim_process(tokenizer, "--ttft-ms", "20", "--itl-ms", "50", "--max-num-seqs", "100000",
                     cpu=server_core) as sim:
        wall, ok = many_streams(sim.port, orjson.dumps(paced), args.streams)
    print(f"{args.streams} concurrent paced streams (ideal 1.97 s each): all done in {wall:.2f} s, {ok} complete")
    if rps < 1000 or tps < 50000:
        print("BELOW TARGET (on a shared machine, check the load average and rerun)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

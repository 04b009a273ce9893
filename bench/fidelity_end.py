"""What the fidelity certificate adds to the end of a big run: a synthetic merged file of
--rows records (a Poisson schedule at 200 req/s, sends 0.05-3 ms late with 1% late by 10-500 ms,
0.1% of prompts miscounted, 1% of outputs cut), read in a fresh process twice: once only read
(the pass the end makes anyway: the summary's), once with every record fed to the
CertificateBuilder and the certificate made. Prints each one's peak RSS (ru_maxrss) and time,
and the certificate's addition (the difference), the median of --runs.

Target (issue 24): a 2,000,000-row run's end gains at most 100 MB and finishes in under a minute.

    .venv/bin/python bench/fidelity_end.py [--rows 2000000] [--runs 3] [--file /tmp/fidelity-2m.jsonl]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import orjson

from replay.results.records import RECORD_FIELDS, read_records

T0 = 1_800_000_000.0
RATE = 200.0


def write_records(path: Path, rows: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    due = T0
    with open(path, "wb", buffering=1 << 20) as f:
        for i in range(rows):
            due += rng.expovariate(RATE)
            lag = rng.uniform(10, 500) if rng.random() < 0.01 else rng.uniform(0.05, 3.0)
            sent = due + lag / 1000
            inp, out = rng.randint(50, 4000), rng.randint(1, 8)
            r = dict.fromkeys(RECORD_FIELDS)
            r.update(request_id=i, worker=i % 4, endpoint="http://127.0.0.1:8000", api="openai-chat",
                     scheduled_at=due, sent_at=sent, finished_at=sent + 0.2, drift_ms=round(lag, 3), ttft_ms=50.0,
                     tpot_ms=5.0, e2e_ms=200.0, itl_ms=[5.0] * (out - 1), status=200, ok=True, input_length=inp,
                     output_length=out, prompt_tokens=inp + (1 if rng.random() < 0.001 else 0),
                     output_tokens=out - (1 if out > 1 and rng.random() < 0.01 else 0), cached_tokens=0,
                     received_tokens=out)
            f.write(orjson.dumps(r) + b"\n")


def child(variant: str, path: str) -> None:
    from replay.results.certificate import CertificateBuilder

    started = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    builder = CertificateBuilder() if variant == "certificate" else None
    for record in read_records(path):
        if builder is not None:
            builder.add(record)
    made = time.perf_counter()
    if builder is not None:  # the summary's drift figures: the end has them already (not counted here)
        cert = builder.certificate({"p50": None, "p99": None, "max": None}, None)
        assert cert["schedule"]["sends"] > 0
    print(json.dumps({"peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "start_mib": before / 1024, "seconds": time.perf_counter() - started,
                      "certificate_s": time.perf_counter() - made}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--file", default="/tmp/tracereplay-fidelity-2m.jsonl")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    path = Path(args.file)
    if not path.exists() or sum(1 for _ in open(path, "rb")) != args.rows:
        t = time.perf_counter()
        write_records(path, args.rows)
        print(f"wrote {args.rows} records to {path} ({path.stat().st_size / 2**20:.0f} MiB) "
              f"in {time.perf_counter() - t:.0f} s")
    results: dict[str, list[dict]] = {"read": [], "certificate": []}
    for _ in range(args.runs):
        for variant in results:
            out = subprocess.run([sys.executable, __file__, "--child", variant, str(path)], capture_output=True,
                                 text=True, check=True)
            results[variant].append(json.loads(out.stdout))
            print(variant, results[variant][-1], flush=True)
    med = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in results.items()}
    added_mib = med["certificate"]["peak_mib"] - med["read"]["peak_mib"]
    added_s = med["certificate"]["seconds"] - med["read"]["seconds"]
    print(f"rows {args.rows}, median of {args.runs}: read only {med['read']['peak_mib']:.0f} MiB peak, "
          f"{med['read']['seconds']:.1f} s; with the certificate {med['certificate']['peak_mib']:.0f} MiB, "
          f"{med['certificate']['seconds']:.1f} s (certificate() itself {med['certificate']['certificate_s']:.1f} s)")
    print(f"added by the certificate: {added_mib:.0f} MiB peak RSS, {added_s:.1f} s")


if __name__ == "__main__":
    main()

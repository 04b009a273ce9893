"""What the end of a big run costs: the fidelity certificate in the master and the cache child
(re-synthesis, infinite cache and the model of the server's pool) beside it. A synthetic run of
--rows rows is written once: a Mooncake trace (each row one of --families 20-block prefixes plus
0-10 blocks of its own, 16-token blocks) and its merged records (a Poisson schedule at 200 req/s,
sends 0.05-3 ms late with 1% late by 10-500 ms, 0.1% of prompts miscounted, 1% of outputs cut,
each request 0.2 s long with a random whole-block cached count). Then, each in a fresh process:

- read: the records only read (the pass the end makes anyway: the summary's);
- certificate: the same with every record fed to the CertificateBuilder and the certificate made;
- cache: the cache section as the end computes it (cache_section: the real child process, the
  toy tokenizer, openai-completions text prompts, server blocks of 16, a pool of --blocks);
- follow: the same section as a run gets it, from the child that follows the run (CacheStream):
  the records appended to a fresh file at --follow-rate records a second (the run), then the
  end: the time from the end marker to the section, checked equal to `cache`'s when both run.
  With --follow-rate 0 (the default) every record is appended at once and the end waits until
  the follower has caught up (its CPU time flat): the run's time is then the follower's
  catch-up (rows / that time: the fastest run it keeps up with), and the end is what a run it
  kept up with leaves (the requests within its horizon of the last send).

Prints each one's peak RSS (ru_maxrss; the cache child's own) and time, the medians of --runs,
the certificate's addition to the master (the difference) and the whole end (certificate and
child, one after the other as `replay.run.finish` runs them).

Target (issue 24): a 2,000,000-row run's end adds at most 100 MB to the master and finishes in
under a minute.

    .venv/bin/python bench/fidelity_end.py [--rows 2000000] [--runs 3] [--blocks 5000] [--dir /tmp/...]
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import random
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import orjson

from replay.results.records import RECORD_FIELDS, read_records

T0 = 1_800_000_000.0
RATE = 200.0
BLOCK = 16
ENDPOINT = "http://127.0.0.1:8000"
VARIANTS = ("read", "certificate", "cache", "follow")


def write_run(folder: Path, rows: int, families: int, seed: int = 0) -> None:
    """trace.jsonl and run.jsonl (its merged records, in request_id order) in `folder`."""
    rng = random.Random(seed)
    prefixes = [[f * 100 + k for k in range(20)] for f in range(families)]
    due = T0
    with open(folder / "trace.jsonl", "wb", buffering=1 << 20) as trace, \
            open(folder / "run.jsonl", "wb", buffering=1 << 20) as records:
        for i in range(rows):
            due += rng.expovariate(RATE)
            hashes = prefixes[rng.randrange(families)] + [10_000_000 + i * 16 + k for k in range(rng.randrange(11))]
            inp, out = len(hashes) * BLOCK - rng.randrange(BLOCK), rng.randint(1, 8)
            trace.write(orjson.dumps({"timestamp": round((due - T0) * 1000, 3), "input_length": inp,
                                      "output_length": out, "hash_ids": hashes}) + b"\n")
            lag = rng.uniform(10, 500) if rng.random() < 0.01 else rng.uniform(0.05, 3.0)
            sent = due + lag / 1000
            r = dict.fromkeys(RECORD_FIELDS)
            r.update(request_id=i, worker=i % 4, endpoint=ENDPOINT, api="openai-completions",
                     scheduled_at=due, sent_at=sent, finished_at=sent + 0.2, drift_ms=round(lag, 3), ttft_ms=50.0,
                     tpot_ms=5.0, e2e_ms=200.0, itl_ms=[5.0] * (out - 1), status=200, ok=True, input_length=inp,
                     output_length=out, prompt_tokens=inp + (1 if rng.random() < 0.001 else 0),
                     output_tokens=out - (1 if out > 1 and rng.random() < 0.01 else 0),
                     cached_tokens=BLOCK * rng.randrange((inp - 1) // BLOCK + 1), received_tokens=out)
            records.write(orjson.dumps(r) + b"\n")


def follow(job, folder: Path, rate: float) -> tuple[dict, float, float]:
    """(the follower's section, the run's seconds, the end's seconds): the records appended to
    follow.jsonl at `rate` a second, in chunks of a tenth of a second, then the end."""
    import dataclasses

    from replay.results.cache_section import CacheStream

    appended = folder / "follow.jsonl"
    appended.write_bytes(b"")
    job = dataclasses.replace(job, results=str(appended))
    stream = CacheStream()
    stream.start(job)
    started = time.perf_counter()
    if rate > 0:
        chunk = max(int(rate / 10), 1)
        with open(folder / "run.jsonl", "rb") as records, open(appended, "ab") as out:
            for k in itertools.count(1):
                lines = list(itertools.islice(records, chunk))
                if not lines:
                    break
                out.write(b"".join(lines))
                out.flush()
                time.sleep(max(0.0, started + k / 10 - time.perf_counter()))
    else:  # every record at once; the run lasts until the follower has caught up (its CPU time flat for 3 s)
        shutil.copyfile(folder / "run.jsonl", appended)
        flat_since, last = time.perf_counter(), -1.0
        while time.perf_counter() - flat_since < 3.0:
            time.sleep(0.5)
            fields = Path(f"/proc/{stream.pid}/stat").read_text().rsplit(")", 1)[1].split()
            cpu = int(fields[11]) + int(fields[12])  # utime, stime in clock ticks
            if cpu != last:
                flat_since, last = time.perf_counter(), cpu
        started += 3.0  # the flat wait is not the follower's
    run_s = time.perf_counter() - started
    ended = time.perf_counter()
    section = stream.section(job)
    end_s = time.perf_counter() - ended
    appended.unlink()
    return section, run_s, end_s


def child(variant: str, folder: Path, blocks: int, rate: float) -> None:
    started = time.perf_counter()
    made = started
    out: dict = {}
    if variant in ("cache", "follow"):
        from replay.results.cache_section import CacheJob, cache_section

        job = CacheJob(results=str(folder / "run.jsonl"), trace=str(folder / "trace.jsonl"), trace_format="mooncake",
                       block_size=BLOCK, tokenizer=str(folder / "tok"), chat_template=None, api="openai-completions",
                       prompt_format="text", seed=0, server_block_size=BLOCK,
                       servers={ENDPOINT: {"num_gpu_blocks": blocks, "served_before": False}})
        if variant == "cache":
            section, _ = cache_section(job)
        else:
            section, run_s, end_s = follow(job, folder, rate)
            if section is None:
                sys.exit("the follower gave no section (see its log lines)")
            out = {"run_s": run_s, "end_s": end_s}
            made = time.perf_counter() - end_s
        pool = section["misses"]["model"]["endpoints"][ENDPOINT]
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        out.update(compared=section["requests_compared"], evictions=pool["evictions"],
                   exact_share=section["misses"]["predicted_exact_share"], child_cpu_s=children.ru_utime + children.ru_stime,
                   section_sha256=hashlib.sha256(orjson.dumps(section, option=orjson.OPT_SORT_KEYS)).hexdigest())
        peak = children.ru_maxrss  # the cache child's
    else:
        from replay.results.certificate import CertificateBuilder

        builder = CertificateBuilder() if variant == "certificate" else None
        for record in read_records(folder / "run.jsonl"):
            if builder is not None:
                builder.add(record)
        made = time.perf_counter()
        if builder is not None:  # the summary's drift figures: the end has them already (not counted here)
            cert = builder.certificate({"p50": None, "p99": None, "max": None}, None)
            assert cert["schedule"]["sends"] > 0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_mib": peak / 1024, "seconds": time.perf_counter() - started,
                      "certificate_s": time.perf_counter() - made, **out}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=5000, help="the server's pool (num_gpu_blocks)")
    parser.add_argument("--families", type=int, default=2000)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--dir", type=Path, help="where the run's files are (made when missing); "
                        "default /tmp/tracereplay-fidelity-ROWS")
    parser.add_argument("--follow-rate", type=float, default=0.0,
                        help="follow: records appended a second while the run goes (0: all at once, "
                        "then the end once the follower has caught up)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], Path(args.child[1]), args.blocks, args.follow_rate)
        return
    folder = args.dir or Path(f"/tmp/tracereplay-fidelity-{args.rows}")
    if not (folder / "done").exists():
        from replay.synth.toy import build_toy_tokenizer

        folder.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        build_toy_tokenizer(folder / "tok")
        write_run(folder, args.rows, args.families)
        (folder / "done").write_text(f"{args.rows} rows, {args.families} families\n")
        print(f"wrote {args.rows:,} rows to {folder} (trace {(folder / 'trace.jsonl').stat().st_size / 2**20:.0f} MiB, "
              f"records {(folder / 'run.jsonl').stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t:.0f} s")
    variants = args.variants.split(",")
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(args.runs):
        for variant in variants:
            out = subprocess.run([sys.executable, __file__, "--child", variant, str(folder), "--blocks",
                                  str(args.blocks), "--follow-rate", str(args.follow_rate)],
                                 capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{variant} failed:\n{out.stderr[-3000:]}")
            results[variant].append(json.loads(out.stdout))
            print(variant, results[variant][-1], flush=True)
    med = {v: {k: statistics.median(r[k] for r in rs) for k in ("peak_mib", "seconds", "certificate_s")}
           for v, rs in results.items()}
    print(f"rows {args.rows:,}, pool {args.blocks} blocks, median of {args.runs}:")
    for v, m in med.items():
        print(f"  {v}: peak RSS {m['peak_mib']:.0f} MiB, {m['seconds']:.1f} s")
    if "follow" in med:
        follows = results["follow"]
        how = f"records appended at {args.follow_rate:g}/s" if args.follow_rate > 0 else "the follower's catch-up"
        print(f"  follow: the run ({how}) "
              f"{statistics.median(r['run_s'] for r in follows):.1f} s, then the end "
              f"{statistics.median(r['end_s'] for r in follows):.1f} s (the follower's CPU in all "
              f"{statistics.median(r['child_cpu_s'] for r in follows):.1f} s)")
        if "cache" in med:
            same = {r["section_sha256"] for r in follows} == {r["section_sha256"] for r in results["cache"]}
            print(f"  follow's section {'equals' if same else 'DIFFERS FROM'} cache's")
    if "read" in med and "certificate" in med:
        added_mib = med["certificate"]["peak_mib"] - med["read"]["peak_mib"]
        added_s = med["certificate"]["seconds"] - med["read"]["seconds"]
        print(f"  added by the certificate: {added_mib:.0f} MiB peak RSS, {added_s:.1f} s "
              f"(certificate() itself {med['certificate']['certificate_s']:.1f} s)")
        if "cache" in med:
            print(f"  the whole end beyond the summary's read: certificate {added_s:.1f} s + cache child "
                  f"{med['cache']['seconds']:.1f} s = {added_s + med['cache']['seconds']:.1f} s")


if __name__ == "__main__":
    main()

"""Does --otlp-receiver add drift to the dispatch? Runs of bench/dispatch.py's, alternately
without and with it, at the project's usual rates.

Each rate's trace is replayed `--runs` times each way, run for run alternately, by
`locust --headless` pinned to one core against `replay sim` pinned to the other: "off" against
a sim that exports nothing; "on" with `--otlp-receiver` against a sim that exports one span a
request to it (`--otlp-endpoint`), so the receiver decodes and writes a span per request while
the run sends, and the end waits for the last spans and joins them. The receiver is a child of
the locust process and inherits its core: it competes with the dispatch for that one core,
the worst case (on a host with a core to spare it would not). Prints the median of the runs:
drift p50 / p99 / max (ms), the records joined, the locust process tree's CPU per request, and
the wall seconds of the whole run (the end's wait for late spans included), with the load average,
the p99 lateness of the same timer in an idle process on that core just before the run (idle
timer p99: the host's own noise, bench/dispatch.py's), and how long in all the locust process waited for its core while runnable (runq wait, ms: other
processes on that core, the receiver among them; each such wait shows up as drift). Each run's
own figures are printed too (--each), as a busy shared host makes single runs stall.

First, the receiver's CPU per span and the join's per record, alone (--cost-only: only those).

    .venv/bin/python bench/otlp.py [--rates 100,200,500] [--seconds 5] [--runs 3] [--each] [--cost-only]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from common import compile_bytecode, split_cores  # noqa: E402
from dispatch import BLOCK, one_run, write_trace  # noqa: E402

from replay.rules.run_files import summary_path  # noqa: E402
from replay.sim.process import sim_process  # noqa: E402
from replay.synth.toy import build_toy_tokenizer  # noqa: E402

FIELDS = ("rate", "p50", "p99", "max", "noise_p99", "runqueue_ms", "cpu_ms", "wall_s", "joined")


def timed_run(tokenizer: Path, url: str, trace: Path, out: Path, cpu: int | None, extra: tuple[str, ...]) -> dict:
    started = time.monotonic()
    result = one_run(tokenizer, url, trace, out, cpu, extra=extra)
    result["wall_s"] = time.monotonic() - started
    spans = json.loads(summary_path(out).read_text()).get("spans") if extra else None
    result["joined"] = spans["joined"] / spans["ok_records"] if spans else float("nan")
    return result


def vllm_like_span(request_id: int) -> dict:
    """A span as vLLM's llm_request carries it (its attributes, their types)."""
    attributes = {"gen_ai.latency.time_to_first_token": 0.0138, "gen_ai.latency.e2e": 0.0374,
                  "gen_ai.latency.time_in_queue": 0.00003, "gen_ai.usage.prompt_tokens": 51,
                  "gen_ai.usage.completion_tokens": 100, "gen_ai.latency.time_in_model_prefill": 0.0083,
                  "gen_ai.latency.time_in_model_decode": 0.0255, "gen_ai.latency.time_in_model_inference": 0.0338,
                  "gen_ai.request.id": f"chatcmpl-0123456789ab-{request_id}", "gen_ai.request.top_p": 1.0,
                  "gen_ai.request.max_tokens": 100, "gen_ai.request.temperature": 1.0, "gen_ai.request.n": 1}
    return {"name": "llm_request", "start_ns": 1, "end_ns": 2, "attributes": attributes}


def child_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def receiver_and_join_cost(tmp: Path, batches: int = 200, batch: int = 100) -> None:
    """CPU of the receiver child per span (decode + write) and of the end's join per record:
    figures the host's load does not move much, unlike drift."""
    import requests

    from replay.protocol.otlp import PROTOBUF, export_body
    from replay.results.otlp_receiver import SpanReceiver
    from replay.results.span_join import SpanTable

    path = tmp / "cost.spans.jsonl"
    receiver = SpanReceiver.start("127.0.0.1:0", path)
    bodies = [export_body([vllm_like_span(b * batch + i) for i in range(batch)], "bench") for b in range(batches)]
    with requests.Session() as exporter:
        exporter.post(f"http://127.0.0.1:{receiver.port}/v1/traces", data=bodies[0], headers={"Content-Type": PROTOBUF})
        before = child_cpu_s(receiver.pid)
        started = time.perf_counter()
        for body in bodies[1:]:
            exporter.post(f"http://127.0.0.1:{receiver.port}/v1/traces", data=body, headers={"Content-Type": PROTOBUF})
        wall = time.perf_counter() - started
        cpu = child_cpu_s(receiver.pid) - before
    receiver.stop()
    spans = (batches - 1) * batch
    print(f"receiver: {spans} spans in batches of {batch} ({len(bodies[1]) / 1024:.1f} KiB each): "
          f"{cpu / spans * 1e6:.1f} us CPU a span (decode + write), {spans / wall:.0f} spans/s over one connection")
    rows = batches * batch
    started = time.process_time()
    table = SpanTable(path, "0123456789ab", 0, bytearray([1]) * rows, lambda request_id: True)
    table.read()
    records = [{"request_id": i} for i in range(rows)]
    for record in records:
        table.fill(record)
    cpu = time.process_time() - started
    print(f"join: {rows} records, {cpu / rows * 1e6:.1f} us CPU a record (read its span line, fill its fields)",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="100,200,500")
    parser.add_argument("--seconds", type=float, default=5.0, help="trace length per run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--output-tokens", type=int, default=100)
    parser.add_argument("--port", type=int, default=43180, help="the receiver's port")
    parser.add_argument("--each", action="store_true", help="also print each run's drift and runq wait")
    parser.add_argument("--cost-only", action="store_true", help="only the receiver's and the join's CPU costs")
    args = parser.parse_args()
    client_cpu, sim_cpu = split_cores()
    compile_bytecode()
    with tempfile.TemporaryDirectory() as tmp:
        receiver_and_join_cost(Path(tmp))
    if args.cost_only:
        return
    print(f"otlp bench: {args.seconds:g} s traces, {args.output_tokens} output tokens streamed, median of "
          f"{args.runs} runs each way, alternating; locust (and its receiver) on cpu {client_cpu}, sim on cpu {sim_cpu}")
    print(f"{'target/s':>9} {'receiver':>8} {'achieved/s':>10} {'drift p50':>10} {'p99':>8} {'max':>8} "
          f"{'idle timer p99':>14} {'runq wait':>9} {'cpu/req':>8} {'wall s':>7} {'joined':>7}  loadavg")
    sim_args = ("--block-size", str(BLOCK), "--ttft-ms", "20", "--itl-ms", "5", "--prefill-ms-per-1k", "0",
                "--max-num-seqs", "100000")
    receiver = ("--otlp-receiver", f"127.0.0.1:{args.port}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tokenizer = build_toy_tokenizer(tmp / "tok")
        with sim_process(tokenizer, *sim_args, cpu=sim_cpu) as plain, \
                sim_process(tokenizer, *sim_args, "--otlp-endpoint", f"http://127.0.0.1:{args.port}/v1/traces",
                            cpu=sim_cpu) as exporting:
            ways = {"off": (plain.url, ()), "on": (exporting.url, receiver)}
            rates = [float(r) for r in args.rates.split(",")]
            for rate in rates:
                trace = tmp / f"trace-{rate:g}.jsonl"
                write_trace(trace, rate, args.seconds, args.output_tokens)
                if rate == rates[0]:
                    one_run(tokenizer, plain.url, trace, tmp / "warm-up.jsonl", client_cpu)
                runs: dict[str, list[dict]] = {way: [] for way in ways}
                for i in range(args.runs):
                    for way, (url, extra) in ways.items():
                        runs[way].append(timed_run(tokenizer, url, trace, tmp / f"out-{rate:g}-{i}-{way}.jsonl",
                                                   client_cpu, extra))
                        if args.each:
                            r = runs[way][-1]
                            print(f"{'':9} {way:>8} run {i + 1}: drift p99 {r['p99']:.3f} max {r['max']:.3f} "
                                  f"idle timer p99 {r['noise_p99']:.3f} runq wait {r['runqueue_ms']:.0f} ms", flush=True)
                for way in ways:
                    med = {k: statistics.median(r[k] for r in runs[way]) for k in FIELDS}
                    print(f"{rate:9.0f} {way:>8} {med['rate']:10.1f} {med['p50']:10.3f} {med['p99']:8.3f} "
                          f"{med['max']:8.3f} {med['noise_p99']:14.3f} {med['runqueue_ms']:9.0f} {med['cpu_ms']:8.3f} {med['wall_s']:7.1f} {med['joined']:7.1%}  "
                          f"{open('/proc/loadavg').read().split()[0]}", flush=True)


if __name__ == "__main__":
    main()

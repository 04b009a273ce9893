"""What `replay record` costs the traffic it forwards: the same replay of the bundled sample
trace straight to a `replay sim` and through the proxy in front of it, alternately, `--runs`
times each; the added TTFT (p50, p99, medians over the runs) and the proxy's CPU per request
(the proxy's user+system time, and its recorder child's apart, read from /proc before and after
the replay), and the time the proxy waited for a CPU (its run queue wait, from
/proc/PID/schedstat), which is where its tail latency comes from on a busy machine.

The rate is the sample trace's (258 requests over 61 s) times `--scale` (default 4: about 17
requests/s, streamed); the sim answers as the demo's (TTFT 20 ms, 10 ms a token). The figures
are wall-clock latencies on whatever else the machine runs: on a shared machine, read them
with the spread the runs show.

    .venv/bin/python bench/record.py [--scale 4] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import REPO, compile_bytecode

from replay.results.records import read_records
from replay.sim.process import sim_process
from replay.synth.toy import build_toy_tokenizer

SAMPLE = REPO / "replay" / "data" / "sample_trace.jsonl"
sys.path.insert(0, str(REPO / "tests"))
from support.record import RecordProcess  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def replay(url: str, tokenizer: Path, output: Path, scale: float) -> tuple[float, float, int]:
    """(TTFT p50, p99 in ms, requests ok) of one headless replay of the sample trace."""
    proc = subprocess.run([sys.executable, "-m", "replay", "run", "--headless", "--host", url, "--trace", str(SAMPLE),
                           "--tokenizer", str(tokenizer), "--model", "sim", "--output", str(output), "--scale",
                           str(scale), "--loglevel", "WARNING", "--overwrite"], capture_output=True, text=True)
    records = list(read_records(output))
    ttft = [r["ttft_ms"] for r in records if r.get("ok") and r.get("ttft_ms") is not None]
    if proc.returncode != 0 or len(ttft) != len(records):
        raise RuntimeError(f"replay exit {proc.returncode}: {proc.stderr[-2000:]}")
    return percentile(ttft, 50), percentile(ttft, 99), len(ttft)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proxy_cpu(pid: int) -> tuple[float, float, float]:
    """(the proxy's CPU seconds, its recorder child's, the proxy's seconds waiting on a run queue:
    runnable, not running)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    waited = int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    return cpu_seconds(pid), sum(cpu_seconds(int(c)) for c in children), waited


def cpu_pressure() -> str:
    """The machine's load average and CPU pressure (share of time some task waited for a CPU)."""
    load = os.getloadavg()[0]
    try:
        some = Path("/proc/pressure/cpu").read_text().split()[1].split("=")[1]
    except (OSError, IndexError):
        some = "?"
    return f"load {load:.1f}, CPU pressure {some}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=4.0)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    compile_bytecode()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tokenizer = build_toy_tokenizer(tmp / "tok")
        direct, proxied, cpu = [], [], []
        with sim_process(tokenizer, "--block-size", "16", "--ttft-ms", "20", "--itl-ms", "10") as sim:
            for run in range(args.runs):
                direct.append(replay(sim.url, tokenizer, tmp / "direct.jsonl", args.scale))
                proxy = RecordProcess(sim.url, tmp / f"trace-{run}.jsonl")
                try:
                    started = proxy_cpu(proxy.proc.pid)
                    proxied.append(replay(proxy.url, tokenizer, tmp / "proxied.jsonl", args.scale))
                    ended = proxy_cpu(proxy.proc.pid)
                    used = [e - s for s, e in zip(started, ended)]
                finally:
                    proxy.proc.send_signal(signal.SIGTERM)
                    proxy.stop()
                cpu.append(tuple(u / proxied[-1][2] for u in used))
                print(f"run {run + 1} ({cpu_pressure()}): direct TTFT p50 {direct[-1][0]:.2f} p99 {direct[-1][1]:.2f} "
                      f"ms; through the proxy p50 {proxied[-1][0]:.2f} p99 {proxied[-1][1]:.2f} ms; per request: proxy "
                      f"CPU {cpu[-1][0] * 1000:.2f} ms, waiting for a CPU {cpu[-1][2] * 1000:.2f} ms, recorder CPU "
                      f"{cpu[-1][1] * 1000:.2f} ms", flush=True)
    p50 = statistics.median(p[0] - d[0] for d, p in zip(direct, proxied))
    p99 = statistics.median(p[1] - d[1] for d, p in zip(direct, proxied))
    rate = 258 / 61.0 * args.scale
    print(f"at {rate:.1f} requests/s (sample trace x{args.scale:g}, streamed), median of {args.runs} runs: "
          f"added TTFT p50 {p50:+.2f} ms, p99 {p99:+.2f} ms; CPU per request: proxy "
          f"{statistics.median(c[0] for c in cpu) * 1000:.2f} ms (waiting for a CPU "
          f"{statistics.median(c[2] for c in cpu) * 1000:.2f} ms), recorder (off the forwarding path) "
          f"{statistics.median(c[1] for c in cpu) * 1000:.2f} ms")


if __name__ == "__main__":
    main()

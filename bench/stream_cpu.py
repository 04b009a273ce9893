"""CPU cost of reading streams in the load generator: CPU ms per request and us per token.

CPU time, unlike drift, barely depends on what else the shared machine is running, so
this is the figure to compare read paths by. Requests go out open-loop at --rate through
the worker's own path (replay.protocol write + read, one greenlet per answer) to `replay sim`
pinned to the other core; this process's user+system CPU over the run is divided by the
requests and by the content tokens they streamed. Median of several runs.

    .venv/bin/python bench/stream_cpu.py [--rate 500] [--seconds 4] [--runs 3] [--output-tokens 100]

The issue's case (a token a read: few streams, a 2 ms gap) is `--rate 40 --output-tokens 200
--itl-ms 2`. `--against TREE` pairs each run with one of another checkout's client (e.g. main's),
alternating, in fresh processes, and prints both medians and the per-token difference.

`--client` times another reader of the same streams, the yardsticks for the replay's own:
`epoll`, the least a Python client can pay to time each token (one epoll loop, a recv and a
clock read a wake-up, no parsing); `threads`, the standard library's way (http.client, a thread a
request, a line a token), as the stdlib reference replayer reads.
"""

from __future__ import annotations

import argparse
import http.client
import os
import resource
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parent.parent
TREE_FLAG = "--tree"  # internal: time the client of this checkout instead (a run of --against)
sys.path.insert(0, sys.argv[sys.argv.index(TREE_FLAG) + 1] if TREE_FLAG in sys.argv else str(REPO))

import gevent  # noqa: E402
import orjson  # noqa: E402
from common import split_cores  # noqa: E402
from gevent.pool import Group  # noqa: E402

from replay.protocol.client import Endpoint, read, send, write  # noqa: E402
from replay.protocol.table import get_api  # noqa: E402
from replay.sim.process import sim_process  # noqa: E402
from replay.synth.toy import build_toy_tokenizer  # noqa: E402

HEADERS = {"Content-Type": "application/json"}


def cpu_seconds() -> tuple[float, float]:
    """(user, system) CPU seconds of this process: system time is the recv and wake-up syscalls."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def request_body(output_tokens: int) -> bytes:
    return orjson.dumps({"model": "sim", "messages": [{"role": "user", "content": "bada kelo misu ra"}],
                         "max_tokens": output_tokens, "min_tokens": output_tokens, "ignore_eos": True,
                         "stream": True, "stream_options": {"include_usage": True}})


def figures(user: float, system: float, count: int, tokens: int, ok: int, seconds: float) -> dict:
    cpu = user + system
    return {"cpu_ms_per_req": cpu * 1000 / count, "us_per_token": cpu * 1e6 / max(tokens, 1),
            "user_us_per_token": user * 1e6 / max(tokens, 1), "sys_us_per_token": system * 1e6 / max(tokens, 1),
            "ok": ok / count, "cpu_share": cpu / seconds}


def one_run(url: str, rate: float, seconds: float, output_tokens: int) -> dict:
    api = get_api("openai-chat")
    body = request_body(output_tokens)
    endpoint = Endpoint(url)
    count = int(rate * seconds)
    endpoint.warm(min(count, int(rate * 0.6) + 50))
    outcomes = []
    group = Group()

    def collect(sent) -> None:
        outcomes.append(read(endpoint, api, True, sent))

    def fallback() -> None:
        outcomes.append(send(endpoint, api, body, True, HEADERS))

    start_cpu, start = cpu_seconds(), time.time() + 0.05
    for i in range(count):
        gevent.sleep(max(0.0, start + i / rate - time.time()))  # plain pacing: no spin in the CPU figure
        sent = write(endpoint, api, body, True, HEADERS)
        group.spawn(collect, sent) if sent is not None else group.spawn(fallback)
    group.join()
    end_cpu = cpu_seconds()
    endpoint.close()
    ok = sum(1 for o in outcomes if o.ok)
    tokens = sum(o.events_tokens for o in outcomes)
    return figures(end_cpu[0] - start_cpu[0], end_cpu[1] - start_cpu[1], count, tokens, ok, time.time() - start)


def epoll_run(url: str, rate: float, seconds: float, output_tokens: int) -> dict:
    """The floor: non-blocking sockets in one epoll loop; each wake-up reads what came and the
    clock, and counts the events by their `data: ` prefix (less the role's, the usage's and [DONE])."""
    parts = urlsplit(url)
    body = request_body(output_tokens)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    count = int(rate * seconds)
    poller, sockets, events, stamps, counts = select.epoll(), {}, {}, [], []
    sent = done = 0
    start_cpu, start = cpu_seconds(), time.time() + 0.05
    while done < count:
        wait = start + sent / rate - time.time() if sent < count else 1.0
        if sent < count and wait <= 0:
            sock = socket.create_connection((parts.hostname, parts.port))
            sock.setblocking(False)
            sock.sendall(head + body)
            poller.register(sock.fileno(), select.EPOLLIN)
            sockets[sock.fileno()], events[sock.fileno()] = sock, 0
            sent += 1
            continue
        for fd, _ in poller.poll(max(wait, 0.0)):
            data = sockets[fd].recv(65536)
            stamps.append(time.perf_counter())
            events[fd] += data.count(b"data: ")
            if not data:
                poller.unregister(fd)
                sockets.pop(fd).close()
                counts.append(events.pop(fd) - 3)  # before the next socket takes its number
                done += 1
    end_cpu = cpu_seconds()
    tokens = sum(counts)
    ok = sum(1 for n in counts if n >= output_tokens)
    return figures(end_cpu[0] - start_cpu[0], end_cpu[1] - start_cpu[1], count, tokens, ok, time.time() - start)


def threads_run(url: str, rate: float, seconds: float, output_tokens: int) -> dict:
    """The standard library's way: a thread a request, http.client, a line read (and timed) at a time."""
    parts = urlsplit(url)
    body = request_body(output_tokens)
    counts: list[int] = []

    def one() -> None:
        connection = http.client.HTTPConnection(parts.hostname, parts.port)
        connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        answer, tokens, stamps = connection.getresponse(), 0, []
        while line := answer.fp.readline():
            stamps.append(time.perf_counter())
            if line.startswith(b"data: [DONE]"):
                break
            tokens += line.startswith(b"data: {")
        connection.close()
        counts.append(tokens - 2)  # the role's event and the usage's

    count = int(rate * seconds)
    threads = []
    start_cpu, start = cpu_seconds(), time.time() + 0.05
    for i in range(count):
        time.sleep(max(0.0, start + i / rate - time.time()))
        threads.append(threading.Thread(target=one))
        threads[-1].start()
    for thread in threads:
        thread.join()
    end_cpu = cpu_seconds()
    ok = sum(1 for n in counts if n >= output_tokens)
    return figures(end_cpu[0] - start_cpu[0], end_cpu[1] - start_cpu[1], count, sum(counts), ok, time.time() - start)


CLIENTS = {"replay": one_run, "epoll": epoll_run, "threads": threads_run}


def measure(args: argparse.Namespace) -> dict:
    """Median figures of args.runs runs against one sim, this process pinned to the client core."""
    client_cpu, sim_cpu = split_cores()
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = build_toy_tokenizer(Path(tmp) / "tok")
        with sim_process(tokenizer, "--ttft-ms", "20", "--itl-ms", str(args.itl_ms), "--prefill-ms-per-1k", "0",
                         "--max-num-seqs", "100000", cpu=sim_cpu) as sim:
            if client_cpu is not None:
                os.sched_setaffinity(0, {client_cpu})
            client = CLIENTS[args.client]
            runs = [client(sim.url, args.rate, args.seconds, args.output_tokens) for _ in range(args.runs)]
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def paired(args: argparse.Namespace) -> dict[str, list[dict]]:
    """args.runs single runs of each client, alternating this checkout's and args.against's."""
    common = ["--rate", str(args.rate), "--seconds", str(args.seconds), "--output-tokens", str(args.output_tokens),
              "--itl-ms", str(args.itl_ms), "--runs", "1", "--json"]
    figures: dict[str, list[dict]] = {"this": [], "against": []}
    for _ in range(args.runs):
        for name, tree in (("against", args.against), ("this", str(REPO))):
            out = subprocess.run([sys.executable, __file__, *common, TREE_FLAG, tree], check=True,
                                 capture_output=True, text=True).stdout
            figures[name].append(orjson.loads(out.splitlines()[-1]))
    return figures


def line(med: dict) -> str:
    return (f"{med['cpu_ms_per_req']:.3f} CPU ms/request (= CPU s per 1,000 requests), {med['us_per_token']:.2f} "
            f"us/token (user {med['user_us_per_token']:.2f}, system {med['sys_us_per_token']:.2f}), "
            f"client core busy {med['cpu_share']:.0%}, ok {med['ok']:.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=500.0)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--output-tokens", type=int, default=100)
    parser.add_argument("--itl-ms", type=float, default=5.0)
    parser.add_argument("--client", choices=sorted(CLIENTS), default="replay",
                        help="whose reader: the replay's (default), or a yardstick (epoll: the floor; threads: stdlib)")
    parser.add_argument("--against", metavar="TREE", help="another checkout whose client each run is paired with")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(TREE_FLAG, help=argparse.SUPPRESS)
    args = parser.parse_args()

    about = (f"stream cpu ({args.client}): {args.rate:g} req/s x {args.output_tokens} tokens (itl {args.itl_ms:g} ms), "
             f"median of {args.runs} runs of {args.seconds:g} s")
    load = f"loadavg {open('/proc/loadavg').read().split()[0]}"
    if args.against:
        figures = paired(args)
        meds = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in figures.items()}
        gaps = [a["us_per_token"] - t["us_per_token"] for a, t in zip(figures["against"], figures["this"])]
        print(f"{about}, paired:\n  this:    {line(meds['this'])}\n  against: {line(meds['against'])} "
              f"({args.against})\n  saved per token, median of the pairs: {statistics.median(gaps):.2f} us; {load}")
        return
    med = measure(args)
    if args.json:
        print(orjson.dumps(med).decode())
        return
    print(f"{about}: {line(med)}; {load}")


if __name__ == "__main__":
    main()

"""A multi-host run on one machine: master, two workers and two `replay sim` servers, each in
its own Linux network namespace, joined by a bridge that lives in a namespace of its own.

Every process sees only its namespace's interface and address (198.18.0.0/15, the
benchmarking range), so the run goes over a real network path between "hosts", exactly as
the README's commands would on separate machines, and nothing reaches the host's own
network. Needs root and iproute2; skips with the reason otherwise. Namespaces are removed
even when a test fails.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import sys
import uuid
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from replay.results.records import read_records
from replay.results.summary import percentile
from replay.sim.process import READY_PREFIX
from support.processes import LOCUST, finish
from support.records import check_records
from support.traces import bailian_trace, mooncake_trace

REPO = Path(__file__).resolve().parent.parent
SUBNET = "198.18.0"
MASTER_ADDR = f"{SUBNET}.1"
SIM_ADDRS = (f"{SUBNET}.11", f"{SUBNET}.12")
MASTER_PORT = 5557  # Locust's default: each namespace has its own ports, so it is free
SIM_PORT = 8000
BLOCK = 16


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)


def _check_ip(*args: str) -> None:
    proc = _ip(*args)
    assert proc.returncode == 0, f"ip {' '.join(args)}: {proc.stderr.strip()}"


def _namespaces_unavailable() -> str | None:
    if shutil.which("ip") is None:
        return "needs the `ip` command (Debian package iproute2)"
    if os.geteuid() != 0:
        return "needs root to create network namespaces; run the tests as root (CI does) to cover it"
    probe = f"trprobe-{uuid.uuid4().hex[:8]}"
    made = _ip("netns", "add", probe)
    if made.returncode != 0:
        return f"`ip netns add` fails here (a container without CAP_SYS_ADMIN?): {made.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


class Network:
    """A switch namespace holding a bridge, and one namespace per host with eth0 on it."""

    def __init__(self):
        self.tag = uuid.uuid4().hex[:6]
        self.switch = f"tr-{self.tag}-sw"
        self.hosts: list[str] = []
        self.procs: list[subprocess.Popen] = []
        _check_ip("netns", "add", self.switch)
        _check_ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _check_ip("-n", self.switch, "link", "set", "br0", "up")

    def host(self, name: str, addr: str) -> str:
        ns = f"tr-{self.tag}-{name}"
        _check_ip("netns", "add", ns)
        self.hosts.append(ns)
        port = f"p{len(self.hosts)}"
        # created straight inside the namespaces: no interface ever appears on the real host
        _check_ip("link", "add", port, "netns", self.switch, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _check_ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        _check_ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        _check_ip("-n", ns, "link", "set", "eth0", "up")
        _check_ip("-n", ns, "link", "set", "lo", "up")
        return ns

    def spawn(self, ns: str, cmd: list[str], log: Path, **kwargs) -> subprocess.Popen:
        out = kwargs.pop("stdout", None) or open(log, "w")
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *cmd], stdout=out, stderr=kwargs.pop("stderr", subprocess.STDOUT),
                                text=True, **kwargs)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        for ns in [*self.hosts, self.switch]:  # deleting a namespace deletes its veth ends
            _ip("netns", "del", ns)


@pytest.fixture
def network():
    reason = _namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    net = Network()
    try:
        yield net
    finally:
        net.close()
    leftover = [line for line in _ip("netns", "list").stdout.splitlines() if net.tag in line]
    assert not leftover, f"namespaces left behind: {leftover}"


def _start_sim(net: Network, ns: str, addr: str, tokenizer: Path, log: Path) -> str:
    """`replay sim` bound to the namespace's address; returns its URL once it listens."""
    proc = net.spawn(ns, [sys.executable, "-m", "replay", "sim", "--tokenizer", str(tokenizer), "--host", addr,
                          "--port", str(SIM_PORT), "--block-size", str(BLOCK), "--ttft-ms", "20", "--itl-ms", "2",
                          "--prefill-ms-per-1k", "0"], log, stdout=subprocess.PIPE, stderr=open(log, "w"))
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    line = proc.stdout.readline() if ready else ""
    assert line.startswith(READY_PREFIX), f"sim in {ns} did not start: {line!r} {log.read_text()[-2000:]}"
    return line[len(READY_PREFIX):].strip()


def _replay(net: Network, tmp: Path, tokenizer: Path, trace: Path, *flags: str,
            worker_env: dict[int, dict] | None = None) -> tuple[list[dict], str, list[str]]:
    """One headless run over the namespaces; returns the merged records, the master's log and the sims' URLs."""
    sims = [_start_sim(net, net.host(f"sim{i}", addr), addr, tokenizer, tmp / f"sim{i}.log")
            for i, addr in enumerate(SIM_ADDRS)]
    assert sims == [f"http://{a}:{SIM_PORT}" for a in SIM_ADDRS]
    master_ns = net.host("master", MASTER_ADDR)
    worker_ns = [net.host(f"worker{i}", f"{SUBNET}.{21 + i}") for i in range(2)]
    output = tmp / "results" / "run.jsonl"
    master = net.spawn(master_ns, [*LOCUST, "--headless", "--master", "--expect-workers", "2",
                                   "--master-bind-host", MASTER_ADDR, "--master-bind-port", str(MASTER_PORT),
                                   "--trace", str(trace), "--tokenizer", str(tokenizer), "--model", "sim",
                                   "--endpoints", ",".join(sims), "--output", str(output), "--loglevel", "INFO",
                                   *flags], tmp / "master.log", cwd=tmp)
    workers = [net.spawn(ns, [*LOCUST, "--worker", "--master-host", MASTER_ADDR, "--master-port", str(MASTER_PORT)],
                         tmp / f"worker{i}.log", cwd=tmp, env={**os.environ, **(worker_env or {}).get(i, {})})
               for i, ns in enumerate(worker_ns)]
    finish([master, *workers], timeout=90)
    log = (tmp / "master.log").read_text()
    assert master.returncode == 0, log[-4000:]
    return list(read_records(output)), log, sims


def test_session_routing_across_hosts(tmp_path, toy_tokenizer_dir, network):
    """Rows spread over both workers (--partition round-robin), yet every session stays on one
    server: the workers, on different hosts, agree on where a session goes."""
    trace = bailian_trace(tmp_path / "bailian.jsonl", sessions=7, turns=3, gap_s=0.08)  # odd: turns alternate workers
    records, log, sims = _replay(network, tmp_path, toy_tokenizer_dir, trace, "--trace-format", "bailian",
                                 "--block-size", str(BLOCK), "--routing", "session", "--partition", "round-robin")
    check_records(tmp_path / "results" / "run.jsonl", trace)
    assert {r["worker"] for r in records} == {0, 1}
    assert {r["endpoint"] for r in records} == set(sims)
    sessions: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        sessions[r["session_id"]].append(r)
    assert len(sessions) == 7
    assert all(len({r["endpoint"] for r in recs}) == 1 for recs in sessions.values()), \
        {s: [r["endpoint"] for r in recs] for s, recs in sessions.items()}
    assert any(len({r["worker"] for r in recs}) == 2 for recs in sessions.values())  # sessions did cross hosts
    # later turns find the conversation so far in their server's cache
    rows = [json.loads(line) for line in open(trace)]
    later = [r for r in records if rows[r["request_id"]]["turn"] > 1]
    assert all(r["cached_tokens"] > 0 for r in later), [r["cached_tokens"] for r in later]
    # each worker's clock offset to the master is measured and reported
    assert log.count("clock offset") >= 2


def test_round_robin_spreads_across_hosts(tmp_path, toy_tokenizer_dir, network):
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=40, gap_ms=40)
    records, _, sims = _replay(network, tmp_path, toy_tokenizer_dir, trace, "--block-size", str(BLOCK))
    check_records(tmp_path / "results" / "run.jsonl", trace)
    per = Counter((r["worker"], r["endpoint"]) for r in records)
    assert per == {(w, url): 10 for w in (0, 1) for url in sims}, per
    for w in (0, 1):  # each worker alternates between the servers
        sent = [r["endpoint"] for r in sorted(records, key=lambda r: r["sent_at"]) if r["worker"] == w]
        assert all(a != b for a, b in zip(sent, sent[1:])), sent


@pytest.mark.alone
def test_worker_with_a_skewed_clock(tmp_path, toy_tokenizer_dir, network):
    """A worker host whose clock is 2.5 s ahead (no NTP): it measures its offset to the master,
    sends on the master's schedule, and its records are in the master's clock like the others'."""
    skew = tmp_path / "skew"
    skew.mkdir()
    (skew / "sitecustomize.py").write_text("import time\n_real = time.time\ntime.time = lambda: _real() + 2.5\n")
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=40, gap_ms=40)
    records, log, _ = _replay(network, tmp_path, toy_tokenizer_dir, trace, "--block-size", str(BLOCK),
                              worker_env={1: {"PYTHONPATH": os.pathsep.join([str(skew), os.environ.get("PYTHONPATH", "")])}})
    check_records(tmp_path / "results" / "run.jsonl", trace)
    offsets = sorted(float(m) for m in re.findall(r"worker \d ready \(clock offset (-?[\d.]+) ms", log))
    # the 2.5 s skew measured and applied: bounds a loaded machine meets (a ping's half round
    # trip is the error), far inside the 2500 ms an unapplied offset would show
    assert len(offsets) == 2 and -2600 < offsets[0] < -2400 and abs(offsets[1]) < 100, offsets
    drift = sorted(r["drift_ms"] for r in records)
    assert drift[0] > -100 and percentile(drift, 99) < 250, drift[-5:]
    master_clock_start = min(r["scheduled_at"] for r in records)
    assert all(0 <= r["sent_at"] - master_clock_start < 2.0 for r in records)  # the 1.6 s trace, one clock

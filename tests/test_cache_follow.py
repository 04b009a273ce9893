"""The cache section computed while the run replays (replay/results/cache_child.py --follow,
replay/results/cache_section.py CacheStream): the follower reads the records as the run appends
them, checks them in send order once no earlier send can come, and its section is the one the
end would compute from the merged file; when it cannot be (a record too late, the follower
gone, the run's settings changed), the end computes the section as before; a run that dies
leaves no follower behind."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import time
from pathlib import Path

import gevent
import orjson
import pytest

from replay.results.cache_child import RecordTail, StreamBroken
from replay.results.cache_section import CacheStream, cache_job, cache_section
from replay.results.metadata import read_run_metadata
from replay.rules.run_files import summary_path
from replay.run.finish import CACHE_FOLLOW_ENV
from replay.sim.process import sim_process
from support.cache_model import SIM_BLOCK, reuse_trace
from support.processes import replay_args, run_locust, spawn_locust
from support.waiting import wait_for_text

FAST_SIM = ("--block-size", str(SIM_BLOCK), "--ttft-ms", "3", "--itl-ms", "1", "--prefill-ms-per-1k", "0",
            "--eos-prob", "0")


@pytest.fixture(scope="module")
def evicting_run(tmp_path_factory, toy_tokenizer_dir) -> Path:
    """A real replay against a `replay sim` whose small cache evicts: its OUTPUT (merged, sorted
    by request_id) beside OUTPUT.worker-0.jsonl (the records in the order the worker wrote them)."""
    tmp_path = tmp_path_factory.mktemp("run")
    trace = reuse_trace(tmp_path / "trace.jsonl")
    output = tmp_path / "run.jsonl"
    with sim_process(toy_tokenizer_dir, *FAST_SIM, "--cache-blocks", "30") as sim, pytest.MonkeyPatch.context() as env:
        env.setenv(CACHE_FOLLOW_ENV, "1")  # a short single-process run computes its section at its end otherwise
        proc = run_locust(replay_args(trace, toy_tokenizer_dir, sim.url, output, "--only-summary"), tmp_path)
    assert "cache fidelity computed while the run replayed" in proc.stderr, proc.stderr[-3000:]
    return output


def _records(path: Path) -> list[bytes]:
    return [line for line in path.read_bytes().splitlines(keepends=True) if line.strip()]


def test_the_run_took_the_followers_section_and_it_is_the_ends(evicting_run):
    """The run's summary holds the follower's section; the end's computation from the merged
    file (what `replay report` does) gives the same, the model's evictions and causes included."""
    summary = json.loads(summary_path(evicting_run).read_text())
    job = cache_job(evicting_run, read_run_metadata(evicting_run), out=None)
    section, _ = cache_section(job)
    assert summary["cache"] == section
    assert section["misses"]["model"]["endpoints"], section["misses"]
    assert any(e.get("evictions") for e in section["misses"]["model"]["endpoints"].values())


def test_a_follower_fed_as_the_run_goes_makes_the_same_section(evicting_run, tmp_path):
    """The worker's records, appended in the order it wrote them, a few at a time, with a short
    horizon so the follower checks most of them before the end: the section equals the one the
    end computes from the merged file."""
    job = cache_job(evicting_run, read_run_metadata(evicting_run), out=None)
    expected, _ = cache_section(job)
    appended = tmp_path / "appended.jsonl"
    appended.write_bytes(b"")
    lines = _records(Path(f"{evicting_run}.worker-0.jsonl"))
    stream = CacheStream()
    following = dataclasses.replace(job, results=str(appended))
    stream.start(following, horizon_s=0.2)
    assert stream.pid is not None
    with open(appended, "ab") as f:
        for k in range(0, len(lines), 7):
            f.write(b"".join(lines[k:k + 7]))
            f.flush()
            time.sleep(0.01)
    assert stream.section(following) == {**expected}


def test_a_changed_job_is_computed_at_the_end(evicting_run):
    """Also: the follower runs under SCHED_IDLE, on the cores its run is not pinned to."""
    job = cache_job(evicting_run, read_run_metadata(evicting_run), out=None)
    stream = CacheStream()
    pinned = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(pinned)})
    try:
        stream.start(job)
    finally:
        os.sched_setaffinity(0, pinned)
    pid = stream.pid
    assert os.sched_getscheduler(pid) == os.SCHED_IDLE
    if len(pinned) > 1:
        assert min(pinned) not in os.sched_getaffinity(pid)
    assert stream.section(dataclasses.replace(job, seed=job.seed + 1)) is None
    assert stream.pid is None and not _alive(pid)


def _tail_record(rid: int, sent_at: float, ok: bool = True) -> bytes:
    return orjson.dumps({"request_id": rid, "sent_at": sent_at, "ok": ok, "status": 200 if ok else 500,
                         "worker": 0, "endpoint": "x"}) + b"\n"


def test_the_tail_hands_out_in_send_order_once_no_earlier_send_can_come(tmp_path):
    """Records appended out of send order (as requests end) come out in send order, each once the
    file holds a record sent the horizon after it; a record the server did not take in is only
    told; a record later than the horizon allows breaks the tail; the end marker ends it."""
    path, end = tmp_path / "records.jsonl", tmp_path / "end"
    path.write_bytes(b"")
    unscheduled: list[int] = []
    tail = RecordTail(str(path), end, horizon_s=1.0, poll_s=0.005, on_unscheduled=unscheduled.append)
    out: list[tuple[float, int]] = []

    def consume():
        for record in tail:
            out.append((record["sent_at"], record["request_id"]))

    consumer = gevent.spawn(consume)
    with open(path, "ab") as f:
        # sent 0, 0.5, 1.0, ...; each pair written in reverse order; request 3 failed
        for k in range(0, 20, 2):
            f.write(_tail_record(k + 1, (k + 1) / 2, ok=k + 1 != 3) + _tail_record(k, k / 2))
            f.flush()
        gevent.sleep(0.1)
        assert out == sorted(out) and out[-1][0] < 9.5 - 1.0 and len(out) == 16, out  # 0..8.0 (17) less request 3
        assert unscheduled == [3]
        f.write(_tail_record(99, 8.2))  # 1.3 s after the latest send: within its horizon, not handed out yet
        f.flush()
        gevent.sleep(0.05)
        f.write(_tail_record(100, 7.0))  # before 8.0, already handed out: a broken order
        f.flush()
        with pytest.raises(StreamBroken, match="request 100"):
            consumer.get(timeout=5)
    tail.close()

    path.write_bytes(b"".join(_tail_record(k, k / 10) for k in range(5)) + b'{"request_id": 5')
    tail = RecordTail(str(path), end, horizon_s=100.0, poll_s=0.005)
    end.touch()
    with pytest.raises(StreamBroken, match="ends inside a line"):
        list(tail)
    tail.close()
    path.write_bytes(b"".join(_tail_record(k, k / 10) for k in range(5)) + b"   \n")  # a blanked placeholder
    tail = RecordTail(str(path), end, horizon_s=100.0, poll_s=0.005)
    assert [r["request_id"] for r in tail] == [0, 1, 2, 3, 4]
    tail.close()


def test_the_tail_prepares_each_record_as_it_comes(tmp_path):
    """A request's own work (its prompt made again) is done as its record comes, while the run
    replays, not when the horizon lets it out: a short run's end is left only the checks."""
    path, end = tmp_path / "records.jsonl", tmp_path / "end"
    path.write_bytes(b"".join(_tail_record(k, k / 10) for k in (1, 0, 2)))
    prepared: list[int] = []

    def prepare(record: dict) -> tuple[int, str]:
        prepared.append(record["request_id"])
        return record["request_id"], "prepared"

    tail = RecordTail(str(path), end, horizon_s=100.0, poll_s=0.005, prepare=prepare)
    assert tail._read()  # what the tail does between waits: nothing is handed out within the horizon
    assert prepared == [1, 0, 2]
    end.touch()
    assert list(tail) == [(0, "prepared"), (1, "prepared"), (2, "prepared")]  # in send order
    tail.close()


END_SIGNAL_SCRIPT = """
import os, signal, sys, threading, time
from pathlib import Path
from replay.results.cache_child import END_SIGNAL, RecordTail
signal.pthread_sigmask(signal.SIG_BLOCK, [END_SIGNAL])  # as the follower starts (start_module's `blocked`)
path, end = Path(sys.argv[1]), Path(sys.argv[2])
path.write_bytes(b"")
tail = RecordTail(str(path), end, horizon_s=100.0, poll_s=60.0)
def the_end():
    time.sleep(0.3)
    end.touch()
    os.kill(os.getpid(), END_SIGNAL)
threading.Thread(target=the_end).start()
started = time.monotonic()
assert list(tail) == []
print(f"{time.monotonic() - started:.3f}")
"""


def test_the_end_signal_ends_the_tails_wait(tmp_path):
    """The run touches the end marker and sends END_SIGNAL: the follower reads on at once, not
    at its next poll (POLL_S of wall time added to every run's end)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", END_SIGNAL_SCRIPT, str(tmp_path / "r.jsonl"), str(tmp_path / "end")],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) < 5.0  # 0.3 s, and never the 60 s poll


def _followers() -> dict[int, str]:
    """{pid: its command line} of the cache followers running now."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "replay.results.cache_child --follow" in cmdline:
                found[int(entry.name)] = cmdline
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"


def _started_followers(tmpdir: Path, proc) -> list[int]:
    """The pids of the followers whose job is in `tmpdir` (the run's TMPDIR), once there is one."""
    deadline = time.monotonic() + 10
    while not (mine := [pid for pid, cmd in _followers().items() if str(tmpdir) in cmd]) and time.monotonic() < deadline:
        assert proc.poll() is None
        time.sleep(0.05)
    assert mine, "no follower started"
    return mine


@contextlib.contextmanager
def _replay_under_way(tmp_path, tokenizer_dir, monkeypatch, gap_ms: float, *sim_args):
    """A replay of reuse_trace (rows `gap_ms` apart) against a sim, with a TMPDIR of its own, once
    it has said its go: (its process, that TMPDIR, OUTPUT, its log). Killed on the way out."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    monkeypatch.setenv(CACHE_FOLLOW_ENV, "1")
    trace = reuse_trace(tmp_path / "trace.jsonl", gap_ms=gap_ms)
    output, log = tmp_path / "run.jsonl", tmp_path / "run.log"
    with sim_process(tokenizer_dir, *FAST_SIM, *sim_args) as sim:
        proc = spawn_locust(replay_args(trace, tokenizer_dir, sim.url, output, "--only-summary"), tmp_path, log)
        try:
            wait_for_text(log, "replay starts at", proc)
            yield proc, tmpdir, output, log
        finally:
            proc.kill()


def test_a_follower_killed_leaves_the_end_to_compute_the_section(tmp_path, toy_tokenizer_dir, monkeypatch):
    with _replay_under_way(tmp_path, toy_tokenizer_dir, monkeypatch, 25.0, "--cache-blocks", "30") \
            as (proc, tmpdir, output, log):  # 4 s
        for pid in _started_followers(tmpdir, proc):
            os.kill(pid, signal.SIGKILL)
        assert proc.wait(timeout=90) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "the cache section is computed at the end: the child that followed the run ended without it" in text, \
        text[-3000:]
    summary = json.loads(summary_path(output).read_text())
    job = cache_job(output, read_run_metadata(output), out=None)
    assert summary["cache"] == cache_section(job)[0]


def test_a_master_killed_leaves_no_follower(tmp_path, toy_tokenizer_dir, monkeypatch):
    """The master dies (SIGKILL) mid-run: its follower sees its parent gone, ends, and removes its folder."""
    with _replay_under_way(tmp_path, toy_tokenizer_dir, monkeypatch, 100.0) as (proc, tmpdir, _, _):  # 16 s
        mine = _started_followers(tmpdir, proc)
        assert any(p.name.startswith("tracereplay-follow-") for p in tmpdir.iterdir())
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in mine) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in mine)
    assert not any(p.name.startswith("tracereplay-follow-") for p in tmpdir.iterdir()), list(tmpdir.iterdir())


def test_the_trace_cursor_reads_only_as_far_as_asked(tmp_path):
    """Rows read past are held until asked for, dropped once their record says the server did not
    take them in; a row asked for after that (a placeholder, then its real record) breaks the
    stream; `finish` counts the rows never asked for in the trace's ideal."""
    from replay.results.cache_child import TraceCursor
    from replay.trace.reader import TraceStream

    trace = reuse_trace(tmp_path / "trace.jsonl", rows=10)
    cursor = TraceCursor(TraceStream(trace, "mooncake", SIM_BLOCK))
    row, ideal = cursor.take(3)
    assert row.request_id == 3 and ideal is not None
    assert sorted(cursor._held) == [0, 1, 2]
    cursor.drop(1)
    cursor.drop(5)  # not read yet: never held
    assert [cursor.take(rid)[0].request_id for rid in (0, 2, 4, 6)] == [0, 2, 4, 6]
    assert sorted(cursor._held) == []
    with pytest.raises(StreamBroken, match="request 5's record came after"):
        cursor.take(5)
    ideal = cursor.finish()
    whole = TraceCursor(TraceStream(trace, "mooncake", SIM_BLOCK)).finish()
    assert (ideal.hit_tokens, ideal.total_tokens) == (whole.hit_tokens, whole.total_tokens)
    window = TraceCursor(TraceStream(trace, "mooncake", SIM_BLOCK), first=5)  # a run of rows 5..9
    assert window.take(7)[0].request_id == 7 and sorted(window._held) == [5, 6]


def test_the_tail_reads_more_than_one_read_at_a_time(tmp_path):
    """Records appended at once past TAIL_READ (a line split between two reads), sent over more
    than the horizon: every one handed out once, in send order."""
    from replay.results.cache_child import TAIL_READ

    path, end = tmp_path / "records.jsonl", tmp_path / "end"
    pad = "x" * 500
    lines = [orjson.dumps({"request_id": k, "sent_at": k / 10, "ok": True, "status": 200, "worker": 0,
                           "endpoint": "x", "pad": pad}) + b"\n" for k in range(4000)]
    path.write_bytes(b"".join(lines))
    assert path.stat().st_size > 2 * TAIL_READ
    end.touch()
    tail = RecordTail(str(path), end, horizon_s=30.0, poll_s=0.005)
    assert [r["request_id"] for r in tail] == list(range(4000))
    tail.close()

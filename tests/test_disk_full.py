"""A full disk under `--output`: the run stops at the first write that fails, says which file
and why in one line, exits non-zero, and leaves every file complete or marked incomplete in
OUTPUT.meta.json, never a torn JSON line. The disk is a real one: a tmpfs of a chosen size,
mounted by the test (root only: skipped elsewhere), sometimes pre-filled by a filler file, so
the disk fills at the moment wanted: before the first send, mid-run, during the final write.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest

from replay.errors import OutputError
from replay.results.files import AppendFile
from replay.results.metadata import read_run_metadata
from replay.results.records import OUTPUT_ERROR, RECORD_FIELDS, read_records
from replay.results.store import RecordStore
from replay.run import driver
from replay.run.finish import CACHE_FOLLOW_ENV
from support.ports import free_port
from support.processes import finish, master_and_workers, replay_args, run_replay, spawn_locust, spawn_worker
from support.records import ok_record
from support.waiting import wait_for, wait_for_text

SAMPLE = Path(__file__).resolve().parent.parent / "replay" / "data" / "sample_trace.jsonl"  # 258 rows, 60 s
SAMPLE_ROWS = 258
PAGE = 4096
RUN_TIMEOUT_S = 120  # a run on a full disk must end by itself: past this it hangs


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Callable[[int, str], Path]]:
    """small_disk(KiB, name): a tmpfs of that size mounted at tmp_path/name, unmounted after."""
    mounted: list[Path] = []

    def mount(kib: int, name: str = "disk") -> Path:
        path = tmp_path / name
        path.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"needs root to mount a small tmpfs (a full disk on demand); run the tests as root (CI "
                        f"does) to cover it: {proc.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(disk: Path, leave: int = 0) -> Path:
    """A filler file taking every free byte of `disk` but `leave` (whole pages). With leave=0 a
    run writing to the disk meanwhile only makes it full sooner: the filler stops there."""
    filler = disk / "filler"
    st = os.statvfs(disk)
    size = st.f_bavail * st.f_frsize - leave
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        while size > 0:
            try:
                size -= os.write(fd, b"\0" * min(size, 1 << 20))
            except OSError as e:
                if e.errno != errno.ENOSPC or leave:
                    raise
                break
    finally:
        os.close(fd)
    return filler


def args(sim_url: str, tokenizer: Path, output: Path | str, *extra: str) -> list[str]:
    return replay_args(SAMPLE, tokenizer, sim_url, Path(output), "--scale", "30", *extra)


def assert_no_torn_line(folder: Path) -> dict[str, int]:
    """Every JSONL file under `folder` ends with a whole line and each line parses; returns
    the lines per file."""
    counts = {}
    for path in sorted(folder.glob("*.jsonl")):
        data = path.read_bytes()
        assert not data or data.endswith(b"\n"), f"{path.name}: a torn last line: {data[-80:]!r}"
        lines = [line for line in data.split(b"\n") if line.strip()]
        for line in lines:
            orjson.loads(line)
        counts[path.name] = len(lines)
    return counts


def assert_fault_said_once(log: str, file_name: str, stopping: bool = True) -> None:
    """One line names the first file and the reason (and stops the run, when it was still
    going), one more at the end lists every incomplete file; no traceback."""
    assert "Traceback" not in log, log[-4000:]
    said = [line for line in log.splitlines() if "cannot write" in line and "not complete" not in line]
    assert len(said) == 1, said or log[-4000:]
    assert f"replay: cannot write {file_name}: No space left on device (errno 28)" in said[0], said[0]
    assert said[0].endswith(": stopping the run") == stopping, said[0]
    ends = [line for line in log.splitlines() if "the run's files are not complete" in line]
    assert len(ends) == 1 and file_name in ends[0] and ends[0].endswith("exit code 1"), ends or log[-4000:]


def assert_records_once(output: Path) -> list[dict]:
    records = list(read_records(output))
    ids = [r["request_id"] for r in records]
    assert len(ids) == len(set(ids)), "a row has two records"
    assert set(ids) <= set(range(SAMPLE_ROWS))
    for r in records:
        assert tuple(r) == RECORD_FIELDS
    return records


def run(cmd_args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return run_replay(cmd_args, cwd, RUN_TIMEOUT_S)


def run_as(mode: str, cmd_args: list[str], cwd: Path) -> tuple[int, str, str]:
    """(exit code, log, stdout) of a run in one process ("local") or a master and two workers
    ("workers": the master's exit code and log, the workers' logs checked for tracebacks)."""
    if mode == "local":
        proc = run(cmd_args, cwd)
        return proc.returncode, proc.stderr, proc.stdout
    master, workers = master_and_workers(cwd, cmd_args)
    finish([master, *workers], timeout=RUN_TIMEOUT_S)
    for i in range(len(workers)):
        assert "Traceback" not in (cwd / f"worker{i}.log").read_text()
    log = (cwd / "master.log").read_text()
    return master.returncode, log, log


# -- the writers themselves -------------------------------------------------------------------


def test_a_failed_append_leaves_the_file_as_it_was(small_disk):
    disk = small_disk(8)
    f = AppendFile(disk / "a.jsonl")
    f.append(b'{"a": 1}\n')
    with pytest.raises(OutputError) as caught:
        f.append(b'{"b": "' + b"x" * 20_000 + b'"}\n')
    assert caught.value.errno == 28
    assert str(caught.value) == f"cannot write {disk / 'a.jsonl'}: No space left on device (errno 28)"
    assert (disk / "a.jsonl").read_bytes() == b'{"a": 1}\n'
    f.append(b'{"c": 3}\n')  # the space it gave back is usable again
    assert (disk / "a.jsonl").read_bytes() == b'{"a": 1}\n{"c": 3}\n'


def test_a_failed_sorted_rewrite_keeps_the_appended_file_one_line_a_row(small_disk):
    disk = small_disk(12)
    faults: list[OutputError] = []
    store = RecordStore(disk / "run.jsonl", 0, 9, on_fault=faults.append)
    line = {"request_id": 0, "worker": 0, "ok": True, "pad": "x" * 600}
    store.add([{**line, "request_id": i, "ok": False} for i in (5, 6)], placeholder=True)
    store.add([{**line, "request_id": i} for i in (9, 3, 5, 1, 0, 2, 4, 6, 7, 8)])  # 5, 6 replace placeholders
    fill(disk)
    seen = []
    count = store.finish(seen.append)
    assert count == 10 and [r["request_id"] for r in seen] == list(range(10)) and all(r["ok"] for r in seen)
    assert len(faults) == 1 and faults[0].path.name == "run.jsonl.tmp", faults
    assert not (disk / "run.jsonl.tmp").exists()
    kept = list(read_records(disk / "run.jsonl"))  # unsorted, but each row once, its latest record
    assert sorted(r["request_id"] for r in kept) == list(range(10)) and all(r["ok"] for r in kept)


# -- real runs -----------------------------------------------------------------------------------


def test_lock_file_on_a_full_disk_is_refused_before_anything_is_sent(tmp_path, small_disk, toy_tokenizer_dir, sim):
    disk = small_disk(64)
    fill(disk)
    proc = run(args(sim.url, toy_tokenizer_dir, disk / "run.jsonl"), tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (f"replay: --output {disk / 'run.jsonl'}: cannot write {disk / 'run.jsonl.lock'}: "
            f"No space left on device") in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("mode", ["local", "workers"])
def test_full_before_the_first_send(tmp_path, small_disk, toy_tokenizer_dir, sim, mode):
    """Room for the lock file only: the meta, written as the run begins, fails; nothing is sent."""
    disk = small_disk(64)
    fill(disk, leave=PAGE)
    output = disk / "run.jsonl"
    code, log, _ = run_as(mode, args(sim.url, toy_tokenizer_dir, output), tmp_path)
    assert code == 1, log[-4000:]
    assert_fault_said_once(log, f"{output}.meta.json")
    assert "the meta could not be written either" in log, log[-3000:]
    assert_no_torn_line(disk)
    assert not Path(f"{output}.meta.json").exists() and not Path(f"{output}.meta.json.tmp").exists()
    sent = [r for r in read_records(output) if r["sent_at"] is not None] if output.stat().st_size else []
    assert not sent


def test_full_mid_run_single_process(tmp_path, small_disk, toy_tokenizer_dir, sim):
    """The issue's case: 96 KiB under --output, the sample trace. The run stops at the first
    failed write; every file whole; the meta says what is incomplete; `replay report` says so."""
    disk = small_disk(96)
    output = disk / "run.jsonl"
    proc = run(args(sim.url, toy_tokenizer_dir, output), tmp_path)
    log = proc.stderr
    assert proc.returncode == 1, log[-4000:]
    assert "Traceback" not in log, log[-4000:]
    stops = [line for line in log.splitlines() if "stopping the run" in line]
    assert len(stops) == 1 and "No space left on device (errno 28)" in stops[0], stops or log[-3000:]
    assert_no_torn_line(disk)
    records = assert_records_once(output)
    assert any(r["error"] == OUTPUT_ERROR for r in records) or len(records) < SAMPLE_ROWS
    meta = read_run_metadata(output)
    assert meta["complete"] is False
    assert meta["incomplete"] and all(i["file"] and "No space left on device" in i["error"]
                                      for i in meta["incomplete"])
    report = subprocess.run([sys.executable, "-m", "replay", "report", str(output)], capture_output=True,
                            text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    assert "Traceback" not in report.stderr
    assert "incomplete" in report.stderr, report.stderr
    assert len([line for line in report.stderr.splitlines() if "incomplete" in line]) == 1


def test_full_mid_run_master_and_workers(tmp_path, small_disk, toy_tokenizer_dir, sim):
    """Master and two workers, all writing on the full disk: the run ends, no process hangs."""
    disk = small_disk(96)
    output = disk / "run.jsonl"
    master, workers = master_and_workers(tmp_path, args(sim.url, toy_tokenizer_dir, output))
    finish([master, *workers], timeout=RUN_TIMEOUT_S)
    log = (tmp_path / "master.log").read_text()
    assert master.returncode == 1, log[-4000:]
    assert "Traceback" not in log, log[-4000:]
    for i in range(2):
        assert "Traceback" not in (tmp_path / f"worker{i}.log").read_text()
    assert [line for line in log.splitlines() if "stopping the run" in line], log[-3000:]
    assert_no_torn_line(disk)
    assert_records_once(output)
    meta = read_run_metadata(output)
    assert meta["complete"] is False and meta["incomplete"], meta.get("incomplete")


def test_a_worker_on_a_full_disk_stops_the_run(tmp_path, small_disk, toy_tokenizer_dir, sim):
    """The workers' disk fills, the master's does not: a relative --output resolves in each
    process's own folder. The master hears of it, stops the run and records every row."""
    master_dir = tmp_path / "master"
    master_dir.mkdir()
    workers_dir = tmp_path / "workers"
    workers_dir.mkdir()
    small_disk(48, "workers/out")
    port = free_port()
    master = spawn_locust([*args(sim.url, toy_tokenizer_dir, "out/run.jsonl"), "--master", "--expect-workers",
                           "2", "--master-bind-host", "127.0.0.1", "--master-bind-port", str(port)],
                          master_dir, tmp_path / "master.log")
    workers = [spawn_worker(workers_dir, port, f"worker{i}") for i in range(2)]
    finish([master, *workers], timeout=RUN_TIMEOUT_S)
    log = (tmp_path / "master.log").read_text()
    assert master.returncode == 1, log[-4000:]
    assert "Traceback" not in log
    assert [line for line in log.splitlines() if "stopping the run" in line and ".worker-" in line], log[-3000:]
    output = master_dir / "out" / "run.jsonl"
    records = assert_records_once(output)
    assert len(records) == SAMPLE_ROWS  # the master's disk is fine: every row recorded
    assert any(r["error"] == OUTPUT_ERROR for r in records)
    meta = read_run_metadata(output)
    assert meta["complete"] is False
    assert any(".worker-" in i["file"] for i in meta["incomplete"]), meta["incomplete"]
    assert_no_torn_line(workers_dir / "out")
    for i in range(2):
        wlog = (workers_dir / f"worker{i}.log").read_text()
        assert "Traceback" not in wlog, wlog[-3000:]


@pytest.mark.parametrize("mode", ["local", "workers"])
def test_full_during_the_final_write(tmp_path, small_disk, toy_tokenizer_dir, sim, mode):
    """Room for every record as it comes, not for the sorted rewrite: the records stay as
    appended (each row once), the summary and the meta are written, the meta says so."""
    probe = tmp_path / "probe"
    probe.mkdir()
    code, log, _ = run_as(mode, args(sim.url, toy_tokenizer_dir, probe / "run.jsonl"), probe)
    assert code == 0, log[-3000:]
    sizes = {p.name: p.stat().st_size for p in probe.iterdir() if p.name.startswith("run.jsonl")}
    pages = lambda n: -(-n // PAGE) * PAGE  # noqa: E731
    records = sizes["run.jsonl"]
    workers = sum(pages(size) for name, size in sizes.items() if ".worker-" in name)
    before_rewrite = (pages(records) + workers + pages(sizes["run.jsonl.server-metrics.jsonl"]) * 3
                      + 4 * pages(sizes["run.jsonl.meta.json"]))
    disk = small_disk((before_rewrite + records // 2) // 1024)
    output = disk / "run.jsonl"
    code, log, stdout = run_as(mode, args(sim.url, toy_tokenizer_dir, output), tmp_path)
    assert code == 1, log[-4000:]
    assert_fault_said_once(log, f"{output}.tmp", stopping=False)
    assert_no_torn_line(disk)
    assert not Path(f"{output}.tmp").exists()
    records = assert_records_once(output)
    assert len(records) == SAMPLE_ROWS and all(r["ok"] for r in records)
    meta = read_run_metadata(output)
    assert meta["complete"] is False
    assert [i["file"] for i in meta["incomplete"]] == [f"{output}.tmp"], meta["incomplete"]
    assert "not sorted" in meta["incomplete"][0]["error"]
    assert "Successful requests:                     258" in stdout, stdout[-3000:]


# -- more faults of the family -------------------------------------------------------------------


def test_report_json_and_html_on_a_full_disk(tmp_path, small_disk):
    """`replay report --json/--html` to a full disk: one line naming the file, exit 1, no file."""
    import random

    rng = random.Random(0)
    results = tmp_path / "run.jsonl"
    results.write_bytes(b"".join(orjson.dumps(ok_record(i, rng)) + b"\n" for i in range(50)))
    disk = small_disk(16)
    fill(disk)
    for flag, name in (("--json", "summary.json"), ("--html", "report.html")):
        if flag == "--html":
            pytest.importorskip("matplotlib", reason="matplotlib (the report extra) is not installed: "
                                "pip install 'tracereplay[report]' (make install does)")
        proc = subprocess.run([sys.executable, "-m", "replay", "report", str(results), flag, str(disk / name)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1, proc.stderr
        assert "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.strip().splitlines()[-1] == (f"replay report: cannot write {disk / name}: "
                                                         f"No space left on device (errno 28)"), proc.stderr
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]


def test_disk_filled_by_another_writer_mid_run(tmp_path, small_disk, toy_tokenizer_dir, sim):
    """Another process takes the disk's last byte once records are coming: the run stops at its
    next write, says so in one line, and the meta, whose room was taken at the start, says
    which files are incomplete."""
    disk = small_disk(4096)
    output = disk / "run.jsonl"
    log = tmp_path / "run.log"
    proc = spawn_locust(replay_args(SAMPLE, toy_tokenizer_dir, sim.url, output, "--scale", "4"), tmp_path, log)
    try:
        wait_for_text(log, "replay starts at", proc, timeout=60)
        wait_for(lambda: output.exists() and output.read_bytes().count(b"\n") >= 10, "10 records", timeout=60)
        fill(disk)
        finish([proc], timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert proc.returncode == 1, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    said = [line for line in text.splitlines() if "stopping the run" in line]
    assert len(said) == 1 and "No space left on device (errno 28)" in said[0], said or text[-3000:]
    assert_no_torn_line(disk)
    records = assert_records_once(output)
    assert 10 <= len(records) < SAMPLE_ROWS
    meta = read_run_metadata(output)
    assert meta["complete"] is False and meta["epoch"] is not None, meta["incomplete"]  # the end's meta
    assert any(i["file"] == str(output) and "rows have no record in it" in i["error"] for i in meta["incomplete"])


@pytest.mark.parametrize("name", ["out.jsonl", "out.jsonl.gz"])
def test_trace_convert_on_a_full_disk(small_disk, name):
    """`replay trace convert` to a full disk: one line naming the file, exit 1, and no half
    trace left behind to be replayed by mistake."""
    disk = small_disk(16)
    fill(disk, leave=PAGE)  # less than the trace takes, gzipped or not
    out = disk / name
    proc = subprocess.run([sys.executable, "-m", "replay", "trace", "convert", str(SAMPLE), str(out), "--block-size",
                           "16"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip() == f"error: cannot write {out}: No space left on device (errno 28)", proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("name", ["out.jsonl", "out.jsonl.gz"])
@pytest.mark.parametrize("leave", [PAGE, 12 * PAGE], ids=["full-in-the-temporary-files", "full-in-OUT"])
def test_trace_amplify_on_a_full_disk(small_disk, name, leave):
    """`replay trace amplify` to a full disk (its temporary files, the sessions' arrays and the
    sort spools, and OUT.tmp are beside OUT): one line naming OUT, exit 1, and neither OUT nor a
    temporary file left behind. A page left: the disk fills while the sessions are found; 12
    pages hold those files (about 10 pages for this trace) but not OUT, gzipped or not."""
    disk = small_disk(256)
    fill(disk, leave=leave)
    out = disk / name
    proc = subprocess.run([sys.executable, "-m", "replay", "trace", "amplify", str(SAMPLE), str(out), "--factor",
                           "4"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip() == f"error: cannot write {out}: No space left on device (errno 28)", proc.stderr
    assert sorted(p.name for p in disk.iterdir()) == ["filler"]


def test_full_while_writing_the_fidelity_file(tmp_path, small_disk):
    """The disk fills while the end is written, room left for the summary only: the fidelity
    certificate (OUTPUT.fidelity.json) is named once as incomplete in the meta, no temporary file
    is left, the summary is whole and still holds the certificate, and the exit code is 1. The
    engine in one process (tests/engine_support.py), so the disk fills exactly there."""
    import gevent
    from engine_support import FakeClock, FakeWorker, make_rows, spec_of

    from replay.engine.transport import LOCAL_CLIENT, LocalLink
    from replay.rules.run_files import fidelity_path, summary_path

    def run_into(folder: Path, leave: int | None) -> list[int]:
        spec = spec_of(make_rows(40), folder)
        link, clock, codes = LocalLink(), FakeClock(), []
        coordinator = driver.start(spec, link, clock, on_exit_code=codes.append)
        if leave is not None:  # the summary is computed: its file next, then the certificate
            coordinator.summary_listeners.append(lambda report: fill(folder, leave=leave))
        FakeWorker(link, clock=clock).hello()
        gevent.sleep(0.001)
        coordinator.begin([(LOCAL_CLIENT, 0)])
        clock.drive(coordinator.finished.is_set)
        ending = gevent.spawn(coordinator.end)
        clock.drive(lambda: ending.dead)
        ending.get()
        return codes

    probe = tmp_path / "probe"
    probe.mkdir()
    assert run_into(probe, None) == []
    summary_pages = -(-summary_path(probe / "run.jsonl").stat().st_size // PAGE) * PAGE
    disk = small_disk(1024)
    output = disk / "run.jsonl"
    assert run_into(disk, summary_pages) == [1]
    meta = read_run_metadata(output)
    assert [i["file"] for i in meta["incomplete"]] == [str(fidelity_path(output))], meta["incomplete"]
    assert "No space left on device" in meta["incomplete"][0]["error"]
    assert not fidelity_path(output).exists() and not Path(f"{fidelity_path(output)}.tmp").exists()
    summary = orjson.loads(summary_path(output).read_bytes())
    assert summary["fidelity"]["schedule"]["sends"] == 40
    assert len(list(read_records(output))) == 40


@pytest.mark.parametrize("pages", [2, 1])
def test_full_while_the_cache_child_writes(tmp_path, small_disk, toy_tokenizer_dir, sim, monkeypatch, pages):
    """The cache children (replay/results/cache_child.py: the one that follows the run from its
    go, then, when it gives no section, the end's) write their job, spool and result under
    $TMPDIR, a disk nearly full. With room for tempfile's probe, a job and a small result (2
    pages), the follower, which spools nothing, makes the section. With room for the probe and a
    job only (1 page), neither can: the run still ends by itself, its summary and certificate
    written without a cache section (the certificate says the cache line is not checked), one
    line saying so. Either way no temporary file is left there. (A TMPDIR with no room at all,
    tempfile skips for /tmp.)"""
    disk = small_disk(64, "tmp")
    fill(disk, leave=pages * PAGE)
    monkeypatch.setenv("TMPDIR", str(disk))
    monkeypatch.setenv(CACHE_FOLLOW_ENV, "1")  # the follower, not the end's computation in the run's process
    output = tmp_path / "run.jsonl"
    proc = run(replay_args(SAMPLE, toy_tokenizer_dir, sim.url, output, "--scale", "30", "--max-requests", "40"),
               tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cert = orjson.loads(Path(f"{output}.fidelity.json").read_bytes())
    if pages == 2:
        assert "cache fidelity computed while the run replayed" in proc.stderr, proc.stderr[-3000:]
        assert "cache fidelity:" not in proc.stderr and cert["cache"]["infinite"] is not None
    else:
        assert proc.stderr.count("cache fidelity:") == 1 and "no cache section" in proc.stderr, proc.stderr[-3000:]
        assert cert["cache"] == {"infinite": None, "misses": None}
        assert "not checked: cache" in proc.stdout
    assert sorted(p.name for p in disk.iterdir()) == ["filler"]


def test_full_while_the_import_memo_is_written(tmp_path, small_disk, monkeypatch):
    """The set-up cache key's import memo (replay.synth.setup_cache.IMPORT_MEMO) on a full cache
    folder: the digest is the one every source parsed gives, nothing raised, no temporary file
    left (the temporary file is made, a name takes no page; its write fails)."""
    from replay import source_graph
    from replay.synth import setup_cache

    disk = small_disk(64, "cache")
    fill(disk)
    monkeypatch.setenv(setup_cache.ENV, str(disk))
    expected = source_graph.source_digest(setup_cache.SETUP_ENTRIES, source_graph.ROOT)
    assert setup_cache.code_digest.__wrapped__(source_graph.ROOT) == expected
    assert sorted(p.name for p in disk.iterdir()) == ["filler"]

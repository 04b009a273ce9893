"""The output is claimed by the master before anything is sent: its folder writable, locked for
the run, an earlier run's results replaced only with --overwrite (stale per-worker files too).

Unit tests of replay.results.output, then real `locust` runs: before this, a bad --output was a
traceback at the start of the run and a run that never ended, and a rerun or a second run at
the same time silently replaced or interleaved the results.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from replay.errors import OptionError
from replay.results.metadata import read_run_metadata
from replay.results.output import OutputTaken, claim_output, earlier_run_files
from replay.results.records import RecordWriter
from replay.rules.run_files import (
    fidelity_path,
    lock_path,
    meta_path,
    metrics_path,
    summary_path,
    worker_path,
)
from support.paths import char_device
from support.processes import LOCUST, finish, replay_args, run_locust, spawn_locust
from support.records import check_records
from support.traces import mooncake_trace
from support.waiting import wait_for_text

# -- claim_output -------------------------------------------------------------------------------


def test_a_folder_under_a_regular_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    for output in (tmp_path / "file" / "run.jsonl", tmp_path / "file" / "deeper" / "run.jsonl"):
        with pytest.raises(OptionError) as e:
            claim_output(str(output))
        assert str(e.value) == (f"--output {output}: cannot create its folder {output.parent}: "
                                f"{tmp_path / 'file'} is a file, not a folder")


def test_a_folder_as_output_is_refused(tmp_path):
    with pytest.raises(OptionError, match=f"--output {tmp_path}: is a folder; name a file"):
        claim_output(str(tmp_path))


def test_the_folder_is_made(tmp_path):
    output = tmp_path / "a" / "b" / "run.jsonl"
    claim = claim_output(str(output))
    assert output.parent.is_dir() and lock_path(output).exists()
    claim.release()


def test_a_held_output_is_refused_until_released(tmp_path):
    output = str(tmp_path / "run.jsonl")
    first = claim_output(output)
    with pytest.raises(OutputTaken) as e:
        claim_output(output, overwrite=True)  # --overwrite replaces results, never a running run's
    assert str(e.value).startswith(f"--output {output}: another run is writing it (pid {os.getpid()} on ")
    assert first.held and lock_path(output).exists()
    first.release()
    assert not lock_path(output).exists()
    claim_output(output).release()


def test_earlier_results_are_refused_without_overwrite(tmp_path):
    output = tmp_path / "run.jsonl"
    for existing in (output, meta_path(output), worker_path(output, 3)):
        existing.write_text("{}\n")
        with pytest.raises(OutputTaken) as e:
            claim_output(str(output))
        assert str(e.value) == (f"--output {output}: {existing} exists (an earlier run's results); pass --overwrite "
                                f"to replace them, or choose another --output")
        assert existing.exists() and not lock_path(output).exists()  # nothing removed, nothing left locked
        existing.unlink()


def test_overwrite_removes_the_earlier_runs_files_and_only_those(tmp_path):
    output = tmp_path / "run.jsonl"
    earlier = [output, meta_path(output), summary_path(output), metrics_path(output),
               *(worker_path(output, i) for i in (0, 1, 7, 12))]
    others = [tmp_path / "run.jsonl.worker-x.jsonl", tmp_path / "run.jsonl.bak", tmp_path / "other.jsonl",
              tmp_path / "other.jsonl.worker-0.jsonl", tmp_path / "xrun.jsonl.worker-0.jsonl"]
    for p in earlier + others:
        p.write_text("{}\n")
    assert sorted(earlier_run_files(output)) == sorted(earlier)
    claim = claim_output(str(output), overwrite=True)
    assert not any(p.exists() for p in earlier)
    assert all(p.exists() for p in others)
    claim.release()


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _folder(path: Path) -> Path:
    path.mkdir()
    return path


def _symlink_out(path: Path) -> Path:
    """A link to a file outside the output's folder: replacing or writing through it must not happen."""
    target = path.parent.parent / f"{path.parent.name}-outside.txt"
    target.write_text("someone else's file\n")
    path.symlink_to(target)
    return path


def _dangling_symlink(path: Path) -> Path:
    path.symlink_to(path.parent.parent / f"{path.parent.name}-nowhere.txt")
    return path


NOT_FILES = [(char_device, "a character device"), (_fifo, "a FIFO"), (_folder, "a folder"),
             (_symlink_out, "a symbolic link"), (_dangling_symlink, "a symbolic link")]


@pytest.mark.parametrize("which, make, kind", [
    (which, make, kind) for which in ("output", "meta", "worker", "lock", "tmp") for make, kind in NOT_FILES
    if (which, make) != ("output", _folder)  # a folder as --output has its own message (see above)
])
def test_only_regular_files_are_replaced(tmp_path, make, kind, which):
    """--overwrite replaced whatever was at an output path: as root, `--output /dev/full
    --overwrite` deleted /dev/full. Now anything but a regular file there is refused, with or
    without --overwrite, and left as it was."""
    folder = tmp_path / "out"
    folder.mkdir()
    output = folder / "run.jsonl"
    path = {"output": output, "meta": meta_path(output), "worker": worker_path(output, 2), "lock": lock_path(output),
            "tmp": Path(f"{output}.tmp")}[which]
    make(path)
    before = os.lstat(path)
    outside = sorted(p.name for p in tmp_path.iterdir())
    for overwrite in (True, False):
        with pytest.raises(OptionError) as e:
            claim_output(str(output), overwrite=overwrite)
        assert str(e.value) == (f"--output {output}: {path} is {kind}, not a regular file; only an earlier run's "
                                f"regular files are replaced: remove it, or choose another --output")
        after = os.lstat(path)
        assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)
        assert not lock_path(output).exists() or which == "lock"
    assert sorted(p.name for p in tmp_path.iterdir()) == outside  # nothing written through a link


@pytest.mark.parametrize("make, kind", [(_fifo, "a FIFO"), (_symlink_out, "a symbolic link"),
                                        (_folder, "a folder")])
def test_a_workers_own_file_is_written_only_as_a_regular_file(tmp_path, make, kind):
    """A worker on another host writes OUTPUT.worker-N.jsonl where the master's claim did not
    look: it opened it with "wb" (blocking on a FIFO, writing through a link). Now it refuses,
    which fails the worker's rows as `worker failed: ...` with this line."""
    folder = tmp_path / "out"
    folder.mkdir()
    output = folder / "run.jsonl"
    path = make(worker_path(output, 1))
    outside = sorted((p.name, p.read_bytes() if p.is_file() else None) for p in tmp_path.iterdir())
    with pytest.raises(OptionError) as e:
        RecordWriter(path, output)
    assert str(e.value) == (f"--output {output}: {path} is {kind}, not a regular file; only an earlier run's "
                            f"regular files are replaced: remove it, or choose another --output")
    assert sorted((p.name, p.read_bytes() if p.is_file() else None) for p in tmp_path.iterdir()) == outside
    worker_path(output, 2).write_text("an earlier run's\n")
    writer = RecordWriter(worker_path(output, 2), output)  # a regular file is replaced
    writer.close()
    assert worker_path(output, 2).read_text() == ""


def test_default_output_takes_the_next_free_name(tmp_path):
    default = tmp_path / "results" / "replay-20250101-000000.jsonl"
    first = claim_output(str(default), default=True)  # a run that started in the same second
    assert first.output == str(default)
    second = claim_output(str(default), default=True)
    assert second.output == str(tmp_path / "results" / "replay-20250101-000000-2.jsonl")
    first.release()
    Path(default).write_text("{}\n")  # a finished run's results: kept
    third = claim_output(str(default), default=True)
    assert third.output == str(tmp_path / "results" / "replay-20250101-000000-3.jsonl")
    assert Path(default).read_text() == "{}\n"
    second.release()
    third.release()


def test_a_forked_child_does_not_free_its_parents_claim(tmp_path):
    """Locust forks workers (--processes); they inherit the descriptor and the exit hook."""
    output = str(tmp_path / "run.jsonl")
    claim = claim_output(output)
    pid = os.fork()
    if pid == 0:
        claim.release()
        os._exit(0)
    os.waitpid(pid, 0)
    assert lock_path(output).exists()
    with pytest.raises(OutputTaken):
        claim_output(output)
    claim.release()


HOLD = "import sys, time; from replay.results.output import claim_output; claim_output(sys.argv[1]); " \
       "print('claimed', flush=True); time.sleep(float(sys.argv[2]))"


def test_the_lock_goes_with_its_process(tmp_path):
    """Removed at a normal exit; after a SIGKILL the file stays but holds nothing."""
    output = str(tmp_path / "run.jsonl")
    subprocess.run([sys.executable, "-c", HOLD, output, "0"], check=True, timeout=30, capture_output=True)
    assert not lock_path(output).exists()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, output, "60"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "claimed"
        with pytest.raises(OutputTaken, match=f"pid {holder.pid} on "):
            claim_output(output)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert lock_path(output).exists()
    claim_output(output).release()


# -- real runs ----------------------------------------------------------------------------------


def refused(args: list[str], cwd: Path, message: str, prefix: list[str] = ()) -> str:
    """A run that must stop in its preflight: exit 2, the message on one line, no traceback."""
    started = time.monotonic()
    proc = subprocess.run([*prefix, *LOCUST, *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"replay: {message}" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert time.monotonic() - started < 30
    return proc.stderr


def test_output_under_a_regular_file_is_refused(tmp_path, toy_tokenizer_dir):
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=3, gap_ms=10)
    (tmp_path / "file").write_text("x")
    output = tmp_path / "file" / "run.jsonl"
    refused(replay_args(trace, toy_tokenizer_dir, "http://127.0.0.1:9", output), tmp_path,
            f"--output {output}: cannot create its folder {output.parent}: {output.parent} is a file, not a folder")


@pytest.fixture
def read_only_dir(tmp_path) -> tuple[Path, list[str]]:
    """A folder and the command prefix that runs a process with a read-only file system
    mounted on it (a mount namespace of its own: nothing outside the process sees it)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    prefix = ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o ro none "{ro}" && exec "$@"', "sh"]
    try:
        probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("needs the unshare command (Debian package util-linux)")
    if probe.returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs in a user namespace here (this kernel or container forbids "
                    f"unprivileged user namespaces; root in CI can): {probe.stderr.decode().strip()}")
    return ro, prefix


@pytest.mark.parametrize("where", ["in", "under"])
def test_output_on_a_read_only_mount_is_refused(tmp_path, toy_tokenizer_dir, read_only_dir, where):
    ro, prefix = read_only_dir
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=3, gap_ms=10)
    output = ro / "run.jsonl" if where == "in" else ro / "results" / "run.jsonl"
    message = (f"--output {output}: cannot write in {ro}: Read-only file system" if where == "in" else
               f"--output {output}: cannot create its folder {output.parent}: Read-only file system")
    refused(replay_args(trace, toy_tokenizer_dir, "http://127.0.0.1:9", output), tmp_path, message, prefix)


def test_a_second_run_on_the_same_output_is_refused_while_the_first_runs(tmp_path, toy_tokenizer_dir, sim):
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=60, gap_ms=100)  # 6 s
    output = tmp_path / "run.jsonl"
    first = spawn_locust(replay_args(trace, toy_tokenizer_dir, sim.url, output), tmp_path, tmp_path / "first.log")
    try:
        wait_for_text(tmp_path / "first.log", "replay starts at", first)
        for flags in ([], ["--overwrite"]):  # --overwrite replaces finished results, never a running run's
            refused(replay_args(trace, toy_tokenizer_dir, sim.url, output, *flags), tmp_path,
                    f"--output {output}: another run is writing it (pid {first.pid} on ")
        finish([first])
    finally:
        finish([first], timeout=5)
    assert first.returncode == 0, (tmp_path / "first.log").read_text()[-3000:]
    check_records(output, trace)  # the first run's records, whole
    assert requests.get(f"{sim.url}/debug/requests", timeout=10).json()["total"] == 60  # the second sent nothing
    assert not lock_path(output).exists()  # removed at the end


def test_an_earlier_runs_results_need_overwrite(tmp_path, toy_tokenizer_dir, sim):
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=20, gap_ms=20)
    output = tmp_path / "run.jsonl"
    run_locust(replay_args(trace, toy_tokenizer_dir, sim.url, output), tmp_path)
    kept = output.read_bytes(), meta_path(output).read_bytes()
    refused(replay_args(trace, toy_tokenizer_dir, sim.url, output), tmp_path,
            f"--output {output}: {output} exists (an earlier run's results); pass --overwrite to replace them")
    assert (output.read_bytes(), meta_path(output).read_bytes()) == kept
    assert not lock_path(output).exists()

    stale = worker_path(output, 3)  # from an earlier run with more workers
    stale.write_text('{"request_id": 0}\n')
    config = tmp_path / "run.yaml"
    config.write_text("overwrite: true\n")  # the option as a --replay-config key
    run_locust(replay_args(trace, toy_tokenizer_dir, sim.url, output, "--replay-config", str(config)), tmp_path)
    check_records(output, trace)
    assert not stale.exists()
    assert earlier_run_files(output) == [output, meta_path(output), summary_path(output), fidelity_path(output),
                                         metrics_path(output), worker_path(output, 0)]
    assert read_run_metadata(output)["run_id"] not in kept[1].decode()


def test_default_output_is_unchanged(tmp_path, toy_tokenizer_dir, sim):
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=5, gap_ms=20)
    args = replay_args(trace, toy_tokenizer_dir, sim.url, Path("unused"))
    args = args[: args.index("--output")] + args[args.index("--output") + 2 :]
    proc = run_locust(args, tmp_path)
    outputs = sorted((tmp_path / "results").iterdir())
    records = [p.name for p in outputs if p.name.endswith(".jsonl") and ".worker-" not in p.name
               and ".server-metrics." not in p.name]  # fmt: skip
    assert records == [outputs[0].name]
    assert outputs[0].name.startswith("replay-") and f"-> {Path('results') / outputs[0].name}" in proc.stdout
    check_records(outputs[0], trace)
    assert not list((tmp_path / "results").glob("*.lock"))


def test_overwrite_never_replaces_a_device(tmp_path, toy_tokenizer_dir):
    """The issue's case: a character device as --output with --overwrite was unlinked and a
    regular file written in its place."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=3, gap_ms=10)
    output = char_device(tmp_path / "full")
    refused(replay_args(trace, toy_tokenizer_dir, "http://127.0.0.1:9", output, "--overwrite"), tmp_path,
            f"--output {output}: {output} is a character device, not a regular file; only an earlier run's "
            f"regular files are replaced: remove it, or choose another --output")
    assert stat.S_ISCHR(os.lstat(output).st_mode)
    assert not lock_path(output).exists() and not meta_path(output).exists()


@pytest.mark.parametrize("how", ["the trace itself", "a hard link to it", "its metadata a link to the trace"])
def test_no_file_of_the_run_is_one_it_reads(tmp_path, toy_tokenizer_dir, how):
    """`--output TRACE --overwrite` removed the trace as an earlier run's results, then failed to
    read it; any file of the run on an input (the records, a file beside them, by inode) is
    refused, with or without --overwrite (replay.output_claim, on the options typed Input)."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=3, gap_ms=10)
    output = {"the trace itself": trace, "a hard link to it": tmp_path / "run.jsonl",
              "its metadata a link to the trace": tmp_path / "linked.jsonl"}[how]
    if how == "a hard link to it":
        os.link(trace, output)
    elif how == "its metadata a link to the trace":
        meta_path(output).symlink_to(trace)
    kept = trace.read_bytes()
    written = "" if how != "its metadata a link to the trace" else f"writes {meta_path(output)}, which is "
    same = "the same file as " if how == "a hard link to it" else ""
    refused(replay_args(trace, toy_tokenizer_dir, "http://127.0.0.1:9", output, "--overwrite"), tmp_path,
            f"--output {output}: {written or 'is '}{same}--trace {trace}, which this command reads: choose another "
            f"--output")
    assert trace.read_bytes() == kept and not lock_path(output).exists()


@pytest.mark.parametrize("case", ["--html on the trace", "--html on --output", "--json-file on the run's metadata",
                                  "--output on --replay-config"])
def test_locusts_reports_and_the_config_are_claimed_with_the_run(tmp_path, toy_tokenizer_dir, case):
    """Locust writes --html and --json-file at the run's end, over whatever is there: the trace,
    or the run's own records; --output --overwrite removed the --replay-config it was read from.
    Now refused before the run (replay.locust.outputs), everything left as it was."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=3, gap_ms=10)
    output, config = tmp_path / "run.jsonl", tmp_path / "run.yaml"
    config.write_text("seed: 1\n")
    flag, message = {
        "--html on the trace": (["--html", str(trace)], f"--html {trace}: is --trace {trace}"),
        "--html on --output": (["--html", str(output)], f"--html {output}: --output {output} writes it too"),
        "--json-file on the run's metadata": (["--json-file", f"{output}.meta"],  # Locust adds .json
                                              f"--json-file {output}.meta: --output {output} writes it too "
                                              f"({meta_path(output)})"),
        "--output on --replay-config": (["--replay-config", str(config), "--overwrite"],
                                        f"--output {config}: is --replay-config {config}"),
    }[case]
    if case == "--output on --replay-config":
        output = config
    kept = {p: p.read_bytes() for p in (trace, config)}
    refused(replay_args(trace, toy_tokenizer_dir, "http://127.0.0.1:9", output, *flag), tmp_path, message)
    assert {p: p.read_bytes() for p in (trace, config)} == kept and not lock_path(output).exists()

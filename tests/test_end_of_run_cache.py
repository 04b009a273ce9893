"""The end of a run computes the cache fidelity section from the run's files, in a child process
(replay/results/cache_section.py), or in its own for a short single-process run: the same
section `replay report --server-block-size N` prints; the asking process never loads the tokenizer; a child that fails or is killed is one
error line and a summary without the section, never a hang."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from replay.results import cache_child
from replay.results import cache_section as cache_module
from replay.results.cache_section import CacheChildError, cache_job, cache_section
from replay.results.metadata import read_run_metadata
from replay.results.report import ReportError
from replay.run.finish import CACHE_FOLLOW_ENV, CACHE_HERE_ROWS, cache_here
from replay.sim.process import sim_process
from replay.synth import prompts as prompts_module
from replay.synth import tokenizer as tokenizer_module
from support.processes import replay_args, run_locust, spawn_locust
from support.traces import mooncake_trace
from support.waiting import wait_for_text

SERVER_BLOCK = 32
SIM_ARGS = ("--block-size", str(SERVER_BLOCK), "--cache-blocks", "100000", "--ttft-ms", "5", "--itl-ms", "1",
            "--prefill-ms-per-1k", "0")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, toy_tokenizer_dir) -> Path:
    """A real replay against `replay sim` with --server-block-size: its OUTPUT."""
    tmp_path = tmp_path_factory.mktemp("run")
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=40, gap_ms=20)
    output = tmp_path / "run.jsonl"
    with sim_process(toy_tokenizer_dir, *SIM_ARGS) as sim:
        proc = run_locust(replay_args(trace, toy_tokenizer_dir, sim.url, output, "--server-block-size",
                                      str(SERVER_BLOCK), "--only-summary"), tmp_path)
    (tmp_path / "run.log").write_text(proc.stderr)
    return output


def test_a_short_single_process_run_computes_it_in_its_own_process(finished_run):
    """A single-process run of a few rows starts no cache child at all, neither a follower nor
    the end's: its worker's set-up is in its process already, and a child's memory would add to
    the run's while both live. The section is still `replay report`'s (the next test)."""
    log = finished_run.with_name("run.log").read_text()
    assert "cache fidelity computed in the run's own process" in log, log[-3000:]
    assert "computed in a child process" not in log and "while the run replayed" not in log


def test_the_end_of_run_section_is_replay_reports(finished_run, tmp_path):
    summary = json.loads(Path(f"{finished_run}.summary.json").read_text())
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "replay", "report", str(finished_run), "--server-block-size",
                           str(SERVER_BLOCK), "--json", str(out)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    cache = summary["cache"]
    assert cache == json.loads(out.read_text())["cache"]
    assert cache["requests_compared"] == 40 and cache["requests_matching"] == 40, cache["worst"]
    assert cache["expected_cached_tokens"] > 0


def test_the_asking_process_never_loads_the_tokenizer(finished_run):
    """Computed from a fresh interpreter: afterwards it has not even imported `tokenizers`."""
    script = textwrap.dedent(f"""
        import json, sys
        from replay.results.cache_section import cache_job, cache_section
        from replay.results.metadata import read_run_metadata
        output = {str(finished_run)!r}
        job = cache_job(output, read_run_metadata(output), server_block_size={SERVER_BLOCK})
        section, _ = cache_section(job)
        assert "tokenizers" not in sys.modules and "replay.synth.tokenizer" not in sys.modules, "tokenizer loaded"
        print(json.dumps(section))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(Path(f"{finished_run}.summary.json").read_text())
    assert json.loads(proc.stdout) == summary["cache"]


def test_the_child_takes_the_set_up_from_the_cache_and_never_loads_the_tokenizer(finished_run, monkeypatch):
    """The prompts' token ids come from the set-up the run's preflight cached: the child loads
    the tokenizer itself only where a worker would (a real one costs 0.1-0.35 s of CPU and up to
    170 MB, at every run's end and in every follower)."""

    def refuse(path):
        raise AssertionError(f"the child loaded the tokenizer {path}")

    from_cache = []
    cached = prompts_module.setup_cache.cached

    def recorded(*args):
        measured, hit = cached(*args)
        from_cache.append(hit)
        return measured, hit

    monkeypatch.setattr(tokenizer_module, "load_tokenizer", refuse)
    monkeypatch.setattr(prompts_module.setup_cache, "cached", recorded)
    job = cache_job(finished_run, read_run_metadata(finished_run), server_block_size=SERVER_BLOCK)
    section = cache_child.compute(dataclasses.asdict(job))
    assert from_cache == [True]
    assert section == json.loads(Path(f"{finished_run}.summary.json").read_text())["cache"]


def test_the_checks_come_back_for_the_html(finished_run):
    job = cache_job(finished_run, read_run_metadata(finished_run), server_block_size=SERVER_BLOCK)
    section, checks = cache_section(job, checks=True)
    assert len(checks) == section["requests_compared"] == 40
    assert sum(c.expected for c in checks) == section["expected_cached_tokens"]
    assert [c.sent_at for c in checks] == sorted(c.sent_at for c in checks)  # send order


@pytest.mark.parametrize("body, said", [
    ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", "signal 9"),
    ("raise RuntimeError('the child broke')\n", "RuntimeError: the child broke"),
    ("pass\n", r"wrote no result \(no output\)"),  # ended well, wrote no result
])  # fmt: skip
def test_a_faulty_child_is_one_error(finished_run, tmp_path, monkeypatch, body, said):
    (tmp_path / "faulty_child.py").write_text(body)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr(cache_module, "CHILD_MODULE", "faulty_child")
    job = cache_job(finished_run, read_run_metadata(finished_run), server_block_size=SERVER_BLOCK)
    with pytest.raises(CacheChildError, match=said) as caught:
        cache_section(job)
    assert "\n" not in str(caught.value)


def test_only_a_short_run_of_short_prompts_computes_it_in_its_own_process(monkeypatch):
    """The end's work grows with the prompts' tokens: a run of long ones leaves it to the
    follower, which makes them while the run sends; so does a run with --processes workers."""
    def spec(rows: int, longest: int):
        return SimpleNamespace(total=rows, schedule=SimpleNamespace(input_lengths=(1, longest)))

    monkeypatch.delenv(CACHE_FOLLOW_ENV, raising=False)
    assert cache_here(spec(250, 1280), single_process=True)
    assert not cache_here(spec(250, 1280), single_process=False)
    assert not cache_here(spec(CACHE_HERE_ROWS + 1, 10), single_process=True)
    assert not cache_here(spec(40, 30_000), single_process=True)  # 1.2 million tokens to make again
    monkeypatch.setenv(CACHE_FOLLOW_ENV, "1")
    assert not cache_here(spec(250, 1280), single_process=True)


def test_a_failure_computing_it_in_the_runs_process_is_one_error(finished_run, monkeypatch):
    """Computed in the run's own process (a short single-process run's end), what would have
    crashed a child is one error (the run logs it and ends without the section), not the end's crash."""
    def broken(job, checks_path=None, run_synth=None):
        raise RuntimeError("the computation broke\nsecond line")

    monkeypatch.setattr(cache_module, "compute", broken)
    job = cache_job(finished_run, read_run_metadata(finished_run), server_block_size=SERVER_BLOCK)
    with pytest.raises(CacheChildError, match=r"RuntimeError: the computation broke\); no cache section") as caught:
        cache_module.cache_section_here(job)
    assert "\n" not in str(caught.value)


def test_a_bad_input_is_the_childs_one_line_error(finished_run, tmp_path):
    trace = mooncake_trace(tmp_path / "short.jsonl", rows=5, gap_ms=20)  # the run's records name rows 5..39
    job = cache_job(finished_run, read_run_metadata(finished_run), server_block_size=SERVER_BLOCK, trace=str(trace),
                    block_size=16)
    with pytest.raises(ReportError, match=r"35 records name rows the trace does not have \(first: request_id 5\)"):
        cache_section(job)


def test_a_run_whose_child_fails_ends_without_the_section(tmp_path, toy_tokenizer_dir):
    """The trace is removed once the run has read it: the child cannot read it at the end. The
    run still ends by itself, exit code 0, with one error line and a summary without the section."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=40, gap_ms=50)
    output = tmp_path / "run.jsonl"
    log = tmp_path / "run.log"
    with sim_process(toy_tokenizer_dir, *SIM_ARGS) as sim:
        proc = spawn_locust(replay_args(trace, toy_tokenizer_dir, sim.url, output, "--server-block-size",
                                        str(SERVER_BLOCK), "--only-summary"), tmp_path, log)
        try:
            wait_for_text(log, "replay starts at", proc)
            trace.unlink()
            assert proc.wait(timeout=90) == 0, log.read_text()[-3000:]
        finally:
            proc.kill()
    text = log.read_text()
    errors = [line for line in text.splitlines() if "cache fidelity:" in line]
    assert len(errors) == 1 and "No such file or directory" in errors[0], errors
    summary = json.loads(Path(f"{output}.summary.json").read_text())
    assert summary["requests_ok"] == 40 and summary.get("cache") is None
    assert "Prefix Cache Fidelity" not in text


@pytest.mark.parametrize("follow", [False, True], ids=["at the end", "followed"])
def test_a_run_that_skipped_bad_lines_has_the_section_and_so_does_its_report(tmp_path, toy_tokenizer_dir,
                                                                              monkeypatch, follow):
    """The section reads the trace again: with the run's --on-bad-line skip (from its metadata),
    so a bad line that the run skipped is skipped again and the request ids line up, at the
    run's end, in the follower while the run replays, and in `replay report`."""
    if follow:
        monkeypatch.setenv(CACHE_FOLLOW_ENV, "1")
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=12, gap_ms=20)
    lines = trace.read_text().splitlines()
    trace.write_text("\n".join([*lines[:5], '{"timestamp": 100, "input_len', *lines[5:]]) + "\n")
    output = tmp_path / "run.jsonl"
    with sim_process(toy_tokenizer_dir, *SIM_ARGS) as sim:
        proc = run_locust(replay_args(trace, toy_tokenizer_dir, sim.url, output, "--server-block-size",
                                      str(SERVER_BLOCK), "--only-summary", "--on-bad-line", "skip"), tmp_path)
    assert "cache fidelity:" not in proc.stderr, proc.stderr[-3000:]
    assert ("while the run replayed" in proc.stderr) == follow, proc.stderr[-3000:]
    cache = json.loads(Path(f"{output}.summary.json").read_text())["cache"]
    assert cache["requests_compared"] == 12 and cache["requests_matching"] == 12, cache
    out = tmp_path / "report.json"
    report = subprocess.run([sys.executable, "-m", "replay", "report", str(output), "--json", str(out)],
                            capture_output=True, text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    assert json.loads(out.read_text())["cache"] == cache
    assert "trace rows skipped as bad lines (--on-bad-line skip): 1" in report.stdout  # as the run's end said


@pytest.mark.parametrize("seed, broken", [(0, True), (5, False)])
def test_the_sections_prompts_come_from_the_spec_not_from_the_run_synthesizer(finished_run, seed, broken):
    """The synthesizer the end is handed (the worker's) lends only its blocks: one whose test hook
    breaks a block (the worker's bug the check is there to see) is not used as it is, and one of
    another spec (seed 5) not at all; the section is `replay report`'s either way."""
    from replay.synth.prompts import PromptSynthesizer
    from replay.synth.tokenizer import ServerTokenizer

    job = cache_job(finished_run, read_run_metadata(finished_run), server_block_size=SERVER_BLOCK)
    worker = PromptSynthesizer(ServerTokenizer.load(job.tokenizer, job.chat_template, lazy=True), api=job.api,
                               block_size=job.block_size, seed=seed)
    if broken:
        worker.break_block(0)
    section = cache_child.compute(dataclasses.asdict(job), None, worker)
    assert section == json.loads(Path(f"{finished_run}.summary.json").read_text())["cache"]

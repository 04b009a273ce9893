"""Where a run starts (replay.run.preflight): a trace and a tokenizer become a frozen RunSpec,
and a refusal leaves nothing held. No server: the one asked what it serves is dead (the spec
holds its answer; check_servers refuses it), --max-prompt-tokens is given."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import orjson
import pytest

from replay.engine.options import ReplayOptions
from replay.protocol.models import Served
from replay.rules.run_files import lock_path
from replay.run import preflight
from replay.synth.tokenizer import tokenizer_fingerprint
from support.traces import BLOCK, mooncake_trace


def options_for(tmp_path, toy_tokenizer_dir, **kwargs) -> ReplayOptions:
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=12, gap_ms=100)
    return ReplayOptions(trace=str(trace), block_size=BLOCK, tokenizer=str(toy_tokenizer_dir), model="m",
                         output=str(tmp_path / "run.jsonl"), max_prompt_tokens=100_000, **kwargs)


def test_load_makes_a_frozen_spec(tmp_path, toy_tokenizer_dir):
    spec = preflight.load(options_for(tmp_path, toy_tokenizer_dir), "http://127.0.0.1:9")
    try:
        assert spec.total == 12 and len(spec.schedule) == 12 and spec.max_prompt_tokens == 100_000
        assert spec.trace.format == "mooncake" and spec.trace.block_size == BLOCK and len(spec.trace.sha256) == 64
        assert spec.tokenizer_fingerprint == tokenizer_fingerprint(str(toy_tokenizer_dir), None)
        assert spec.output == str(tmp_path / "run.jsonl") and lock_path(spec.output).exists()
        assert spec.endpoint_urls() == ["http://127.0.0.1:9"]  # the host the preflight looked at, fixed
        with pytest.raises(dataclasses.FrozenInstanceError):
            spec.run_id = "another"  # type: ignore[misc]
    finally:
        spec.schedule.close()
        spec.claim.release()


def test_a_refusal_releases_the_output(tmp_path, toy_tokenizer_dir):
    options = options_for(tmp_path, toy_tokenizer_dir, max_requests=0)
    with pytest.raises(ValueError, match="no rows to replay in the window"):
        preflight.load(options, "http://127.0.0.1:9")
    assert not lock_path(tmp_path / "run.jsonl").exists()


def test_a_duration_alone_is_the_first_seconds_of_a_trace_of_epoch_times(tmp_path, toy_tokenizer_dir):
    """--duration counts from --start, else from the first row: a run (and a search's probe) of
    a trace whose times are since 1970 replays its first seconds, not nothing."""
    options = options_for(tmp_path, toy_tokenizer_dir, duration=0.55)
    trace = Path(options.trace)
    rows = [orjson.loads(line) for line in trace.read_bytes().splitlines()]
    trace.write_bytes(b"".join(orjson.dumps({**r, "timestamp": r["timestamp"] + 1_715_299_200_000}) + b"\n"
                               for r in rows))
    spec = preflight.load(options, "http://127.0.0.1:9")
    try:
        assert spec.total == 6 and spec.schedule.origin == 1_715_299_200.0  # rows every 0.1 s
    finally:
        spec.schedule.close()
        spec.claim.release()
    epoch = [orjson.loads(line) for line in trace.read_bytes().splitlines()]
    trace.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in [epoch[3], *epoch[:3], *epoch[4:]]))
    with pytest.raises(ValueError, match=r"--duration 0.55 without --start counts from the trace's first row .* not in "
                                         r"time order\): give --start"):
        preflight.load(options, "http://127.0.0.1:9")


def test_a_search_whose_probe_window_is_empty_names_the_probe_duration(tmp_path, toy_tokenizer_dir):
    """A search's probe replays --probe-duration seconds, not --duration: the refusal names the
    option the user must change."""
    options = options_for(tmp_path, toy_tokenizer_dir, capacity_search=True, slo="ttft_ms=100",
                          probe_duration=1.0, start=3600)
    with pytest.raises(ValueError, match=r"no rows to replay in the window \(--start 3600.*--probe-duration 1,"):
        preflight.load(options, "http://127.0.0.1:9")


def test_a_search_whose_lowest_probe_keeps_too_few_rows_is_refused(tmp_path, toy_tokenizer_dir):
    """Below 1x an amplify probe keeps a sample of whole sessions: at 0.05x of 12 rows, none. Such
    a probe waited for answers that never came, then the search said it was stopped."""
    options = options_for(tmp_path, toy_tokenizer_dir, capacity_search=True, slo="ttft_ms=100", probe_duration=1.0,
                          search_range="0.05:4")
    with pytest.raises(ValueError, match=r"--search-range 0.05:4: at 0.05x a probe replays \d rows of the window "
                                         r"\(--probe-duration 1\); judging its goodput takes at least 10"):
        preflight.load(options, "http://127.0.0.1:9")
    assert not lock_path(tmp_path / "run.jsonl").exists()


def test_the_server_check_off_asks_nothing(tmp_path, toy_tokenizer_dir):
    """--verify-server off asks no server to count; what each serves is checked all the same."""
    spec = preflight.load(options_for(tmp_path, toy_tokenizer_dir, verify_server="off"), "http://127.0.0.1:9")
    try:
        assert spec.served == (Served("http://127.0.0.1:9", problem="did not answer GET /v1/models "
                                                                    "(connection refused)"),)
        with pytest.raises(preflight.ServersRefused, match="^http://127.0.0.1:9 did not answer GET /v1/models"):
            preflight.check_servers(spec)
        serving = dataclasses.replace(spec, served=(Served("http://127.0.0.1:9", {"m": None}),))
        assert preflight.check_servers(serving) == {"skipped": "--verify-server off", "endpoints": []}
    finally:
        spec.schedule.close()
        spec.claim.release()

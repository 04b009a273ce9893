"""`--prompt-format token-ids`: completions prompts sent as token ids, against a real `replay sim`.

Why the option exists: a server whose tokenizer encodes text differently from the
tokenizer.json the replay was given counts a text prompt wrongly, but takes token ids as
they are. The sims here serve either the replay's own toy tokenizer or a second toy
tokenizer trained on other words (same vocabulary size, different merges), which stands in
for such a server: its text counts are far from the trace's, its token-id counts exact.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from replay.engine.options import ReplayOptions, add_arguments
from replay.results.metadata import read_run_metadata
from replay.results.records import RECORD_FIELDS
from replay.run.config import ConfigError, apply_config, load_config
from replay.sim.process import sim_process
from support.processes import replay_args, run_locust, run_replay
from support.records import check_records
from support.traces import BLOCK, mooncake_trace

SIM_FLAGS = ("--block-size", str(BLOCK), "--ttft-ms", "30", "--itl-ms", "2", "--prefill-ms-per-1k", "0")


@pytest.fixture(scope="session")
def other_tokenizer_dir(tmp_path_factory) -> Path:
    """A tokenizer the replay is not given: the toy one trained on other words (seed 1)."""
    from replay.synth.toy import build_toy_tokenizer

    return build_toy_tokenizer(tmp_path_factory.mktemp("other-tokenizer"), seed=1)


def replay(tmp_path: Path, trace: Path, tokenizer: Path, server_tokenizer: Path, name: str, *flags: str) -> Path:
    """One completions replay of `trace` against a fresh sim (a cold cache) serving `server_tokenizer`."""
    output = tmp_path / name / "run.jsonl"
    with sim_process(server_tokenizer, *SIM_FLAGS) as sim:
        run_locust(replay_args(trace, tokenizer, sim.url, output, "--api", "openai-completions", *flags), tmp_path)
    return output


def test_token_ids_count_and_cache_as_text_does(tmp_path, toy_tokenizer_dir):
    """With the server's own tokenizer both formats give every row its exact prompt and the
    same cached tokens (the ids are the ones the text encodes to); the run's metadata and the
    report's cache check both know the format."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=30, gap_ms=50)
    text = check_records(replay(tmp_path, trace, toy_tokenizer_dir, toy_tokenizer_dir, "text"), trace)
    output = replay(tmp_path, trace, toy_tokenizer_dir, toy_tokenizer_dir, "ids", "--prompt-format", "token-ids")
    ids = check_records(output, trace)  # every row ok, prompt_tokens == input_length
    cached = {r["request_id"]: r["cached_tokens"] for r in text}
    assert {r["request_id"]: r["cached_tokens"] for r in ids} == cached
    assert sum(cached.values()) > 0  # the trace's shared prefixes did hit
    meta = read_run_metadata(output)
    assert meta["options"]["prompt_format"] == "token-ids" and meta["api"] == "openai-completions"

    summary = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "replay", "report", str(output), "--server-block-size", str(BLOCK),
                           "--json", str(summary)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    cache = json.loads(summary.read_text())["cache"]
    assert "openai-completions token-id prompts" in cache["method"]
    assert cache["requests_matching"] == cache["requests_compared"] == len(ids)
    assert cache["requests_prompt_mismatch"] == 0


def test_token_ids_are_exact_whatever_the_server_tokenizer(tmp_path, toy_tokenizer_dir, other_tokenizer_dir):
    """Against a server with another tokenizer, text prompts miscount (the reason for the
    option; sent only with --verify-server off, which otherwise refuses that server) and
    token-id prompts still count exactly input_length."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=20, gap_ms=50)
    text = check_records(replay(tmp_path, trace, toy_tokenizer_dir, other_tokenizer_dir, "text",
                                "--verify-server", "off"), trace, exact_prompt=False)
    assert sum(r["prompt_tokens"] != r["input_length"] for r in text) > len(text) // 2
    output = replay(tmp_path, trace, toy_tokenizer_dir, other_tokenizer_dir, "ids", "--prompt-format", "token-ids")
    ids = check_records(output, trace)
    assert all(r["prompt_tokens"] == r["input_length"] for r in ids)
    assert sum(r["cached_tokens"] for r in ids) > 0


@pytest.mark.parametrize("api", ["openai-chat", "tgi"])
def test_token_ids_refused_with_other_apis(tmp_path, toy_tokenizer_dir, api):
    """Only the completions API takes a list of ids: refused on the master, one line, exit 2."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=3, gap_ms=10)
    args = replay_args(trace, toy_tokenizer_dir, "http://127.0.0.1:9", tmp_path / "run.jsonl", "--api", api,
                       "--prompt-format", "token-ids")
    proc = run_replay(args, tmp_path, 60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    message = f"replay: --prompt-format token-ids: only with --api openai-completions, not --api {api}"
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line or "Traceback" in line]
    assert len(errors) == 1 and errors[0].endswith(message), proc.stderr[-2000:]
    assert not (tmp_path / "run.jsonl").exists()


def test_prompt_format_config_key_and_plan(tmp_path):
    """`prompt-format` is a --replay-config key with the flag's choices, and it travels to
    workers in the plan (to_dict / from_dict)."""
    path = tmp_path / "run.yaml"
    path.write_text("api: openai-completions\nprompt-format: token-ids\n")
    assert load_config(path) == {"api": "openai-completions", "prompt_format": "token-ids"}
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--replay-config", str(path)]
    parsed = parser.parse_args(argv)
    apply_config(parsed, argv)
    options = ReplayOptions.from_parsed(parsed)
    assert options.prompt_format == "token-ids"
    assert ReplayOptions.from_dict(options.to_dict()).prompt_format == "token-ids"
    assert ReplayOptions().prompt_format == "text"

    path.write_text("prompt_format: ids\n")
    with pytest.raises(ConfigError, match="run.yaml:1: key 'prompt-format': 'ids' is not one of text, token-ids"):
        load_config(path)


def test_report_refuses_token_ids_with_another_api(tmp_path, toy_tokenizer_dir):
    """`replay report --prompt-format token-ids --api openai-chat` names both options (exit 2)."""
    results = tmp_path / "run.jsonl"
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=2, gap_ms=10)
    record = dict.fromkeys(RECORD_FIELDS)
    record.update(request_id=0, api="openai-chat", ok=True, status=200, sent_at=1.0, finished_at=2.0, e2e_ms=1000.0,
                  cached_tokens=0, prompt_tokens=20, input_length=20, output_tokens=3, output_length=3)
    results.write_text(json.dumps(record) + "\n")
    proc = subprocess.run([sys.executable, "-m", "replay", "report", str(results), "--trace", str(trace),
                           "--block-size", str(BLOCK), "--server-block-size", str(BLOCK), "--tokenizer",
                           str(toy_tokenizer_dir), "--prompt-format", "token-ids"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("replay report: --prompt-format token-ids: only with --api openai-completions, "
                                   "not --api openai-chat")

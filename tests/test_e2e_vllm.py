"""End to end against real vLLM on CPU: 150 real Mooncake rows, replayed by `locust --headless`,
reported by `replay report`.

The slice is the first 150 rows of ../shared/traces/mooncake_synthetic_trace.jsonl, rescaled
to 32-token blocks (vLLM's block size here), compressed to about 5 s of sends, outputs capped
at 32 tokens (the decode steps are most of vLLM's work on CPU; an exact output count proves as
much at 32 tokens as at 700). vLLM on CPU spends about a core for as long as any request is
in flight, so a shorter slice costs the suite less; vLLM queues the rest, and
its prefix cache registers a prompt's blocks as it schedules them, so the hits follow the
send order at any concurrency. The tiny model serves the Qwen2 tokenizer and chat template.

Why two runs: with Qwen2's chat template a chat prompt cannot be shorter than 13 tokens (an
empty system message, the user turn and the generation prompt), and after rescaling about a
third of these rows ask for 1..12. So the 100% assertions (prompt_tokens == input_length,
output_tokens == output_length, cached_tokens == expected) run on openai-completions, which
adds nothing to the text and is exact at any length; the chat run asserts exactness on every
row the template permits and that the others get the template's minimum.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from replay.results.metadata import read_run_metadata
from replay.results.records import read_records
from replay.synth.prompts import PromptSynthesizer
from replay.synth.tokenizer import ServerTokenizer
from support.paths import shared_path
from support.processes import run_locust
from support.records import check_answer_timing, counter_change, server_samples
from support.traces import mooncake_slice
from support.vllm import reset_prefix_cache

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(560)]

ROWS = 150
BLOCK = 32
TIME_SCALE = 9
MAX_OUTPUT = 32
# vLLM on 2 CPU cores shared with the rest of the suite can answer the slice's tail long after
# it was sent: the default 60 s drain timeout would fail rows this test is not about
DRAIN_TIMEOUT_S = 240
# vLLM busy prefilling on the same 2 cores answers /metrics slowly: a scrape's own limit is
# min(2 s, the interval), and every scrape must succeed here (check_server_metrics)
SCRAPE_S = 2.0


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    return shared_path("tokenizers", "qwen2")


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    return mooncake_slice(tmp_path_factory.mktemp("e2e"), ROWS, BLOCK, TIME_SCALE, MAX_OUTPUT)


def replay(url: str, trace: Path, tokenizer_dir: Path, api: str, output: Path, *extra: str) -> tuple[list[dict], str]:
    """The run's records and its end-of-run summary (stdout)."""
    reset_prefix_cache(url)
    proc = run_locust(["--headless", "--host", url, "--trace", str(trace), "--tokenizer", str(tokenizer_dir), "--api",
                       api, "--model", "tiny", "--output", str(output), "--loglevel", "INFO", "--drain-timeout",
                       str(DRAIN_TIMEOUT_S), "--server-metrics-interval", str(SCRAPE_S), *extra], output.parent, timeout=480)  # fmt: skip
    records = list(read_records(output))
    assert sorted(r["request_id"] for r in records) == list(range(ROWS))
    failed = [r for r in records if not r["ok"]]
    assert not failed, failed[:3]
    for r in records:  # vllm_qwen2 runs with --enable-per-request-metrics: every answer's own times
        check_answer_timing(r)
    # --verify-server (default auto): vLLM counted the sample exactly as the unchanged tokenizer does
    [check] = read_run_metadata(output)["server_check"]["endpoints"]
    assert check["ok"] and check["method"] == "tokenize" and check["prompts"] >= 20, check
    return records, proc.stdout


def report(results: Path, trace: Path, tokenizer_dir: Path) -> tuple[dict, str]:
    summary = results.with_suffix(".summary.json")
    proc = subprocess.run(
        [sys.executable, "-m", "replay", "report", str(results), "--trace", str(trace), "--server-block-size",
         str(BLOCK), "--tokenizer", str(tokenizer_dir), "--json", str(summary)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    print(proc.stdout)  # the summary block of a real run, for `pytest -s`
    return json.loads(summary.read_text()), proc.stdout


def check_cache_fidelity(summary: dict, text: str, records: list[dict]) -> None:
    cache = summary["cache"]
    assert cache["requests_compared"] == ROWS
    assert cache["requests_matching"] >= 0.99 * ROWS, cache["worst"]
    assert cache["requests_matching_share"] >= 0.99
    # the slice must really exercise the cache, or matching would prove nothing
    hits = [r for r in records if r["cached_tokens"]]
    assert len(hits) >= 5 and cache["expected_cached_tokens"] >= 5000
    assert cache["observed_cached_tokens"] == sum(r["cached_tokens"] for r in records)
    share = f"({100 * cache['requests_matching_share']:.2f}%)"
    assert f"Requests matching:                       {cache['requests_matching']} of {ROWS} {share}" in text
    assert "Prefix Cache Fidelity" in text


def check_server_metrics(url: str, results: Path, records: list[dict]) -> None:
    """vLLM's own counters over the run, scraped by the master, against the records. vLLM v1
    counts prefix_cache_queries (request.num_tokens) and prefix_cache_hits (the hit tokens) once
    per request, when the scheduler admits it (Scheduler.schedule -> record_prefix_cache_stats;
    a preempted request's second lookup is kept apart, in stats never exported), and exports them
    with each engine step's stats, so the change over the run equals the records' sums exactly."""
    samples = server_samples(results)
    assert samples and all(s["ok"] and s["endpoint"] == url for s in samples), samples[:2]
    assert samples[0]["t"] < min(r["sent_at"] for r in records)
    assert samples[-1]["t"] > max(r["finished_at"] for r in records)
    hits = counter_change(samples, url, "vllm:prefix_cache_hits_total")
    queries = counter_change(samples, url, "vllm:prefix_cache_queries_total")
    print(f"vLLM counters over the run: {hits:.0f} hit of {queries:.0f} queried tokens, "
          f"{counter_change(samples, url, 'vllm:num_preemptions_total'):.0f} preemptions, {len(samples)} samples")
    assert hits == sum(r["cached_tokens"] for r in records) > 0
    assert queries == sum(r["prompt_tokens"] for r in records)
    assert counter_change(samples, url, "vllm:prompt_tokens_total") == queries
    assert max(s["metrics"]["vllm:num_requests_running"] for s in samples) >= 1


def test_completions_replay_is_exact(vllm_qwen2, trace, tokenizer_dir, tmp_path):
    results = tmp_path / "completions.jsonl"
    records, end_of_run = replay(vllm_qwen2, trace, tokenizer_dir, "openai-completions", results,
                                 "--server-block-size", str(BLOCK))
    check_server_metrics(vllm_qwen2, results, records)
    wrong_prompt = [r for r in records if r["prompt_tokens"] != r["input_length"]]
    wrong_output = [r for r in records if r["output_tokens"] != r["output_length"]]
    assert not wrong_prompt, wrong_prompt[:3]
    assert not wrong_output, wrong_output[:3]
    summary, text = report(results, trace, tokenizer_dir)
    assert summary["requests_ok"] == ROWS and summary["requests_failed"] == 0
    check_cache_fidelity(summary, text, records)
    assert summary["cache"]["requests_prompt_mismatch"] == 0
    # the master's own summary carried the same fidelity section (--server-block-size)
    assert "Prefix Cache Fidelity" in end_of_run
    assert json.loads(Path(f"{results}.summary.json").read_text())["cache"] == summary["cache"]
    assert summary["server"]["endpoints"][vllm_qwen2]["prompt_tokens_difference"] == 0


def test_chat_replay_is_exact_where_the_template_permits(vllm_qwen2, trace, tokenizer_dir, tmp_path):
    synth = PromptSynthesizer(ServerTokenizer.load(tokenizer_dir), api="openai-chat", block_size=BLOCK)
    shortest = synth.min_overhead_tokens + 1  # one content token inside the smallest frame
    empty = synth.short_frame.empty_tokens if synth.short_frame else synth.frame.empty_tokens
    results = tmp_path / "chat.jsonl"
    records, _ = replay(vllm_qwen2, trace, tokenizer_dir, "openai-chat", results)
    long_enough = [r for r in records if r["input_length"] >= shortest]
    too_short = [r for r in records if r["input_length"] < shortest]
    print(f"chat: {len(long_enough)} rows of >= {shortest} tokens, {len(too_short)} shorter (the template's minimum "
          f"is {empty} tokens)")  # fmt: skip
    assert len(long_enough) > ROWS // 2
    assert [r for r in long_enough if r["prompt_tokens"] != r["input_length"]] == []
    # the rest get the template's minimum (an empty message), exactly as the synthesizer said
    assert [r for r in too_short if r["prompt_tokens"] != max(r["input_length"], empty)] == []
    assert [r for r in records if r["output_tokens"] != r["output_length"]] == []
    summary, text = report(results, trace, tokenizer_dir)
    check_cache_fidelity(summary, text, records)
    assert summary["cache"]["requests_prompt_mismatch"] == 0  # the expected prompts are what vLLM counted

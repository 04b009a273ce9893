"""The server's own times from real vLLM on CPU (`--enable-per-request-metrics`, the shared
`vllm_qwen2` server): every ok record carries them, the server's TTFT is within the client's, and
a burst of long prompts makes the queue grow and the summary put the TTFT's growth on it.

The prompts go as token ids (`--prompt-format token-ids`): vLLM's front end then tokenizes
nothing, so what the server's timing cannot see (the rest) is the network and the client, and
a burst's growth lands in the parts vLLM times. (With text prompts its front end tokenizes
3,200-token prompts one after another before its engine's queue: half of a burst's TTFT was
there, measured 2026-11-28, which an answer's timing counts in the rest and a trace span in
the server's own.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from replay.results.metadata import read_run_metadata
from replay.results.records import read_records
from replay.results.server_time import growth, largest_part, most_grown
from replay.rules.run_files import summary_path
from support.paths import shared_path
from support.processes import run_locust
from support.records import check_answer_timing
from support.vllm import reset_prefix_cache

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(400)]

BLOCK = 32
PROMPT_BLOCKS = 100  # 3,200 tokens: a prefill of a tenth of a second or more on CPU
IDLE_GAP_MS = 700  # longer than one request's whole answer: nothing waits
BURST = 12


def trace(path: Path, rows: int, gap_ms: float) -> Path:
    """`rows` prompts of PROMPT_BLOCKS blocks sharing none (no prefix cache hit), 4 output tokens."""
    with open(path, "w") as f:
        for i in range(rows):
            f.write(json.dumps({"timestamp": i * gap_ms, "input_length": PROMPT_BLOCKS * BLOCK, "output_length": 4,
                                "hash_ids": [100_000 * (i + 1) + k for k in range(PROMPT_BLOCKS)]}) + "\n")
    return path


def replay(url: str, tmp_path: Path, name: str, rows: int, gap_ms: float) -> tuple[list[dict], dict]:
    reset_prefix_cache(url)
    output = tmp_path / f"{name}.jsonl"
    run_locust(["--headless", "--host", url, "--trace", str(trace(tmp_path / f"{name}.trace.jsonl", rows, gap_ms)),
                "--block-size", str(BLOCK), "--tokenizer", str(shared_path("tokenizers", "qwen2")), "--api",
                "openai-completions", "--prompt-format", "token-ids", "--model", "tiny", "--output", str(output),
                "--loglevel", "INFO", "--drain-timeout", "120", "--check-server-timing"], tmp_path, timeout=300)  # fmt: skip
    assert list(read_run_metadata(output)["server_check"]["server_timing"].values()) == ["sent"]
    records = list(read_records(output))
    assert len(records) == rows
    for r in records:
        check_answer_timing(r)
    return records, json.loads(summary_path(output).read_text())["server_timing"]


def test_a_burst_of_long_prompts_queues_and_the_growth_is_the_queues(vllm_qwen2, tmp_path):
    _, idle = replay(vllm_qwen2, tmp_path, "idle", 4, IDLE_GAP_MS)
    records, burst = replay(vllm_qwen2, tmp_path, "burst", BURST, 0)
    assert idle["ttft_ms"]["queue"]["p99"] < 50, idle  # one at a time: nothing waits
    queues = sorted(r["server_queue_ms"] for r in records)
    assert queues[-1] > 4 * max(idle["ttft_ms"]["queue"]["p99"], 25), queues  # the burst waits, the last longest
    assert largest_part(burst["ttft_ms"]) == "queue", burst["ttft_ms"]["share"]
    grown = growth(idle["ttft_ms"], burst["ttft_ms"])
    assert most_grown(idle["ttft_ms"], burst["ttft_ms"]) == "queue", grown
    assert grown["queue"] > 0.5 * grown["client"], grown
    print(f"TTFT mean grew {grown['client']:.0f} ms: " + ", ".join(f"{k} {v:+.0f}" for k, v in grown.items()))

"""Cache fidelity: expected cached tokens from re-synthesized prompts, checked against a
token-level computation done here (longest common token prefix with any earlier prompt), and
a real replay against `replay sim` whose cache counts like vLLM's."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from replay.results.fidelity import check_cache, summarize_cache
from replay.results.records import RECORD_FIELDS, read_records
from replay.sim.process import sim_process
from replay.synth.prompts import PromptSynthesizer, encode_prompt
from replay.synth.tokenizer import ServerTokenizer
from replay.trace.record import TraceRow
from support.paths import shared_path
from support.processes import replay_args, run_locust
from support.traces import leading_common, mooncake_trace

TRACE_BLOCK = 16
T0 = 1_700_000_000.0


def make_rows(n: int = 40, seed: int = 1) -> list[TraceRow]:
    """Rows sharing 0..5 leading trace blocks with others, lengths on both sides of block edges."""
    rng = random.Random(seed)
    families = [[100 * f + k for k in range(6)] for f in range(4)]
    rows = []
    for i in range(n):
        shared = families[rng.randrange(4)][: rng.randint(0, 6)]
        ids = shared + [10_000 + 10 * i + k for k in range(rng.randint(0, 3))] or [10_000 + 10 * i]
        length = len(ids) * TRACE_BLOCK - rng.choice((0, 0, 1, 7, TRACE_BLOCK - 1))
        rows.append(TraceRow(request_id=i, timestamp_s=i * 0.01, input_length=length, output_length=4,
                             hash_ids=tuple(ids), line=i + 1))  # fmt: skip
    rows.append(TraceRow(request_id=n, timestamp_s=n * 0.01, input_length=3, output_length=4, hash_ids=(100,), line=n + 1))
    rows.append(TraceRow(request_id=n + 1, timestamp_s=n * 0.01, input_length=50, output_length=4, line=n + 2))
    return rows


def independent_expected(prompts: list[list[int]], block: int) -> list[int]:
    """vLLM's rule from first principles: whole blocks of the longest prefix shared with any
    earlier prompt, never covering the last token."""
    out = []
    for i, p in enumerate(prompts):
        shared = max((leading_common(p, q) for q in prompts[:i]), default=0)
        out.append(min(shared // block, (len(p) - 1) // block) * block)
    return out


def record(rid: int, sent_at: float | None, **fields) -> dict:
    r = {k: None for k in RECORD_FIELDS}
    r.update(request_id=rid, sent_at=sent_at, status=200 if sent_at else 0, ok=sent_at is not None, api="openai-chat")
    r.update(fields)
    return r


@pytest.fixture(params=["openai-chat", "openai-completions"])
def synth(request, toy_tokenizer_dir) -> PromptSynthesizer:
    return PromptSynthesizer(ServerTokenizer.load(toy_tokenizer_dir), api=request.param, block_size=TRACE_BLOCK)


@pytest.mark.parametrize("name", ["qwen2", "llama3", "llama2"])
@pytest.mark.parametrize("api", ["openai-chat", "openai-completions"])
def test_prompt_ids_are_what_the_server_encodes(name, api):
    tokenizer = ServerTokenizer.load(shared_path("tokenizers", name))
    synth = PromptSynthesizer(tokenizer, api=api, block_size=TRACE_BLOCK)
    for row in make_rows(25):
        assert synth.server_ids(row) == encode_prompt(synth.tokenizer, synth.prompt(row)), (name, api, row)


@pytest.mark.parametrize("server_block", [16, 32, 48])
def test_expected_matches_token_level_rule_in_send_order(synth, server_block):
    rows = make_rows()
    rng = random.Random(server_block)
    order = list(range(len(rows)))
    rng.shuffle(order)  # send order differs from request_id order
    sent_at = {rid: T0 + k * 0.05 for k, rid in enumerate(order)}
    prompts = {r.request_id: encode_prompt(synth.tokenizer, synth.prompt(r)) for r in rows}
    in_order = [prompts[rid] for rid in order]
    truth = dict(zip(order, independent_expected(in_order, server_block)))
    assert sum(1 for v in truth.values() if v) >= 10  # the rows exercise the cache

    records = [record(rid, sent_at[rid], cached_tokens=truth[rid], prompt_tokens=len(prompts[rid])) for rid in order]
    records.append(record(999, None))  # never sent: not compared, not cached
    wrong = order[-1], order[-3]
    for r in records:
        if r["request_id"] in wrong:
            r["cached_tokens"] += server_block
    checks = check_cache(records, {r.request_id: r for r in rows}, synth, server_block)
    assert [c.request_id for c in checks] == order
    assert {c.request_id: c.expected for c in checks} == truth
    section = summarize_cache(checks, "test")
    assert section["requests_compared"] == len(rows)
    assert section["requests_matching"] == len(rows) - 2
    assert section["requests_matching_share"] == pytest.approx((len(rows) - 2) / len(rows))
    assert section["expected_cached_tokens"] == sum(truth.values())
    assert section["observed_cached_tokens"] == sum(truth.values()) + 2 * server_block
    assert section["ratio"] == pytest.approx(section["observed_cached_tokens"] / section["expected_cached_tokens"])
    assert {w["request_id"] for w in section["worst"]} == set(wrong)
    assert section["requests_prompt_mismatch"] == 0


def test_failed_before_scheduling_does_not_feed_the_cache(synth):
    rows = [TraceRow(i, 0.0, 200, 4, hash_ids=tuple(range(13))) for i in range(3)]
    records = [
        record(0, T0, status=503, ok=False, error="HTTP 503"),  # refused: cached nothing
        record(1, T0 + 1, cached_tokens=0),
        record(2, T0 + 2, cached_tokens=999),
    ]
    checks = check_cache(records, {r.request_id: r for r in rows}, synth, 16)
    assert [c.request_id for c in checks] == [1, 2]
    prompt = len(synth.server_ids(rows[2]))
    assert checks[0].expected == 0 and checks[1].expected == (prompt - 1) // 16 * 16


def test_reorder_window_explains_near_simultaneous_sends(synth):
    rows = [TraceRow(i, 0.0, 160, 4, hash_ids=tuple(range(10))) for i in range(2)]
    full = (len(synth.server_ids(rows[0])) - 1) // 16 * 16
    # the server scheduled 1 before 0 although 0 left 1 ms earlier
    records = [record(0, T0, cached_tokens=full), record(1, T0 + 0.001, cached_tokens=0)]
    by_id = {r.request_id: r for r in rows}
    strict = summarize_cache(check_cache(records, by_id, synth, 16), "strict")
    assert strict["requests_matching"] == 0
    tolerant = check_cache(records, by_id, synth, 16, reorder_window_ms=5)
    assert all(c.explained for c in tolerant)
    assert summarize_cache(tolerant, "window")["requests_explained_by_reordering"] == 2
    assert not any(c.explained for c in check_cache(records, by_id, synth, 16, reorder_window_ms=0.5))


def test_rows_missing_from_trace_are_an_error(synth):
    with pytest.raises(ValueError, match="request_id 7"):
        check_cache([record(7, T0, cached_tokens=0)], {}, synth, 16)


def test_replay_against_sim_matches_exactly(tmp_path, toy_tokenizer_dir):
    """A real replay (locust) against `replay sim` with 32-token server blocks over a 16-token trace."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=40, gap_ms=30)
    output = tmp_path / "run.jsonl"
    with sim_process(toy_tokenizer_dir, "--block-size", "32", "--cache-blocks", "100000", "--ttft-ms", "20",
                     "--itl-ms", "1", "--prefill-ms-per-1k", "0") as sim:  # fmt: skip
        run_locust(replay_args(trace, toy_tokenizer_dir, sim.url, output), tmp_path)
    records = list(read_records(output))
    summary = tmp_path / "summary.json"
    proc = subprocess.run([sys.executable, "-m", "replay", "report", str(output), "--trace", str(trace),
                           "--block-size", "16", "--server-block-size", "32", "--tokenizer", str(toy_tokenizer_dir),
                           "--json", str(summary)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    cache = json.loads(summary.read_text())["cache"]
    assert cache["requests_compared"] == 40
    assert cache["requests_matching"] == 40, cache["worst"]
    assert cache["expected_cached_tokens"] == sum(r["cached_tokens"] for r in records) > 0
    assert "Requests matching:                       40 of 40 (100.00%)" in proc.stdout

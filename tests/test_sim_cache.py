"""The sim's prefix cache and engine decisions, in-process (no HTTP)."""

from __future__ import annotations

import pytest

from replay.sim.cache import BlockPool, block_hashes, hit_tokens
from replay.sim.engine import Engine
from replay.sim.options import SimOptions, validate


def run(pool: BlockPool, prompt: list[int], output: int = 1) -> int:
    """One request from start to end (none other running): its cached tokens."""
    size = pool.block_size
    hit, blocks = pool.allocate(block_hashes(prompt, size), len(prompt), output)
    pool.free(blocks)
    return hit_tokens(hit, size, len(prompt))


def cached(pool: BlockPool, prompt: list[int]) -> int:
    return hit_tokens(pool.hit_blocks(block_hashes(prompt, pool.block_size), len(prompt)), pool.block_size, len(prompt))


def test_whole_blocks_and_last_token_rule():
    pool = BlockPool(block_size=32, num_gpu_blocks=1000)
    prompt = list(range(1978))
    assert run(pool, prompt) == 0
    # vLLM on CPU: the same 1978-token prompt twice reports 1952 cached tokens at block size 32.
    assert run(pool, prompt) == 1952
    # A prompt of exactly two blocks can hit only one: the last token is always computed.
    two_blocks = list(range(64))
    assert run(pool, two_blocks) == 32
    assert run(pool, list(range(65))) == 64


def test_chain_hash_needs_the_whole_prefix():
    pool = BlockPool(block_size=4, num_gpu_blocks=1000)
    run(pool, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    # Same second block after a different first block: no hit at all.
    assert cached(pool, [0, 0, 0, 0, 5, 6, 7, 8, 9]) == 0
    # Shared first block only.
    assert cached(pool, [1, 2, 3, 4, 0, 6, 7, 8, 9]) == 4
    assert block_hashes([1, 2, 3, 4, 5], 4) == block_hashes([1, 2, 3, 4, 6], 4)
    assert len(block_hashes(list(range(11)), 4)) == 2


def test_lru_evicts_tail_blocks_first():
    # 5 blocks (vLLM's null block aside); a request of 4 full prompt blocks and 1 more token,
    # with 1 output token, holds 5: its 4 prompt blocks and 1 for the last token and the output.
    pool = BlockPool(block_size=2, num_gpu_blocks=6)
    a = [1, 1, 2, 2, 3, 3, 4, 4, 9]
    run(pool, a)
    assert cached(pool, a) == 8 and len(pool) == 4
    run(pool, [7, 7, 9])  # 2 blocks: the free queue's head is a's last blocks (freed first)
    assert cached(pool, a) == 6
    run(pool, [5, 5, 6, 6, 8, 8, 9])  # 4 blocks: a's remaining ones go, head last
    assert cached(pool, a) == 0
    assert cached(pool, [7, 7, 9]) == 2


def test_zero_capacity_never_hits():
    for blocks in (0, 1):  # 1: only vLLM's null block
        pool = BlockPool(block_size=2, num_gpu_blocks=blocks)
        run(pool, [1, 2, 3, 4, 5])
        assert run(pool, [1, 2, 3, 4, 5]) == 0


@pytest.fixture
def engine(toy_tokenizer_dir):
    return Engine(SimOptions(tokenizer=str(toy_tokenizer_dir), block_size=4, seed=7, eos_prob=0.2))


def test_output_is_seeded_and_respects_ignore_eos(engine, toy_tokenizer_dir):
    prompt = list(range(10, 30))
    exact = engine.schedule(prompt, 50, ignore_eos=True)
    assert exact.completion_tokens == 50 and exact.finish_reason == "length"
    early = [engine.schedule(prompt, 50, ignore_eos=False, min_tokens=3) for _ in range(20)]
    assert all(3 < p.completion_tokens <= 50 for p in early)
    assert any(p.finish_reason == "stop" and p.completion_tokens < 50 for p in early)
    again = Engine(SimOptions(tokenizer=str(toy_tokenizer_dir), block_size=4, seed=7, eos_prob=0.2))
    replay = [again.schedule(prompt, 50, ignore_eos=True)] + [again.schedule(prompt, 50, False, 3) for _ in range(20)]
    assert [p.token_ids for p in replay] == [exact.token_ids] + [p.token_ids for p in early]


def test_latency_plan_follows_the_model(toy_tokenizer_dir):
    opts = SimOptions(tokenizer=str(toy_tokenizer_dir), block_size=10, ttft_ms=30, prefill_ms_per_1k=100,
                      itl_ms=5, stall_ms=7)
    engine = Engine(opts)
    prompt = list(range(2000))
    cold = engine.schedule(prompt, 4, ignore_eos=True)
    assert cold.ttft_s == pytest.approx((30 + 100 * 2.0 + 7) / 1000)
    warm = engine.schedule(prompt, 4, ignore_eos=True)
    assert warm.cached_tokens == 1990
    assert warm.ttft_s == pytest.approx((30 + 100 * 0.010 + 7) / 1000)
    assert warm.itl_s == [0.005] * 3
    jittery = Engine(SimOptions(tokenizer=str(toy_tokenizer_dir), ttft_ms=100, itl_ms=10, jitter=0.5))
    plan = jittery.schedule(list(range(20)), 200, ignore_eos=True)
    assert all(0.005 <= g <= 0.015 for g in plan.itl_s)
    assert len(set(plan.itl_s)) > 100


def test_options_are_validated(toy_tokenizer_dir):
    with pytest.raises(ValueError, match="--error-rate"):
        validate(SimOptions(tokenizer=str(toy_tokenizer_dir), error_rate=1.5))
    with pytest.raises(ValueError, match="--block-size"):
        validate(SimOptions(tokenizer=str(toy_tokenizer_dir), block_size=0))

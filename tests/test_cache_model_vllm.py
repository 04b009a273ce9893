"""The cache model against real vLLM on CPU with a cache small enough to evict: a trace with heavy
prefix reuse, replayed by `locust --headless`; the model (replay/results/cache_model.py, vLLM's
block pool at the block size and pool size its /metrics state) predicts the observed cached
tokens for >= 95% of requests and names a cause for every miss.

The pool: VLLM_CPU_KVCACHE_SPACE is whole GiB (1 GiB holds 131072 blocks of this tiny model),
so `--num-gpu-blocks-override 40` makes it small; vLLM's CPU attention takes blocks of a
multiple of 32 tokens. The server is this module's own (its own SERIAL_GROUPS group).
"""

from __future__ import annotations

import pytest

from support.cache_model import reuse_trace, run_verdicts
from support.paths import shared_path
from support.processes import run_locust
from support.vllm import make_tiny_model, require_vllm, reset_prefix_cache, vllm_server

# alone: the model's start times come from the run's timing, which the other tests' load skews
# (0.875 exact beside them in a clean-clone run, 0.96-1.0 alone)
pytestmark = [pytest.mark.vllm, pytest.mark.alone, pytest.mark.timeout(400)]

BLOCKS = 40
BLOCK = 32


@pytest.fixture(scope="module")
def small_cache_vllm(tmp_path_factory):
    require_vllm()
    model = make_tiny_model(shared_path("tokenizers", "qwen2"), tmp_path_factory.mktemp("tiny-qwen2"), max_model_len=1024)
    with vllm_server(model, block_size=BLOCK, kv_cache_gib=1, max_model_len=1024,
                     extra_args=("--num-gpu-blocks-override", str(BLOCKS), "--max-num-seqs", "16")) as url:
        yield url


def test_the_model_predicts_real_vllms_evictions(small_cache_vllm, tmp_path):
    tokenizer = shared_path("tokenizers", "qwen2")
    trace = reuse_trace(tmp_path / "trace.jsonl", rows=160, families=16, gap_ms=20)
    output = tmp_path / "run.jsonl"
    reset_prefix_cache(small_cache_vllm)
    run_locust(["--headless", "--host", small_cache_vllm, "--trace", str(trace), "--block-size", "16", "--tokenizer",
                str(tokenizer), "--model", "tiny", "--output", str(output), "--only-summary"], tmp_path, timeout=300)
    verdicts, section, caches = run_verdicts(output, tokenizer)
    assert list(caches.values()) == [{"block_size": BLOCK, "num_gpu_blocks": BLOCKS, "source": "server"}]
    assert section["requests_compared"] == 160
    assert section["exact_share"] >= 0.95, [v for v in verdicts if not v.exact]
    assert section["misses"] > 0 and section["misses_attributed_share"] == 1.0, section["miss_causes"]
    assert section["miss_causes"]["evicted"]["requests"] > 0 and "unexplained" not in section["miss_causes"]

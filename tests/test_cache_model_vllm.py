"""The cache model against real vLLM on CPU with a cache small enough to evict: a trace with heavy
prefix reuse, replayed by `locust --headless`; the model (replay/results/cache_model.py, vLLM's
block pool at the block size and pool size its /metrics state) predicts the observed cached
tokens for >= 95% of requests and names a cause for every miss.

The server (support.vllm.small_cache_vllm) is this module's own (its own SERIAL_GROUPS group);
`make test` starts it ahead, while the parallel tests run (tests/support/serve_vllm.py), so this
alone test does not wait for its start.
"""

from __future__ import annotations

import pytest

from support.cache_model import reuse_trace, run_verdicts
from support.paths import shared_path
from support.processes import run_locust
from support.vllm import (
    SMALL_CACHE_BLOCK,
    SMALL_CACHE_BLOCKS,
    SMALL_CACHE_ENV,
    require_vllm,
    reset_prefix_cache,
    small_cache_vllm,
    started_ahead,
)

# alone: the model's start times come from the run's timing, which the other tests' load skews
# (0.875 exact beside them in a clean-clone run, 0.96-1.0 alone)
pytestmark = [pytest.mark.vllm, pytest.mark.alone, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def small_cache_url(tmp_path_factory):
    require_vllm()
    shared_path("tokenizers", "qwen2")  # the skip that says why, where it is missing
    url = started_ahead(SMALL_CACHE_ENV)
    if url:
        yield url
        return
    with small_cache_vllm(tmp_path_factory.mktemp("tiny-qwen2")) as url:
        yield url


def test_the_model_predicts_real_vllms_evictions(small_cache_url, tmp_path):
    tokenizer = shared_path("tokenizers", "qwen2")
    trace = reuse_trace(tmp_path / "trace.jsonl", rows=160, families=16, gap_ms=20)
    output = tmp_path / "run.jsonl"
    reset_prefix_cache(small_cache_url)
    run_locust(["--headless", "--host", small_cache_url, "--trace", str(trace), "--block-size", "16", "--tokenizer",
                str(tokenizer), "--model", "tiny", "--output", str(output), "--only-summary"], tmp_path, timeout=300)
    verdicts, section, caches = run_verdicts(output, tokenizer)
    assert list(caches.values()) == [{"block_size": SMALL_CACHE_BLOCK, "num_gpu_blocks": SMALL_CACHE_BLOCKS,
                                      "source": "server"}]
    assert section["requests_compared"] == 160
    assert section["exact_share"] >= 0.95, [v for v in verdicts if not v.exact]
    assert section["misses"] > 0 and section["misses_attributed_share"] == 1.0, section["miss_causes"]
    assert section["miss_causes"]["evicted"]["requests"] > 0 and "unexplained" not in section["miss_causes"]
    # real vLLM's usage is what its /metrics counters count: the certificate takes it as evidence
    import json

    from replay.rules.run_files import fidelity_path

    usage = json.loads(fidelity_path(output).read_text())["usage"]
    assert {name: figure["status"] for name, figure in usage.items()} == {"prompt_tokens": "agrees",
                                                                          "cached_tokens": "agrees"}, usage

"""--verify-server against real vLLM on CPU: the case that made it necessary.

Llama 3's tokenizer.json is a byte-level BPE. With `"tokenizer_class": "LlamaTokenizerFast"` in
its tokenizer_config.json, vLLM (transformers 5) builds a LlamaTokenizer from the files that
splits text otherwise (`" in is the"` becomes `in`, `ist`, `he`), so text prompts synthesized
for tokenizer.json arrive hundreds of tokens off while every request succeeds. The check must
refuse that server before any trace request; token-id prompts must then run exact. (The same
tokenizer served unchanged passes the check: tests/test_e2e_vllm.py asserts it on every run.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests

from replay.results.records import read_records
from support.paths import shared_path
from support.processes import run_locust
from support.traces import mooncake_slice
from support.vllm import make_tiny_model, metric_total, require_vllm, vllm_server

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(560)]

ROWS = 40
BLOCK = 32
MAX_OUTPUT = 32  # the prompts are on trial here, not the outputs


@pytest.fixture(scope="module")
def llama3_dir() -> Path:
    return shared_path("tokenizers", "llama3")


@pytest.fixture(scope="module")
def vllm_llamatokenizer(llama3_dir, tmp_path_factory):
    """vLLM serving the Llama 3 tokenizer with that one line changed in tokenizer_config.json."""
    require_vllm()
    model = make_tiny_model(llama3_dir, tmp_path_factory.mktemp("tiny-llama3-class"))
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "LlamaTokenizerFast"
    (model / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    with vllm_server(model, block_size=BLOCK, kv_cache_gib=1) as url:
        yield url


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    return mooncake_slice(tmp_path_factory.mktemp("verify"), ROWS, BLOCK, 20, MAX_OUTPUT)


def args(url: str, trace: Path, tokenizer: Path, output: Path, *extra: str) -> list[str]:
    return ["--headless", "--host", url, "--trace", str(trace), "--tokenizer", str(tokenizer), "--model", "tiny",
            "--output", str(output), "--loglevel", "INFO", "--drain-timeout", "240", *extra]


def served_prompt_tokens(url: str) -> float:
    return metric_total(requests.get(f"{url}/metrics", timeout=10).text, "vllm:prompt_tokens_total") or 0.0


@pytest.mark.parametrize("api", ["openai-completions", "openai-chat"])
def test_the_changed_tokenizer_class_is_refused_before_any_request(vllm_llamatokenizer, trace, llama3_dir,
                                                                 tmp_path, api):
    before = served_prompt_tokens(vllm_llamatokenizer)
    output = tmp_path / "run.jsonl"
    proc = run_locust(args(vllm_llamatokenizer, trace, llama3_dir, output, "--api", api), tmp_path, timeout=300,
                      exit_code=2)
    assert served_prompt_tokens(vllm_llamatokenizer) == before  # nothing was generated
    assert not output.exists()
    err = proc.stderr
    print(err[err.find("does not count"):][:3000])  # the refusal as a user sees it, for `pytest -s`
    assert f"{vllm_llamatokenizer} does not count prompts as --tokenizer {llama3_dir} does" in err
    assert "asked by POST /tokenize" in err and "first difference at token" in err
    assert "likely cause: the server's tokens carry no space marker where this tokenizer's do" in err
    assert "tokenizer_class such as LlamaTokenizerFast" in err


def test_token_id_prompts_then_run_exact(vllm_llamatokenizer, trace, llama3_dir, tmp_path):
    output = tmp_path / "run.jsonl"
    run_locust(args(vllm_llamatokenizer, trace, llama3_dir, output, "--api", "openai-completions",
                    "--prompt-format", "token-ids"), tmp_path, timeout=480)
    records = list(read_records(output))
    assert sorted(r["request_id"] for r in records) == list(range(ROWS))
    assert all(r["ok"] for r in records), [r for r in records if not r["ok"]][:3]
    assert all(r["prompt_tokens"] == r["input_length"] for r in records), \
        [(r["request_id"], r["prompt_tokens"], r["input_length"]) for r in records if r["prompt_tokens"] != r["input_length"]]

"""`replay prompts check` as a user runs it: a real process, real files, exit codes."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

from support.paths import REPO, shared_path


def run_check(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "replay", "prompts", "check", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=120)


def write_trace(path, lengths: list[int], block: int = 512) -> str:
    lines = []
    for i, length in enumerate(lengths):
        blocks = -(-length // block)
        hash_ids = [0] + [100 * i + k for k in range(1, blocks)] if blocks else []
        record = {"timestamp": i * 10, "input_length": length, "output_length": 5, "hash_ids": hash_ids}
        lines.append(orjson.dumps(record))
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


@pytest.mark.parametrize("api", ["openai-chat", "openai-completions"])
def test_all_exact_exits_0_with_the_json_totals(tmp_path, toy_tokenizer_dir, api):
    trace = write_trace(tmp_path / "t.jsonl", [700, 1500, 40, 513, 2048, 100, 1024])
    done = run_check("--trace", trace, "--tokenizer", str(toy_tokenizer_dir), "--api", api, "--json")
    assert done.returncode == 0, done.stderr
    result = orjson.loads(done.stdout)
    assert result["requests"] == result["exact"] == 7
    assert result["max_abs_error"] == 0 and result["mismatches"] == [] and result["warnings"] == 0
    assert result["tokenizer"] == str(toy_tokenizer_dir) and result["block_size"] == 512
    assert result["template_overhead_tokens"] == (14 if api == "openai-chat" else 0)
    assert result["elapsed_s"] >= 0


def test_rows_shorter_than_the_template_exit_1_and_are_listed(tmp_path, toy_tokenizer_dir):
    trace = write_trace(tmp_path / "t.jsonl", [600, 3, 900, 5])
    done = run_check("--trace", trace, "--tokenizer", str(toy_tokenizer_dir), "--json")
    assert done.returncode == 1
    result = orjson.loads(done.stdout)
    assert result["requests"] == 4 and result["exact"] == 2 and result["warnings"] == 2
    assert [(m["request_id"], m["line"], m["input_length"]) for m in result["mismatches"]] == [(1, 2, 3), (3, 4, 5)]
    assert result["max_abs_error"] == 14 - 3
    text = run_check("--trace", trace, "--tokenizer", str(toy_tokenizer_dir), "--limit", "2", "--verbose")
    assert text.returncode == 1
    assert "requests         2" in text.stdout
    assert "request 1 (line 2): input_length 3, server counts 14 (+11)" in text.stdout


def test_block_size_to_rescales_lengths(tmp_path, toy_tokenizer_dir):
    trace = write_trace(tmp_path / "t.jsonl", [5000, 3000, 1200])
    done = run_check(
        "--trace", trace, "--tokenizer", str(toy_tokenizer_dir), "--api", "tgi", "--block-size-to", "32", "--json"
    )
    assert done.returncode == 0, done.stderr
    result = orjson.loads(done.stdout)
    assert result["block_size"] == 32 and result["exact"] == 3


def test_bad_inputs_exit_2_naming_the_problem(tmp_path, toy_tokenizer_dir):
    good = write_trace(tmp_path / "t.jsonl", [600])
    missing = run_check("--trace", good, "--tokenizer", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "tokenizer not found" in missing.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2, 3]}\n')
    broken = run_check("--trace", str(bad), "--tokenizer", str(toy_tokenizer_dir))
    assert broken.returncode == 2 and f"{bad}:1" in broken.stderr and "hash_ids" in broken.stderr


def test_mooncake_rows_on_qwen2_chat_are_exact():
    trace = shared_path("traces", "mooncake_synthetic_trace.jsonl")
    qwen2 = shared_path("tokenizers", "qwen2")
    done = run_check("--trace", str(trace), "--tokenizer", str(qwen2), "--limit", "12", "--json")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr
    result = orjson.loads(done.stdout)
    assert result["requests"] == result["exact"] == 12 and result["template_overhead_tokens"] == 29


def test_a_row_the_template_refuses_exits_2_naming_row_and_template(tmp_path, toy_tokenizer_dir):
    template = tmp_path / "roles.jinja"
    template.write_text("{% for m in messages %}\n{% if m.role == 'tool' %}{{ raise_exception('no tool turns') }}"
                        "{% endif %}{{ m.content }}{% endfor %}")
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": 0, "messages": [{"role": "user", "content": "hi"}], "output_length": 1},
            {"timestamp": 1, "messages": [{"role": "tool", "content": "x"}], "output_length": 1}]
    trace.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    done = run_check("--trace", str(trace), "--tokenizer", str(toy_tokenizer_dir), "--chat-template", str(template))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr == f"error: row 1 (trace line 2): chat template {template}, template line 2: no tool turns\n"


def test_rows_of_their_own_messages_and_no_length_are_not_compared(tmp_path, toy_tokenizer_dir):
    """AIPerf's `text_input` and `messages` rows give their prompt and no input_length: there is
    no length to match, so they are rendered (a template that refuses one still fails) and
    counted apart, and the check passes; a row that says its length is still compared."""
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": 0, "text_input": "What is the capital of France?", "output_length": 5},
            {"timestamp": 1, "messages": [{"role": "user", "content": "hi there"}], "output_length": 5},
            {"timestamp": 2, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}]
    trace.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    done = run_check("--trace", str(trace), "--tokenizer", str(toy_tokenizer_dir), "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    result = orjson.loads(done.stdout)
    assert (result["requests"], result["exact"], result["unsaid"], result["mismatches"]) == (3, 1, 2, [])
    text = run_check("--trace", str(trace), "--tokenizer", str(toy_tokenizer_dir))
    assert "own messages     2 (rows that give their own prompt: sent as they are, not compared)" in text.stdout

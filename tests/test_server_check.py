"""--verify-server and `replay prompts check --server`: the server counts a sample of prompts as
the tokenizer does, or nothing of the trace is sent.

A server that tokenizes otherwise is a real `replay sim` serving a tokenizer.json whose
normalizer removes spaces: the same vocabulary and ids, text split otherwise, as vLLM does
with a byte-level tokenizer.json loaded as LlamaTokenizer (tests/test_verify_vllm.py has that
real case). `--no-tokenize-endpoint` makes the sim a server without POST /tokenize.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from replay.rules.run_files import meta_path
from replay.sim.process import sim_process
from replay.synth.prompts import PromptSynthesizer
from replay.synth.server_check import MAX_SAMPLE_TOKENS, TOKENIZE, build_samples, check_server
from replay.synth.tokenizer import ServerTokenizer
from support.paths import REPO
from support.ports import free_port
from support.processes import replay_args, run_locust
from support.records import check_records
from support.traces import mooncake_trace

ROWS = 40


def spaceless_tokenizer(source: Path, folder: Path) -> Path:
    """`source`'s tokenizer with a normalizer that drops every space: same ids, other counts."""
    shutil.copytree(source, folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "Replace", "pattern": {"String": " "}, "content": ""}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


@pytest.fixture(scope="module")
def other_tokenizer_dir(toy_tokenizer_dir, tmp_path_factory) -> Path:
    return spaceless_tokenizer(toy_tokenizer_dir, tmp_path_factory.mktemp("spaceless") / "tok")


@pytest.fixture
def trace(tmp_path) -> Path:
    return mooncake_trace(tmp_path / "trace.jsonl", ROWS, gap_ms=5)


def sim_with(tokenizer: Path, *args: str):
    return sim_process(tokenizer, "--block-size", "16", "--ttft-ms", "5", "--itl-ms", "1", *args)


def generation_requests(url: str) -> int:
    """Generation requests the sim has seen (its ledger counts every one at arrival)."""
    return requests.get(f"{url}/debug/requests", timeout=10).json()["total"]


def server_check(output: Path) -> dict:
    return json.loads(meta_path(output).read_text())["server_check"]


@pytest.mark.parametrize("api", ["openai-chat", "openai-completions"])
def test_a_server_that_counts_alike_is_checked_then_replayed(api, toy_tokenizer_dir, trace, tmp_path):
    output = tmp_path / "run.jsonl"
    with sim_with(toy_tokenizer_dir) as sim:
        run_locust(replay_args(trace, toy_tokenizer_dir, sim.url, output, "--api", api), tmp_path)
        assert generation_requests(sim.url) == ROWS  # the check asked /tokenize, never generated
    check_records(output, trace)
    [endpoint] = server_check(output)["endpoints"]
    assert endpoint["ok"] and endpoint["method"] == "tokenize" and endpoint["mismatches"] == 0
    assert endpoint["prompts"] >= 5 and endpoint["tokens"] > 0


@pytest.mark.parametrize("api", ["openai-chat", "openai-completions"])
def test_a_server_that_tokenizes_otherwise_is_refused_before_any_request(api, toy_tokenizer_dir,
                                                                        other_tokenizer_dir, trace, tmp_path):
    output = tmp_path / "run.jsonl"
    with sim_with(other_tokenizer_dir) as sim:
        proc = run_locust(replay_args(trace, toy_tokenizer_dir, sim.url, output, "--api", api), tmp_path,
                          exit_code=2)
        assert generation_requests(sim.url) == 0
    err = proc.stderr
    assert f"{sim.url} does not count prompts as --tokenizer {toy_tokenizer_dir} does" in err
    assert "tokens here," in err and "on the server" in err
    assert "first difference at token" in err
    assert "likely cause: the server's tokens carry no space marker where this tokenizer's do" in err
    assert "no request of the trace was sent" in err
    assert ("--prompt-format token-ids" in err) == (api == "openai-completions")
    assert not output.exists()


def test_token_id_prompts_are_exact_against_that_server(toy_tokenizer_dir, other_tokenizer_dir, trace, tmp_path):
    output = tmp_path / "run.jsonl"
    with sim_with(other_tokenizer_dir) as sim:
        run_locust(replay_args(trace, toy_tokenizer_dir, sim.url, output, "--api", "openai-completions",
                               "--prompt-format", "token-ids"), tmp_path)
    check_records(output, trace)  # every prompt_tokens == input_length: the ids are counted as given
    assert server_check(output)["skipped"].startswith("--prompt-format token-ids")


def test_without_tokenize_the_usage_counts_are_checked(toy_tokenizer_dir, other_tokenizer_dir, trace, tmp_path):
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    with sim_with(toy_tokenizer_dir, "--no-tokenize-endpoint") as sim:
        run_locust(replay_args(trace, toy_tokenizer_dir, sim.url, good), tmp_path)
    check_records(good, trace)
    [endpoint] = server_check(good)["endpoints"]
    assert endpoint["ok"] and endpoint["method"] == "usage"
    with sim_with(other_tokenizer_dir, "--no-tokenize-endpoint") as sim:
        proc = run_locust(replay_args(trace, toy_tokenizer_dir, sim.url, bad), tmp_path, exit_code=2)
    assert "asked by usage.prompt_tokens" in proc.stderr and "likely cause:" in proc.stderr


def test_a_server_with_no_way_to_count_is_skipped_by_auto_and_refused_by_require(toy_tokenizer_dir, trace,
                                                                                tmp_path):
    """TGI's protocol reports no prompt count, and this sim has no /tokenize."""
    auto, require = tmp_path / "auto.jsonl", tmp_path / "require.jsonl"
    with sim_with(toy_tokenizer_dir, "--no-tokenize-endpoint") as sim:
        proc = run_locust(replay_args(trace, toy_tokenizer_dir, sim.url, auto, "--api", "tgi"), tmp_path)
        assert "not checked" in proc.stderr
        [endpoint] = server_check(auto)["endpoints"]
        assert endpoint["method"] is None and not endpoint["ok"] and "no POST /tokenize" in endpoint["note"]
        seen = generation_requests(sim.url)
        proc = run_locust(replay_args(trace, toy_tokenizer_dir, sim.url, require, "--api", "tgi",
                                      "--verify-server", "require"), tmp_path, exit_code=2)
        assert generation_requests(sim.url) == seen
    assert f"--verify-server require: {sim.url} offers no way to count prompts" in proc.stderr
    check_records(auto, trace, exact_prompt=False)  # tgi records carry no prompt count


def test_fleet_every_endpoint_is_checked(toy_tokenizer_dir, other_tokenizer_dir, trace, tmp_path):
    """One server of two tokenizes otherwise: the run is refused, naming that one."""
    output = tmp_path / "run.jsonl"
    with sim_with(toy_tokenizer_dir) as good, sim_with(other_tokenizer_dir) as bad:
        args = replay_args(trace, toy_tokenizer_dir, good.url, output, "--endpoints", f"{good.url},{bad.url}")
        proc = run_locust(args, tmp_path, exit_code=2)
        assert generation_requests(good.url) == generation_requests(bad.url) == 0
    assert f"{bad.url} does not count prompts" in proc.stderr


def prompts_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replay", "prompts", "check", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_prompts_check_server(toy_tokenizer_dir, other_tokenizer_dir, trace):
    base = ["--trace", str(trace), "--block-size", "16", "--tokenizer", str(toy_tokenizer_dir), "--model", "sim"]
    with sim_with(toy_tokenizer_dir) as good, sim_with(other_tokenizer_dir) as bad:
        ok = prompts_check(*base, "--server", good.url)
        differs = prompts_check(*base, "--server", bad.url, "--json")
    assert ok.returncode == 0, ok.stderr
    assert f"server           {good.url}: all " in ok.stdout and "counted as here (by tokenize)" in ok.stdout
    assert differs.returncode == 1, differs.stderr
    [server] = json.loads(differs.stdout)["servers"]
    assert not server["ok"] and server["mismatches"] > 0 and "likely cause:" in server["explanation"]
    unreachable = prompts_check(*base, "--server", f"http://127.0.0.1:{free_port()}")
    assert unreachable.returncode == 2 and "cannot be asked: no answer" in unreachable.stdout


def test_the_sample_stays_under_its_cap_and_the_servers_context(toy_tokenizer_dir):
    """A window's row longer than MAX_SAMPLE_TOKENS (or than the server's context) is not asked:
    its prompt is built the same way as the shorter ones, and one of them is asked instead."""
    synth = PromptSynthesizer(ServerTokenizer.load(toy_tokenizer_dir), "openai-completions", block_size=16)
    over, under = MAX_SAMPLE_TOKENS + 1000, 3000
    lengths = {len(s.ids) for s in build_samples(synth, (under, over))}
    assert under in lengths and over not in lengths and max(lengths) < MAX_SAMPLE_TOKENS
    small = build_samples(synth, (under,), max_len=512)
    assert max(len(s.ids) for s in small) < 512 and under not in {len(s.ids) for s in small}


def test_the_check_asks_every_sample_on_one_connection(toy_tokenizer_dir, monkeypatch):
    """A connect and a close per sample cost the master as much CPU as the question itself."""
    import http.client

    connects = []
    real = http.client.socket.create_connection
    monkeypatch.setattr(http.client.socket, "create_connection", lambda *a, **k: connects.append(a) or real(*a, **k))
    synth = PromptSynthesizer(ServerTokenizer.load(toy_tokenizer_dir), "openai-completions", block_size=16)
    samples = build_samples(synth, (300,))
    with sim_with(toy_tokenizer_dir) as sim:
        check = check_server(sim.url, samples, "openai-completions", "sim")
    assert check.ok and check.method == TOKENIZE and check.prompts == len(samples) > 5
    assert len(connects) == 1


@pytest.mark.parametrize("limit_from", ["option", "server"])
def test_a_run_whose_every_row_is_over_the_prompt_limit_is_refused(toy_tokenizer_dir, trace, tmp_path, limit_from):
    """Nothing would be sent: refused before the server check (which, its sample capped at one
    token, asked /tokenize once per word of the vocabulary: 41,547 requests for qwen2's). The
    limit is --max-prompt-tokens, or the served model's context (max_model_len)."""
    output = tmp_path / "run.jsonl"
    option, server = (["--max-prompt-tokens", "1"], []) if limit_from == "option" else ([], ["--max-model-len", "1"])
    with sim_with(toy_tokenizer_dir, *server) as sim:
        proc = run_locust(replay_args(trace, toy_tokenizer_dir, sim.url, output, *option), tmp_path, exit_code=2)
        assert generation_requests(sim.url) == 0
    lines = [line for line in proc.stderr.splitlines() if "replay: " in line]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    shortest = min(json.loads(line)["input_length"] for line in trace.read_text().splitlines())
    where = ("--max-prompt-tokens 1" if option else
             "the served model's prompt limit, 1 (its max_model_len; --max-prompt-tokens sets another)")
    assert lines[0].endswith(f"replay: {where}: every one of the {ROWS} rows in the window has a "
                             f"longer prompt (the shortest: {shortest} tokens); nothing would be sent"), lines[0]
    assert not output.exists() and "--verify-server" not in proc.stderr


def test_the_sample_is_sized_by_the_servers_context_not_the_prompt_limit(toy_tokenizer_dir, trace, tmp_path):
    """--max-prompt-tokens filters the run's rows; the check's vocabulary prompts are no rows of
    the run, and are as long as the server takes (its stated context): a limit of a few tokens
    made them one word each, a request per word of the vocabulary."""
    output = tmp_path / "run.jsonl"
    lengths = sorted(json.loads(line)["input_length"] for line in trace.read_text().splitlines())
    limit = lengths[len(lengths) // 2]
    with sim_with(toy_tokenizer_dir) as sim:
        run_locust(replay_args(trace, toy_tokenizer_dir, sim.url, output, "--max-prompt-tokens", str(limit)),
                   tmp_path, exit_code=1)  # the rows over the limit are recorded as failed
    (endpoint,) = server_check(output)["endpoints"]
    synth = PromptSynthesizer(ServerTokenizer.load(toy_tokenizer_dir), "openai-chat", block_size=16)
    sent = [n for n in lengths if n <= limit]
    assert endpoint["ok"] and endpoint["prompts"] == len(build_samples(synth, (sent[0], sent[-1]), max_len=32768))


@pytest.mark.parametrize("answer, ids", [
    ({"tokens": [5, 0, 7], "token_strs": ["a", "b", "c"]}, [5, 0, 7]),
    ({"tokens": []}, []),
    ({"tokens": [5, "6"]}, None),
    ({"tokens": [5, 6.0]}, None),
    ({"tokens": [5, -1]}, None),
    ({"tokens": [5, 2 ** 40]}, None),
    ({"tokens": "5 6"}, None),
    ([{"id": 3, "text": "x"}], [3]),
])
def test_tokenize_answers_are_read_only_when_they_are_token_ids(answer, ids):
    from replay.synth.server_check import _tokenize_ids

    assert _tokenize_ids(answer)[0] == ids


@pytest.mark.parametrize("count", [1, 2, 97, 41547, 151643])
def test_the_vocabulary_sample_takes_every_word_once(count):
    from replay.synth.server_check import _spread

    order = _spread(count, seed=7)
    assert sorted(order) == list(range(count))
    if count > 2:
        assert abs(order[1] - order[0]) > 1  # neighbours are spread apart

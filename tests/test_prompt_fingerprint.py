"""The prompt fingerprint (replay/rules/prompt_fingerprint.py, docs/records.md): each record keeps
a CRC-32 of its prompt as the worker built it, at a few block checkpoints; the cache section's
child compares it with the spec's re-synthesis, and only a fingerprint that differs blames the
replay (`prompt-differs`). The rule on numbers first, then the engine in one process (a
Coordinator and a Dispatcher over LocalLink) against a real `replay sim`."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import zlib
from array import array

import gevent
import orjson
import pytest

from replay.engine.dispatcher import Dispatcher
from replay.engine.options import ReplayOptions
from replay.engine.transport import LOCAL_CLIENT, LocalLink
from replay.results.records import read_records
from replay.rules.prompt_fingerprint import agreed_tokens, checkpoints
from replay.rules.run_files import fidelity_path
from replay.run import driver, preflight
from replay.synth.prompts import BREAK_BLOCK_ENV, PromptSynthesizer
from replay.synth.tokenizer import ServerTokenizer
from replay.trace.reader import TraceStream
from replay.trace.record import TraceRow
from support.traces import BLOCK


def test_checkpoints_double_up_to_the_end():
    assert checkpoints(0) == [] and checkpoints(1) == [1] and checkpoints(2) == [1, 2]
    assert checkpoints(5) == [1, 2, 4, 5] and checkpoints(8) == [1, 2, 4, 8]
    assert len(checkpoints(30_000 // 16)) == 12  # a 30,000-token prompt of 16-token blocks keeps a dozen pairs


def test_agreed_tokens_says_up_to_where_the_prompt_is_the_traces():
    spec = [[20, 1], [36, 2], [68, 3], [90, 4]]
    assert agreed_tokens(spec, spec) == math.inf
    assert agreed_tokens([[20, 1], [36, 2], [68, 9], [90, 8]], spec) == 36
    assert agreed_tokens([[20, 7], [36, 2]], spec) == 0
    assert agreed_tokens([[20, 1], [36, 2]], spec) == 36  # cut short: proven only as far as it goes
    assert agreed_tokens(None, spec) is None  # a record from before the field: nothing proven


@pytest.mark.parametrize("api, token_ids", [("openai-chat", False), ("openai-completions", False),
                                            ("openai-completions", True)])
def test_the_fingerprint_is_the_crc_of_the_content_sent(toy_tokenizer_dir, api, token_ids):
    """The last checkpoint is the CRC-32 of the content the body carries (its text, or its ids
    between the frame's), at the server token where the content ends; a broken block changes the
    checkpoints from the first one past it, and the positions stay."""
    synth = PromptSynthesizer(ServerTokenizer.load(toy_tokenizer_dir), api=api, block_size=BLOCK,
                              token_ids=token_ids)
    row = TraceRow(request_id=7, timestamp_s=0.0, input_length=5 * BLOCK + 3, output_length=4,
                   hash_ids=[1, 2, 3, 4, 5, 6], line=1)
    prompt = synth.prompt(row)
    frame = synth.frame
    before, after = len(frame.before), len(frame.after)
    fingerprint = prompt.fingerprint
    assert [pos for pos, _ in fingerprint] == [before + BLOCK, before + 2 * BLOCK, before + 4 * BLOCK,
                                               row.input_length - after]
    if token_ids:
        content = array("I", prompt.token_ids[before:len(prompt.token_ids) - after]).tobytes()
    else:
        content = (prompt.messages[-1]["content"] if prompt.messages else prompt.text).encode()
    assert fingerprint[-1][1] == zlib.crc32(content)
    synth.break_block(3)  # the test hook's seam: block 3 gets the row's own words
    broken = synth.prompt(row).fingerprint
    assert broken[:2] == fingerprint[:2] and broken[2][1] != fingerprint[2][1]
    assert agreed_tokens(broken, fingerprint) == before + 2 * BLOCK
    assert [pos for pos, _ in broken] == [pos for pos, _ in fingerprint]


def shared_block_trace(path, rows: int = 12):
    """Rows 50 ms apart; rows 4 and 9 share a 4-block prefix whose third block (hash id 33) no
    other row has, and every other row is its own: breaking block 33 breaks those two rows only,
    and row 9 then misses the two blocks the trace says it shares with row 4."""
    with open(path, "w") as f:
        for i in range(rows):
            hashes = [31, 32, 33, 34] if i in (4, 9) else [1000 + 10 * i + k for k in range(3)]
            row = {"timestamp": i * 50.0, "input_length": len(hashes) * BLOCK + (BLOCK if i == 9 else 0),
                   "output_length": 4, "hash_ids": hashes + ([35] if i == 9 else [])}
            f.write(json.dumps(row) + "\n")
    return path


def run_in_process(trace, output, url, tokenizer_dir, **options) -> None:
    """The run of `trace` by a Coordinator and its local Dispatcher over LocalLink, its end included
    (the records merged, the cache section's child, OUTPUT.fidelity.json)."""
    opts = ReplayOptions(trace=str(trace), block_size=BLOCK, tokenizer=str(tokenizer_dir), model="sim",
                         output=str(output), reset_server_cache=True, **options)
    link = LocalLink()
    part = Dispatcher(link, local=True)
    coordinator = driver.start(preflight.load(opts, url), link, local_part=part)
    coordinator.begin([(LOCAL_CLIENT, 0)])
    assert coordinator.finished.wait(timeout=60), f"{coordinator.recorded} of {coordinator.total} rows recorded"
    gevent.spawn(coordinator.end).join(timeout=120)


@pytest.fixture
def slow_sim(toy_tokenizer_dir):
    """The rows' answers come back before the next row is sent: no two requests in flight together."""
    from replay.sim.process import sim_process

    with sim_process(toy_tokenizer_dir, "--block-size", str(BLOCK), "--ttft-ms", "2", "--itl-ms", "0",
                     "--eos-prob", "0") as server:
        yield server


def causes(cert: dict) -> dict[str, int]:
    """The causes the certificate names but the server's order of requests in flight together
    (a busy host's sends may overlap: the template's first block is every row's)."""
    return {cause: c["requests"] for cause, c in cert["cache"]["misses"]["causes"].items()
            if c["requests"] and cause != "in-flight"}


@pytest.mark.parametrize("prompt_format", ["text", "token-ids"])
def test_every_record_keeps_the_fingerprint_of_the_prompt_it_sent(tmp_path, slow_sim, toy_tokenizer_dir,
                                                                   prompt_format):
    """An honest run: each record's fingerprint is its row's prompt as the spec makes it, the
    section checked every one, and no cache line blames anything."""
    trace = shared_block_trace(tmp_path / "trace.jsonl")
    output = tmp_path / "run.jsonl"
    api = "openai-completions" if prompt_format == "token-ids" else "openai-chat"
    run_in_process(trace, output, slow_sim.url, toy_tokenizer_dir, api=api, prompt_format=prompt_format)
    synth = PromptSynthesizer(ServerTokenizer.load(toy_tokenizer_dir), api=api, block_size=BLOCK,
                              token_ids=prompt_format == "token-ids")
    rows = {row.request_id: row for row in TraceStream(str(trace), "mooncake", BLOCK)}
    records = list(read_records(output))
    assert len(records) == 12 and all(r["ok"] for r in records)
    assert all(r["prompt_fingerprint"] == synth.prompt(rows[r["request_id"]]).fingerprint for r in records)
    cert = json.loads(fidelity_path(output).read_text())
    assert cert["cache"]["infinite"]["fingerprints"] == {"checked": 12, "differ": 0, "without": 0, "examples": []}
    assert not any(line.startswith(("prompts", "cache")) for line in cert["failing"]), cert["failing"]
    assert set(causes(cert)) <= {"partial-block"}, cert["cache"]["misses"]


def test_a_prompt_sent_otherwise_is_prompt_differs_by_its_fingerprint(tmp_path, slow_sim, toy_tokenizer_dir,
                                                                      monkeypatch):
    """The worker breaks block 33 ($TRACEREPLAY_TEST_BREAK_BLOCK): rows 4 and 9 are sent with words
    of their own there, their lengths exact. Their fingerprints differ from the spec's from the
    third block on: the prompts line fails with the evidence, and row 9's miss of the blocks it
    should share with row 4 is prompt-differs. The same records without their fingerprints (as a
    run from before the field wrote them), reported again: nothing proves the prompt differed, so
    the miss blames nobody and the line says the evidence is missing."""
    trace = shared_block_trace(tmp_path / "trace.jsonl")
    output = tmp_path / "run.jsonl"
    monkeypatch.setenv(BREAK_BLOCK_ENV, "33")
    run_in_process(trace, output, slow_sim.url, toy_tokenizer_dir)
    cert = json.loads(fidelity_path(output).read_text())
    fingerprints = cert["cache"]["infinite"]["fingerprints"]
    assert fingerprints["checked"] == 12 and fingerprints["differ"] == 2, fingerprints
    assert [e["request_id"] for e in fingerprints["examples"]] == [4, 9]
    before = fingerprints["examples"][0]["agreed_tokens"] - 2 * BLOCK  # agreed through 2 blocks: the frame's before
    assert before >= 0 and fingerprints["examples"][1]["agreed_tokens"] == before + 2 * BLOCK
    assert cert["prompts"]["exact_share"] == 1.0  # the server counted every length right
    assert causes(cert) == {"prompt-differs": 1}, cert["cache"]["misses"]
    assert cert["cache"]["misses"]["model"]["miss_causes"]["prompt-differs"]["examples"] == [9]
    assert cert["verdict"] == "unfaithful"
    assert any(line.startswith("prompts: 2 of 12 prompts sent differ from the trace's") and "request 4" in line
               for line in cert["failing"]), cert["failing"]
    assert "cache: 1 requests prompt-differs (needs 0)" in cert["failing"]

    older = tmp_path / "older.jsonl"
    lines = [orjson.loads(line) for line in output.read_bytes().splitlines()]
    output.write_bytes(b"".join(orjson.dumps({k: v for k, v in r.items() if k != "prompt_fingerprint"}) + b"\n"
                                for r in lines))
    proc = subprocess.run([sys.executable, "-m", "replay", "report", str(output), "--json", str(older)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(older.read_text())
    unproven = report["fidelity"]
    assert unproven["cache"]["infinite"]["fingerprints"]["without"] == 12
    assert causes(unproven) == {"no-fingerprint": 1}, unproven["cache"]["misses"]
    assert not any(line.startswith(("prompts", "cache")) for line in unproven["failing"]), unproven["failing"]
    assert any("no prompt_fingerprint" in line for line in unproven["unchecked"]), unproven["unchecked"]
    assert "a replay bug" not in proc.stdout
    assert "Prompts as sent (fingerprints):          0 of 0 the trace's, 12 without" in proc.stdout, proc.stdout


def test_a_prompt_that_differs_where_no_row_shares_it_still_fails(tmp_path, slow_sim, toy_tokenizer_dir,
                                                                  monkeypatch):
    """Breaking a block no other row has (row 3's last, hash id 1032): no cached-token count can
    show it, yet the prompt sent is not the trace's. Its fingerprint says so: the prompts line fails."""
    trace = shared_block_trace(tmp_path / "trace.jsonl")
    output = tmp_path / "run.jsonl"
    monkeypatch.setenv(BREAK_BLOCK_ENV, "1032")
    run_in_process(trace, output, slow_sim.url, toy_tokenizer_dir)
    cert = json.loads(fidelity_path(output).read_text())
    assert cert["cache"]["infinite"]["fingerprints"]["differ"] == 1
    assert "prompt-differs" not in causes(cert)
    assert cert["verdict"] == "unfaithful" and any(line.startswith("prompts: 1 of 12 prompts sent differ")
                                                   for line in cert["failing"]), cert["failing"]


def test_a_server_that_evicts_what_it_said_it_would_hold_is_not_a_replay_bug(tmp_path, toy_tokenizer_dir):
    """A 30-block sim taken for a 100,000-block one (--server-cache-blocks), its KV usage not
    scraped (--server-metrics-interval 0: nothing shows its cache is smaller): the model says the
    server must hold every block it evicted. The fingerprints prove each prompt the trace's, so
    those misses are the server's (server-missed), never prompt-differs, and no cache line fails."""
    from replay.sim.process import sim_process
    from support.cache_model import reuse_trace

    trace = reuse_trace(tmp_path / "trace.jsonl", rows=60)
    output = tmp_path / "run.jsonl"
    with sim_process(toy_tokenizer_dir, "--block-size", str(BLOCK), "--ttft-ms", "2", "--itl-ms", "0",
                     "--eos-prob", "0", "--cache-blocks", "30") as sim:
        run_in_process(trace, output, sim.url, toy_tokenizer_dir, server_cache_blocks=100_000,
                       server_metrics_interval=0)
    cert = json.loads(fidelity_path(output).read_text())
    assert cert["cache"]["infinite"]["fingerprints"]["differ"] == 0
    assert causes(cert).get("server-missed", 0) > 0 and "prompt-differs" not in causes(cert), cert["cache"]["misses"]
    assert not any(line.startswith(("prompts", "cache")) for line in cert["failing"]), cert["failing"]


def test_a_report_with_another_spec_compares_no_fingerprint(tmp_path, slow_sim, toy_tokenizer_dir):
    """`replay report --seed 5` of a run made with seed 0 re-synthesizes other words: every
    fingerprint would differ and blame an honest run. Prompts that are not provably the run's
    prove nothing: the fingerprints are not compared, the section says why, no line fails."""
    trace = shared_block_trace(tmp_path / "trace.jsonl")
    output = tmp_path / "run.jsonl"
    run_in_process(trace, output, slow_sim.url, toy_tokenizer_dir)
    assert json.loads(fidelity_path(output).read_text())["cache"]["infinite"]["fingerprints"]["checked"] == 12
    records = output.read_bytes()
    output.write_bytes(records.replace(b'"prompt_fingerprint":[[', b'"prompt_fingerprint":[["x",', 1))
    refused = subprocess.run([sys.executable, "-m", "replay", "report", str(output)], capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode == 2 and "prompt_fingerprint" in refused.stderr and "request_id" in refused.stderr, \
        (refused.returncode, refused.stderr)
    output.write_bytes(records)
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "replay", "report", str(output), "--seed", "5", "--json", str(report)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    cert = json.loads(report.read_text())["fidelity"]
    fingerprints = cert["cache"]["infinite"]["fingerprints"]
    assert fingerprints["checked"] == 0 and fingerprints["without"] == 12, fingerprints
    assert fingerprints["unchecked"] == "--seed 5 is not the run's (0)"
    assert not any(line.startswith("prompts") for line in cert["failing"]), cert["failing"]


def test_a_fingerprint_of_another_shape_is_refused_not_taken_for_a_difference():
    spec = [[20, 1], [36, 2]]
    for bad in ("abc", [[20, 1], [36]], [[20, 1.5]], [["20", 1]], {"20": 1}):
        with pytest.raises(ValueError, match=r"expected \[\[tokens, crc32\], \.\.\.\]"):
            agreed_tokens(bad, spec)


def test_a_server_whose_usage_says_no_hits_and_other_lengths_blames_no_prompt(tmp_path, toy_tokenizer_dir):
    """A server whose usage says every prompt had 1 token and none was cached, and whose /metrics
    are not scraped (--server-metrics-interval 0: no counter to contradict it): its word alone made
    every expected hit a `prompt-differs` by "another prompt length". The fingerprints prove every
    prompt the trace's: the misses are the server's (server-missed), no cache line fails and
    nothing is called a replay bug (the prompts line still says what the server counted)."""
    from replay.sim.process import sim_process

    trace = shared_block_trace(tmp_path / "trace.jsonl")
    output = tmp_path / "run.jsonl"
    with sim_process(toy_tokenizer_dir, "--block-size", str(BLOCK), "--ttft-ms", "2", "--itl-ms", "0",
                     "--eos-prob", "0", "--false-usage", json.dumps({"prompt_tokens": 1, "cached_tokens": 0})) as sim:
        run_in_process(trace, output, sim.url, toy_tokenizer_dir, server_metrics_interval=0)
    cert = json.loads(fidelity_path(output).read_text())
    assert cert["cache"]["infinite"]["fingerprints"]["differ"] == 0
    assert causes(cert) == {"server-missed": 1}, cert["cache"]["misses"]
    assert not any(line.startswith("cache") for line in cert["failing"]), cert["failing"]
    assert not any("a replay bug" in note for note in cert["cache"]["misses"]["notes"])


@pytest.mark.parametrize("api, prompt_format", [("openai-chat", "text"), ("openai-completions", "text"),
                                                ("openai-completions", "token-ids")])
def test_the_runs_end_makes_the_spec_prompts_from_the_workers_blocks(tmp_path, slow_sim, toy_tokenizer_dir,
                                                                     monkeypatch, api, prompt_format):
    """A single-process run's end computes the cache section in its own process from the blocks
    its worker made (PromptSynthesizer.with_blocks_of): no block of a hash id is made a second
    time, each prompt is walked once, and the section is the one `replay report` computes apart,
    for rows that share prefixes and a row shorter than the template."""
    from replay.run import finish as finish_module
    from replay.synth import blocks as blocks_module
    from replay.synth import prompts as prompts_module

    trace = shared_block_trace(tmp_path / "trace.jsonl")
    with open(trace, "a") as f:
        f.write(json.dumps({"timestamp": 12 * 50.0, "input_length": 2, "output_length": 4, "hash_ids": [31]}) + "\n")
    output = tmp_path / "run.jsonl"
    at_end: list[str] = []
    make, prompt, cache_section = (blocks_module.BlockSource.make, prompts_module.PromptSynthesizer.prompt,
                                   finish_module._cache_section)

    def counted_make(self, namespace, key):
        if at_end and namespace == blocks_module.HASHED:
            at_end.append(f"block {key.decode()} made again")
        return make(self, namespace, key)

    def counted_prompt(self, row, pause=None):
        if at_end:
            at_end.append(f"row {row.request_id} made whole again")
        return prompt(self, row, pause)

    def ending(*args):
        at_end.append("the end")
        return cache_section(*args)

    monkeypatch.setattr(blocks_module.BlockSource, "make", counted_make)
    monkeypatch.setattr(prompts_module.PromptSynthesizer, "prompt", counted_prompt)
    monkeypatch.setattr(finish_module, "_cache_section", ending)
    run_in_process(trace, output, slow_sim.url, toy_tokenizer_dir, api=api, prompt_format=prompt_format)
    assert at_end == ["the end"]
    summary = json.loads(output.with_name(output.name + ".summary.json").read_text())
    assert summary["cache"]["requests_compared"] == 13 and summary["cache"]["fingerprints"]["checked"] == 13
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "replay", "report", str(output), "--json", str(report)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert summary["cache"] == json.loads(report.read_text())["cache"]

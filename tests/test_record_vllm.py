"""The round trip against real vLLM on CPU: a slice of ../shared's Mooncake trace (shared
prefixes), and a Bailian trace (sessions) over both completions and chat, replayed by `replay
run` through `replay record` to vLLM, are recorded as T' with the same lengths, arrival gaps
within the replay's drift, the same block sharing and the same sessions and turns; T' replayed
against a cold vLLM gets the same cached tokens per request as T did, and `replay compare`
pairs the two replays row by row.

openai-completions: with Qwen2's tokenizer (no BOS) a completions prompt is its content with
nothing around it, so T's blocks are the server's blocks and the sharing must be equal exactly;
openai-chat: the template's frame moves the block boundaries, by the rule of
support.traces.expected_shared.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from replay.results.records import read_records
from replay.synth.prompts import set_up
from replay.synth.tokenizer import ServerTokenizer
from replay.trace.reader import read_trace
from support.paths import shared_path
from support.processes import run_locust
from support.record import RecordProcess
from support.traces import bailian_trace, expected_shared, leading_common, mooncake_slice
from support.vllm import reset_prefix_cache

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(560)]

ROWS = 60
BLOCK = 32  # the vllm_qwen2 fixture's block size, which the proxy reads from its /metrics
DRAIN_TIMEOUT_S = 240


def replay(url: str, trace: Path, tokenizer: Path, output: Path, *extra: str, rows: int = ROWS,
           api: str = "openai-completions") -> dict[int, dict]:
    reset_prefix_cache(url)
    run_locust(["--headless", "--host", url, "--trace", str(trace), "--tokenizer", str(tokenizer), "--api",
                api, "--model", "tiny", "--output", str(output), "--drain-timeout",
                str(DRAIN_TIMEOUT_S), *extra], output.parent, timeout=480)
    records = {r["request_id"]: r for r in read_records(output)}
    assert sorted(records) == list(range(rows)) and all(r["ok"] for r in records.values())
    return records


def test_the_round_trip_through_real_vllm(vllm_qwen2, tmp_path):
    tokenizer = shared_path("tokenizers", "qwen2")
    trace = mooncake_slice(tmp_path, ROWS, BLOCK, time_scale=9, max_output=16)
    recorded = tmp_path / "recorded.jsonl"
    salt, raw = tmp_path / "salt", tmp_path / "raw.jsonl"
    salt.write_bytes(b"s" * 32)
    with RecordProcess(vllm_qwen2, recorded, "--id-header", "X-Request-Id", "--salt-file", str(salt),
                       "--raw-log", str(raw)) as proxy:
        through_proxy = replay(proxy.url, trace, tokenizer, tmp_path / "run-t.jsonl")
    original, again = read_trace(trace).rows, read_trace(recorded).rows
    # T' is in arrival order; rows T sends at the same instant may arrive either way round, so each
    # T' row is paired with its T row by the replay's X-Request-Id (<run id>-<request id>)
    order = [int(json.loads(line)["client_request_id"].rsplit("-", 1)[1]) for line in recorded.read_text().splitlines()]
    assert sorted(order) == list(range(ROWS))
    of = {t: again[k] for k, t in enumerate(order)}  # T row id -> its T' row
    assert [of[i].input_length for i in range(ROWS)] == [r.input_length for r in original]
    assert [of[i].output_length for i in range(ROWS)] == [r.output_length for r in original]
    # Arrival gaps: within the replay's drift of both rows, plus the proxy's own lateness: it stamps
    # a request when its loop reads it, which beside vLLM prefilling on 2 shared cores (load 9)
    # was once 100 ms (the sim round trip in test_record.py holds 20 ms, run alone).
    drift = max(abs(r["drift_ms"]) for r in through_proxy.values()) / 1000.0
    for i, o in enumerate(original):
        assert abs((of[i].timestamp_s - again[0].timestamp_s) - (o.timestamp_s - original[order[0]].timestamp_s)) \
            <= 2 * drift + 0.25
    measured, _ = set_up(ServerTokenizer.load(tokenizer), "openai-completions")
    assert measured.frame.overhead == 0  # nothing around the content: T's blocks are the server's
    for i in range(ROWS):
        for j in range(i):
            whole = original[i].input_length == original[j].input_length and original[i].hash_ids == original[j].hash_ids
            shared = leading_common(original[i].hash_ids, original[j].hash_ids)
            if not whole:  # a partial last block is shared only by prompts that end there too
                shared = min(shared * BLOCK, original[i].input_length, original[j].input_length) // BLOCK
            assert leading_common(of[i].hash_ids, of[j].hash_ids) == shared, (i, j)
    anonymized = tmp_path / "anonymized.jsonl"  # the same trace from the proxy's raw log, counted by vLLM's /tokenize
    done = subprocess.run([sys.executable, "-m", "replay", "trace", "anonymize", str(raw), str(anonymized),
                           "--tokenize-url", vllm_qwen2, "--block-size", str(BLOCK), "--salt-file", str(salt)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    made, seen = anonymized.read_text().splitlines(), recorded.read_text().splitlines()
    assert len(made) == len(seen) and next(((a, b) for a, b in zip(made, seen) if a != b), None) is None
    for command in (["validate"], ["stats"]):
        done = subprocess.run([sys.executable, "-m", "replay", "trace", *command, str(recorded)], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
    direct = replay(vllm_qwen2, recorded, tokenizer, tmp_path / "run-t2.jsonl")
    cached = [(through_proxy[order[k]]["cached_tokens"], direct[k]["cached_tokens"]) for k in range(ROWS)]
    assert [a for a, _ in cached] == [b for _, b in cached]
    assert sum(a for a, _ in cached) > 0
    compared = subprocess.run([sys.executable, "-m", "replay", "compare", str(tmp_path / "run-t.jsonl"),
                               str(tmp_path / "run-t2.jsonl")], capture_output=True, text=True, timeout=300)
    assert compared.returncode == 0, compared.stderr
    assert f"{ROWS} rows matched" in compared.stdout and "paired through the recording: " in compared.stdout, \
        compared.stdout


SESSIONS, TURNS = 3, 3


@pytest.mark.parametrize("api", ["openai-completions", "openai-chat"])
def test_sessions_round_trip_through_real_vllm(api, vllm_qwen2, tmp_path):
    """Bailian sessions (each turn extends its parent's blocks), few rows: the recorded trace has
    the same sessions and turn order (`--session-header` on both sides), lengths, arrivals and
    sharing, and replayed against a cold vLLM gets T's cached tokens per request."""
    tokenizer = shared_path("tokenizers", "qwen2")
    trace = bailian_trace(tmp_path / "t.jsonl", sessions=SESSIONS, turns=TURNS, gap_s=0.25, blocks_per_turn=5)
    rows = SESSIONS * TURNS
    recorded = tmp_path / "recorded.jsonl"
    with RecordProcess(vllm_qwen2, recorded, "--session-header", "X-Session-Id", "--id-header", "X-Request-Id") as proxy:
        through_proxy = replay(proxy.url, trace, tokenizer, tmp_path / "run-t.jsonl", "--session-header",
                               "X-Session-Id", rows=rows, api=api)
    original = read_trace(trace).rows
    again = read_trace(recorded).rows  # no option: its format, block size and sessions are its own
    lines = [json.loads(line) for line in recorded.read_text().splitlines()]
    order = [int(line["client_request_id"].rsplit("-", 1)[1]) for line in lines]
    assert sorted(order) == list(range(rows))
    of = {t: again[k] for k, t in enumerate(order)}  # T row id -> its T' row
    assert [of[i].input_length for i in range(rows)] == [r.input_length for r in original]
    assert [of[i].output_length for i in range(rows)] == [r.output_length for r in original]
    drift = max(abs(r["drift_ms"]) for r in through_proxy.values()) / 1000.0
    for i, o in enumerate(original):  # as the Mooncake round trip above: the replay's drift, and the proxy's lateness
        assert abs((of[i].timestamp_s - again[0].timestamp_s) - (o.timestamp_s - original[order[0]].timestamp_s)) \
            <= 2 * drift + 0.25
    pairs = {(o.session_id, of[i].session_id) for i, o in enumerate(original)}
    assert len(pairs) == len({o.session_id for o in original}) == len({r.session_id for r in again}) == SESSIONS
    turn_of = {t: line["turn"] for t, line in zip(order, lines)}
    assert [turn_of[i] for i in range(rows)] == [o.turn - 1 for o in original]
    measured, _ = set_up(ServerTokenizer.load(tokenizer), api)
    before, overhead = len(measured.frame.before), measured.frame.overhead
    assert (overhead == 0) == (api == "openai-completions")
    for i, ti in enumerate(original):
        for j, tj in enumerate(original[:i]):
            expected = expected_shared(ti, tj, before, overhead, server_block=BLOCK, block=read_trace(trace).block_size)
            assert leading_common(of[i].hash_ids, of[j].hash_ids) == expected, (i, j)
    direct = replay(vllm_qwen2, recorded, tokenizer, tmp_path / "run-t2.jsonl", "--session-header", "X-Session-Id",
                    rows=rows, api=api)
    cached = [(through_proxy[order[k]]["cached_tokens"], direct[k]["cached_tokens"]) for k in range(rows)]
    assert [a for a, _ in cached] == [b for _, b in cached], cached
    assert sum(a for a, _ in cached) > 0

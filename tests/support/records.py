"""Records built by hand, the checks every real run's records must pass, and a run's
server-metrics file (OUTPUT.server-metrics.jsonl)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from replay.results.records import RECORD_FIELDS, read_records
from replay.rules.server_timing import ANSWER_TTFT_SUM_BOUND_MS
from support.traces import trace_ids

T0 = 1_700_000_000.0


def record(rid: int, **fields) -> dict:
    r = {k: None for k in RECORD_FIELDS}
    r.update(request_id=rid, worker=0, endpoint="http://127.0.0.1:1", api="openai-chat", status=200, ok=True,
             input_length=100, output_length=10)  # fmt: skip
    r.update(fields)
    return r


def ok_record(rid: int, rng: random.Random) -> dict:
    scheduled = T0 + rid * 0.1
    drift = rng.uniform(0.05, 3.0)
    sent = scheduled + drift / 1000
    out = rng.randint(1, 40)
    ttft = rng.uniform(20, 400)
    itl = [rng.uniform(5, 30) for _ in range(out - 1)]
    e2e = ttft + sum(itl) + rng.uniform(0, 2)
    tpot = (e2e - ttft) / (out - 1) if out > 1 else None
    inp = rng.randint(10, 3000)
    return record(
        rid, scheduled_at=scheduled, sent_at=sent, finished_at=sent + e2e / 1000, drift_ms=drift, ttft_ms=ttft,
        tpot_ms=tpot, e2e_ms=e2e, itl_ms=itl, input_length=inp, output_length=out, prompt_tokens=inp,
        output_tokens=out, cached_tokens=0,
    )  # fmt: skip


def check_records(output: Path, trace: Path, exact_prompt: bool = True) -> list[dict]:
    """A whole, honest run: one ok record per row of `trace`, exact token counts (the prompt's
    too, unless `exact_prompt` is false), times in order."""
    records = list(read_records(output))
    ids = [r["request_id"] for r in records]
    assert len(ids) == len(set(ids)), "a row has two records"
    assert set(ids) == trace_ids(trace)
    for r in records:
        assert tuple(r) == RECORD_FIELDS
        assert r["ok"], r
        assert r["status"] == 200
        assert r["output_tokens"] == r["output_length"]
        if exact_prompt:
            assert r["prompt_tokens"] == r["input_length"], r
            assert r["usage_mismatch"] is None, r  # an honest server's usage (replay.rules.usage)
        assert r["sent_at"] >= r["scheduled_at"] - 0.005
        assert r["finished_at"] >= r["sent_at"]
    return records


def server_samples(output: Path) -> list[dict]:
    """Every line of a run's server-metrics file, each parsed (a line that does not parse fails)."""
    path = Path(f"{output}.server-metrics.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def counter_change(samples: list[dict], endpoint: str, name: str) -> float:
    """Last minus first value of a counter at `endpoint` (the tests' servers never restart)."""
    values = [s["metrics"][name] for s in samples if s["endpoint"] == endpoint and s["ok"]]
    assert len(values) >= 2, f"{endpoint}: {len(values)} samples of {name}"
    return values[-1] - values[0]


def check_answer_timing(r: dict) -> None:
    """An ok streamed record of a server that tells its per-request timing in its answers (vLLM
    with --enable-per-request-metrics, `replay sim --per-request-metrics`): every field, the
    server's TTFT its queue + prefill (replay.rules.server_timing's bound) and within the client's."""
    assert r["ok"] and r["server_timing_source"] == "answer" and r["server_timing_problem"] is None, r
    assert None not in (r["server_queue_ms"], r["server_prefill_ms"], r["server_decode_ms"]), r
    assert abs(r["server_ttft_ms"] - (r["server_queue_ms"] + r["server_prefill_ms"])) <= ANSWER_TTFT_SUM_BOUND_MS, r
    assert r["server_ttft_ms"] <= r["ttft_ms"], r
    assert r["server_ttft_ms"] + r["server_decode_ms"] <= r["e2e_ms"], r
    assert r["server_e2e_ms"] is None  # a trace span's, never an answer's

"""--otlp-receiver against real vLLM on CPU (docs/otlp.md): a server started with
--otlp-traces-endpoint pointing at the run's receiver (and OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=
http/protobuf: vLLM exports over gRPC by default) exports one llm_request span per request; the
run joins every ok record to its span by request id, through vLLM's prefixes (chat:
chatcmpl-<id>, completions: cmpl-<id>-0), and the split is consistent with the client's own
measure. The server is this module's own (its own SERIAL_GROUPS group), a dozen rows a run.
"""

from __future__ import annotations

import json
import os
from unittest import mock

import pytest

from replay.rules.run_files import fidelity_path, spans_path, summary_path
from support.paths import shared_path
from support.ports import free_port
from support.processes import run_locust
from support.traces import mooncake_trace
from support.vllm import make_tiny_model, require_vllm, vllm_server

# alone: the front end's bound is wall-clock time, which vLLM's API server starved by other tests
# (make test runs the rest under SCHED_IDLE, vLLM with them) stretches past it
pytestmark = [pytest.mark.vllm, pytest.mark.alone, pytest.mark.timeout(400)]

FRONT_END_MS = 100.0  # server TTFT - (queue + prefill): the API server's work before the engine queues it
ROUNDING_MS = 0.002


@pytest.fixture(scope="module")
def traced_vllm(tmp_path_factory):
    """(vLLM's URL, the receiver port its spans go to)."""
    require_vllm()
    tokenizer = shared_path("tokenizers", "qwen2")
    model = make_tiny_model(tokenizer, tmp_path_factory.mktemp("tiny-qwen2-otlp"))
    port = free_port()
    with mock.patch.dict(os.environ, {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}), \
            vllm_server(model, block_size=32, kv_cache_gib=1,
                        extra_args=("--otlp-traces-endpoint", f"http://127.0.0.1:{port}/v1/traces")) as url:
        yield url, port


@pytest.mark.parametrize("api", ["openai-chat", "openai-completions"])
def test_vllms_spans_join_every_record(traced_vllm, api, tmp_path):
    url, port = traced_vllm
    tokenizer = shared_path("tokenizers", "qwen2")
    trace = mooncake_trace(tmp_path / "trace.jsonl", 12, 40)
    output = tmp_path / "run.jsonl"
    run_locust(["--headless", "--host", url, "--trace", str(trace), "--block-size", "16", "--tokenizer",
                str(tokenizer), "--model", "tiny", "--api", api, "--output", str(output), "--only-summary",
                "--otlp-receiver", f"127.0.0.1:{port}"], tmp_path, timeout=300)
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(rows) == 12 and all(r["ok"] for r in rows)
    for r in rows:
        assert r["server_timing_source"] == "span", r  # the request asked for no metrics: the span's alone
        assert r["server_ttft_ms"] <= r["ttft_ms"], r  # the server's arrival is after the client's send
        front_end = r["server_ttft_ms"] - (r["server_queue_ms"] + r["server_prefill_ms"])
        assert -ROUNDING_MS <= front_end <= FRONT_END_MS, r
        # the engine core's queued -> last token is inside the front end's arrival -> finished
        assert r["server_queue_ms"] + r["server_prefill_ms"] + r["server_decode_ms"] <= r["server_e2e_ms"], r
        assert r["server_e2e_ms"] <= r["e2e_ms"], r
    section = json.loads(summary_path(output).read_text())["spans"]
    assert section["joined"] == section["ok_records"] == 12 and section["ok_records_without_span"] == 0, section
    assert section["no_record"] == section["duplicate"] == 0, section


def test_both_sources_keep_the_answers_times_and_the_spans_ttft(tmp_path):
    """vLLM with --enable-per-request-metrics and spans to the run's receiver: each record keeps
    its answer's queue, prefill and decode (the same engine-core times as its span's), takes the
    span's TTFT (from the server's arrival: the answer's queue + prefill leave out the front end)
    and E2E, and the certificate judges the client's excess over it, never asking for
    --otlp-receiver."""
    require_vllm()
    tokenizer = shared_path("tokenizers", "qwen2")
    model = make_tiny_model(tokenizer, tmp_path / "model")
    port = free_port()
    trace = mooncake_trace(tmp_path / "trace.jsonl", 12, 40)
    output = tmp_path / "run.jsonl"
    with mock.patch.dict(os.environ, {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}), \
            vllm_server(model, block_size=32, kv_cache_gib=1, extra_args=(
                "--enable-per-request-metrics", "--otlp-traces-endpoint", f"http://127.0.0.1:{port}/v1/traces")) as url:
        run_locust(["--headless", "--host", url, "--trace", str(trace), "--block-size", "16", "--tokenizer",
                    str(tokenizer), "--model", "tiny", "--output", str(output), "--only-summary",
                    "--otlp-receiver", f"127.0.0.1:{port}"], tmp_path, timeout=300)
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    spans = {}
    for line in spans_path(output).read_text().splitlines():
        span = json.loads(line)
        if span.get("name") == "llm_request":
            spans[int(span["attributes"]["gen_ai.request.id"].rsplit("-", 1)[1])] = span["attributes"]
    assert len(rows) == 12 and all(r["ok"] for r in rows)
    for r in rows:
        attributes = spans[r["request_id"]]
        assert r["server_timing_source"] == "answer", r
        assert abs(r["server_ttft_ms"] - 1000 * attributes["gen_ai.latency.time_to_first_token"]) <= ROUNDING_MS, r
        assert abs(r["server_e2e_ms"] - 1000 * attributes["gen_ai.latency.e2e"]) <= ROUNDING_MS, r
        # the answer's engine-core times, as its span's (vLLM reads both from the same stats)
        assert abs(r["server_queue_ms"] - 1000 * attributes["gen_ai.latency.time_in_queue"]) <= 1.0, (r, attributes)
        assert r["server_ttft_ms"] <= r["ttft_ms"], r
        front_end = r["server_ttft_ms"] - (r["server_queue_ms"] + r["server_prefill_ms"])
        assert -1.0 <= front_end <= FRONT_END_MS, r
    certificate = json.loads(fidelity_path(output).read_text())
    assert certificate["server_ttft"]["compared"] == {"span": 12}, certificate["server_ttft"]
    assert not any("--otlp-receiver" in line for line in certificate["unchecked"]), certificate["unchecked"]

"""The server's side of a run: the master scrapes every endpoint's /metrics into
OUTPUT.server-metrics.jsonl, the summary sets the server's counters against the records, and
--server-block-size puts the cache fidelity section in the end-of-run summary;
--metrics-endpoint exporters (a fake dcgm-exporter) are scraped in the same rounds, kept raw,
and their GPUs' peaks summarised, apart from the servers'.

Real `replay sim` processes and real Locust processes throughout; the parser is fed text in
each server's own format.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import requests

from replay.protocol.prometheus import parse_series
from replay.results.records import read_records
from replay.results.server_metrics import KNOWN, CounterChange, parse
from replay.sim.process import sim_process
from support.dcgm import PAGE, fake_dcgm_exporter, idle_page
from support.processes import finish, master_and_workers, replay_args, run_locust
from support.records import check_records, counter_change, server_samples
from support.traces import BLOCK, mooncake_trace

HITS, QUERIES, PROMPT = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:prompt_tokens_total"

VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
# HELP vllm:prefix_cache_hits Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 1024.0
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{le="0.3",model_name="m"} 1.0
vllm:e2e_request_latency_seconds_count{model_name="m"} 1.0
vllm:e2e_request_latency_seconds_sum{model_name="m"} 0.2
"""
SGLANG_TEXT = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 7.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 2.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.41
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="m"} 0.6
"""
TGI_TEXT = """\
# TYPE tgi_queue_size gauge
tgi_queue_size 4
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 8
# TYPE tgi_request_count counter
tgi_request_count 12
"""


def test_parse_knows_vllm_sglang_and_tgi():
    """Series summed over engines (fractions averaged), histograms and _created left out, and
    any other series only when asked for (--server-metric)."""
    assert parse(VLLM_TEXT, KNOWN) == {"vllm:num_requests_running": 5.0, "vllm:kv_cache_usage_perc": 0.375,
                                       HITS: 1024.0}  # fmt: skip
    assert parse(SGLANG_TEXT, KNOWN) == {"sglang:num_running_reqs": 7.0, "sglang:num_queue_reqs": 2.0,
                                         "sglang:token_usage": 0.41, "sglang:cache_hit_rate": 0.6}  # fmt: skip
    assert parse(TGI_TEXT, KNOWN) == {"tgi_queue_size": 4.0, "tgi_batch_current_size": 8.0}
    assert parse(TGI_TEXT, (*KNOWN, "tgi_request_count"))["tgi_request_count"] == 12.0
    with pytest.raises(ValueError):
        parse("this is { not prometheus\n", KNOWN)


def test_parse_reads_labels_whole_and_refuses_what_is_not_the_format():
    """Quoted label values may hold spaces, braces and escaped quotes; a timestamp may follow
    the value; blanks may be tabs; NaN samples are left out; an unparsable wanted line, or a
    page with none of ours that is not the format, is a ValueError."""
    text = ('vllm:num_requests_running{model_name="a} b \\"c\\" {d}",engine="0"} 2 1700000000000\n'
            'vllm:num_requests_running{engine="1"}\t3.5\n'
            'vllm:num_requests_waiting{engine="0"} NaN\n'
            'vllm:num_requests_waiting{engine="1"} 1e1\n'
            'vllm:prompt_tokens_total +Inf\n'
            '# EOF\n')
    assert parse(text, KNOWN) == {"vllm:num_requests_running": 5.5, "vllm:num_requests_waiting": 10.0,
                                  PROMPT: float("inf")}
    for bad in ('vllm:num_requests_running{engine="0} 2\n', "vllm:num_requests_running 2 3 4\n",
                "vllm:num_requests_running two\n", "<html><body>not found</body></html>\n",
                '{"object": "list", "data": [{"id": "sim"}]}\n'):
        with pytest.raises(ValueError, match="not the Prometheus text format"):
            parse(bad, KNOWN)
    assert parse("other_metric{a=\"1\"} 4\n", KNOWN) == {}


def test_counter_change_survives_a_server_restart():
    change = CounterChange()
    for value in (100, 150, 160, 20, 50):  # restarted between 160 and 20
        change.add(value)
    assert change.total == 60 + 50


def test_sim_gauges_are_its_state(toy_tokenizer_dir):
    """Running and waiting requests and the KV blocks the running one holds, read while a slow
    request runs and another waits behind it (--max-num-seqs 1); all back to 0 afterwards."""
    prompt = list(range(1000, 1000 + 3 * BLOCK + 5))  # 3 full blocks and 5 tokens
    body = {"model": "sim", "prompt": prompt, "max_tokens": 20, "ignore_eos": True}
    with sim_process(toy_tokenizer_dir, "--block-size", str(BLOCK), "--cache-blocks", "100", "--max-num-seqs", "1",
                     "--itl-ms", "50") as sim:  # fmt: skip
        import gevent

        jobs = [gevent.spawn(requests.post, sim.url + "/v1/completions", json=body) for _ in range(2)]
        deadline = time.monotonic() + 30
        while True:
            metrics = parse(requests.get(sim.url + "/metrics").text, KNOWN)
            if metrics["vllm:num_requests_waiting"] == 1 or time.monotonic() > deadline:
                break
            gevent.sleep(0.02)
        assert metrics["vllm:num_requests_running"] == 1 and metrics["vllm:num_requests_waiting"] == 1
        own = -(-(5 + 20 - 1) // BLOCK)  # its last partial prompt block and its output but the last token
        assert metrics["vllm:kv_cache_usage_perc"] == (3 + own) / 99  # vLLM's null block is not counted
        gevent.joinall(jobs)
        assert all(job.value.status_code == 200 for job in jobs)
        metrics = parse(requests.get(sim.url + "/metrics").text, KNOWN)
        assert metrics["vllm:num_requests_running"] == metrics["vllm:num_requests_waiting"] == 0
        assert metrics["vllm:kv_cache_usage_perc"] == 0
        assert metrics[QUERIES] == metrics[PROMPT] == 2 * len(prompt)
        assert metrics[HITS] == 3 * BLOCK  # the second found the first's full blocks
        assert metrics["vllm:num_preemptions_total"] == 0
    with sim_process(toy_tokenizer_dir, "--no-metrics") as sim:
        assert requests.get(sim.url + "/metrics").status_code == 404


def fidelity_block(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "Prefix Cache Fidelity" in line)
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("---"))
    return lines[start:end]


def test_fleet_of_two_sims_one_without_metrics(tmp_path, toy_tokenizer_dir):
    """A master and two workers replay to two sims, one serving no /metrics. The file has a
    sample of every endpoint in every round, the first before the first send and the last after
    the last answer; the metrics-less one is noted once and the run succeeds; the server's
    prefix-hit counter change equals the records' cached_tokens, exactly; and the end-of-run
    summary carries the fidelity section exactly as `replay report` prints it. A fake
    dcgm-exporter is scraped in every round too: its page whole, its GPUs' peaks in the
    summary's `server.exporters`, and nothing of it in the servers' figures or the cache check."""
    # 100 ms apart: a row's prefix was prefilled (30 ms) before it is sent, even on a loaded host,
    # so the infinite cache's expectation is exact for every row
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=60, gap_ms=100)
    output = tmp_path / "run.jsonl"
    args = ["--block-size", str(BLOCK), "--ttft-ms", "30", "--itl-ms", "2", "--prefill-ms-per-1k", "0"]
    with (sim_process(toy_tokenizer_dir, *args) as a, sim_process(toy_tokenizer_dir, *args, "--no-metrics") as b,
          fake_dcgm_exporter() as exporter):
        # --routing prefix: each prefix family stays on one sim, so one infinite cache is exact
        master, workers = master_and_workers(tmp_path, replay_args(
            trace, toy_tokenizer_dir, a.url, output, "--endpoints", f"{a.url},{b.url}", "--routing", "prefix",
            "--server-metrics-interval", "0.25", "--server-block-size", str(BLOCK), "--metrics-endpoint", exporter))  # fmt: skip
        finish([master, *workers])
    log = (tmp_path / "master.log").read_text()
    assert master.returncode == 0, log[-4000:]
    records = check_records(output, trace)
    samples = server_samples(output)
    rounds: dict[float, list[str]] = {}
    for s in samples:
        rounds.setdefault(s["t"], []).append(s["endpoint"])
    assert all(eps == [a.url, b.url, exporter] for eps in rounds.values()), rounds
    assert len(rounds) >= 2
    assert min(rounds) < min(r["sent_at"] for r in records)
    assert max(rounds) > max(r["finished_at"] for r in records)
    assert all(s["ok"] and s["metrics"] for s in samples if s["endpoint"] == a.url)
    page = parse_series(PAGE())
    exported = [s for s in samples if s.get("exporter")]
    assert {s["endpoint"] for s in exported} == {exporter} and all(s["ok"] for s in exported)
    assert exported[-1]["metrics"] == page and len(page) == 38  # every series, labels and all
    assert exported[0]["metrics"] == parse_series(idle_page(PAGE()))
    assert all(not s["ok"] and s["error"] == "HTTP 404" for s in samples if s["endpoint"] == b.url)
    assert log.count(f"{b.url}/metrics: HTTP 404") == 1
    for worker in range(2):  # never scraped from a worker
        assert "server metrics" not in (tmp_path / f"worker{worker}.log").read_text()

    on_a = [r for r in records if r["endpoint"] == a.url]
    assert on_a and sum(r["cached_tokens"] for r in on_a) > 0
    assert counter_change(samples, a.url, HITS) == sum(r["cached_tokens"] for r in on_a)
    assert counter_change(samples, a.url, QUERIES) == sum(r["prompt_tokens"] for r in on_a)
    assert counter_change(samples, a.url, PROMPT) == sum(r["prompt_tokens"] for r in on_a)

    summary = json.loads(output.with_name("run.jsonl.summary.json").read_text())
    server = summary["server"]
    entry = server["endpoints"][a.url]
    assert entry["server"] == "vllm" and entry["samples"] == len(rounds) and entry["samples_failed"] == 0
    assert entry["prefix_cache_hits"] == entry["records_cached_tokens"] == sum(r["cached_tokens"] for r in on_a)
    assert entry["prompt_tokens"] == entry["records_prompt_tokens"] and entry["prompt_tokens_difference"] == 0
    assert entry["prefix_cache_hit_ratio"] == entry["prefix_cache_hits"] / entry["prefix_cache_queries"]
    assert entry["generation_tokens"] == sum(r["output_tokens"] for r in on_a)
    assert entry["preemptions"] == 0 and entry["note"] is None
    assert server["endpoints"][b.url]["note"] == "no metrics: HTTP 404"
    assert server["total"]["endpoints_without_metrics"] == [b.url]
    assert "Server Metrics (Prometheus)" in log and f"{b.url}: no metrics: HTTP 404" in log
    assert set(server["endpoints"]) == {a.url, b.url}  # the exporter is no server
    gpus = server["exporters"][exporter]["gpus"]
    assert server["exporters"][exporter]["samples"] == len(rounds) and list(gpus) == ["gpu-node-1/gpu 0",
                                                                                   "gpu-node-1/gpu 1"]
    assert gpus["gpu-node-1/gpu 0"] == {
        "gpu": "0", "uuid": "GPU-3b5c9e1a-8f4d-4c1e-9a2b-7d6e5f4a3b21", "model": "NVIDIA H100 80GB HBM3",
        "hostname": "gpu-node-1", "peak_util_pct": 97, "peak_fb_used_mib": 74676, "least_fb_free_mib": 6411,
        "peak_power_w": 612.438, "peak_sm_clock_mhz": 1980, "peak_temp_c": 67}
    assert gpus["gpu-node-1/gpu 1"]["peak_util_pct"] == 64
    assert f"{exporter} (exporter): {len(rounds)} samples, 38 series, 2 GPUs" in log
    assert "peak utilisation 97 %, peak memory used 74676 MiB, least memory free 6411 MiB, peak power 612.438 W" in log

    cache = summary["cache"]
    assert cache["requests_compared"] == len(records) and cache["requests_matching"] == len(records)
    report = subprocess.run([sys.executable, "-m", "replay", "report", str(output), "--server-block-size", str(BLOCK),
                             "--json", str(tmp_path / "report.json")], capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert fidelity_block(log) == fidelity_block(report.stdout)
    reported = json.loads((tmp_path / "report.json").read_text())
    assert reported["cache"] == cache and reported["server"]["endpoints"] == server["endpoints"]


def test_stopped_run_has_a_complete_metrics_file(tmp_path, toy_tokenizer_dir, sim):
    """--run-time stops the run mid-way: the scraper's last round still comes after the last
    answer, and every line is whole. --server-metrics-interval 0 writes no file."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=400, gap_ms=25)
    output = tmp_path / "stopped.jsonl"
    run_locust(replay_args(trace, toy_tokenizer_dir, sim.url, output, "--run-time", "3s",
                           "--server-metrics-interval", "0.2"), tmp_path)  # fmt: skip
    records = list(read_records(output))
    answered = [r for r in records if r["ok"]]
    assert answered and len(answered) < len(records)
    samples = server_samples(output)  # every line parses
    assert all(s["ok"] and s["endpoint"] == sim.url for s in samples)
    assert samples[-1]["t"] > max(r["finished_at"] for r in answered)
    # requests the stop cut off were looked up too: between the answered ones and all sent
    cut = [r for r in records if r["sent_at"] is not None and not r["ok"]]
    answered_prompt = sum(r["prompt_tokens"] for r in answered)
    assert answered_prompt <= counter_change(samples, sim.url, QUERIES) <= answered_prompt + sum(
        r["input_length"] for r in cut)
    assert counter_change(samples, sim.url, HITS) >= sum(r["cached_tokens"] for r in answered)

    small = mooncake_trace(tmp_path / "small.jsonl", rows=5, gap_ms=10)
    off = tmp_path / "off.jsonl"
    run_locust(replay_args(small, toy_tokenizer_dir, sim.url, off, "--server-metrics-interval", "0"), tmp_path)
    assert not (tmp_path / "off.jsonl.server-metrics.jsonl").exists()
    assert json.loads((tmp_path / "off.jsonl.summary.json").read_text())["server"] is None

"""The capacity search against a real server, `replay sim`, whose capacity can be computed: with
--max-num-seqs N requests served at once, each for TTFT + (output - 1) x ITL, and nothing else
in its time, it serves N / that many requests a second; past it, requests queue and their TTFT
grows past the SLO. The search's answer (one run) is checked against a coarse grid of separate
runs at --scale k (docs/capacity.md)."""

from __future__ import annotations

import orjson
import pytest

from replay.rules.run_files import capacity_path, summary_path
from replay.sim.process import sim_process
from support.processes import replay_args, run_locust
from support.traces import BLOCK, mooncake_trace

SEQS, TTFT_MS, ITL_MS, OUTPUT = 4, 20, 10, 10  # each request 110 ms: the sim serves 36.4 requests a second
GAP_MS, ROWS = 50, 100  # the trace: 20 requests a second for 5 s, so its capacity is about 1.8x
SLO, TARGET = "ttft_ms=60", "0.9"


@pytest.fixture
def slow_sim(toy_tokenizer_dir):
    with sim_process(toy_tokenizer_dir, "--block-size", str(BLOCK), "--ttft-ms", str(TTFT_MS), "--itl-ms",
                     str(ITL_MS), "--prefill-ms-per-1k", "0", "--max-num-seqs", str(SEQS)) as server:
        yield server


def test_the_search_agrees_with_a_grid_of_separate_runs(tmp_path, toy_tokenizer_dir, slow_sim):
    trace = mooncake_trace(tmp_path / "trace.jsonl", ROWS + 1, GAP_MS, output_length=(OUTPUT, OUTPUT))
    seconds = str(ROWS * GAP_MS / 1000)  # the window: the first ROWS rows
    common = ("--slo", SLO, "--verify-server", "off", "--drain-timeout", "10")
    output = tmp_path / "search.jsonl"
    run_locust(replay_args(trace, toy_tokenizer_dir, slow_sim.url, output, *common, "--capacity-search",
                           "--goodput-target", TARGET, "--search-range", "0.5:8", "--search-precision", "0.1",
                           "--probe-duration", seconds, "--cooldown", "0.5"), tmp_path, timeout=240,
               exit_code=None)
    report = orjson.loads(capacity_path(output).read_bytes())
    if report["result"] == "client-limited":  # the search said so instead of a wrong answer: this host is too busy
        pytest.skip(f"the search ended client-limited (drift p99 over 10 ms): {report['probes'][-1]}")
    assert report["result"] == "found", report
    found = report["capacity"]
    grid_passes = []
    for k in (1.4, 1.6, 1.8, 2.0, 2.2):  # around the computed 1.82x
        out = tmp_path / f"grid-{k}.jsonl"
        run_locust(replay_args(trace, toy_tokenizer_dir, slow_sim.url, out, *common, "--scale", str(k),
                               "--duration", seconds), tmp_path,
                   )
        summary = orjson.loads(summary_path(out).read_bytes())
        if summary["requests_good"] / ROWS >= float(TARGET):
            grid_passes.append(k)
    grid = max(grid_passes)
    assert abs(found - grid) / grid <= 0.10, (found, grid, report["probes"])

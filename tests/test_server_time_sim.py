"""The server's own times against `replay sim --per-request-metrics`, whose queue and step
times are known: a replay's records carry them (replay/rules/server_timing.py), the summary says
where the time went (replay/results/server_time.py), and a server that sends figures of the
wrong type loses those fields, never the row.

The sim times a streamed request as it sends it: its prefill is --ttft-ms (with no per-token
prefill cost here) and its decode (n - 1) x --itl-ms, each late by at most its event loop's lag
(LATE_MS: timers on a busy 2-core machine).
"""

from __future__ import annotations

import html
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from replay.results.html import SERVER_TIME_PLOT
from replay.results.records import read_records
from replay.results.server_time import largest_part
from replay.rules.run_files import fidelity_path, meta_path, summary_path
from replay.rules.server_timing import ANSWER_TTFT_SUM_BOUND_MS, SERVER_TIMING_FIELDS
from replay.sim.process import sim_process
from support.processes import replay_args, run_locust
from support.traces import BLOCK, mooncake_trace

TTFT_MS = 40.0
ITL_MS = 5.0
LATE_MS = 60.0  # the sim's timers and its slot hand-over, late on a loaded host (SCHED_IDLE beside 4 test processes: 32 ms seen)


def sim_args(*extra: str) -> list[str]:
    return ["--block-size", str(BLOCK), "--ttft-ms", str(TTFT_MS), "--prefill-ms-per-1k", "0", "--itl-ms",
            str(ITL_MS), "--eos-prob", "0", *extra]


def replay(tmp_path, tokenizer, sim_extra: tuple[str, ...], rows: int, gap_ms: float, extra: tuple[str, ...] = ()):
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=rows, gap_ms=gap_ms, output_length=(10, 10))
    output = tmp_path / "run.jsonl"
    with sim_process(tokenizer, *sim_args(*sim_extra)) as sim:
        proc = run_locust(replay_args(trace, tokenizer, sim.url, output, *extra), tmp_path)
        received = requests.get(f"{sim.url}/debug/requests", timeout=10).json()
    meta = json.loads(meta_path(output).read_text())
    assert received["total"] == rows  # the rows, each once
    meta["received_without_id"] = received["without_id"]  # the preflight's question, if asked
    meta["output"] = output
    return list(read_records(output)), json.loads(summary_path(output).read_text()), proc, meta


def check_split(r: dict) -> None:
    """One ok streamed record against the sim's model: the fields, and the client's TTFT above the server's."""
    assert r["ok"] and r["server_timing_source"] == "answer" and r["server_timing_problem"] is None, r
    assert TTFT_MS <= r["server_prefill_ms"] <= TTFT_MS + LATE_MS, r
    decode = (r["received_tokens"] - 1) * ITL_MS
    assert decode - LATE_MS <= r["server_decode_ms"] <= decode + LATE_MS, r
    assert r["server_mean_itl_ms"] == pytest.approx(r["server_decode_ms"] / (r["received_tokens"] - 1), abs=0.002)
    assert abs(r["server_ttft_ms"] - (r["server_queue_ms"] + r["server_prefill_ms"])) <= ANSWER_TTFT_SUM_BOUND_MS, r
    assert r["server_ttft_ms"] <= r["ttft_ms"], r
    assert r["server_e2e_ms"] is None  # an answer has none: a span's


def test_an_idle_sim_tells_its_known_times_and_the_summary_splits_them(tmp_path, toy_tokenizer_dir):
    records, summary, proc, meta = replay(tmp_path, toy_tokenizer_dir, ("--per-request-metrics",), rows=12,
                                          gap_ms=120, extra=("--check-server-timing",))
    assert list(meta["server_check"]["server_timing"].values()) == ["sent"] and meta["received_without_id"] == 1
    assert "sends its per-request timing" in proc.stderr
    assert len(records) == 12
    for r in records:
        check_split(r)
        assert r["server_queue_ms"] <= LATE_MS, r  # one at a time: nothing waits
    section = summary["server_timing"]
    assert section["requests_with_server_timing"] == 12 and section["requests_lacking_server_timing"] == 0
    assert section["by_source"] == {"answer": 12}
    ttft = section["ttft_ms"]
    assert ttft["requests"] == 12
    assert sum(ttft["share"].values()) == pytest.approx(1.0)  # means add up: the parts are the whole
    assert largest_part(ttft) == "prefill"
    assert ttft["rest"]["p50"] >= 0  # the client sees the server's TTFT and more
    assert "Where the Time Went" in proc.stdout and "server prefill" in proc.stdout
    # the certificate sets the client's TTFT against the server's: answers leave out its front end, so not judged
    cert = json.loads(fidelity_path(meta["output"]).read_text())
    assert cert["server_ttft"]["compared"] == {"answer": 12} and cert["server_ttft"]["server_over_client"] == 0
    assert any(u.startswith("server TTFT: 12 requests' server TTFT is their answers'") for u in cert["unchecked"])


def test_a_loaded_sim_queues_and_the_summary_blames_the_queue(tmp_path, toy_tokenizer_dir):
    """--max-num-seqs 1 and every row at once: the k-th request served waits k services in the
    queue (each TTFT_MS + 9 x ITL_MS long), and the TTFT's growth is the queue's."""
    rows = 8
    records, summary, _, meta = replay(tmp_path, toy_tokenizer_dir, ("--per-request-metrics", "--max-num-seqs", "1"),
                                       rows=rows, gap_ms=0)
    service = TTFT_MS + 9 * ITL_MS
    queues = sorted(r["server_queue_ms"] for r in records)
    for k, queue in enumerate(queues):
        check_split(next(r for r in records if r["server_queue_ms"] == queue))
        assert k * service - LATE_MS <= queue <= k * (service + LATE_MS) + LATE_MS, (k, queues)
    ttft = summary["server_timing"]["ttft_ms"]
    assert largest_part(ttft) == "queue" and ttft["share"]["queue"] > 0.6, ttft
    assert ttft["queue"]["p90"] > ttft["prefill"]["p90"]
    # replay report reads the run's own records to the same section, and draws the split over time
    page, report = tmp_path / "report.html", tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "replay", "report", str(meta["output"]), "--json", str(report),
                           "--html", str(page)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(report.read_text())["server_timing"] == summary["server_timing"]
    assert "Where the Time Went" in proc.stdout
    plot = re.search(r'<figure id="plot-server-time" class="plot"><figcaption>(.*?)</figcaption>(.*?)</figure>',
                     page.read_text(), re.S)  # fmt: skip
    assert plot and plot.group(1) == html.escape(SERVER_TIME_PLOT[1]) and "server queue" in plot.group(2)


def test_a_server_without_timing_is_no_failure_and_the_summary_counts_what_lacked_it(tmp_path, toy_tokenizer_dir):
    records, summary, proc, meta = replay(tmp_path, toy_tokenizer_dir, (), rows=6, gap_ms=20,
                                          extra=("--check-server-timing",))
    assert list(meta["server_check"]["server_timing"].values()) == ["not sent"]
    assert all(r["ok"] and all(r[name] is None for name in SERVER_TIMING_FIELDS) for r in records)
    section = summary["server_timing"]
    assert section["requests_with_server_timing"] == 0 and section["requests_lacking_server_timing"] == 6
    assert "Where the Time Went" not in proc.stdout
    assert "per-request timing: not sent" in proc.stderr


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_timing_figures_of_the_wrong_type_are_dropped_never_the_row(tmp_path, toy_tokenizer_dir, stream):
    lie = {"queue_time_ms": "12", "generation_time_ms": -4, "mean_itl_ms": True}
    records, summary, _, meta = replay(tmp_path, toy_tokenizer_dir, ("--false-metrics", json.dumps(lie)), rows=6,
                                       gap_ms=20, extra=("--check-server-timing",) if stream else ("--no-stream",))
    if stream:
        assert list(meta["server_check"]["server_timing"].values())[0].startswith("sent, with figures that are not")
    else:  # not asked: no request but the rows reached the server, and the records keep the answers' all the same
        assert "server_timing" not in meta["server_check"] and meta["received_without_id"] == 0
    for r in records:
        assert r["ok"], r
        assert r["server_queue_ms"] is None and r["server_decode_ms"] is None and r["server_mean_itl_ms"] is None
        assert r["server_ttft_ms"] is None  # no queue: no sum
        assert TTFT_MS <= r["server_prefill_ms"] <= TTFT_MS + LATE_MS and r["server_timing_source"] == "answer"
        assert r["server_timing_problem"] == ("metrics queue_time_ms '12' is not a duration; "
                                              "metrics generation_time_ms -4 is not a duration; "
                                              "metrics mean_itl_ms True is not a duration")
    assert summary["server_timing"]["requests_timing_problem"] == 6
    assert summary["server_timing"]["ttft_ms"]["requests"] == 0


def test_a_server_whose_queue_exceeds_the_clients_ttft_is_not_blamed(tmp_path, toy_tokenizer_dir):
    """A server that says it queued a request 5 s when its client had the first token in ~50 ms
    lies: its times are not evidence, so the split leaves them out and says how many, instead
    of blaming a 5 s queue (a share of thousands of percent, a negative rest)."""
    records, summary, proc, _ = replay(tmp_path, toy_tokenizer_dir, ("--false-metrics", '{"queue_time_ms": 5000}'),
                                       rows=6, gap_ms=20)
    assert all(r["ok"] and r["server_queue_ms"] == 5000.0 for r in records)  # the record keeps what was sent
    section = summary["server_timing"]
    assert section["requests_server_over_client"] == 6
    assert section["ttft_ms"]["requests"] == 0 and section["e2e_ms"]["requests"] == 0
    assert "6 of 6 ok requests' server times exceed the client's own" in proc.stdout + proc.stderr


def test_a_duration_no_request_can_take_is_dropped_and_named(tmp_path, toy_tokenizer_dir):
    records, summary, _, _ = replay(tmp_path, toy_tokenizer_dir, ("--false-metrics", '{"queue_time_ms": 1e300}'),
                                    rows=3, gap_ms=20)
    for r in records:
        assert r["ok"] and r["server_queue_ms"] is None and r["server_ttft_ms"] is None, r
        assert r["server_timing_problem"] == "metrics queue_time_ms 1e+300 is not a duration", r
    assert summary["server_timing"]["requests_timing_problem"] == 3


def compare_runs(tmp_path, tokenizer, sims: dict[str, tuple[str, ...]]) -> dict[str, Path]:
    """One real run of one trace per sim: 40 rows every 20 ms, each served in about 40 + 9 x 5 ms."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=40, gap_ms=20, output_length=(10, 10))
    out = {}
    for name, extra in sims.items():
        out[name] = tmp_path / f"{name}.jsonl"
        with sim_process(tokenizer, *sim_args("--per-request-metrics", "--jitter", "0.2", *extra)) as sim:
            run_locust(replay_args(trace, tokenizer, sim.url, out[name]), tmp_path)
    return out


@pytest.mark.alone  # real runs whose latencies the verdicts judge: another test's load shifts one run
def test_compare_tells_a_regression_in_queue_time_from_one_in_decode(tmp_path, toy_tokenizer_dir, capsys):
    """BASE: the sim serving every row at once. NEW: the same sim serving one at a time (the
    rows queue), or decoding twice as slowly: compare puts the change on the part that moved."""
    from replay.cli import main

    runs = compare_runs(tmp_path, toy_tokenizer_dir, {"base": (), "queued": ("--max-num-seqs", "1"),
                                                       "slow-decode": ("--itl-ms", str(2 * ITL_MS))})
    results = {}
    for new in ("queued", "slow-decode"):
        out = tmp_path / f"{new}.compare.json"
        assert main(["compare", str(runs["base"]), str(runs[new]), "--json", str(out)]) == 0
        results[new] = {e["metric"]: e for e in json.loads(out.read_text())["metrics"]}
    printed = capsys.readouterr().out
    assert "queue_p50" in printed and "decode_mean" in printed
    queued, slow = results["queued"], results["slow-decode"]
    assert queued["queue_p50"]["verdict"] == "worse" and queued["queue_p50"]["change"] > 100, queued["queue_p50"]
    assert abs(queued["decode_mean"]["relative_change"]) < 0.2, queued["decode_mean"]
    assert slow["decode_mean"]["verdict"] == "worse", slow["decode_mean"]
    assert slow["decode_mean"]["relative_change"] == pytest.approx(1.0, abs=0.25)
    assert abs(slow["queue_p50"]["change"]) < LATE_MS, slow["queue_p50"]
    # runs without the servers' times compare as before: no server rows, and a gate on one says why
    plain = tmp_path / "plain.jsonl"
    with sim_process(toy_tokenizer_dir, *sim_args()) as sim:
        run_locust(replay_args(tmp_path / "trace.jsonl", toy_tokenizer_dir, sim.url, plain), tmp_path)
    out = tmp_path / "plain.compare.json"
    assert main(["compare", str(plain), str(plain), "--json", str(out)]) == 0
    assert not {"queue_p50", "decode_mean", "rest_p99"} & {e["metric"] for e in json.loads(out.read_text())["metrics"]}
    assert main(["compare", str(plain), str(plain), "--fail-on", "queue_p99>+10%"]) == 2
    assert "no run has the servers' own times" in capsys.readouterr().err


def test_a_fleet_says_where_the_time_went_per_endpoint(tmp_path, toy_tokenizer_dir):
    """Two sims round-robin, one serving a request at a time: its requests queue, the other's do
    not, and the per-endpoint sections and lines say which."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=24, gap_ms=10, output_length=(10, 10))
    output = tmp_path / "fleet.jsonl"
    with sim_process(toy_tokenizer_dir, *sim_args("--per-request-metrics", "--max-num-seqs", "1")) as slow, \
            sim_process(toy_tokenizer_dir, *sim_args("--per-request-metrics")) as fast:
        proc = run_locust(replay_args(trace, toy_tokenizer_dir, slow.url, output, "--endpoints",
                                      f"{slow.url},{fast.url}"), tmp_path)  # fmt: skip
    endpoints = json.loads(summary_path(output).read_text())["endpoints"]
    queued, served = (endpoints[url]["server_timing"]["ttft_ms"] for url in (slow.url, fast.url))
    assert queued["requests"] == served["requests"] == 12
    assert largest_part(queued) == "queue" and queued["queue"]["p50"] > 200, queued["queue"]
    assert largest_part(served) == "prefill" and served["queue"]["p99"] < LATE_MS, served["queue"]
    lines = proc.stdout.split("Where the Time Went")[1].split("\n")
    row = next(line for line in lines if line.startswith(slow.url))
    assert row.split()[1].split("/")[0] == f"{queued['queue']['p50']:.1f}"

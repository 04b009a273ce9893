"""The fidelity certificate (replay.results.certificate, docs/fidelity.md): its sections on
records built by hand, in one process; then a real run against `replay sim` writing
OUTPUT.fidelity.json and the summary's section, a lying sim making the run unfaithful (exit 1
with --require-faithful), and the file on a full disk."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
from array import array
from bisect import bisect_right
from dataclasses import replace

import orjson
import pytest

from replay.results.arrivals import BINS_PER_DECADE, FLOOR_S, GapHistogram, gap_bin, ks_bounds
from replay.results.certificate import (
    BUSY_HOST,
    FAITHFUL,
    NOTHING_SENT,
    REMEDIES,
    SHARED_SERVER,
    UNFAITHFUL,
    WARM_CACHE,
    CertificateBuilder,
    format_certificate,
    miss_attribution,
)
from replay.results.host_load import busy_host, figures, sample
from replay.results.records import unsent_record
from replay.results.report import build_report, format_report
from replay.rules.run_files import fidelity_path, meta_path, summary_path
from replay.sim.process import sim_process
from replay.trace.record import TraceRow
from support.processes import replay_args, run_locust
from support.records import T0, ok_record, record
from support.traces import BLOCK, mooncake_trace


def certify(records: list[dict], cache: dict | None = None, server: dict | None = None, host: dict | None = None,
            **kwargs) -> dict:
    builder = CertificateBuilder(**kwargs)
    for r in records:
        builder.add(r)
    return builder.certificate(build_report(records)["drift_ms"], cache, server, host)


def sends(lags_ms: list[float], gap_s: float = 0.1, **fields) -> list[dict]:
    out = []
    for i, lag in enumerate(lags_ms):
        due = T0 + i * gap_s
        out.append(record(i, scheduled_at=due, sent_at=due + lag / 1000, drift_ms=lag, finished_at=due + 1,
                          prompt_tokens=100, output_tokens=10, received_tokens=10, worker=i % 3, **fields))
    return out


# -- the sections, on records built by hand ----------------------------------------------------------


def test_an_honest_run_is_faithful():
    rng = random.Random(0)
    records = [ok_record(i, rng) for i in range(500)]
    cert = certify(records)
    s = cert["schedule"]
    assert s["sends"] == 500 and s["unsent"] == 0 and s["late"] == 0 and s["late_worst"] == []
    assert s["on_time_share"] == sum(r["drift_ms"] <= 1.0 for r in records) / 500 < 0.99  # ok_record: up to 3 ms
    assert s["lag_ms"] == build_report(records)["drift_ms"]  # the summary's figures, one computation
    # due exactly 0.1 s apart, sent with up to 3 ms of jitter: the gaps spread over a few bins
    assert 0 < s["inter_arrival_ks"] <= s["inter_arrival_ks_upper_bound"] < 1
    assert s["count_gap_s"] == pytest.approx(max(r["drift_ms"] for r in records) / 1000, abs=2e-3)
    assert s["count_gap_requests"] == 1  # 0.1 s apart, sent within 3 ms: never two behind
    assert cert["prompts"] == {"ok_rows": 500, "counted": 500, "exact": 500, "exact_share": 1.0, "mismatches": 0,
                               "mismatch_worst": [], "uncounted": 0, "unsaid": 0}
    assert cert["outputs"]["exact_share"] == 1.0 and set(cert["outputs"]["others"].values()) == {0}
    assert cert["verdict"] == UNFAITHFUL and cert["failing"][0].startswith("schedule: ")
    on_time = certify(sends([0.2] * 200))
    assert on_time["verdict"] == FAITHFUL and on_time["failing"] == [], on_time["failing"]
    assert on_time["schedule"]["inter_arrival_ks_upper_bound"] == 0.0 and on_time["schedule"]["count_gap_s"] == pytest.approx(2e-4, abs=1e-6)
    assert on_time["unchecked"] == ["cache: no miss attribution (no finite-cache model of the server)"]


def test_an_overloaded_client_says_so_in_the_schedule_lines():
    """The sends fall further and further behind (a client that cannot keep up): p99 > 10 ms,
    the late rows listed worst first with their worker, the counts' gap in requests and seconds."""
    lags = [i * 0.5 for i in range(400)]  # 0 .. 199.5 ms behind, 100 ms apart due, 100.5 ms sent
    cert = certify(sends(lags))
    s = cert["schedule"]
    assert certify(sends(lags)[::-1])["schedule"] == s  # times in any order: sorted by the certificate
    assert s["lag_ms"]["p99"] > 10 and s["lag_ms"]["max"] == 199.5
    assert s["on_time_share"] == 3 / 400 and s["late"] == sum(lag > 10 for lag in lags)
    assert [w["request_id"] for w in s["late_worst"]] == list(range(399, 389, -1))
    assert s["late_worst"][0] == {"request_id": 399, "worker": 399 % 3, "lag_ms": 199.5}
    assert s["count_gap_s"] == pytest.approx(0.1995) and s["count_gap_requests"] == 2
    assert cert["verdict"] == UNFAITHFUL
    assert cert["failing"] == ["schedule: 0.75% of sends within 1 ms of their time (needs >= 99%); 379 late by > 10 ms"]
    text = "\n".join(format_certificate(cert, 50))
    assert "Sends late by > 10 ms:                   379" in text and "request 399 (worker 0): 199.50 ms late" in text
    # a burst sent evenly: the same sends, other inter-arrival times (KS 1: no gap is alike)
    burst = sends([0.0] * 100, gap_s=0.0)
    for i, r in enumerate(burst):
        r["sent_at"] = T0 + i * 0.01
        r["drift_ms"] = i * 10.0
    s = certify(burst)["schedule"]
    assert s["inter_arrival_ks"] == 1.0 and s["count_gap_requests"] == 99 and s["count_gap_s"] == pytest.approx(0.99)


def test_prompt_mismatches_and_rows_without_a_count():
    records = sends([0.1] * 30)
    for i, diff in ((3, -2), (7, 5), (9, 5), (12, 1)):
        records[i]["prompt_tokens"] = 100 + diff
    records[20]["prompt_tokens"] = None
    records[21].update(ok=False, status=500, error="HTTP 500", prompt_tokens=None)
    cert = certify(records)
    p = cert["prompts"]
    assert (p["ok_rows"], p["counted"], p["exact"], p["mismatches"], p["uncounted"]) == (29, 28, 24, 4, 1)
    assert [(w["request_id"], w["difference"]) for w in p["mismatch_worst"]] == [(7, 5), (9, 5), (3, -2), (12, 1)]
    assert cert["verdict"] == UNFAITHFUL
    assert cert["failing"] == ["prompts: 4 of 28 prompts the server counted differ from the trace's input_length "
                               "(needs 100% exact)"]
    no_usage = sends([0.1] * 5, )
    for r in no_usage:
        r["prompt_tokens"] = None
    cert = certify(no_usage)
    assert cert["verdict"] == FAITHFUL and "prompts: the server counted no prompt (no usage)" in cert["unchecked"]


def test_rows_of_their_own_messages_have_no_length_to_match():
    """A row that gives its messages and no input_length (AIPerf's `text_input`, `messages`) is
    recorded with input_length null: its prompt is counted apart, never a mismatch; a run of
    only such rows has its prompts unchecked, not unfaithful."""
    row = TraceRow(request_id=0, timestamp_s=0.0, input_length=0, output_length=5,
                   messages=[{"role": "user", "content": "hi"}])
    assert row.said_input_length is None and replace(row, messages=None).said_input_length == 0
    records = sends([0.1] * 10)
    for r in records[:4]:
        r["input_length"] = None
    cert = certify(records)
    p = cert["prompts"]
    assert (p["ok_rows"], p["counted"], p["exact"], p["mismatches"], p["unsaid"]) == (10, 6, 6, 0, 4)
    assert cert["verdict"] == FAITHFUL, cert["failing"]
    assert "  ok rows of their own prompts (not compared): 4" in "\n".join(format_certificate(cert, 50))
    for r in records:
        r["input_length"] = None
    cert = certify(records)
    assert cert["verdict"] == FAITHFUL and cert["failing"] == []
    assert "prompts: every row gave its own prompt, sent as it is: no length to match" in cert["unchecked"]


def test_output_reasons():
    records = sends([0.1] * 6)
    records[1].update(output_tokens=4, received_tokens=4)  # stopped short
    records[2].update(ok=False, status=503, error="HTTP 503")
    records[3].update(output_tokens=None, received_tokens=None)
    records[4].update(output_length=0, output_tokens=1, received_tokens=1)  # 0 asks for 1
    o = certify(records)["outputs"]
    assert (o["sent"], o["exact"]) == (6, 3)
    assert o["others"] == {"early stop allowed": 0, "server cut": 1, "error": 1, "no count": 1}
    assert certify(records, ignore_eos=False)["outputs"]["others"]["early stop allowed"] == 1


def test_the_cache_hook_decides_the_cache_line():
    infinite = {"expected_cached_tokens": 10, "observed_cached_tokens": 8, "ratio": 0.8}
    cert = certify(sends([0.1] * 3), cache=infinite)
    assert cert["cache"] == {"infinite": infinite, "misses": None} and cert["verdict"] == FAITHFUL
    misses = {"causes": {"evicted": {"requests": 2, "tokens": 64}, "unexplained": {"requests": 1, "tokens": 16},
                         "prompt-differs": {"requests": 0, "tokens": 0}}, "endpoints": {}, "notes": ["a note"]}
    assert miss_attribution({**infinite, "misses": misses}) is misses and miss_attribution(infinite) is None
    cert = certify(sends([0.1] * 3), cache={**infinite, "misses": misses})
    assert cert["cache"]["infinite"] == infinite and cert["cache"]["misses"] is misses
    assert cert["verdict"] == UNFAITHFUL and cert["failing"] == ["cache: 1 requests unexplained (needs 0)"]
    assert "  cache evicted: 2 requests, 64 tokens" in format_certificate(cert, 50)


def test_number_edges():
    """Zero rows, one row, every row failed or never sent, equal times: no division by zero, no NaN."""
    empty = certify([])
    assert empty["verdict"] == NOTHING_SENT and empty["failing"] == ["schedule: no request was sent"]
    assert empty["remedies"][0].startswith("the run sent no request")  # no one's fault named: not the replay's
    assert empty["schedule"]["inter_arrival_ks"] is None and empty["schedule"]["count_gap_s"] is None
    assert empty["prompts"]["exact_share"] is None and empty["outputs"]["exact_share"] is None
    one = certify(sends([0.3]))
    assert one["verdict"] == FAITHFUL and one["schedule"]["inter_arrival_ks"] is None
    assert one["schedule"]["count_gap_requests"] == 1 and one["schedule"]["count_gap_s"] == pytest.approx(3e-4, abs=1e-6)
    failed = sends([0.1] * 4)
    for r in failed:
        r.update(ok=False, status=500, error="HTTP 500", prompt_tokens=None, output_tokens=None)
    cert = certify(failed)
    assert cert["outputs"]["others"]["error"] == 4 and cert["prompts"]["ok_rows"] == 0
    row = TraceRow(request_id=0, timestamp_s=0.0, input_length=10, output_length=2, session_id=None, line=1)
    unsent = [unsent_record(row, worker=None, api="openai-chat", scheduled_at=None, reason="run stopped")]
    cert = certify(unsent)
    assert cert["schedule"]["unsent"] == 1 and cert["outputs"]["sent"] == 0
    same_time = sends([0.0] * 5, gap_s=0.0)  # a burst due at one instant, sent at it
    assert certify(same_time)["schedule"]["inter_arrival_ks"] == 0.0
    for each in (empty, one, cert):
        orjson.dumps(each)  # every value is JSON (orjson refuses NaN only by writing null: none here)
        assert "nan" not in json.dumps(each).lower()
        format_certificate(each, 50)


def test_the_binned_ks_brackets_the_exact_one():
    def times(gaps: list[float]) -> array:
        return array("d", itertools.accumulate(gaps, initial=T0))

    def exact(a: list[float], b: list[float]) -> float:
        return max(abs(bisect_right(sorted(a), t) / len(a) - bisect_right(sorted(b), t) / len(b)) for t in a + b)

    rng = random.Random(1)
    a = [rng.expovariate(10) for _ in range(2000)]
    b = [rng.expovariate(12) for _ in range(2000)]
    a_times, b_times = times(a), times(b)
    a = [y - x for x, y in zip(a_times, a_times[1:])]  # the gaps as the times give them back
    b = [y - x for x, y in zip(b_times, b_times[1:])]
    low, high = ks_bounds(GapHistogram(a_times), GapHistogram(b_times))
    assert low <= exact(a, b) <= high and high - low < 0.01
    # a fixed rate, kept or not: every bin holds one value, so the statistic is exact
    due, sent = [0.1] * 50, [0.1] * 25 + [0.2] * 25
    assert ks_bounds(GapHistogram(times(due)), GapHistogram(times(due))) == (0.0, 0.0)
    low, high = ks_bounds(GapHistogram(times(due)), GapHistogram(times(sent)))
    assert low == high == pytest.approx(0.5)
    assert gap_bin(0.0) == 0 and gap_bin(FLOOR_S) == 1 and gap_bin(10 * FLOOR_S) == 1 + BINS_PER_DECADE


def test_the_summary_prints_it():
    report = build_report(sends([0.1] * 3))
    report["fidelity"] = certify(sends([0.1] * 3))
    assert "Fidelity Certificate" in format_report(report) and "Verdict:                                 faithful" \
        in format_report(report)


# -- real runs ---------------------------------------------------------------------------------------


def test_a_run_writes_its_certificate(tmp_path, toy_tokenizer_dir, sim):
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=20, gap_ms=50)
    output = tmp_path / "run.jsonl"
    proc = run_locust(replay_args(trace, toy_tokenizer_dir, sim.url, output), tmp_path)  # its verdict: the clock's
    cert = json.loads(fidelity_path(output).read_text())
    assert json.loads(summary_path(output).read_text())["fidelity"] == cert
    assert cert["schedule"]["sends"] == 20 and cert["prompts"]["exact_share"] == 1.0
    assert cert["outputs"]["exact_share"] == 1.0
    assert "Fidelity Certificate" in proc.stdout and "Prompts exact (server-counted):          100.00% of 20" \
        in proc.stdout
    # the host while it sent, read from /proc by the process that sent (one process: senders_here), kept in
    # the meta for `replay report`; whether it counts as busy is the rule's (tested on recorded figures above)
    host = cert["schedule"]["host"]
    assert host["senders_here"] is True and host["wall_s"] > 0.5 and 0 <= host["others_share"] <= 1
    assert json.loads(meta_path(output).read_text())["host_load"] == host
    # late sends that waited for other sends are the replay's own pace, whatever the host (the rule's order)
    expected_busy = None if cert["schedule"]["queued"] else busy_host(host)
    assert cert["schedule"]["busy_host"] == expected_busy and "Host while sending:" in proc.stdout
    assert cert["usage"]["prompt_tokens"]["status"] == "agrees"  # the sim's usage is its counters'
    # `replay report` says the same (its --json too); the schedule's lines are the run's own
    out = tmp_path / "report.json"
    report = subprocess.run([sys.executable, "-m", "replay", "report", str(output), "--json", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert json.loads(out.read_text())["fidelity"] == cert and "Fidelity Certificate" in report.stdout


def test_a_run_whose_client_cannot_keep_up_says_so(tmp_path, toy_tokenizer_dir, sim):
    """A real run asked for far more than one process can send (3,000 rows 0.05 ms apart: 20,000
    a second): the sends fall behind, and the certificate's schedule lines say so."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=3000, gap_ms=0.05, output_length=(1, 2))
    output = tmp_path / "run.jsonl"
    proc = run_locust(replay_args(trace, toy_tokenizer_dir, sim.url, output, "--require-faithful",
                                  "--verify-server", "off"), tmp_path, exit_code=1)  # fmt: skip
    s = json.loads(fidelity_path(output).read_text())["schedule"]
    assert s["sends"] == 3000 and s["lag_ms"]["p99"] > 10 and s["late"] > 0 and len(s["late_worst"]) == 10
    assert s["on_time_share"] < 0.99 and s["count_gap_s"] > 0.01
    assert "fidelity: unfaithful (schedule: " in proc.stderr
    assert f"Sends late by > 10 ms:                   {s['late']}" in proc.stdout


def test_require_faithful_exits_1_on_an_unfaithful_run(tmp_path, toy_tokenizer_dir):
    """A server whose prompt counts are false (`replay sim --false-usage`) and that has no /metrics
    to check them against: every prompt differs, as far as anything can tell. (With /metrics the
    counters tell: test_a_server_lying_about_prompt_tokens_is_found_out_by_its_counters.)"""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=8, gap_ms=20)
    output = tmp_path / "run.jsonl"
    with sim_process(toy_tokenizer_dir, "--block-size", str(BLOCK), "--ttft-ms", "2", "--itl-ms", "1",
                     "--false-usage", json.dumps({"prompt_tokens": 1}), "--no-metrics") as lying:
        proc = run_locust(replay_args(trace, toy_tokenizer_dir, lying.url, output, "--require-faithful",
                                      "--verify-server", "off", "--server-block-size", str(BLOCK)), tmp_path,
                          exit_code=1)
    cert = json.loads(fidelity_path(output).read_text())
    assert cert["verdict"] == UNFAITHFUL and cert["prompts"]["mismatches"] == 8
    # (a loaded host may fail the schedule line too: it would come first)
    assert "fidelity: unfaithful (" in proc.stderr and "prompts: 8 of 8 prompts" in proc.stderr
    assert "--require-faithful: exit code 1" in proc.stderr


def test_a_server_lying_about_prompt_tokens_is_found_out_by_its_counters(tmp_path, toy_tokenizer_dir):
    """The same lying server with its /metrics: its prompt-token counter counted exactly the
    tokens the run sent, so its usage is false, not the prompts: the prompts line is judged from
    the counter and passes, and no request is called a replay bug."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=8, gap_ms=20)
    output = tmp_path / "run.jsonl"
    with sim_process(toy_tokenizer_dir, "--block-size", str(BLOCK), "--ttft-ms", "2", "--itl-ms", "1",
                     "--false-usage", json.dumps({"prompt_tokens": 1})) as lying:
        proc = run_locust(replay_args(trace, toy_tokenizer_dir, lying.url, output, "--verify-server", "off",
                                      "--reset-server-cache"), tmp_path)
    cert = json.loads(fidelity_path(output).read_text())
    prompts = cert["usage"]["prompt_tokens"]
    assert prompts["status"] == "disagrees" and prompts["usage"] == 8 and prompts["counters"] == prompts["sent"]
    assert not any(line.startswith(("prompts", "cache")) for line in cert["failing"]), cert["failing"]
    assert cert["cache"]["judged_from"] == "counters" and "a replay bug" not in proc.stdout
    assert f"Prompts exact (server /metrics):         {prompts['sent']} tokens counted" in proc.stdout
    # the summary's note on the difference says it once, and names the false usage, not other traffic
    notes = [line for line in proc.stdout.splitlines() if "prompt tokens against the records" in line]
    assert len(notes) == 1 and "usage is false" in notes[0] and "other traffic" not in notes[0], notes
    summary = json.loads(summary_path(output).read_text())  # the JSON says what the printed line says
    server_notes = [e["note"] for e in (*summary["server"]["endpoints"].values(), summary["server"]["total"])]
    assert any("usage is false" in (n or "") for n in server_notes), server_notes
    assert not any("other traffic" in (n or "") for n in server_notes), server_notes


def test_a_lying_server_is_not_the_replays_fault_on_rows_of_their_own_prompts(tmp_path, toy_tokenizer_dir):
    """Rows that give their own text (AIPerf's text_input) say no length the run can set against
    the server's counters: the usage cannot be proven false, so the misses its false
    cached_tokens make are not blamed on the replay, and no prompt is judged."""
    trace = tmp_path / "own.jsonl"
    words = "bada kelo misu ra tove lin pemo"
    trace.write_text("".join(json.dumps({"timestamp": 20 * i, "text_input": f"{words} {i}", "output_length": 3}) + "\n"
                             for i in range(8)))
    output = tmp_path / "run.jsonl"
    with sim_process(toy_tokenizer_dir, "--block-size", str(BLOCK), "--ttft-ms", "2", "--itl-ms", "1",
                     "--false-usage", json.dumps({"prompt_tokens": 60, "cached_tokens": 40})) as lying:
        run_locust(replay_args(trace, toy_tokenizer_dir, lying.url, output, "--verify-server", "off",
                               "--reset-server-cache"), tmp_path)
    cert = json.loads(fidelity_path(output).read_text())
    assert cert["usage"]["prompt_tokens"]["sent"] is None and cert["usage"]["prompt_tokens"]["status"] == "unknown"
    assert cert["verdict"] != UNFAITHFUL and not any(f.startswith(("prompts", "cache")) for f in cert["failing"]), \
        cert["failing"]  # fmt: skip
    assert cert["prompts"]["unsaid"] == 8


def test_a_broken_prompt_is_prompt_differs_and_unfaithful(tmp_path, toy_tokenizer_dir, monkeypatch):
    """The test hook $TRACEREPLAY_TEST_BREAK_BLOCK (docs/testing.md): the worker gives hash id 3
    (family 0's fourth block) each row's own words, so those rows keep their lengths (the prompts
    line stays exact) but stop sharing the block: the cache model names them prompt-differs, the
    verdict is unfaithful, and --require-faithful exits 1."""
    from replay.synth.prompts import BREAK_BLOCK_ENV
    from support.cache_model import SIM_BLOCK, reuse_trace

    trace = reuse_trace(tmp_path / "trace.jsonl", rows=40)
    output = tmp_path / "run.jsonl"
    monkeypatch.setenv(BREAK_BLOCK_ENV, "3")
    with sim_process(toy_tokenizer_dir, "--block-size", str(SIM_BLOCK), "--ttft-ms", "2", "--itl-ms", "1",
                     "--eos-prob", "0") as sim:
        proc = run_locust(replay_args(trace, toy_tokenizer_dir, sim.url, output, "--require-faithful"), tmp_path,
                          exit_code=1)
    cert = json.loads(fidelity_path(output).read_text())
    assert cert["prompts"]["exact_share"] == 1.0
    fingerprints = cert["cache"]["infinite"]["fingerprints"]  # the evidence: the prompts as sent
    assert fingerprints["differ"] > 0 and fingerprints["checked"] == 40, fingerprints
    assert any(line.startswith(f"prompts: {fingerprints['differ']} of 40 prompts sent differ") for line in cert["failing"])
    differs = cert["cache"]["misses"]["causes"]["prompt-differs"]
    assert differs["requests"] > 0 and differs["tokens"] > 0, cert["cache"]["misses"]
    assert cert["verdict"] == UNFAITHFUL and f"cache: {differs['requests']} requests prompt-differs (needs 0)" \
        in cert["failing"]
    assert "--require-faithful: exit code 1" in proc.stderr and "a replay bug" in proc.stdout


# -- whose doing a failure is: the server's usage, a warm cache, a busy host ------------------------------
def server_section(prompt_tokens: int, records_prompt_tokens: int, hits: int, records_cached_tokens: int,
                   preemptions: int = 0) -> dict:
    """The `server` section's fleet total as replay.results.server_metrics makes it from /metrics."""
    return {"endpoints": {}, "total": {"prompt_tokens": prompt_tokens, "records_prompt_tokens": records_prompt_tokens,
                                       "prefix_cache_hits": hits, "records_cached_tokens": records_cached_tokens,
                                       "preemptions": preemptions, "endpoints_without_metrics": []}}


def cache_section(low: int, high: int, causes: dict[str, int] | None = None, served_before=()) -> dict:
    """A cache section with the model's attribution (`causes`: {cause: requests}) and the range of
    cached tokens the run's prompts give over every request (`all_requests`)."""
    counts = {cause: {"requests": n, "tokens": 16 * n} for cause, n in (causes or {}).items()}
    return {"expected_cached_tokens": high, "observed_cached_tokens": 0, "requests_compared": 3,
            "all_requests": {"requests": 3, "expected": high, "low": low, "high": high},
            "misses": {"causes": counts, "endpoints": {}, "notes": [], "served_before": list(served_before),
                       "model": {"predicted_cached_tokens_all": low}}}


def test_a_server_whose_usage_its_counters_contradict_is_judged_by_its_counters():
    """cached_tokens 0 in every answer while /metrics counted the hits the prompts give: the usage
    is not evidence (its per-request causes, a replay bug among them, are not judged); the cache
    line is judged from the counter. A counter outside what the prompts give still fails."""
    records = sends([0.1] * 3, cached_tokens=0)
    sent = sum(r["input_length"] for r in records)
    cache = cache_section(96, 128, {"prompt-differs": 3})
    cert = certify(records, cache, server=server_section(sent, sent, 112, 0))
    assert cert["usage"]["cached_tokens"] == {"usage": 0, "counters": 112, "status": "disagrees"}
    assert cert["usage"]["prompt_tokens"]["status"] == "agrees"
    assert cert["verdict"] == FAITHFUL and cert["failing"] == [], cert["failing"]
    assert cert["cache"]["judged_from"] == "counters"
    text = "\n".join(format_certificate(cert, 50))
    assert "usage 0 / 112: disagrees, judged from /metrics" in text and "a replay bug" not in text
    outside = certify(records, cache, server=server_section(sent, sent, 40, 0))
    assert outside["verdict"] == UNFAITHFUL and outside["failing"] == [
        "cache: the server's counters show 40 prefix-cache hit tokens, outside the 96..128 this run's prompts give "
        "(its usage cannot name the requests)"]
    # the same usage with the counters agreeing: the per-request causes are judged, as before
    honest = certify(sends([0.1] * 3, cached_tokens=0), cache, server=server_section(sent, sent, 0, 0))
    assert honest["usage"]["cached_tokens"]["status"] == "agrees"
    assert honest["failing"] == ["cache: 3 requests prompt-differs (needs 0)"]
    # a server whose usage has no cached_tokens (vLLM without --enable-prompt-tokens-details): by the counter too
    silent = certify(sends([0.1] * 3), cache_section(96, 128), server=server_section(sent, sent, 112, 0))
    assert silent["usage"]["cached_tokens"]["status"] == "absent" and silent["cache"]["judged_from"] == "counters"
    assert silent["verdict"] == FAITHFUL and silent["cache"]["counters"] == {"prefix_cache_hits": 112, "low": 96,
                                                                             "high": 128}
    # other traffic on the server (it counted prompts the run did not send): nothing can be said of the usage
    busy = certify(records, cache, server=server_section(sent + 500, sent, 112, 0))
    assert busy["usage"]["cached_tokens"]["status"] == "unknown"
    assert busy["failing"] == ["cache: 3 requests prompt-differs (needs 0)"]
    # ... nor can the counter judge a usage without cached_tokens: others' hits are in it
    shared = certify(sends([0.1] * 3), cache, server=server_section(sent + 500, sent, 500, 0))
    assert shared["usage"]["cached_tokens"]["status"] == "absent" and shared["verdict"] == FAITHFUL
    assert shared["unchecked"][-1].startswith("cache: the server's usage cannot be taken and its counters cannot judge")


def test_a_server_lying_about_prompt_tokens_is_judged_by_its_prompt_counter():
    records = sends([0.1] * 4)
    for r in records:
        r["prompt_tokens"] = 1
    sent = sum(r["input_length"] for r in records)
    cert = certify(records, server=server_section(sent, 4, 0, 0))
    assert cert["usage"]["prompt_tokens"] == {"usage": 4, "counters": sent, "sent": sent, "status": "disagrees"}
    assert cert["verdict"] == FAITHFUL and not any(f.startswith("prompts") for f in cert["failing"])
    assert f"Prompts exact (server /metrics):         {sent} tokens counted of {sent} sent" \
        in format_certificate(cert, 50)
    # without counters the usage is all there is: the prompts line fails as before
    assert certify(records)["failing"][0].startswith("prompts: 4 of 4 prompts")


def test_a_warm_cache_is_a_verdict_of_its_own_with_its_remedy():
    """Hits from prompts the server cached before the run are not the trace's cache behaviour:
    the verdict says warm-cache (not faithful: --require-faithful fails it) and how to get a cold one."""
    cert = certify(sends([0.1] * 3), cache_section(0, 0, {"warm-at-start": 2}, served_before=["http://a"]))
    assert cert["verdict"] == WARM_CACHE
    assert cert["failing"] == ["cache: 2 requests hit prompts cached before this run (warm-at-start)"]
    assert cert["remedies"] == [REMEDIES[WARM_CACHE]] and "--reset-server-cache" in REMEDIES[WARM_CACHE]
    assert "  remedy: the server's cache held prompts from before this run" in "\n".join(format_certificate(cert, 50))
    # a replay bug beside it: the replay's is the verdict, both remedies... the replay's has none
    both = certify(sends([0.1] * 3), cache_section(0, 0, {"warm-at-start": 2, "unexplained": 1}))
    assert both["verdict"] == UNFAITHFUL and both["remedies"] == [REMEDIES[WARM_CACHE]]


# figures as replay.results.host_load.figures records them (OUTPUT.meta.json's host_load)
QUIET = {"senders_here": True, "cpus": 2, "wall_s": 60.0, "busy_share": 0.05, "own_share": 0.02,
         "own_core_share": 0.04, "others_share": 0.03, "steal_share": 0.0, "load_1m": 0.3, "waited_share": 0.0002}
BUSY = {**QUIET, "busy_share": 0.99, "others_share": 0.97, "load_1m": 6.2, "waited_share": 0.049}


def test_late_sends_on_a_busy_host_are_the_hosts_doing():
    """The same late sends, with the host figures a run recorded: on a busy host the verdict
    says busy-host and why; on a quiet one the replay is unfaithful; a replay that wanted a
    whole core is its own limit on any host; a master whose workers send elsewhere cannot say."""
    late = sends([0.2] * 80 + [3.0] * 20)
    busy = certify(late, host=BUSY)
    assert busy["verdict"] == BUSY_HOST and busy["schedule"]["busy_host"] == (
        "other processes used 97% of its 2 CPUs; load average 6.2 on 2 CPUs; the replay waited for a CPU 4.9% of the "
        "time")
    assert busy["failing"] == ["schedule: 80.00% of sends within 1 ms of their time (needs >= 99%); 0 late by > 10 ms; "
                               "the host was busy: " + busy["schedule"]["busy_host"]]
    assert busy["remedies"] == [REMEDIES[BUSY_HOST]]
    text = "\n".join(format_certificate(busy, 50))
    assert "Host while sending:                      others 97% of 2 CPUs, replay 4% of a core" in text
    assert certify(late, host=QUIET)["verdict"] == UNFAITHFUL
    limited = certify(late, host={**BUSY, "own_core_share": 0.2, "waited_share": 0.6})  # it wanted 80% of a core
    assert limited["verdict"] == UNFAITHFUL and limited["failing"][0].endswith(
        "; the replay itself wanted 80% of a core: at this rate one process cannot keep up (more workers: "
        "--processes N, docs/distributed.md)")
    assert certify(late, host={**BUSY, "senders_here": False})["verdict"] == UNFAITHFUL
    assert certify(late)["verdict"] == UNFAITHFUL  # no figures (no /proc)
    assert certify(sends([0.2] * 100), host=BUSY)["verdict"] == FAITHFUL  # a busy host that did not make them late
    assert busy_host({**QUIET, "steal_share": 0.08}) == "the hypervisor took 8% (steal)"
    # rows due together, sent 50 us apart: the late ones left after others (they queued): the replay's pace
    burst = sends([0.0] * 100, gap_s=0.0)
    for i, r in enumerate(burst):
        r["sent_at"], r["drift_ms"] = T0 + i * 5e-5, i * 0.05
    queued = certify(burst, host=BUSY)
    assert queued["verdict"] == UNFAITHFUL and queued["schedule"]["busy_host"] is None
    assert queued["failing"][0].endswith("; 79 of the 79 sends over 1 ms late waited for other sends to leave: the "
                                         "replay could not send this fast (more workers: --processes N, "
                                         "docs/distributed.md)")


def test_host_figures_from_proc(tmp_path):
    """host_load.sample reads /proc's files (here a copy with figures of our own) and figures()
    turns two samples into shares."""
    import os

    def write(cpu: list[int], load: str, waited_ns: int) -> None:
        (tmp_path / "self").mkdir(exist_ok=True)
        (tmp_path / "stat").write_text("cpu  " + " ".join(map(str, cpu)) + " 0 0\ncpu0 1 2 3\n")
        (tmp_path / "loadavg").write_text(f"{load} 1.00 1.00 2/300 999\n")
        (tmp_path / "self" / "schedstat").write_text(f"5000 {waited_ns} 7\n")

    tick = os.sysconf("SC_CLK_TCK")
    write([100, 0, 50, 1000, 0, 0, 0, 0], "0.50", 0)
    start = sample(tmp_path)
    write([100 + 150 * tick // 100, 0, 50, 1000 + 50 * tick // 100, 0, 0, 0, 0], "3.50", 10**9)  # 1.5 s busy of 2 s
    end = sample(tmp_path)
    assert start is not None and end is not None and end.load_1m == 3.5
    end = end.__class__(**{**end.__dict__, "t": start.t + 10.0, "own_s": start.own_s})
    host = figures(start, end, senders_here=True)
    assert host["busy_share"] == pytest.approx(0.75) and host["others_share"] == pytest.approx(0.75)
    assert host["waited_share"] == pytest.approx(0.1) and host["load_1m"] == 3.5
    assert sample(tmp_path / "nothing") is None and figures(start, None, senders_here=True) is None


def test_a_burst_sent_one_after_another_is_explained_where_the_ks_is_printed():
    burst = sends([0.0] * 100, gap_s=0.0)
    for i, r in enumerate(burst):  # due together, sent 5 us apart
        r["sent_at"] = T0 + i * 5e-6
        r["drift_ms"] = i * 0.005
    cert = certify(burst)
    s = cert["schedule"]
    assert s["inter_arrival_ks"] == 1.0 and s["inter_arrival_ks_at_resolution"] == 0.0
    assert cert["verdict"] == FAITHFUL
    text = "\n".join(format_certificate(cert, 50))
    assert "Inter-arrival KS (achieved vs due):      1.0000 (not judged: each send's lag is)" in text
    assert "0.0000 with gaps under 1 ms as 0: rows due at one instant leave one after another" in text


def test_hits_from_other_clients_of_the_server_are_a_shared_server():
    """Two replays of one trace at once against one server (seen: 22 of 40 requests hit more than
    their run's prompts give, 'unexplained'): the prompt counter counted tokens this run did not
    send, so the hits beyond are other clients', not the replay's fault."""
    records = sends([0.1] * 3, cached_tokens=32)
    sent = sum(r["input_length"] for r in records)
    cache = cache_section(0, 64, {"unexplained": 2})
    cache["misses"]["model"]["beyond_causes"] = {"unexplained": {"requests": 2, "tokens": 32, "examples": [1, 2]}}
    shared = certify(records, cache, server=server_section(sent + 300, sent, 96, 96))
    assert shared["verdict"] == SHARED_SERVER and shared["remedies"] == [REMEDIES[SHARED_SERVER]]
    assert shared["failing"] == ["cache: 2 requests hit more than this run's prompts give while the server served "
                                 "other traffic (300 prompt tokens the run did not send)"]
    alone = certify(records, cache, server=server_section(sent, sent, 96, 96))  # no other traffic: unexplained
    assert alone["verdict"] == UNFAITHFUL and alone["failing"] == ["cache: 2 requests unexplained (needs 0)"]


# -- the client's TTFT against the server's own (replay.rules.server_timing) -------------------------


def timed_sends(excess_ms: list[float], source: str) -> list[dict]:
    """On-time sends whose client TTFT is the server's own plus `excess_ms` (the rest)."""
    out = sends([0.2] * len(excess_ms))
    for r, excess in zip(out, excess_ms):
        r.update(ttft_ms=40.0 + excess, server_queue_ms=10.0, server_prefill_ms=30.0, server_ttft_ms=40.0,
                 server_timing_source=source)
    return out


def test_a_client_ttft_far_over_a_spans_is_the_clients_or_the_networks():
    near = certify(timed_sends([2.0] * 200, "span"))
    assert near["verdict"] == FAITHFUL and near["failing"] == [], near["failing"]
    assert near["server_ttft"] == {"compared": {"span": 200}, "bound_ms": 50.0, "over_bound": {}, "over_worst": [],
                                   "server_over_client": 0}
    slow = certify(timed_sends([2.0] * 197 + [80.0, 90.0, 120.0], "span"))  # 3 of 200: over 1%
    assert slow["verdict"] == UNFAITHFUL
    assert slow["failing"] == ["server TTFT: 3 of 200 requests' TTFT exceeds the server's own (its trace span's, from "
                               "its arrival) by > 50 ms (needs <= 1%): their TTFT is the client's or the network's, "
                               "not the server's"]
    assert [w["request_id"] for w in slow["server_ttft"]["over_worst"]] == [199, 198, 197]
    assert certify(timed_sends([2.0] * 199 + [80.0], "span"))["verdict"] == FAITHFUL  # 1 of 200: within 1%
    text = "\n".join(format_certificate(slow, 50))
    assert "Client TTFT over server's by > 50 ms:    3 of 200" in text and "request 199: client 160.0 ms" in text


def test_an_answers_ttft_leaves_out_the_front_end_so_the_excess_is_not_judged():
    cert = certify(timed_sends([200.0] * 50, "answer"))  # a front end tokenizing long prompts: not the client
    assert cert["verdict"] == FAITHFUL and cert["server_ttft"]["over_bound"] == {"answer": 50}
    assert any(u.startswith("server TTFT: 50 requests' server TTFT is their answers'") for u in cert["unchecked"])
    impossible = certify(timed_sends([-5.0] * 3 + [1.0] * 10, "answer"))
    assert impossible["server_ttft"]["server_over_client"] == 3
    assert any("cannot be true" in u for u in impossible["unchecked"])
    assert certify(sends([0.2] * 20))["server_ttft"]["compared"] == {}  # no server times: nothing said


def test_an_answers_record_whose_ttft_a_span_gave_is_judged_as_a_spans():
    """Both sources: the answer's queue and prefill kept, the span's TTFT (from the server's
    arrival) in server_ttft_ms; the excess is judged, never sent back to --otlp-receiver."""
    records = timed_sends([80.0] * 10 + [2.0] * 10, "answer")
    for r in records:
        r.update(server_ttft_ms=45.0, ttft_ms=r["ttft_ms"] + 5.0, server_e2e_ms=90.0)  # 5 ms of front end
    cert = certify(records)
    assert cert["server_ttft"]["compared"] == {"span": 20} and cert["server_ttft"]["over_bound"] == {"span": 10}
    assert cert["verdict"] == UNFAITHFUL and not any("--otlp-receiver" in u for u in cert["unchecked"])

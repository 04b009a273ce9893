"""`replay report` on hand-built results files: every number checked against values computed
here independently (statistics.quantiles 'inclusive' is numpy's linear percentile, as vLLM uses),
failed and never-sent rows included."""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys

import pytest

from replay.cli import main
from replay.results.records import RUN_STOPPED, WORKER_LOST
from replay.results.report import ReportError, build_report, format_report, parse_slo
from support.records import T0, ok_record, record
from support.traces import write_jsonl


@pytest.fixture
def records() -> list[dict]:
    rng = random.Random(3)
    recs = [ok_record(i, rng) for i in range(57)]
    one = recs[0]  # a one-token reply: no TPOT, no ITL
    one.update(output_length=1, output_tokens=1, ttft_ms=30.0, e2e_ms=31.0, tpot_ms=None, itl_ms=[],
               finished_at=one["sent_at"] + 0.031)  # fmt: skip
    # sent, answered with an error status
    recs.append(record(57, scheduled_at=T0 + 5.7, sent_at=T0 + 5.701, finished_at=T0 + 5.75, drift_ms=1.0, e2e_ms=49.0,
                       status=503, ok=False, error="HTTP 503: overloaded"))  # fmt: skip
    # sent, connection reset mid-stream; finishes last of all, so it ends the benchmark
    recs.append(record(58, scheduled_at=T0 + 5.8, sent_at=T0 + 5.8005, finished_at=T0 + 60.0, drift_ms=0.5,
                       status=200, ok=False, error="ConnectionResetError: [Errno 104] Connection reset by peer"))  # fmt: skip
    # never sent
    recs.append(record(59, scheduled_at=T0 + 5.9, status=0, ok=False, error=RUN_STOPPED))
    recs.append(record(60, scheduled_at=None, worker=None, status=0, ok=False, error=WORKER_LOST))
    recs.append(record(61, scheduled_at=T0 + 6.1, status=0, ok=False, error=RUN_STOPPED))
    return recs


def pct(values, p):
    """numpy.percentile(values, p) (linear), computed another way."""
    v = sorted(values)
    if len(v) == 1:
        return v[0]
    return statistics.quantiles(v, n=100, method="inclusive")[p - 1]


def check_distribution(d: dict, values: list[float]) -> None:
    assert d["mean"] == pytest.approx(statistics.fmean(values))
    assert d["std"] == pytest.approx(statistics.pstdev(values))
    assert d["median"] == pytest.approx(statistics.median(values))
    for p in (25, 50, 75, 90, 99):
        assert d[f"p{p}"] == pytest.approx(pct(values, p)), p


def test_every_number_of_the_summary(records):
    slo = {"ttft_ms": 250.0, "tpot_ms": 20.0, "e2e_ms": 800.0}
    report = build_report(records, slo)
    ok = [r for r in records if r["ok"]]
    assert (report["requests"], report["requests_ok"], report["requests_failed"]) == (62, 57, 5)
    assert report["requests_unsent"] == 3
    assert report["failures"] == {RUN_STOPPED: 2, "HTTP 503": 1, WORKER_LOST: 1,
                                  "ConnectionResetError: [Errno 104] Connection reset by peer": 1}  # fmt: skip
    assert report["failures_by_status"] == {"0": 3, "503": 1, "200": 1}

    duration = T0 + 60.0 - min(r["sent_at"] for r in records if r["sent_at"] is not None)
    assert report["duration_s"] == pytest.approx(duration)
    inp = sum(r["prompt_tokens"] for r in ok)
    out = sum(r["output_tokens"] for r in ok)
    assert (report["total_input_tokens"], report["total_output_tokens"]) == (inp, out)
    assert report["request_throughput"] == pytest.approx(57 / duration)
    assert report["input_token_throughput"] == pytest.approx(inp / duration)
    assert report["output_token_throughput"] == pytest.approx(out / duration)
    assert report["total_token_throughput"] == pytest.approx((inp + out) / duration)

    check_distribution(report["ttft_ms"], [r["ttft_ms"] for r in ok])
    check_distribution(report["tpot_ms"], [r["tpot_ms"] for r in ok if r["tpot_ms"] is not None])
    check_distribution(report["itl_ms"], [x for r in ok for x in r["itl_ms"]])
    check_distribution(report["e2e_ms"], [r["e2e_ms"] for r in ok])

    drifts = [r["drift_ms"] for r in records if r["drift_ms"] is not None]
    assert len(drifts) == 59
    assert report["drift_ms"]["p50"] == pytest.approx(pct(drifts, 50))
    assert report["drift_ms"]["p99"] == pytest.approx(pct(drifts, 99))
    assert report["drift_ms"]["max"] == max(drifts)

    def good(r):  # vLLM: every SLO met; a 1-token reply has TPOT 0
        tpot = r["tpot_ms"] if r["output_tokens"] > 1 else 0.0
        return r["ttft_ms"] <= 250 and tpot <= 20 and r["e2e_ms"] <= 800

    n_good = sum(good(r) for r in ok)
    assert 5 < n_good < 50  # the SLO cuts both ways
    assert any(r["output_tokens"] == 1 and good(r) for r in ok)
    assert report["requests_good"] == n_good
    assert report["goodput_rps"] == pytest.approx(n_good / duration)


def test_goodput_absent_without_slo_and_each_slo_alone(records):
    assert build_report(records)["goodput_rps"] is None
    ok = [r for r in records if r["ok"]]
    report = build_report(records, {"e2e_ms": 500.0})
    assert report["requests_good"] == sum(r["e2e_ms"] <= 500 for r in ok)
    # a request without the metric an SLO needs cannot meet it
    unstreamed = [dict(r, ttft_ms=None) for r in ok]
    assert build_report(unstreamed, {"ttft_ms": 1e9})["requests_good"] == 0


def test_vllm_block_layout(records):
    text = format_report(build_report(records, {"ttft_ms": 250.0}))
    lines = text.splitlines()
    assert lines[0] == "{s:=^50}".format(s=" Serving Benchmark Result ")
    assert lines[-1] == "=" * 50
    for header in ("Time to First Token", "Time per Output Token (excl. 1st token)", "Inter-token Latency",
                   "End-to-end Latency", "Dispatch Drift (sent - scheduled)"):  # fmt: skip
        assert f"{header:-^50}" in lines
    assert "{:<40} {:<10}".format("Successful requests:", 57) in lines
    assert "{:<40} {:<10}".format("Failed requests:", 5) in lines
    for label in ("Mean", "Median", "Std", "P25", "P50", "P75", "P90", "P99"):
        for name in ("TTFT", "TPOT", "ITL", "E2EL"):
            assert any(line.startswith(f"{label} {name} (ms):") for line in lines), (label, name)
    assert any(line.startswith("Request goodput (req/s):") for line in lines)
    assert "  2 x run stopped" in lines


def test_parse_slo():
    assert parse_slo("ttft_ms=500, tpot_ms=50,e2e_ms=1e4") == {"ttft_ms": 500.0, "tpot_ms": 50.0, "e2e_ms": 10000.0}
    assert parse_slo(None) == {}
    for bad in ("ttft=5", "ttft_ms", "ttft_ms=fast", "e2e_ms=0"):
        with pytest.raises(ReportError, match="--slo"):
            parse_slo(bad)


def test_only_unsent_rows():
    recs = [record(i, status=0, ok=False, error=RUN_STOPPED) for i in range(3)]
    report = build_report(recs, {"ttft_ms": 1.0})
    assert report["duration_s"] == 0 and report["request_throughput"] == 0 and report["goodput_rps"] == 0
    assert report["ttft_ms"]["p99"] is None and report["drift_ms"]["max"] is None
    assert "n/a" in format_report(report)


def run_report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replay", "report", *args], capture_output=True, text=True, timeout=60)


def test_cli_json_matches_and_prints(tmp_path, records):
    results = write_jsonl(tmp_path / "run.jsonl", records)
    out = tmp_path / "summary.json"
    proc = run_report(str(results), "--slo", "ttft_ms=250,e2e_ms=800", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    for key in ("requests", "requests_ok", "requests_failed", "failures", "duration_s", "request_throughput",
                "input_token_throughput", "output_token_throughput", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms",
                "drift_ms", "goodput_rps", "cache"):  # fmt: skip
        assert key in data, key
    expected = build_report(records, {"ttft_ms": 250.0, "e2e_ms": 800.0})
    assert data.pop("fidelity")["schedule"]["rows"] == len(records)  # tests/test_fidelity_certificate.py
    assert data == json.loads(json.dumps(expected))  # streamed from the file, the same floats
    assert data["cache"] is None
    assert "Serving Benchmark Result" in proc.stdout
    assert f"{'Request goodput (req/s):':<40} {expected['goodput_rps']:<10.2f}" in proc.stdout


def test_cli_errors_name_file_and_line(tmp_path, records):
    results = tmp_path / "run.jsonl"
    results.write_text(json.dumps(records[0]) + "\n{not json\n")
    proc = run_report(str(results))
    assert proc.returncode == 2 and f"{results}:2" in proc.stderr
    proc = run_report(str(write_jsonl(tmp_path / "ok.jsonl", records)), "--slo", "ttft=1")
    assert proc.returncode == 2 and "--slo" in proc.stderr


@pytest.mark.parametrize("content", ["trace", "empty", "json", "array", "summary"])
def test_a_file_that_is_not_a_runs_records_is_refused(tmp_path, records, content, capsys):
    """Before, a trace or any JSON printed an all-"n/a" summary and exit 0. (In this process:
    test_cli_errors_name_file_and_line goes through the command.)"""
    path = tmp_path / "file.jsonl"
    path.write_text({"trace": '{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n',
                     "empty": "\n",
                     "json": '{"a": 1}\n',
                     "array": "[1, 2]\n",
                     "summary": json.dumps(records[0]) + "\n" + json.dumps({"requests": 1}) + "\n"}[content])
    assert main(["report", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    line = 2 if content == "summary" else 1
    assert err == (f"replay report: {path}: no records: expected the per-request JSONL a replay writes "
                           f"(its --output)\n" if content == "empty" else
                           f"replay report: {path}:{line}: not a run's record: expected the per-request JSONL a "
                           f"replay writes (its --output), whose every line has 'request_id' and 'ok'\n")

"""`replay compare`: the statistics on records built by hand (one process), then real runs
against `replay sim`, made once for the module: an A/B whose --fail-on gate fails, an A/A
whose gate holds, runs of another trace or seed refused with the difference named, a run
stopped midway by --run-time (refused, or compared on the rows both answered), and a run of
two workers."""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path

import gevent
import pytest

from replay.cli import main
from replay.results.bootstrap import block_sums, draw
from replay.results.compare import SAME, CompareError, compare
from replay.results.compare_runs import RunRows, run_of_records
from replay.results.gates import parse_gate
from replay.results.records import RUN_STOPPED, STOPPED_IN_FLIGHT
from replay.results.report import build_report
from replay.sim.process import sim_process
from support.browser import need
from support.records import ok_record
from support.traces import BLOCK, mooncake_trace

ROWS = 80


def synthetic(seed: int, rows: int = 250, shift: float = 0.0) -> RunRows:
    return run_of_records(f"run-{seed}", None, synthetic_records(seed, rows, shift))


def synthetic_records(seed: int, rows: int = 250, shift: float = 0.0) -> list[dict]:
    rng = random.Random(seed)
    records = [ok_record(i, rng) for i in range(rows)]
    for r in records:
        r["ttft_ms"] += shift
        r["e2e_ms"] += shift
    return records


def entry(result: dict, metric: str) -> dict:
    return next(e for e in result["metrics"] if e["metric"] == metric)


def test_block_sums_and_draws_count_every_row_as_drawn():
    values = [float(v) for v in range(10)]
    for block in (1, 3, 10, 13):
        expected = [sum(values[(s + j) % 10] for j in range(block)) for s in range(10)]
        assert list(block_sums(values, block)) == expected
    d = draw(random.Random(1), 10, 3)
    assert len(d.starts) == 4 and sum(d.counts) == 12
    assert d.counts == [sum(1 for s in d.starts for j in range(3) if (s + j) % 10 == row) for row in range(10)]


def test_figures_are_the_reports_and_identical_runs_show_no_difference():
    run = synthetic(1)
    report = build_report(synthetic_records(1))
    result = compare([run], [run], resamples=200)
    for lat, key in (("ttft", "ttft_ms"), ("tpot", "tpot_ms"), ("itl", "itl_ms"), ("e2e", "e2e_ms")):
        for stat in ("p50", "p90", "p99", "mean"):
            assert entry(result, f"{lat}_{stat}")["base"] == pytest.approx(report[key][stat], rel=1e-12)
    for e in result["metrics"]:
        if e["ci"] is not None:
            assert e["ci"] == [0.0, 0.0] and e["verdict"] == SAME, e
    assert result["bootstrap"]["resamples"] == 200 and result["bootstrap"]["seed"] == 0


def test_a_shift_is_found_paired_and_a_p99_of_few_rows_is_not_judged():
    base, new = synthetic(1), synthetic(1, shift=10.0)
    result = compare([base], [new], resamples=300, seed=3)
    p50 = entry(result, "ttft_p50")
    assert p50["ci"] == pytest.approx([10.0, 10.0]) and p50["verdict"] == "worse"  # every row +10 ms: no noise left
    p99 = entry(result, "ttft_p99")  # 250 rows: 2.5 beyond the p99
    assert p99["verdict"] == SAME and "too few rows for p99" in p99["note"]
    assert result["mde"]["ttft_p99"]["ms"] is None and result["mde"]["ttft_p50"]["ms"] == pytest.approx(0.0, abs=1e-9)
    assert entry(compare([synthetic(1, 1000)], [synthetic(1, 1000, 10.0)], resamples=100), "ttft_p99")["verdict"] == "worse"
    assert compare([base], [new], resamples=300, seed=3) == result  # the seed makes it repeatable


def test_noise_alone_is_no_detectable_difference_and_runs_pool():
    result = compare([synthetic(1)], [synthetic(2)], resamples=300)
    assert entry(result, "ttft_p50")["verdict"] == SAME and entry(result, "e2e_mean")["verdict"] == SAME
    pooled = compare([synthetic(1), synthetic(1)], [synthetic(2)], resamples=100)  # a run twice: the same distribution
    assert entry(pooled, "ttft_p90")["base"] == pytest.approx(entry(result, "ttft_p90")["base"], rel=1e-12)


def write_run(path: Path, records: list[dict], rows: int | None = None) -> str:
    """A run's file and its meta as a replay writes them (the meta's fields compare reads)."""
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in records))
    meta = {"meta_version": 1, "complete": True, "incomplete": [], "seed": 0, "api": "openai-chat", "scale": 1.0,
            "stream": True, "options": {"prompt_format": None, "slo": None},
            "trace": {"sha256": "0" * 64, "start": None, "duration": None, "max_requests": None,
                      "rows": len(records) if rows is None else rows}}  # fmt: skip
    Path(f"{path}.meta.json").write_text(json.dumps(meta))
    return str(path)


def stopped(records: list[dict], at: int) -> list[dict]:
    """`records` as a run stopped at row `at` writes them: the row in flight cut off, the rest
    never sent; one fast row after it answered before the stop."""
    out = [dict(r) for r in records]
    for r in out[at:]:
        r.update(ok=False, status=0, error=RUN_STOPPED, sent_at=None, finished_at=None, ttft_ms=None, tpot_ms=None,
                 e2e_ms=None, itl_ms=None, output_tokens=None, cached_tokens=None, prompt_tokens=None)  # fmt: skip
    out[at].update(error=STOPPED_IN_FLIGHT, sent_at=records[at]["sent_at"])
    out[at + 1] = dict(records[at + 1], e2e_ms=1.0, ttft_ms=1.0)  # answered: in flight, yet after the stop
    return out


def test_a_stopped_run_is_refused_and_compared_on_the_rows_both_answered(tmp_path, capsys):
    records = synthetic_records(1)
    base = write_run(tmp_path / "base.jsonl", records)
    new = write_run(tmp_path / "new.jsonl", stopped(records, 100))
    assert main(["compare", base, new]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"NEW {new}" in err and f"148 {RUN_STOPPED!r}" in err and "--allow-incomplete" in err
    assert main(["compare", base, new, "--allow-incomplete", "--resamples", "200", "--json", str(tmp_path / "c.json"),
                 "--fail-on", "failure_rate>+1pt", "--fail-on", "e2e_p50<-1%"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert f"INCOMPLETE (--allow-incomplete): NEW {new}" in out
    result = json.loads((tmp_path / "c.json").read_text())
    assert result["rows_matched"] == 100 and result["stop"] == {"request_id": 100, "rows_from_it": 150}
    for e in result["metrics"]:  # the rows both answered are the same rows, answered the same
        if e["ci"] is not None:
            assert e["change"] == 0 and e["verdict"] == SAME, e


def test_itl_point_and_interval_are_of_the_same_gaps(tmp_path, capsys):
    """Many gaps: long answers' gaps get faster, short ones' slower. Every gap weighs the same in
    the report's ITL, so NEW's is better; an interval over thinned gaps (each request's share
    alike) would have said worse, against its own point."""
    base, new = synthetic_records(1, 200), synthetic_records(1, 200)
    rng = random.Random(2)
    for b, n in zip(base, new):
        long = b["request_id"] % 2 == 0
        b["itl_ms"] = [rng.uniform(8, 12) if long else rng.uniform(25, 35) for _ in range(1000 if long else 10)]
        n["itl_ms"] = [v * (0.95 if long else 1.2) for v in b["itl_ms"]]
    paths = [write_run(tmp_path / "base.jsonl", base), write_run(tmp_path / "new.jsonl", new)]
    assert main(["compare", *paths, "--resamples", "200", "--fail-on", "itl_mean>+0.1%",
                 "--json", str(tmp_path / "c.json")]) == 0, capsys.readouterr().out  # fmt: skip
    result = json.loads((tmp_path / "c.json").read_text())
    for e in result["metrics"]:
        if e["ci"] is not None and e["verdict"] != SAME:
            assert e["ci"][0] <= e["change"] <= e["ci"][1], e
    itl = entry(result, "itl_mean")
    assert itl["verdict"] == "better" and itl["relative_change"] == pytest.approx(-0.045, abs=0.01)


def test_a_row_recorded_twice_is_refused_naming_the_lines(tmp_path, capsys):
    records = synthetic_records(1, 20)
    base = write_run(tmp_path / "base.jsonl", records)
    new = write_run(tmp_path / "new.jsonl", [*records[:10], records[4], *records[10:]], rows=20)
    assert main(["compare", base, new]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"replay compare: {new}:11: request_id 4 again (first on line 5): a run has one record a row; "
                   "this file is not one run's --output")  # fmt: skip


@pytest.mark.parametrize("rows", ["0", "21", "100000"])
def test_block_rows_out_of_range_is_one_line(tmp_path, capsys, rows):
    records = synthetic_records(1, 20)
    paths = [write_run(tmp_path / "base.jsonl", records), write_run(tmp_path / "new.jsonl", records)]
    assert main(["compare", *paths, "--block-rows", rows]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"replay compare: --block-rows {rows}: "), err


@pytest.mark.parametrize("text", ["ttft_p99>5", "ttft_p99=+5%", "nope>+5%", "goodput>+5ms", "ttft_p50<-1pt",
                                  "request_throughput>+1%", ""])
def test_bad_gates_are_refused_naming_the_text(text, tmp_path, capsys):
    with pytest.raises(CompareError, match="--fail-on"):
        parse_gate(text)
    assert main(["compare", "a.jsonl", "b.jsonl", "--fail-on", text]) == 2
    assert repr(text) in capsys.readouterr().err


def test_good_gates_parse():
    gate = parse_gate("goodput<-1pt")
    assert (gate.metric, gate.above, gate.bound) == ("goodput", False, pytest.approx(-0.01))
    assert parse_gate(" e2e_p50 > +20ms ").bound == 20.0 and parse_gate("ttft_p99>+5%").bound == pytest.approx(0.05)


def replay(tmp: Path, tokenizer: Path, trace: Path, name: str, sim_seed: int, *extra: str, sim_args=()) -> str:
    with sim_process(tokenizer, "--block-size", str(BLOCK), "--jitter", "0.3", "--seed", str(sim_seed),
                     "--ttft-ms", "20", "--itl-ms", "2", *sim_args) as sim:
        out = tmp / name
        proc = subprocess.run([sys.executable, "-m", "replay", "run", "--headless", "--host", sim.url, "--trace",
                               str(trace), "--block-size", str(BLOCK), "--tokenizer", str(tokenizer), "--model", "sim",
                               "--output", str(out), "--scale", "20", "--only-summary", "--loglevel", "WARNING", *extra],
                              capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, toy_tokenizer_dir) -> dict[str, str]:
    """Real runs of one trace: two on equal sims (A/A), one on a sim stalling every first token
    by 20 ms (TTFT about doubled), one with another synthesis seed, one of another trace."""
    tmp = tmp_path_factory.mktemp("compare")
    trace = mooncake_trace(tmp / "trace.jsonl", ROWS, 200.0, output_length=(4, 8))
    other = mooncake_trace(tmp / "other.jsonl", ROWS, 200.0, output_length=(4, 8), seed=1)
    judged = {
        "a1": replay(tmp, toy_tokenizer_dir, trace, "a1.jsonl", 1),
        "a2": replay(tmp, toy_tokenizer_dir, trace, "a2.jsonl", 2),
        "b": replay(tmp, toy_tokenizer_dir, trace, "b.jsonl", 3, sim_args=("--stall-ms", "20")),
    }
    # The refused runs' latencies are never judged, so they run side by side (greenlets: the
    # module runs under gevent's monkey-patching, tests/conftest.py), after the judged ones.
    refused = {"seed": gevent.spawn(replay, tmp, toy_tokenizer_dir, trace, "seed.jsonl", 4, "--seed", "7"),
               "trace": gevent.spawn(replay, tmp, toy_tokenizer_dir, other, "run-other.jsonl", 5)}
    gevent.joinall(list(refused.values()), raise_error=True)
    return judged | {name: job.value for name, job in refused.items()}


@pytest.mark.alone  # real runs whose latencies the verdicts judge: another test's load shifts one run
def test_a_regression_fails_the_gate_and_noise_does_not(runs, tmp_path, capsys):
    assert main(["compare", runs["a1"], runs["b"], "--fail-on", "ttft_p50>+5%"]) == 1
    out = capsys.readouterr().out
    assert "gate ttft_p50>+5%: FAILED" in out and "1000 resamples, seed 0" in out
    code = main(["compare", "--base", runs["a1"], "--new", runs["a2"], "--fail-on", "ttft_p50>+5%",
                 "--json", str(tmp_path / "c.json")])  # fmt: skip
    assert code == 0, capsys.readouterr().out
    result = json.loads((tmp_path / "c.json").read_text())
    assert result["rows_matched"] == ROWS and result["gates"][0]["held"] and result["exit_code"] == 0
    assert entry(result, "ttft_p50")["verdict"] == SAME


@pytest.mark.alone  # real runs whose latencies the verdicts judge: another test's load shifts one run
@pytest.mark.parametrize("other, named", [("seed", "seed: "), ("trace", "trace fingerprint")])
def test_runs_of_another_trace_or_seed_are_refused(runs, other, named, capsys):
    assert main(["compare", runs["a1"], runs[other]]) == 2
    err = capsys.readouterr().err
    assert "not comparable" in err and named in err and "--allow-different" in err
    assert main(["compare", runs["a1"], runs[other], "--allow-different", "--resamples", "100"]) == 0
    assert f"differs (--allow-different): {named}" in capsys.readouterr().out


@pytest.mark.alone  # real runs whose latencies the verdicts judge: another test's load shifts one run
def test_html_has_the_verdicts_and_both_plots(runs, tmp_path, capsys):
    if importlib.util.find_spec("matplotlib") is None:
        need("matplotlib", "pip install 'tracereplay[report]'")
    page = tmp_path / "c.html"
    assert main(["compare", runs["a1"], runs["b"], "--resamples", "100", "--html", str(page)]) == 0
    text = page.read_text()
    assert 'id="verdicts"' in text and 'id="plot-compare-cdf"' in text and 'id="plot-compare-rows"' in text
    assert '<td class="worse">worse</td>' in text and "<script" not in text


def test_the_command_is_wired(capsys):
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    assert "--fail-on" in capsys.readouterr().out

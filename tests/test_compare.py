"""`replay compare`: the statistics on records built by hand (one process), then real runs
against `replay sim`, made once for the module: an A/B whose --fail-on gate fails, an A/A
whose gate holds, runs of another trace or seed refused with the difference named."""

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
from replay.results.compare import SAME, CompareError, Run, compare
from replay.results.gates import parse_gate
from replay.results.report import build_report
from replay.sim.process import sim_process
from support.browser import need
from support.records import ok_record
from support.traces import BLOCK, mooncake_trace

ROWS = 80


def synthetic(seed: int, rows: int = 250, shift: float = 0.0) -> Run:
    rng = random.Random(seed)
    records = [ok_record(i, rng) for i in range(rows)]
    for r in records:
        r["ttft_ms"] += shift
        r["e2e_ms"] += shift
    return Run(f"run-{seed}", None, records)


def entry(result: dict, metric: str) -> dict:
    return next(e for e in result["metrics"] if e["metric"] == metric)


def test_block_sums_and_draws_count_every_row_as_drawn():
    values = [float(v) for v in range(10)]
    for block in (1, 3, 10, 13):
        expected = [sum(values[(s + j) % 10] for j in range(block)) for s in range(10)]
        assert block_sums(values, block) == expected
    d = draw(random.Random(1), 10, 3)
    assert len(d.starts) == 4 and sum(d.counts) == 12
    assert d.counts == [sum(1 for s in d.starts for j in range(3) if (s + j) % 10 == row) for row in range(10)]


def test_figures_are_the_reports_and_identical_runs_show_no_difference():
    run = synthetic(1)
    report = build_report(run.records)
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

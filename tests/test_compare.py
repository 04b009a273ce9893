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
from array import array
from collections import Counter
from pathlib import Path

import gevent
import pytest

from replay.cli import main
from replay.results import bootstrap
from replay.results.bootstrap import Weighted, block_sums, draw
from replay.results.compare import SAME, CompareError, compare
from replay.results.compare_runs import RunRows, run_of_records
from replay.results.gates import evaluate, parse_gate
from replay.results.records import RUN_STOPPED, STOPPED_IN_FLIGHT, WORKER_LOST, read_records
from replay.results.report import build_report
from replay.results.summary import percentile
from replay.sim.process import sim_process
from replay.synth.toy import build_toy_tokenizer
from support.browser import need
from support.ports import free_port
from support.records import ok_record
from support.traces import BLOCK, mooncake_trace

ROWS = 80
LONG_ROWS = 100


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


def test_a_resamples_figures_are_those_of_the_resample_gathered_by_brute_force():
    """Quantiles read off cumulative counts (and weights: a thinned request's gaps) and means
    from block sums are the figures of the resample built value by value."""
    rng = random.Random(5)
    rows, block = 60, 4
    owners = array("q", [rng.randrange(rows) for _ in range(300)])
    values = array("d", [round(rng.uniform(0, 100), 1) for _ in owners])  # ties too
    weights = array("d", [rng.choice((1.0, 2.0, 3.0)) for _ in owners])
    weighted, plain = Weighted(values, owners, rows, block, weights), Weighted(values, owners, rows, block)
    for _ in range(50):
        d = draw(rng, rows, block)
        gathered = sorted(v for v, r, w in zip(values, owners, weights) for _ in range(d.counts[r] * int(w)))
        assert weighted.quantiles(d, (50, 90, 99)) == pytest.approx([percentile(gathered, p) for p in (50, 90, 99)])
        assert weighted.mean(d) == pytest.approx(sum(gathered) / len(gathered))
        gathered = sorted(v for v, r in zip(values, owners) for _ in range(d.counts[r]))
        assert plain.quantiles(d, (50, 90, 99)) == pytest.approx([percentile(gathered, p) for p in (50, 90, 99)])


@pytest.mark.parametrize("weighted", [False, True])
def test_quantiles_read_off_windows_are_those_read_off_every_value(monkeypatch, weighted):
    """Rows whose values trend over the trace (blocks alike within, unlike across: the widest
    spread a window must hold), ties, and weights: the windows' quantiles are the full ones."""
    monkeypatch.setattr(bootstrap, "WINDOW_MIN_VALUES", 1000)
    rng = random.Random(3)
    rows, block = 3000, 14
    owners = array("q", [rng.randrange(rows) for _ in range(8000)])
    values = array("d", [round(rng.gauss(100 + r / 100, 10), 1) for r in owners])
    weights = array("d", [rng.choice((1.0, 2.0, 3.5)) for _ in owners]) if weighted else None
    windowed = Weighted(values, owners, rows, block, weights, ps=(50, 90, 99))
    full = Weighted(values, owners, rows, block, weights)
    assert set(windowed.windows) == {50, 90, 99} and not full.windows
    assert windowed.windows[50].end - windowed.windows[50].start < len(values) / 2
    for _ in range(200):
        d = draw(rng, rows, block)
        assert windowed.quantiles(d, (50, 90, 99)) == pytest.approx(full.quantiles(d, (50, 90, 99)), abs=1e-9)
    assert windowed.misses == 0


def test_equal_servers_are_judged_different_about_one_time_in_twenty():
    """A/A by brute force: pairs of runs whose every row is drawn afresh from one distribution.
    A 95% interval says `worse` or `better` of about 5% of the (pair, metric) verdicts."""
    verdicts = Counter()
    for pair in range(20):
        result = compare([synthetic(100 + 2 * pair, 300)], [synthetic(101 + 2 * pair, 300)], resamples=200,
                         seed=pair, block=1)  # fmt: skip
        verdicts.update(e["verdict"] for e in result["metrics"] if e["ci"] is not None and not e["note"])
    judged = sum(verdicts.values())
    assert judged >= 20 * 10 and (verdicts["worse"] + verdicts["better"]) / judged <= 0.10, verdicts


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


def test_a_capacity_search_is_not_compared_row_by_row_unasked(tmp_path, capsys):
    """A search's later probes reuse request ids at load factors its own outcomes chose: row by
    row they pair rows of other loads (and, against a plain run, other trace rows)."""
    records = synthetic_records(1)
    base = write_run(tmp_path / "base.jsonl", records)
    new = write_run(tmp_path / "search.jsonl", [dict(r, probe=0, factor=1.0) for r in records])
    meta = json.loads(Path(f"{new}.meta.json").read_text())
    meta["options"]["capacity_search"] = True
    Path(f"{new}.meta.json").write_text(json.dumps(meta))
    for pair in ([base, new], [new, new]):
        assert main(["compare", *pair]) == 2
        err = capsys.readouterr().err
        assert "not comparable" in err and f"{new} is a capacity search" in err and "--allow-different" in err
        assert err.count(f"{new} is a capacity search") == 1, err  # said once, also of a run given twice
    assert main(["compare", base, new, "--allow-different", "--resamples", "100"]) == 0
    assert f"differs (--allow-different): {new} is a capacity search" in capsys.readouterr().out


@pytest.mark.parametrize("damage, named", [
    ("short", "180 records for the 200 rows its meta names (20 missing)"),
    ("not whole", "its files are not whole (run.jsonl: No space left on device)"),
    ("worker lost", f"50 of 200 rows unanswered: 50 {WORKER_LOST!r}"),
])  # fmt: skip
def test_a_run_not_whole_is_refused_saying_why(tmp_path, capsys, damage, named):
    records = synthetic_records(1, 200)
    base = write_run(tmp_path / "base.jsonl", records)
    if damage == "short":
        new = write_run(tmp_path / "new.jsonl", records[:180], rows=200)
    else:
        lost = [dict(r, ok=False, status=0, error=WORKER_LOST, finished_at=None, ttft_ms=None, e2e_ms=None, itl_ms=None)
                if damage == "worker lost" and r["request_id"] % 4 == 1 else r for r in records]  # fmt: skip
        new = write_run(tmp_path / "new.jsonl", lost)
        if damage == "not whole":
            meta = json.loads(Path(f"{new}.meta.json").read_text())
            meta.update(complete=False, incomplete=[{"file": "run.jsonl", "error": "No space left on device"}])
            Path(f"{new}.meta.json").write_text(json.dumps(meta))
    assert main(["compare", base, new]) == 2
    assert f"NEW {new}: {named}" in capsys.readouterr().err
    assert main(["compare", base, new, "--allow-incomplete", "--resamples", "100"]) == 0
    rows = 150 if damage == "worker lost" else 180 if damage == "short" else 200
    assert f"{rows} rows matched by request id, answered in every run" in capsys.readouterr().out


def test_a_run_whose_every_request_failed_says_so(tmp_path, capsys):
    records = synthetic_records(1, 100)
    failed = [dict(r, ok=False, status=500, error="HTTP 500", ttft_ms=None, tpot_ms=None, e2e_ms=None, itl_ms=None)
              for r in records]  # fmt: skip
    paths = [write_run(tmp_path / "base.jsonl", records), write_run(tmp_path / "new.jsonl", failed)]
    assert main(["compare", *paths, "--resamples", "100", "--json", str(tmp_path / "c.json")]) == 0
    result = json.loads((tmp_path / "c.json").read_text())
    assert entry(result, "failure_rate")["verdict"] == "worse"
    assert entry(result, "e2e_p50")["note"] == "no value on NEW: no ok answer has it"
    capsys.readouterr()
    assert main(["compare", *paths, "--resamples", "100", "--fail-on", "e2e_p50>+5%"]) == 2
    assert "no value on NEW: no ok answer has it" in capsys.readouterr().err


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
    try:
        code = main(["compare", *paths, "--block-rows", rows])
    except SystemExit as parser_refused:  # under 1: the option's range (replay/bounds.py), from the parser
        code = parser_refused.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--block-rows" in err and rows in err, err


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


def test_a_goodput_gate_without_an_slo_says_so():
    """No --slo: compare has no goodput row, and the refusal says why (not the servers' times)."""
    with pytest.raises(CompareError, match="goodput needs an SLO"):
        evaluate(parse_gate("goodput<-1pt"), {"metrics": [], "slo": None})


def replay(tmp: Path, tokenizer: Path, trace: Path, name: str, sim_seed: int, *extra: str, sim_args=()) -> str:
    """A real run of `trace` against its own `replay sim` (exit 0: a stop by --run-time is the user's own)."""
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
    by 20 ms (TTFT about doubled), one with another synthesis seed, one of another trace, one
    whose answers may end early (--no-ignore-eos), one of another tokenizer; and of
    a longer trace (5 s at --scale 20): a whole run, one stopped midway by --run-time, one
    by two workers."""
    tmp = tmp_path_factory.mktemp("compare")
    trace = mooncake_trace(tmp / "trace.jsonl", ROWS, 200.0, output_length=(4, 8))
    other = mooncake_trace(tmp / "other.jsonl", ROWS, 200.0, output_length=(4, 8), seed=1)
    longer = mooncake_trace(tmp / "longer.jsonl", LONG_ROWS, 1000.0, output_length=(4, 8))
    port = str(free_port())
    judged = {
        "a1": replay(tmp, toy_tokenizer_dir, trace, "a1.jsonl", 1),
        "a2": replay(tmp, toy_tokenizer_dir, trace, "a2.jsonl", 2),
        "b": replay(tmp, toy_tokenizer_dir, trace, "b.jsonl", 3, sim_args=("--stall-ms", "20")),
        "whole": replay(tmp, toy_tokenizer_dir, longer, "whole.jsonl", 6),
        "stopped": replay(tmp, toy_tokenizer_dir, longer, "stopped.jsonl", 7, "--run-time", "3s"),
        "workers": replay(tmp, toy_tokenizer_dir, longer, "workers.jsonl", 8, "--processes", "2",
                          "--master-bind-host", "127.0.0.1", "--master-host", "127.0.0.1",
                          "--master-bind-port", port, "--master-port", port),
    }  # fmt: skip
    # The refused runs' latencies are never judged, so they run side by side (greenlets: the
    # module runs under gevent's monkey-patching, tests/conftest.py), after the judged ones.
    other_tokenizer = build_toy_tokenizer(tmp / "other-tokenizer", seed=1)  # other words: other prompts
    refused = {"seed": gevent.spawn(replay, tmp, toy_tokenizer_dir, trace, "seed.jsonl", 4, "--seed", "7"),
               "trace": gevent.spawn(replay, tmp, toy_tokenizer_dir, other, "run-other.jsonl", 5),
               "eos": gevent.spawn(replay, tmp, toy_tokenizer_dir, trace, "eos.jsonl", 9, "--no-ignore-eos"),
               "tokenizer": gevent.spawn(replay, tmp, other_tokenizer, trace, "tokenizer.jsonl", 10)}
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
@pytest.mark.parametrize("other, named", [("seed", "seed: "), ("trace", "trace fingerprint"),
                                          ("eos", "ignore_eos (--no-ignore-eos"),
                                          ("tokenizer", "tokenizer and chat template (fingerprint)")])
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


@pytest.mark.alone  # real runs whose latencies the verdicts judge: another test's load shifts one run
def test_a_run_stopped_midway_is_refused_or_compared_on_the_rows_both_answered(runs, tmp_path, capsys):
    records = list(read_records(runs["stopped"]))
    first_stop = min(r["request_id"] for r in records if r["error"] in (RUN_STOPPED, STOPPED_IN_FLIGHT))
    answered = {r["request_id"] for r in records if r["ok"] and r["request_id"] < first_stop}
    assert 0 < len(answered) < LONG_ROWS - 10, len(answered)  # stopped midway (how far: the machine's load)
    assert main(["compare", runs["whole"], runs["stopped"]]) == 2
    err = capsys.readouterr().err
    assert f"NEW {runs['stopped']}" in err and repr(RUN_STOPPED) in err and "--allow-incomplete" in err
    assert main(["compare", runs["whole"], runs["stopped"], "--allow-incomplete",
                 "--json", str(tmp_path / "c.json")]) == 0  # fmt: skip
    assert f"INCOMPLETE (--allow-incomplete): NEW {runs['stopped']}" in capsys.readouterr().out
    result = json.loads((tmp_path / "c.json").read_text())
    assert result["rows_matched"] == len(answered) and result["stop"]["request_id"] == first_stop
    failure = entry(result, "failure_rate")
    assert failure["change"] == 0 and failure["verdict"] == SAME  # the stop is no failure of the server
    assert entry(result, "e2e_p50")["verdict"] == SAME  # the same rows, equal servers


@pytest.mark.alone  # real runs whose latencies the verdicts judge: another test's load shifts one run
def test_a_run_of_two_workers_compares_whole(runs, tmp_path, capsys):
    assert {r["worker"] for r in read_records(runs["workers"])} == {0, 1}
    assert main(["compare", runs["whole"], runs["workers"], "--json", str(tmp_path / "c.json")]) == 0
    assert "INCOMPLETE" not in capsys.readouterr().out
    result = json.loads((tmp_path / "c.json").read_text())
    assert result["rows_matched"] == LONG_ROWS and result["rows_unmatched"] == 0
    assert all(not r["incomplete"] and not r["unanswered"] for r in result["runs"])


def test_the_command_is_wired(capsys):
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    assert "--fail-on" in capsys.readouterr().out


def timed(records: list[dict], queue_ms: float, every: int = 1) -> list[dict]:
    """`records` with the server's own times on every `every`-th row: `queue_ms` queued, the
    rest of the TTFT its prefill but 2 ms (the network), the decode the rest of the E2E."""
    out = [dict(r) for r in records]
    for r in out[::every]:
        prefill = max(r["ttft_ms"] - 2.0 - min(queue_ms, r["ttft_ms"] - 2.0), 0.0)
        r.update(server_queue_ms=queue_ms, server_prefill_ms=prefill, server_ttft_ms=queue_ms + prefill,
                 server_decode_ms=r["e2e_ms"] - r["ttft_ms"], server_timing_source="answer")
    return out


def test_a_servers_times_over_the_clients_are_not_compared():
    """NEW's server says it queued each request 5 s while its client had the first token in
    ~200 ms: no evidence of a queue regression, so its rows leave the server's parts out."""
    records = synthetic_records(1)
    base = run_of_records("base", None, timed(records, 5.0))
    new = run_of_records("new", None, timed(records, 5000.0))
    result = compare([base], [new], resamples=100)
    assert all(e["metric"] not in ("queue_p50", "rest_p50") or e["new"] is None or e["new"] < 1000
               for e in result["metrics"]), [entry(result, "queue_p50"), entry(result, "rest_p50")]


def test_the_servers_parts_are_compared_on_the_rows_every_run_timed():
    """BASE's server timed every row, NEW's (half its fleet without metrics) every other one:
    comparing BASE's all with NEW's half would be two sets of requests, not a change. On the
    rows both timed, the queue is the same."""
    records = synthetic_records(1)
    base = timed(records, 5.0)
    for r in base[1::2]:
        r.update(server_queue_ms=15.0, server_prefill_ms=r["server_prefill_ms"] - 10.0)  # another queue, same TTFT
    new = timed(records, 5.0, every=2)
    result = compare([run_of_records("base", None, base)], [run_of_records("new", None, new)], resamples=100)
    queue = entry(result, "queue_mean")
    assert queue["base"] == pytest.approx(5.0) and queue["new"] == pytest.approx(5.0), queue

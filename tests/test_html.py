"""The HTML report: written by `replay report --html`, opened in headless Chromium without
errors, every plot present in the DOM; and a clear message when the plotting extra is absent.

Chromium (Debian's `chromium`) and matplotlib (the `report` extra) are needed: in CI (CI=true)
their absence fails the test, elsewhere it skips with the reason.
"""

from __future__ import annotations

import html
import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from replay.protocol.prometheus import parse_series
from replay.results.html import CAPACITY_PLOT, PLOTS, TURN_WAITS_PLOT
from replay.results.server_metrics import sample_line
from replay.rules.run_files import metrics_path
from support.browser import BROWSERS, CHROMIUM_FLAGS, need
from support.dcgm import PAGE, idle_page
from support.records import T0, ok_record, record
from support.traces import mooncake_trace


@pytest.fixture(scope="module")
def chromium() -> str:
    path = next((p for p in map(shutil.which, BROWSERS) if p), None)
    if path is None:
        need("chromium", "apt-get install -y chromium")
    return path


@pytest.fixture(scope="module")
def plotting() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        need("matplotlib", "pip install 'tracereplay[report]'")


def results_for(trace: Path, path: Path) -> Path:
    """Records for every row of `trace`: most answered, some failed or never sent."""
    rng = random.Random(5)
    rows = [json.loads(line) for line in open(trace)]
    recs = []
    for i, row in enumerate(rows):
        if i % 13 == 5:
            recs.append(record(i, scheduled_at=T0 + i * 0.1, status=0, ok=False, error="run stopped"))
            continue
        r = ok_record(i, rng)
        r.update(input_length=row["input_length"], output_length=row["output_length"], cached_tokens=0,
                 prompt_tokens=row["input_length"])  # fmt: skip
        if i % 17 == 3:
            r.update(ok=False, status=500, error="HTTP 500: boom", ttft_ms=None, itl_ms=None, tpot_ms=None)
        recs.append(r)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def report(results: Path, trace: Path, tokenizer: Path, *extra: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "replay", "report", str(results), "--trace", str(trace), "--block-size", "16",
         "--server-block-size", "16", "--tokenizer", str(tokenizer), "--slo", "ttft_ms=300", *extra],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip


def test_html_opens_in_chromium_with_every_plot(tmp_path, toy_tokenizer_dir, chromium, plotting):
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=60, gap_ms=100)
    results = results_for(trace, tmp_path / "run.jsonl")
    page, pngs = tmp_path / "report.html", tmp_path / "png"
    proc = report(results, trace, toy_tokenizer_dir, "--html", str(page), "--png-dir", str(pngs))
    assert proc.returncode == 0, proc.stderr
    text = page.read_text()
    # self-contained: nothing to fetch, nothing to run
    for tag in ("<script", "<img", "<link", "<iframe", "src=", "url(http"):
        assert tag not in text, tag
    for name, _ in PLOTS:
        png = (pngs / f"{name}.png").read_bytes()
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000, name

    profile = tmp_path / "chromium-profile"
    browser = subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom", page.as_uri()],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert browser.returncode == 0, browser.stderr[-3000:]
    console = [line for line in browser.stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]
    assert console == [], console
    dom = browser.stdout
    assert 'id="summary"' in dom and "Serving Benchmark Result" in dom and "Prefix Cache Fidelity" in dom
    for name, caption in PLOTS:
        m = re.search(rf'<figure id="plot-{name}" class="plot">(.*?)</figure>', dom, re.S)
        assert m, name
        assert caption in m.group(1) and "<svg" in m.group(1), name
        assert len(re.findall(r"<path", m.group(1))) >= 5, f"{name}: the SVG has nothing drawn"


def test_gpu_plots_and_peaks_from_an_exporter(tmp_path, plotting):
    """An exporter's samples (the fake dcgm-exporter's page, idle then busy) and no server's:
    the report draws each GPU and the summary gives their peaks."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=20, gap_ms=100)
    results = results_for(trace, tmp_path / "run.jsonl")
    url = "http://dcgm-exporter:9400/metrics"
    pages = [idle_page(PAGE()), PAGE(), PAGE()]
    metrics_path(results).write_bytes(b"".join(sample_line(T0 + i, url, parse_series(page), exporter=True)
                                               for i, page in enumerate(pages)))  # fmt: skip
    page = tmp_path / "report.html"
    proc = subprocess.run([sys.executable, "-m", "replay", "report", str(results), "--html", str(page)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert f"{url} (exporter): 3 samples, 38 series, 2 GPUs" in proc.stdout
    assert "gpu-node-1/gpu 1 (NVIDIA H100 80GB HBM3):" in proc.stdout and "peak utilisation 64 %" in proc.stdout
    text = page.read_text()
    for n, name in enumerate(["gpu-node-1/gpu 0", "gpu-node-1/gpu 1"]):
        m = re.search(rf'<figure id="plot-gpu-{n}" class="plot"><figcaption>(.*?)</figcaption>(.*?)</figure>', text, re.S)
        assert m and m.group(1).startswith(f"GPU {name} ({url})") and "<svg" in m.group(2), n
    assert 'id="plot-server-0"' not in text  # an exporter is no server


def test_missing_plotting_extra_is_said_clearly(tmp_path, toy_tokenizer_dir):
    """Without matplotlib: the text and --json still come out, --html explains and exits 1."""
    blocker = tmp_path / "no-matplotlib" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('matplotlib is blocked for this test')\n")
    env = {**os.environ, "PYTHONPATH": str(blocker.parent)}
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=20, gap_ms=100)
    results = results_for(trace, tmp_path / "run.jsonl")
    summary = tmp_path / "summary.json"
    proc = report(results, trace, toy_tokenizer_dir, "--json", str(summary), "--html", str(tmp_path / "r.html"), env=env)
    assert proc.returncode == 1
    assert "--html needs matplotlib" in proc.stderr and "pip install 'tracereplay[report]'" in proc.stderr
    assert "Serving Benchmark Result" in proc.stdout
    assert json.loads(summary.read_text())["requests"] == 20
    assert not (tmp_path / "r.html").exists()


def test_closed_loop_turns_get_a_plot_of_their_waits(tmp_path, plotting):
    """Records with waited_ms (a closed-loop --turn-timing) draw how long the turns waited for
    their previous answers; a run without waits draws no such plot."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=20, gap_ms=100)
    results = results_for(trace, tmp_path / "run.jsonl")
    plain = tmp_path / "plain.html"
    assert subprocess.run([sys.executable, "-m", "replay", "report", str(results), "--html", str(plain)],
                          capture_output=True, timeout=120).returncode == 0  # fmt: skip
    assert 'id="plot-turn-waits"' not in plain.read_text()
    records = [json.loads(line) for line in results.read_text().splitlines()]
    for r in records:
        r["waited_ms"] = 0.0 if r["sent_at"] is None or r["request_id"] % 3 else 40.0 + r["request_id"]
    results.write_text("".join(json.dumps(r) + "\n" for r in records))
    page = tmp_path / "report.html"
    proc = subprocess.run([sys.executable, "-m", "replay", "report", str(results), "--html", str(page)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    plot = re.search(r'<figure id="plot-turn-waits" class="plot"><figcaption>(.*?)</figcaption>(.*?)</figure>',
                     page.read_text(), re.S)  # fmt: skip
    assert plot and plot.group(1) == html.escape(TURN_WAITS_PLOT[1]) and "<svg" in plot.group(2)


def capacity_probe(number: int, factor: float, goodput: float, verdict: str, ttft_p99: float) -> dict:
    return {"probe": number, "factor": factor, "rows": 100, "ok": 100, "good": round(100 * goodput),
            "goodput": goodput, "verdict": verdict, "ttft_ms": {"p50": ttft_p99 / 2, "p99": ttft_p99},
            "tpot_ms": {"p50": 1.0, "p99": 2.0}, "e2e_ms": {"p50": ttft_p99, "p99": 2 * ttft_p99},
            "drift_p99_ms": 0.5, "seconds": 5.0, "repeat_of": None}


def test_a_capacity_search_run_gets_goodput_and_latency_against_load_first(tmp_path, plotting):
    """A run with an OUTPUT.capacity.json: the report's first plot is goodput and latency p99
    against the load factor with the bracket marked, and the quotable line leads the page."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=20, gap_ms=100)
    results = results_for(trace, tmp_path / "run.jsonl")
    probes = [capacity_probe(0, 1.0, 1.0, "pass", 20), capacity_probe(1, 2.0, 0.3, "fail early", 400),
              capacity_probe(2, 1.414, 0.995, "pass", 45), capacity_probe(3, 1.682, 0.9, "fail", 90),
              capacity_probe(4, 1.542, 0.97, "client-limited", 60)]
    capacity = {"slo": {"ttft_ms": 60.0}, "goodput_target": 0.99, "search_by": "amplify", "range": [0.25, 64],
                "precision": 0.2, "probes": probes, "capacity": 1.414, "bracket": [1.414, 1.682],
                "result": "found", "seconds": 30.0}
    (tmp_path / "run.jsonl.capacity.json").write_text(json.dumps(capacity))
    page, pngs = tmp_path / "report.html", tmp_path / "png"
    proc = subprocess.run([sys.executable, "-m", "replay", "report", str(results), "--html", str(page), "--png-dir",
                           str(pngs)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    text = page.read_text()
    line = "Capacity: 1.41x this trace's load (1.41x passes, 1.68x fails) at goodput >= 99% with ttft_ms <= 60 ms"
    assert f'<p id="capacity"><b>{html.escape(line)}</b></p>' in text
    figures = re.findall(r'<figure id="plot-([\w-]+)" class="plot">', text)
    assert figures[0] == CAPACITY_PLOT[0] and set(figures[1:]) >= {name for name, _ in PLOTS}
    plot = re.search(r'<figure id="plot-capacity" class="plot">(.*?)</figure>', text, re.S).group(1)
    assert CAPACITY_PLOT[1] in plot and len(re.findall(r"<path", plot)) >= 10
    for label in ("bracket", "target", "not counted", "TTFT p99", "ttft_ms &lt;= 60"):
        assert label in plot, label
    assert (pngs / "capacity.png").read_bytes().startswith(b"\x89PNG")

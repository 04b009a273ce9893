"""The capacity search against a real server, `replay sim`, whose capacity can be computed: with
--max-num-seqs N requests served at once, each for TTFT + (output - 1) x ITL, and nothing else
in its time, it serves N / that many requests a second; past it, requests queue and their TTFT
grows past the SLO. The search's answer (one run, --search-by amplify) is checked against a
coarse grid of separate runs of `replay trace amplify`'s output (the rows a probe at that factor
sends), and both ways: a separate run at 0.9 x the answer meets the target, one at 1.15 x does
not; a master with 2 worker processes finds the same answer within the precision; a client
that cannot send on time is reported as such, not as the server's failure (docs/capacity.md).

These need the CPU to themselves (a busy host sends late: `alone`). A search that ends
client-limited on a host too busy to send on time fails in CI (CI=true), which must give it a
quiet machine, and skips elsewhere, saying so.
"""

from __future__ import annotations

import html
import importlib.util
import re
import subprocess
import sys

import orjson
import pytest

from replay.rules.run_files import capacity_path, summary_path
from replay.sim.process import sim_process
from replay.trace.amplify import amplify_trace
from replay.trace.reader import TraceStream
from support.browser import IN_CI, need
from support.ports import free_port
from support.processes import finish, master_and_workers, replay_args, run_locust
from support.traces import BLOCK, mooncake_trace

pytestmark = pytest.mark.alone

SEQS, TTFT_MS, ITL_MS, OUTPUT = 4, 20, 10, 10  # each request 110 ms: the sim serves 36.4 requests a second
GAP_MS, ROWS = 50, 60  # the window: 20 requests a second for 3 s, so its capacity is below 1.8x (arrivals bunch)
SLO, TARGET, PRECISION = "ttft_ms=60", 0.9, 0.1
SECONDS = str(ROWS * GAP_MS / 1000)
COMMON = ("--slo", SLO, "--verify-server", "off", "--drain-timeout", "10")
SEARCH = ("--capacity-search", "--goodput-target", str(TARGET), "--search-range", "0.5:8", "--search-precision",
          str(PRECISION), "--probe-duration", SECONDS, "--cooldown", "0.5")


def client_limited(report: dict) -> None:
    """The search said the client could not keep up instead of giving a wrong answer: this host
    is too busy for a test of the server's capacity."""
    why = f"the search ended client-limited (dispatch drift p99 over 10 ms) on this busy host: {report['probes'][-1]}"
    if IN_CI:
        pytest.fail(why + "; CI must run the `alone` tests on a quiet machine", pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="module")
def slow_sim(toy_tokenizer_dir):
    with sim_process(toy_tokenizer_dir, "--block-size", str(BLOCK), "--ttft-ms", str(TTFT_MS), "--itl-ms",
                     str(ITL_MS), "--prefill-ms-per-1k", "0", "--max-num-seqs", str(SEQS),
                     "--per-request-metrics") as server:  # its queue time in each answer: why a probe failed
        yield server


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("capacity")
    mooncake_trace(folder / "trace.jsonl", ROWS + 1, GAP_MS, output_length=(OUTPUT, OUTPUT))
    mooncake_trace(folder / "window.jsonl", ROWS, GAP_MS, output_length=(OUTPUT, OUTPUT))  # its first ROWS rows
    return folder


@pytest.fixture(scope="module")
def search_run(folder, toy_tokenizer_dir, slow_sim) -> tuple[dict, str]:
    """The search in one process, whatever its result: OUTPUT.capacity.json's content, and what it printed."""
    output = folder / "search.jsonl"
    proc = run_locust(replay_args(folder / "trace.jsonl", toy_tokenizer_dir, slow_sim.url, output, *COMMON, *SEARCH),
                      folder, timeout=240, exit_code=None)
    return orjson.loads(capacity_path(output).read_bytes()), proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def search(search_run) -> dict:
    """The search in one process, which found the capacity: OUTPUT.capacity.json's content."""
    report = search_run[0]
    if report["result"] == "client-limited":
        client_limited(report)
    assert report["result"] == "found", report
    return report


@pytest.mark.heavy  # the replay, its OTLP receiver and a sim exporting spans: more than a core
def test_a_failing_probe_says_the_queue_grew_from_trace_spans_alone(folder, toy_tokenizer_dir, tmp_path):
    """The same server telling its times only in trace spans (--otlp-endpoint, no metrics in its
    answers): the spans are joined at the end of the run, after the probes were judged, and the
    probes' splits and why_failed must still be theirs."""
    port = free_port()
    output = tmp_path / "search.jsonl"
    with sim_process(toy_tokenizer_dir, "--block-size", str(BLOCK), "--ttft-ms", str(TTFT_MS), "--itl-ms",
                     str(ITL_MS), "--prefill-ms-per-1k", "0", "--max-num-seqs", str(SEQS),
                     "--otlp-endpoint", f"http://127.0.0.1:{port}/v1/traces") as sim:
        run_locust(replay_args(folder / "trace.jsonl", toy_tokenizer_dir, sim.url, output, *COMMON, *SEARCH,
                               "--otlp-receiver", f"127.0.0.1:{port}", "--otlp-wait", "5"),
                   tmp_path, timeout=240, exit_code=None)
    report = orjson.loads(capacity_path(output).read_bytes())
    if report["result"] == "client-limited":
        client_limited(report)
    assert report["result"] == "found", report
    for probe in report["probes"]:
        assert probe["server_timing"]["requests_with_server_timing"] == probe["server_timing"]["requests_ok"], probe
    why = report["failed_because"]
    assert why and why["grew_most"] == "queue", why


def test_a_failing_probe_says_the_servers_queue_grew(search):
    """Past --max-num-seqs the sim's requests wait for a slot: the failing end of the bracket
    failed on the server's queue time, which its answers told (replay sim --per-request-metrics)."""
    why = search["failed_because"]
    assert why and why["figure"] == "ttft_ms" and why["grew_most"] == "queue", why
    assert why["growth_ms"]["queue"] > why["growth_ms"]["prefill"] and why["growth_ms"]["queue"] > 0, why
    worst = next(p for p in search["probes"] if p["factor"] == search["bracket"][1] and p.get("why_failed"))
    assert worst["why_failed"] == why and worst["server_timing"]["requests_lacking_server_timing"] == 0
    passed = next(p for p in search["probes"] if p["probe"] == why["against_probe"])
    assert passed["verdict"] == "pass" and passed["factor"] == search["bracket"][0]


def separate_run(folder, tokenizer, url: str, factor: float) -> float:
    """The goodput of a run of its own of the window amplified `factor` times (seed 0, as the search's)."""
    amplified = folder / f"x{factor:g}.jsonl"
    done = amplify_trace(lambda: TraceStream(folder / "window.jsonl", None, BLOCK), amplified, factor)
    out = folder / f"run-x{factor:g}.jsonl"
    run_locust(replay_args(amplified, tokenizer, url, out, *COMMON, "--overwrite"), folder, exit_code=None)
    summary = orjson.loads(summary_path(out).read_bytes())
    return summary["requests_good"] / done.rows_out


def test_the_search_agrees_with_a_grid_and_its_answer_holds_both_ways(folder, toy_tokenizer_dir, slow_sim, search):
    """The grid: separate runs at factors 10% apart (1.1^n) below the sim's bound (1.82x, its
    full rate), from low to high until one fails; its answer is the last that passed. It starts
    at 1.33x, well below where arrivals bunch enough to fail: a run that surely passes proves nothing."""
    found, grid = search["capacity"], {}
    for n in range(3, 7):  # 1.33x .. 1.77x
        k = round(1.1**n, 4)
        grid[k] = separate_run(folder, toy_tokenizer_dir, slow_sim.url, k)
        if grid[k] < TARGET:
            break
    passing = [k for k, goodput in grid.items() if goodput >= TARGET]
    assert passing and len(passing) < len(grid), f"the grid does not bracket the capacity: {grid}"
    assert abs(found - max(passing)) / max(passing) <= 0.10 + 1e-9, (found, grid, search["probes"])
    below, above = (separate_run(folder, toy_tokenizer_dir, slow_sim.url, round(found * f, 4)) for f in (0.9, 1.15))
    assert below >= TARGET > above, (found, below, above, search["probes"])


@pytest.mark.heavy  # a master, two workers and the sim: more than a core, so not beside the parallel tests
def test_master_and_two_workers_find_the_same_capacity(folder, toy_tokenizer_dir, slow_sim, search, tmp_path):
    output = tmp_path / "two.jsonl"
    args = replay_args(folder / "trace.jsonl", toy_tokenizer_dir, slow_sim.url, output, *COMMON, *SEARCH)
    master, workers = master_and_workers(tmp_path, args, workers=2)
    finish([master, *workers], timeout=240)
    for log in ("master", "worker0", "worker1"):  # a probe cut short is no greenlet's error in any of them
        assert "Traceback" not in (tmp_path / f"{log}.log").read_text(), log
    report = orjson.loads(capacity_path(output).read_bytes())
    if report["result"] == "client-limited":
        client_limited(report)
    assert report["result"] == "found", report
    one, two = search["capacity"], report["capacity"]
    assert max(one, two) / min(one, two) <= 1 + PRECISION + 1e-9, (search["probes"], report["probes"])
    workers_seen = {orjson.loads(line)["worker"] for line in output.read_bytes().splitlines()}
    assert workers_seen == {0, 1}


def replay_report(output, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replay", "report", str(output), *extra], capture_output=True,
                          text=True, timeout=120)


def test_replay_report_reads_what_a_real_search_wrote(folder, search_run, tmp_path):
    """`replay report` and its HTML on the search's own files, whatever its result: the summary
    as the run printed it (its cache section not computed, saying why, at the run's end too),
    the capacity plot and line first. The run logged no error but its result's, if any."""
    if importlib.util.find_spec("matplotlib") is None:
        need("matplotlib", "pip install 'tracereplay[report]'")
    (search, said), output = search_run, folder / "search.jsonl"
    errors = [line for line in said.splitlines() if "/ERROR/" in line and "capacity search" not in line]
    assert not errors and "Traceback" not in said, said[-3000:]
    why = "cache: not computed (a capacity search's probes send prompts of their own"
    assert why in said
    page = tmp_path / "report.html"
    proc = replay_report(output, "--html", str(page), "--json", str(tmp_path / "report.json"))
    assert proc.returncode == 0, proc.stderr
    assert why in proc.stdout and "cache fidelity: skipped (a capacity search's" in proc.stderr
    summary = orjson.loads((tmp_path / "report.json").read_bytes())  # every row of every probe
    assert summary["requests"] == sum(p["rows"] for p in search["probes"])
    text = page.read_text()
    line = re.search(r"Capacity: [^\n]+", said).group(0)
    assert f'<p id="capacity"><b>{html.escape(line)}</b></p>' in text
    figures = re.findall(r'<figure id="plot-([\w-]+)" class="plot">', text)
    assert figures[0] == "capacity"
    capacity_plot = text[text.index('<figure id="plot-capacity"') :].split("</figure>")[0]
    assert "server queue p99" in capacity_plot  # the sim tells its queue time: each probe's is drawn
    if search_run[0]["result"] == "found":
        assert "the servers' queue grew most" in line, line
    # the text report leads with the same line and the probes, and says its figures pool them
    head = proc.stdout.split("\n")
    assert head[0] == line, proc.stdout[:2000]
    table = head[1 : 2 + len(search["probes"])]
    assert table[0].split() == ["probe", "factor", "rows", "sent", "goodput", "verdict"], table
    for p, row in zip(search["probes"], table[1:]):
        assert row.split()[:4] == [str(p["probe"]), f"{p['factor']:g}x", str(p["rows"]), str(p["sent"])], row
        assert row.endswith(p["verdict"]), row
    assert "the figures below pool every probe" in proc.stdout


@pytest.mark.heavy
def test_a_client_that_cannot_keep_up_is_client_limited_not_a_server_failure(tmp_path, toy_tokenizer_dir, sim):
    """One process asked for thousands of requests a second (the window x 16, x 32, ...) cannot
    send them on time: a probe is client-limited, and so is its repeat, and the search ends there
    (exit 1) saying to add workers, whatever the server could have done."""
    trace = mooncake_trace(tmp_path / "fast.jsonl", 201, 10, output_length=(1, 1))
    output = tmp_path / "fast-search.jsonl"
    proc = run_locust(replay_args(trace, toy_tokenizer_dir, sim.url, output, "--slo", "e2e_ms=60000",
                                  "--verify-server", "off", "--capacity-search", "--search-range", "16:1024",
                                  "--probe-duration", "1", "--cooldown", "0"), tmp_path, timeout=120, exit_code=1)
    report = orjson.loads(capacity_path(output).read_bytes())
    verdicts = [p["verdict"] for p in report["probes"]]
    assert report["result"] == "client-limited", report["probes"]
    assert verdicts[-2:] == ["client-limited"] * 2 and set(verdicts[:-2]) <= {"pass", "client-limited"}, verdicts
    assert report["probes"][-1]["repeat_of"] == report["probes"][-2]["probe"], report["probes"]
    assert "add workers" in proc.stdout + proc.stderr

"""The capacity search (docs/capacity.md) in one process: the search on made-up outcomes, its
options refused before anything is sent, and the probes run as rounds by the Coordinator over
LocalLink with fake workers on a fake clock (tests/engine_support.py). The search against a real
server is tests/test_capacity_sim.py's."""

from __future__ import annotations

import math
from collections import Counter

import orjson
import pytest
from engine_support import FakeClock, FakeWorker, Hub, make_rows, spec_of
from locust.runners import CPU_MONITOR_INTERVAL
from test_engine_pipeline import Run

from replay.engine import coordinator as coordinator_module
from replay.engine import transport
from replay.engine.capacity import (
    INVALID,
    PASS,
    Probe,
    Search,
    capacity_report,
    check_search,
    parse_range,
)
from replay.engine.options import ReplayOptions
from replay.engine.plan import Schedule, decode_row
from replay.engine.probes import max_probes
from replay.engine.rounds import Part, Round
from replay.engine.transport import LocalLink
from replay.errors import OptionError
from replay.results.records import PROBE_CUT, PROBE_INVALID, REFUSED, WORKER_STOPPED
from replay.rules.capacity_result import (
    AT_LEAST_HI,
    BELOW_LO,
    CLIENT_LIMITED,
    FOUND,
    OUTAGE,
    REFUSED_BEFORE_SEND,
    SERVER_ERRORS,
    STOPPED,
    WORKER_SIGNALLED,
    WORKERS_LOST,
    quotable_line,
)
from replay.rules.run_files import capacity_path
from replay.trace.amplify import Clones, amplify_trace
from replay.trace.reader import TraceStream
from replay.trace.sessions import find_sessions
from support.traces import BLOCK, conversation_trace

# -- the search, pure ------------------------------------------------------------------------------


def run_search(capacity: float, lo: float = 0.25, hi: float = 64.0, precision: float = 0.05) -> tuple[Search, list]:
    """The search against a server that serves every factor up to `capacity`."""
    search, tried = Search(lo, hi, precision), []
    while (factor := search.next_factor()) is not None:
        tried.append(factor)
        search.add(factor, factor <= capacity)
        assert len(tried) <= max_probes(search)
    return search, tried


@pytest.mark.parametrize("capacity", [0.3, 0.9, 1.0, 3.4, 17.0, 63.0])
def test_the_search_finds_a_known_capacity_within_its_precision(capacity):
    search, tried = run_search(capacity)
    best, worst = search.bracket
    assert search.result == FOUND
    assert best <= capacity < worst and worst / best <= 1.05
    assert search.capacity == best
    assert len(tried) <= 16


def test_a_server_failing_even_lo_is_below_lo():
    search, tried = run_search(0.1)
    assert search.result == BELOW_LO and search.capacity is None
    assert tried == [1.0, 0.25]


def test_a_server_passing_everything_up_to_hi_is_at_least_hi():
    search, tried = run_search(1000.0)
    assert search.result == AT_LEAST_HI and search.capacity == 64.0
    assert tried == [1, 2, 4, 8, 16, 32, 64]


def test_a_range_above_or_below_one_starts_inside_it():
    assert run_search(5.0, lo=2.0, hi=8.0)[1][0] == 2.0
    assert run_search(0.3, lo=0.1, hi=0.5)[1][0] == 0.5


def test_a_probe_is_hopeless_once_the_target_cannot_be_met():
    probe = Probe(0, 1.0, rows=100, slo={"ttft_ms": 100.0}, target=0.99)
    good = {"ok": True, "ttft_ms": 5.0, "drift_ms": 0.1}
    for _ in range(50):
        probe.add(good)
    probe.add({**good, "ttft_ms": 500.0})  # over the SLO: 1 bad of 100 is allowed
    assert not probe.hopeless
    probe.add({"ok": False, "drift_ms": 0.1})
    assert probe.hopeless


# -- bad input ---------------------------------------------------------------------------------------

BAD = [
    ({"slo": None}, "--capacity-search needs --slo"),
    ({"search_range": "4:2"}, "--search-range 4:2: LO must be below HI"),
    ({"search_range": "1:1"}, "--search-range 1:1: LO must be below HI"),
    ({"search_range": "0:2"}, "--search-range 0:2: LO must be 0.001 to 10000"),
    ({"search_range": "-1:2"}, "--search-range -1:2: LO must be 0.001 to 10000"),
    ({"search_range": "1e-300:2"}, "--search-range 1e-300:2: LO must be 0.001 to 10000"),
    ({"search_range": "1:1e300"}, "--search-range 1:1e300: HI must be 0.001 to 10000"),
    ({"search_precision": 1e-300}, "--search-precision 1e-300: must be 0.001 to 1"),
    ({"cooldown": 1e300}, "--cooldown 1e+300: must be 0 to 3600 seconds"),
    ({"probe_duration": 1e-300}, "--probe-duration 1e-300: must be 0.001 to 604800 trace seconds"),
    ({"search_range": "nan:2"}, "--search-range 'nan:2'"),
    ({"search_range": "1:inf"}, "--search-range '1:inf'"),
    ({"search_range": "2"}, "--search-range '2'"),
    ({"search_precision": 0.0}, "--search-precision 0.0"),
    ({"search_precision": math.nan}, "--search-precision nan"),
    ({"goodput_target": 1.5}, "--goodput-target 1.5"),
    ({"goodput_target": math.nan}, "--goodput-target nan"),
    ({"probe_duration": math.inf}, "--probe-duration inf"),
    ({"probe_duration": 0.0}, "--probe-duration 0.0"),
    ({"probe_duration": 60.0, "duration": 30.0}, "--probe-duration 60: longer than the window (--duration 30)"),
    ({"cooldown": -1.0}, "--cooldown -1.0"),
    ({"max_requests": 10}, "--max-requests: not with --capacity-search"),
    ({"scale": 2.0}, "--scale 2: not with --capacity-search"),
]


@pytest.mark.parametrize("change,message", BAD, ids=[m for _, m in BAD])
def test_bad_search_options_are_refused_naming_the_option(change, message):
    options = ReplayOptions(**{"trace": "t", "tokenizer": "tok", "capacity_search": True, "slo": "ttft_ms=100", **change})
    with pytest.raises(OptionError) as caught:
        options.check()
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_the_range_parses():
    assert parse_range("0.25:64") == (0.25, 64.0)
    check_search(ReplayOptions(capacity_search=True, slo="ttft_ms=100"))


# -- the probes as rounds, in one process ------------------------------------------------------------


def search_run(tmp_path, capacity: float, workers: int = 1, rows: int = 40, hold: int | None = None,
               rows_of=lambda n: make_rows(n, gap_s=1.0 / n), late_from: float | None = None,
               answer_first: dict[int, int] | None = None, cpu_from: float | None = None,
               late_probes: frozenset[int] = frozenset(), fault: dict[int, int] | None = None, cpu_lag_s: float = CPU_MONITOR_INTERVAL, **options):
    """A search over `rows` rows (1 s of trace; `rows_of(rows)` makes them) against fake workers
    whose endpoint fails every row of a probe above `capacity` with HTTP 429 (too many requests:
    the load's failure), and which send every row of a probe at `late_from` or above 50 ms late
    (a client that cannot keep up), and those of the probes numbered in `late_probes` (a stall); worker i answers only its first `answer_first[i]` rows (a
    worker to be lost holds the rest); from the probe at `cpu_from` on, every worker reports 95%
    CPU use; probe n's rows all get status `fault[n]` (0: no answer, as from a server gone)."""
    options = {"capacity_search": True, "slo": "ttft_ms=100", "probe_duration": 1.0, "cooldown": 1.0,
               "search_range": "0.25:16", "search_precision": 0.1, **options}
    spec = spec_of(rows_of(rows), tmp_path, **options)
    clock = FakeClock()
    holder: dict = {}

    def answer(row) -> int:
        probes = holder["run"].coordinator.policy
        probe = probes.probes[probes.probe_of(row.request_id)]
        if fault and probe.number in fault:
            return fault[probe.number]
        return 200 if probe.factor <= capacity else 429

    def late(row) -> float:
        probes = holder["run"].coordinator.policy
        probe = probes.probes[probes.probe_of(row.request_id)]
        return 0.05 if (late_from is not None and probe.factor >= late_from) or probe.number in late_probes else 0.0

    def cpu(client_id: str) -> float:
        probes = holder["run"].coordinator.policy.probes
        return 95.0 if cpu_from is not None and probes and probes[-1].factor >= cpu_from else 20.0

    if workers == 1:
        link = LocalLink()
        run = holder["run"] = Run(spec, link, clock, worker_cpu=cpu, cpu_lag_s=cpu_lag_s)
        fakes = [FakeWorker(link, answer=answer, clock=clock, hold=hold, late=late).hello()]
        run.begin()
    else:
        hub = Hub()
        run = holder["run"] = Run(spec, hub.master, clock, worker_cpu=cpu, cpu_lag_s=cpu_lag_s)
        run.hub = hub
        fakes = [FakeWorker(hub.worker(f"w{i}"), answer=answer, clock=clock, late=late,
                            answer_first=(answer_first or {}).get(i)).hello() for i in range(workers)]
        run.begin([(f"w{i}", i) for i in range(workers)])
    return run, fakes


def test_a_search_in_one_run_finds_the_capacity_and_writes_its_files(tmp_path, capsys):
    run, (fake,) = search_run(tmp_path, capacity=3.0, search_by="scale")
    records = run.finish()
    report = orjson.loads(capacity_path(run.spec.output).read_bytes())
    best, worst = report["bracket"]
    assert report["result"] == FOUND and best <= 3.0 < worst and worst / best <= 1.1
    assert report["capacity"] == best
    probes = report["probes"]
    assert [p["probe"] for p in probes] == list(range(len(probes)))
    assert all(p["rows"] == 40 for p in probes)
    assert {p["verdict"] for p in probes if p["factor"] <= 3.0} == {PASS}
    # one record per row per probe, each with its probe and factor, the trace's id moved by the stride
    assert len(records) == 40 * len(probes)
    by_probe = Counter(r["probe"] for r in records.values())
    assert by_probe == {p["probe"]: 40 for p in probes}
    for r in records.values():
        assert r["factor"] == probes[r["probe"]]["factor"]
        assert r["request_id"] - r["probe"] * report["id_stride"] in range(40)
    # a probe's rows are its own: compressed by its factor, after the previous one's end
    first = sorted((r for r in records.values() if r["probe"] == 1), key=lambda r: r["request_id"])
    gaps = {round(b["scheduled_at"] - a["scheduled_at"], 6) for a, b in zip(first, first[1:])}
    assert gaps == {round(1.0 / 40 / probes[1]["factor"], 6)}
    assert run.exit_codes == [0]
    assert quotable_line(report) in capsys.readouterr().out
    assert fake.rounds_seen[-1]["more"] is False  # told that no more rounds follow


def test_a_failing_probe_is_cut_short_and_its_unsent_rows_labelled(tmp_path, monkeypatch):
    monkeypatch.setattr(coordinator_module, "CHUNK_ROWS", 10)
    monkeypatch.setattr(transport, "HOLD_ROWS", 20)
    run, (fake,) = search_run(tmp_path, capacity=0.5, rows=100, hold=20, search_by="scale")  # the first probe (1x) fails
    records = run.finish()
    report = orjson.loads(capacity_path(run.spec.output).read_bytes())
    first = [r for r in records.values() if r["probe"] == 0]
    labels = Counter(r["error"] for r in first)
    assert labels["HTTP 429"] < 100 and labels[PROBE_CUT] == 100 - labels["HTTP 429"]
    assert report["probes"][0]["verdict"] == "fail early"
    # its goodput is over the rows it sent: those never sent say nothing of the server
    assert report["probes"][0]["sent"] == labels["HTTP 429"] and report["probes"][0]["goodput"] == 0.0
    assert report["probes"][1]["goodput"] == 1.0
    assert report["result"] == FOUND and report["bracket"][0] <= 0.5 < report["bracket"][1]


def test_a_server_failing_every_probe_is_below_lo_with_exit_code_1(tmp_path, capsys):
    run, _ = search_run(tmp_path, capacity=0.1, search_range="0.5:4")
    run.finish()
    report = orjson.loads(capacity_path(run.spec.output).read_bytes())
    assert report["result"] == BELOW_LO and report["capacity"] is None
    assert [p["factor"] for p in report["probes"]] == [1.0, 0.5]
    assert run.exit_codes == [1]
    assert "Capacity: below 0.5x this trace's load" in capsys.readouterr().out


@pytest.mark.parametrize("search_by", ["amplify", "scale"])
def test_a_search_with_two_workers_gives_the_same_answer(tmp_path, search_by):
    # the one worker takes more rows than a probe has (as the Dispatcher's HOLD_ROWS does): it
    # asks for no more when a round is added, so the master grants the new round's chunks itself
    one, _ = search_run(tmp_path / "one", capacity=3.0, search_by=search_by, hold=1000)
    one.finish()
    two, fakes = search_run(tmp_path / "two", capacity=3.0, workers=2, search_by=search_by)
    records = two.finish()
    a = orjson.loads(capacity_path(one.spec.output).read_bytes())
    b = orjson.loads(capacity_path(two.spec.output).read_bytes())
    assert a["bracket"] == b["bracket"]
    assert {r["worker"] for r in records.values()} == {0, 1}


@pytest.mark.parametrize(("capacity", "late_from"), [(3.0, 4.0), (1.5, 2.0)])
def test_a_probe_the_client_sent_late_is_client_limited_and_ends_the_search(tmp_path, capsys, caplog, capacity,
                                                                             late_from):
    """Probes from `late_from` on are sent 50 ms late (drift p99 over 10 ms): whether the server
    would have passed it (3x) or failed it (1.5x), the probe is client-limited, not a server
    failure; it is repeated once, late again, and the search ends there with exit code 1 and a
    line saying to add workers."""
    run, _ = search_run(tmp_path, capacity=capacity, late_from=late_from)
    run.finish()
    report = orjson.loads(capacity_path(run.spec.output).read_bytes())
    probes = report["probes"]
    assert [p["factor"] for p in probes] == [1.0, 2.0, 4.0][: 2 + (late_from == 4.0)] + [late_from]
    assert [p["verdict"] for p in probes[:-2]] == [PASS] * (len(probes) - 2)
    assert [p["verdict"] for p in probes[-2:]] == [CLIENT_LIMITED] * 2 and probes[-1]["drift_p99_ms"] > 10
    assert [p["repeat_of"] for p in probes[-2:]] == [None, probes[-2]["probe"]]
    assert report["result"] == CLIENT_LIMITED and report["bracket"] == [late_from / 2, None]
    assert run.exit_codes == [1]
    assert "add workers" in capsys.readouterr().out
    # the messages name the limit that held, the drift, and no CPU figure that did not
    said = [r.getMessage() for r in caplog.records if "limited by the client" in r.getMessage()]
    assert len(said) == 2 and "repeated once" in said[0] and "add workers" in said[1], said
    assert all("dispatch drift p99" in line and "CPU" not in line for line in said), said


def test_a_probe_sent_late_once_is_repeated_and_the_search_goes_on(tmp_path):
    """A stall of the host during one probe (number 1, 2x, sent 50 ms late) is no client's
    limit: the probe is repeated at its factor, on time, and the search finds what it finds
    without the stall."""
    plain, _ = search_run(tmp_path / "plain", capacity=3.0)
    plain.finish()
    run, _ = search_run(tmp_path / "stall", capacity=3.0, late_probes=frozenset({1}))
    run.finish()
    expected = orjson.loads(capacity_path(plain.spec.output).read_bytes())
    report = orjson.loads(capacity_path(run.spec.output).read_bytes())
    probes = report["probes"]
    assert [(p["factor"], p["verdict"], p["repeat_of"]) for p in probes[:3]] == \
        [(1.0, PASS, None), (2.0, CLIENT_LIMITED, None), (2.0, PASS, 1)]
    assert report["result"] == FOUND and report["bracket"] == expected["bracket"]
    assert [p["factor"] for p in probes[3:]] == [p["factor"] for p in expected["probes"][2:]]
    assert run.exit_codes == [0]


def test_a_probe_shorter_than_the_runners_cpu_sampling_has_no_cpu_figure(tmp_path):
    """Locust samples a worker's CPU every CPU_MONITOR_INTERVAL: a figure read before a probe
    has sent that long covers the time before it, so the probe's is not known (None)."""
    run, _ = search_run(tmp_path, capacity=3.0, workers=2, probe_duration=CPU_MONITOR_INTERVAL * 0.8,
                        rows_of=lambda n: make_rows(n, gap_s=CPU_MONITOR_INTERVAL * 0.8 / n),
                        cpu_lag_s=CPU_MONITOR_INTERVAL)
    run.finish()
    report = orjson.loads(capacity_path(run.spec.output).read_bytes())
    assert report["probes"] and all(p["cpu_peak_pct"] is None for p in report["probes"]), report["probes"]


def test_a_probe_during_which_a_worker_was_busy_is_client_limited(tmp_path, capsys):
    """A worker reporting 95% CPU use while the 4x probe runs: client-limited, though its sends
    were on time; 20% in the probes before it counts for nothing."""
    # fake workers answer before the sends are due: their figures count at once
    run, _ = search_run(tmp_path, capacity=3.0, workers=2, cpu_from=4.0, cpu_lag_s=-math.inf)
    run.finish()
    report = orjson.loads(capacity_path(run.spec.output).read_bytes())
    assert [(p["factor"], p["verdict"], p["cpu_peak_pct"]) for p in report["probes"]] == \
        [(1.0, PASS, 20.0), (2.0, PASS, 20.0), (4.0, CLIENT_LIMITED, 95.0), (4.0, CLIENT_LIMITED, 95.0)]
    assert report["result"] == CLIENT_LIMITED and run.exit_codes == [1]
    assert "CPU at 90%" in capsys.readouterr().out


def test_a_stop_during_a_search_records_every_row_of_its_probes(tmp_path):
    run, _ = search_run(tmp_path, capacity=3.0, search_by="scale")
    run.until(lambda: len(run.coordinator.policy.probes) >= 2)
    records = run.end()
    report = orjson.loads(capacity_path(run.spec.output).read_bytes())
    assert len(records) == 40 * len(report["probes"])
    assert report["result"] == "stopped"


def test_a_search_stopped_with_a_bracket_claims_no_capacity(tmp_path):
    """Stopped after probes that bracket the capacity but before the search's precision: the
    line says the bracket so far, never "Capacity: Nx this trace's load"; no capacity, exit 1."""
    run, _ = search_run(tmp_path, capacity=3.0)
    run.until(lambda: len(run.coordinator.policy.finished) >= 4)  # 1x, 2x, 4x, 2.83x: a bracket
    run.end()
    report = orjson.loads(capacity_path(run.spec.output).read_bytes())
    assert report["result"] == "stopped" and report["capacity"] is None and report["ended_because"] is None
    best, worst = report["bracket"]
    assert best is not None and worst is not None, report["bracket"]
    line = quotable_line(report)
    assert line.startswith("Capacity: not known (the search was stopped; the bracket so far: ") and "passes" in line, line
    assert run.exit_codes == [1]


def test_a_search_the_servers_refused_is_refused_not_stopped(tmp_path):
    """Servers the preflight refuses: no probe ran, and the result says so with the reason, not
    that the search was stopped; exit 2, as any refused run."""
    run = Run(spec_of(make_rows(40), tmp_path, capacity_search=True, slo="ttft_ms=100"), LocalLink())
    why = "http://127.0.0.1:9 did not answer GET /v1/models (connection refused)"
    run.coordinator.refuse(why)
    report = orjson.loads(capacity_path(run.spec.output).read_bytes())
    assert report["result"] == REFUSED_BEFORE_SEND and report["probes"] == [] and report["capacity"] is None
    assert report["ended_because"] == f"{REFUSED}: {why}"
    assert quotable_line(report) == f"Capacity: not measured: {REFUSED}: {why}"
    assert run.exit_codes == [2]


def test_a_probe_a_stop_cut_off_is_stopped_not_a_fail(tmp_path):
    """Worker 1 holds its rows of the 2x probe past its first 10: the stop comes while the probe
    is under way. That probe is its own kind, neither a pass nor a fail; no capacity is claimed,
    and its goodput is over the rows it sent."""
    run, _ = search_run(tmp_path, capacity=3.0, workers=2, answer_first={1: 20 + 10})
    run.until(lambda: len(run.coordinator.policy.probes) >= 2 and run.coordinator.policy.probes[1].recorded >= 50)
    run.end()
    report = orjson.loads(capacity_path(run.spec.output).read_bytes())
    assert [(p["factor"], p["verdict"]) for p in report["probes"]] == [(1.0, PASS), (2.0, STOPPED)]
    assert report["result"] == STOPPED and report["capacity"] is None and report["bracket"] == [1.0, None]
    assert report["probes"][1]["sent"] == 50 and report["probes"][1]["goodput"] == 1.0


# -- servers gone or erroring: not the load's failures ---------------------------------------------


def test_a_server_gone_after_the_first_probe_is_an_outage_not_a_capacity(tmp_path, capsys):
    """Every request of the probes after the first gets no answer (connection refused): the
    search ends at the first of them, exit code 1, result outage, and claims no capacity."""
    run, _ = search_run(tmp_path, capacity=3.0, fault={n: 0 for n in range(1, 20)})
    run.finish()
    report = orjson.loads(capacity_path(run.spec.output).read_bytes())
    assert [(p["factor"], p["verdict"]) for p in report["probes"]] == [(1.0, PASS), (2.0, OUTAGE)]
    assert report["probes"][1]["failed_by"] == {"unanswered": 1}  # target 0.99 of 80 rows: the first failure
    assert report["result"] == OUTAGE and report["capacity"] is None and report["bracket"] == [1.0, None]
    assert run.exit_codes == [1]
    line = quotable_line(report)
    assert line.startswith("Capacity: not measured: the servers stopped answering during the probe at 2x")
    assert "ConnectionRefusedError" in line and line in capsys.readouterr().out


def test_error_answers_that_are_not_the_loads_are_server_errors_not_a_capacity(tmp_path):
    """HTTP 500 (or 503) at a load the server would serve: not a failure of the load."""
    run, _ = search_run(tmp_path, capacity=3.0, fault={1: 500})
    run.finish()
    report = orjson.loads(capacity_path(run.spec.output).read_bytes())
    assert [p["verdict"] for p in report["probes"]] == [PASS, SERVER_ERRORS]
    assert report["probes"][1]["not_load_reasons"] == {"HTTP 500": 80}
    assert report["result"] == SERVER_ERRORS and run.exit_codes == [1]


def test_on_outage_retry_repeats_the_probe_once_the_servers_answer_again(tmp_path):
    run, _ = search_run(tmp_path, capacity=3.0, fault={1: 0}, on_outage="retry")
    asked = []
    run.coordinator.policy.servers_problem = lambda: None if asked.append(1) or len(asked) >= 3 else "HTTP 503"  # back at the third
    run.finish()
    report = orjson.loads(capacity_path(run.spec.output).read_bytes())
    probes = report["probes"]
    assert [(p["factor"], p["verdict"], p["repeat_of"]) for p in probes[:3]] == \
        [(1.0, PASS, None), (2.0, OUTAGE, None), (2.0, PASS, 1)]
    best, worst = report["bracket"]
    assert report["result"] == FOUND and best <= 3.0 < worst and worst / best <= 1.1
    assert len(asked) == 3 and run.exit_codes == [0]


def test_on_outage_retry_ends_the_search_when_the_repeat_is_an_outage_too(tmp_path):
    run, _ = search_run(tmp_path, capacity=3.0, fault={1: 0, 2: 0}, on_outage="retry")
    run.coordinator.policy.servers_problem = lambda: None
    run.finish()
    report = orjson.loads(capacity_path(run.spec.output).read_bytes())
    assert [p["verdict"] for p in report["probes"]] == [PASS, OUTAGE, OUTAGE]
    assert report["result"] == OUTAGE and run.exit_codes == [1]
    assert "--on-outage retry" not in quotable_line(report)  # it was: its remedy is not to retry again


def test_on_outage_retry_ends_the_search_when_the_servers_do_not_come_back(tmp_path):
    run, _ = search_run(tmp_path, capacity=3.0, fault={1: 0}, on_outage="retry")
    run.coordinator.policy.servers_problem = lambda: "HTTP 503"
    run.finish()
    report = orjson.loads(capacity_path(run.spec.output).read_bytes())
    assert [p["verdict"] for p in report["probes"]] == [PASS, OUTAGE]
    assert report["result"] == OUTAGE and run.exit_codes == [1]
    assert report["on_outage"] == "retry" and "--on-outage retry" not in quotable_line(report)


def test_a_few_unanswered_rows_among_the_loads_failures_are_still_a_fail():
    """What failed the probe decides: mostly over the SLO is the load's failure, whatever else came."""
    probe = Probe(0, 2.0, rows=10, slo={"ttft_ms": 100.0}, target=0.8)
    slow = {"ok": True, "status": 200, "ttft_ms": 500.0, "drift_ms": 0.1, "sent_at": 1.0}
    refused = {"ok": False, "status": 0, "error": "ConnectionRefusedError: x", "drift_ms": 0.1, "sent_at": 1.0}
    for record in (slow, refused, slow):
        probe.add(record)
    assert probe.hopeless and probe.failed_by == {"load": 2, "unanswered": 1}
    for _ in range(7):
        probe.add(refused)  # after it could no longer pass: they decide nothing
    assert probe.verdict == "fail"


def test_a_quick_answer_without_a_token_is_a_server_error_not_a_good_row():
    """A server answering 200 with no event stream at all (garbage) is quick: under an e2e limit
    it would pass every probe, a capacity of "at least HI" for a server that serves nothing."""
    probe = Probe(0, 1.0, rows=4, slo={"e2e_ms": 1000.0}, target=0.5)
    garbage = {"ok": True, "status": 200, "e2e_ms": 1.0, "ttft_ms": None, "drift_ms": 0.1, "sent_at": 1.0,
               "output_length": 10, "output_tokens": 0, "received_tokens": 0}
    for _ in range(3):
        probe.add(garbage)
    assert probe.good == 0 and probe.failed_by == {"error": 3}
    assert probe.verdict == SERVER_ERRORS and probe.top_reasons() == {"answered ok without an output token": 3}


# -- --search-by amplify: a probe's rows are `replay trace amplify`'s ----------------------------------


@pytest.mark.parametrize("factor", [2.5, 0.5])
def test_an_amplify_probe_sends_what_replay_trace_amplify_writes(tmp_path, factor):
    """The window amplified in memory, split across two workers' parts, is the file the CLI
    writes from the same rows with the same seed (one rule: replay.trace.amplify.Clones), each
    part in send order."""
    trace = conversation_trace(tmp_path / "conv.jsonl", conversations=30)
    out = tmp_path / "out.jsonl"
    amplify_trace(lambda: TraceStream(trace, None, BLOCK), out, factor, seed=7)
    with open(out) as f:
        written = sorted((round(r["timestamp"], 2), r["session_id"], tuple(r["hash_ids"]), r["input_length"],
                          r["output_length"]) for r in map(orjson.loads, f))
    schedule = Schedule(TraceStream(trace, None, BLOCK))
    sessions = find_sessions(lambda: schedule.rows(range(len(schedule))))
    stride = 10_000
    rounds = [Round(0, factor, 0.0, schedule.origin, stride, 0, Clones(sessions, factor, seed=7))]
    sent, ids = [], set()
    for positions in schedule.partition(2, "session"):
        part = Part(schedule, positions, rounds, 7)
        rows = [decode_row(data) for chunk in part.round_chunks(0) for data in chunk["rows"]]
        times = [row.timestamp_s for row in rows]
        assert times == sorted(times)
        assert [part.request_id(i) for i in range(len(part))] == [row.request_id for row in rows]
        ids.update(row.request_id for row in rows)
        sent += [(round(row.timestamp_s * 1000, 2), row.session_id, row.hash_ids, row.input_length, row.output_length)
                 for row in rows]
    assert sorted(sent) == written
    assert len(ids) == len(sent)  # every copy its own request id


def session_rows(count: int, sessions: int) -> list:
    """`count` rows over 1 s, row i in session i % sessions, whose turns extend their ids; id 0
    is shared by every row (a system prompt)."""
    rows = make_rows(count, gap_s=1.0 / count, sessions=sessions)
    for row in rows:
        s, turn = int(row.session_id[1:]), row.request_id // sessions
        row.hash_ids = (0,) + tuple(1000 * (s + 1) + t for t in range(turn + 1))
    return rows


def test_an_amplify_search_sends_k_times_the_sessions_at_the_traces_pace(tmp_path):
    run, _ = search_run(tmp_path, capacity=3.0, rows=40, search_by="amplify", seed=3,
                        rows_of=lambda n: session_rows(n, 8))
    records = run.finish()
    report = orjson.loads(capacity_path(run.spec.output).read_bytes())
    best, worst = report["bracket"]
    assert report["result"] == FOUND and best <= 3.0 < worst and worst / best <= 1.1
    probes = report["probes"]
    for p in probes:
        mine = [r for r in records.values() if r["probe"] == p["probe"]]
        assert len(mine) == p["rows"]
        if p["factor"] == int(p["factor"]):
            assert p["rows"] == 40 * p["factor"]  # whole sessions k times
        sessions = {r["session_id"] for r in mine}
        copies = Counter(s.split("#")[0] for s in sessions)
        assert set(copies) == {f"s{i}" for i in range(8)}
        assert max(copies.values()) - min(copies.values()) <= 1
        # the trace's pace, not compressed: a probe's sends span about the window (1 s)
        times = [r["scheduled_at"] for r in mine]
        assert 0.8 <= max(times) - min(times) <= 1.0 + 1e-6
    assert len(records) == sum(p["rows"] for p in probes)


# -- a worker lost during a probe ---------------------------------------------------------------------


def lose_during(run, probe: int, client_id: str) -> None:
    """Cut `client_id` off as probe `probe` opens (its rows of the probe are never answered:
    search_run's `answer_first` holds them)."""
    run.until(lambda: len(run.coordinator.policy.probes) > probe)
    run.hub.cut.add(client_id)
    run.gone.add(client_id)


@pytest.mark.parametrize("search_by", ["amplify", "scale"])
def test_a_worker_lost_during_a_probe_makes_it_invalid_and_it_is_repeated_once(tmp_path, search_by):
    run, fakes = search_run(tmp_path, capacity=3.0, workers=2, search_by=search_by, answer_first={1: 20})
    lose_during(run, 1, "w1")
    records = run.finish()
    report = orjson.loads(capacity_path(run.spec.output).read_bytes())
    probes = report["probes"]
    assert probes[1]["verdict"] == INVALID and probes[1]["factor"] == 2.0
    assert probes[2]["factor"] == 2.0 and probes[2]["repeat_of"] == 1 and probes[2]["verdict"] == PASS
    best, worst = report["bracket"]
    assert report["result"] == FOUND and best <= 3.0 < worst and worst / best <= 1.1
    assert run.exit_codes == [0]
    # the repeat and every later probe: all their rows, sent by the worker left
    for p in probes[2:]:
        mine = [r for r in records.values() if r["probe"] == p["probe"]]
        assert len(mine) == p["rows"] and {r["worker"] for r in mine} == {0}
    lost = Counter(r["error"] for r in records.values() if r["probe"] == 1 and not r["ok"])
    assert lost and all(label.startswith("worker lost") or label == PROBE_INVALID for label in lost), lost


@pytest.mark.parametrize("shared", [False, True], ids=["own session", "master's process group"])
def test_a_worker_stopped_by_a_signal_of_its_own_ends_the_search_without_an_answer(tmp_path, capsys, shared):
    """Not a capacity answer (its rows failing would read as the fleet's), nor a lost worker's
    probe repeated with the workers left: the search ends there, "worker stopped", exit 1."""
    run, fakes = search_run(tmp_path, capacity=3.0, workers=2, answer_first={1: 20})
    run.until(lambda: len(run.coordinator.policy.probes) > 1)
    fakes[1].stopped(shared=shared)
    run.until(lambda: run.coordinator.finished.is_set())
    run.hub.cut.add("w1")
    run.gone.add("w1")
    records = run.end()
    report = orjson.loads(capacity_path(run.spec.output).read_bytes())
    assert report["result"] == WORKER_SIGNALLED and len(report["probes"]) == 2
    assert run.exit_codes == [1]
    assert "Capacity: not measured: a worker was stopped by a signal of its own" in capsys.readouterr().out
    failed = Counter(r["error"] for r in records.values() if not r["ok"])
    assert set(failed) <= {WORKER_STOPPED, PROBE_INVALID} and failed[WORKER_STOPPED], failed
    assert all(r["probe"] == 1 for r in records.values() if not r["ok"])


def test_a_workers_own_stop_is_not_lost_when_its_probe_fails_early_meanwhile(tmp_path, capsys):
    """A worker in the master's process group stops by a signal of its own, and before the
    master has judged whose signal it was, the servers' errors fail the probe early: the stop is
    the stronger fact (the probe lost the worker's sends), so the search ends "worker stopped",
    not "server errors", and its rows are not "probe failed early"."""
    run, fakes = search_run(tmp_path, capacity=3.0, workers=2, fault={1: 500}, answer_first={0: 20, 1: 20})
    run.until(lambda: len(run.coordinator.policy.probes) > 1)  # 20 rows each at 1x: probe 1's are held
    fakes[1].stopped(shared=True)
    signalled = run.clock.now()
    run.until(lambda: run.clock.now() >= signalled + 1.0)
    fakes[0].release(100)  # the servers' errors, a second after the signal
    run.until(lambda: run.coordinator.policy.probes[1].cut)
    fakes[1].release(100)  # what it holds of the probe: the rows a cut would record "probe failed early"
    run.until(lambda: run.coordinator.finished.is_set())
    run.hub.cut.add("w1")
    run.gone.add("w1")
    records = run.end()
    report = orjson.loads(capacity_path(run.spec.output).read_bytes())
    assert report["result"] == WORKER_SIGNALLED, report["result"]
    assert run.exit_codes == [1]
    assert "Capacity: not measured: a worker was stopped by a signal of its own" in capsys.readouterr().out
    mine = Counter(r["error"] for r in records.values() if r["probe"] == 1 and r["worker"] == 1 and not r["ok"])
    assert PROBE_CUT not in mine, mine  # it was not cut: what it sent has its answers, the rest the stop's label


def test_a_worker_lost_during_the_repeat_too_ends_the_search_with_exit_code_1(tmp_path, capsys):
    # 40 rows round-robin: 14, 13, 13; at 2x, 26 for w2, which inherits w1's 13 for the repeat
    run, _ = search_run(tmp_path, capacity=3.0, workers=3, answer_first={1: 13, 2: 13 + 26})
    lose_during(run, 1, "w1")
    lose_during(run, 2, "w2")
    run.finish()
    report = orjson.loads(capacity_path(run.spec.output).read_bytes())
    assert [p["verdict"] for p in report["probes"]] == [PASS, INVALID, INVALID]
    assert report["result"] == WORKERS_LOST and report["bracket"] == [1.0, None]
    assert run.exit_codes == [1]
    assert "workers were lost during a probe and again during its repeat" in capsys.readouterr().out


def _timed(ttft: float, queue: float, prefill: float, rest_ms: float = 1.0) -> dict:
    """An ok record of a server that tells its own times: client TTFT = queue + prefill + rest."""
    return {"request_id": 0, "ok": True, "status": 200, "sent_at": 1.0, "output_length": 2, "output_tokens": 2,
            "ttft_ms": ttft + rest_ms, "tpot_ms": 1.0, "e2e_ms": ttft + rest_ms + 5.0, "drift_ms": 0.1,
            "server_queue_ms": queue, "server_prefill_ms": prefill, "server_decode_ms": 5.0,
            "server_ttft_ms": queue + prefill, "server_timing_source": "answer"}


@pytest.mark.parametrize("failing, grew", [
    (lambda: _timed(90.0, 70.0, 20.0), "queue"),  # waited for a slot
    (lambda: _timed(90.0, 0.0, 90.0), "prefill"),  # slower prefill
    (lambda: _timed(20.0, 0.0, 20.0, rest_ms=71.0), "neither: client or network"),  # the server as fast as before
])
def test_a_failing_probe_says_which_part_of_the_time_grew(failing, grew):
    """Against the largest passing probe below it, from the servers' own times (replay.results.server_time)."""
    slo = {"ttft_ms": 50.0}
    search = Search(1.0, 8.0, 0.05)
    passed, failed = (Probe(n, factor, rows=10, slo=slo, target=0.9) for n, factor in ((0, 1.0), (1, 2.0)))
    for _ in range(10):
        passed.add(_timed(20.0, 0.0, 20.0))
        failed.add(failing())
    search.add(1.0, passed.verdict == PASS)
    search.add(2.0, failed.verdict == PASS)
    report = capacity_report(search, [passed, failed], slo=slo, target=0.9, search_by="amplify", precision=0.05,
                             seconds=1.0)
    why = report["failed_because"]
    assert why["against_probe"] == 0 and why["figure"] == "ttft_ms" and why["grew_most"] == grew, why
    assert why["growth_ms"]["client"] == pytest.approx(70.0)
    assert report["probes"][1]["why_failed"] == why and "why_failed" not in report["probes"][0]
    part = "rest" if grew.startswith("neither") else grew
    assert quotable_line({**report, "result": FOUND}).endswith(
        f"grew most ({why['growth_ms'][part]:+.0f} ms of +70 ms mean TTFT)")


def test_a_failing_probe_without_the_servers_times_says_nothing_of_why():
    slo = {"e2e_ms": 50.0}
    search = Search(1.0, 8.0, 0.05)
    passed, failed = (Probe(n, factor, rows=10, slo=slo, target=0.9) for n, factor in ((0, 1.0), (1, 2.0)))
    for _ in range(10):
        passed.add({**_timed(20.0, 0.0, 20.0), "server_timing_source": None})
        failed.add({**_timed(90.0, 70.0, 20.0), "server_timing_source": None})
    search.add(1.0, True)
    search.add(2.0, False)
    report = capacity_report(search, [passed, failed], slo=slo, target=0.9, search_by="amplify", precision=0.05,
                             seconds=1.0)
    assert report["failed_because"] is None and report["probes"][1]["why_failed"] is None
    assert quotable_line({**report, "result": FOUND}).endswith("e2e_ms <= 50 ms")

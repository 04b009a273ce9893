"""Failing fast: before the first send, every endpoint must answer what it serves and serve the
run's model (replay.protocol.models, replay.run.preflight.check_servers); during the run,
servers failing more than --max-error-rate of their answers stop it (replay.engine.error_rate).

The window's rule on a fake clock, the option's checks and the models answers read here; the
Coordinator's side in one process is tests/test_engine_pipeline.py's; the end-to-end cases
(a dead endpoint, a wrong --model, a server failing every request) run real Locust against
`replay sim` below.
"""

from __future__ import annotations

import argparse
import math

import pytest
import requests
from engine_support import FakeClock, make_rows, ok_record

from replay.engine.error_rate import MIN_ANSWERS, WINDOW_S, ErrorRate
from replay.engine.options import ReplayOptions, add_arguments
from replay.errors import OptionError
from replay.protocol.models import Served, ask_served, only_model, prompt_limit, refusal
from replay.protocol.openai import read_models
from replay.protocol.tgi import read_info
from replay.results.metadata import read_run_metadata
from replay.results.records import REFUSED, error_rate_label, read_records, unsent_record
from replay.rules.run_files import summary_path
from replay.sim.process import sim_process
from support.ports import free_port
from support.processes import replay_args, run_locust, web_args
from support.traces import BLOCK, mooncake_trace

# -- the error rate's window ----------------------------------------------------------------------


def answers(count: int, failed: bool) -> list[dict]:
    records = [ok_record(row, 0, 0.0, 1.0) for row in make_rows(count)]
    for r in records:
        r.update(ok=not failed, error="HTTP 500" if failed else None, status=500 if failed else 200)
    return records


def test_no_verdict_before_the_minimum_then_over_means_more_than():
    rate = ErrorRate(0.5, FakeClock())
    assert not rate.add(answers(MIN_ANSWERS - 1, failed=True))  # too few to judge, however bad
    assert rate.add(answers(1, failed=True)) and rate.over
    half = ErrorRate(0.5, FakeClock())
    assert not half.add(answers(MIN_ANSWERS, failed=False) + answers(MIN_ANSWERS, failed=True))  # half: not over
    assert half.add(answers(1, failed=True))


def test_labels_are_no_answers():
    """Rows with a label (never sent, or cut off by a stop) are no server's answer."""
    rate = ErrorRate(0.0, FakeClock())
    rows = make_rows(3 * MIN_ANSWERS)
    labelled = [unsent_record(row, worker=0, api="openai-chat", scheduled_at=1.0, reason="run stopped before the answer",
                              endpoint="http://e", sent_at=1.0) for row in rows]
    assert not rate.add(labelled) and rate.answers == 0


@pytest.mark.parametrize("gap_s, stops", [(1.0, False), (WINDOW_S + 1, True)])
def test_the_window_keeps_the_last_30_s_and_at_least_the_minimum(gap_s, stops):
    """15 failures after 20 answers ok: within the same 30 s, 15 of 35 (not over half); once the
    ok ones are older than the window, the last 20 answers hold 15 failures (over)."""
    clock = FakeClock()
    rate = ErrorRate(0.5, clock)
    assert not rate.add(answers(MIN_ANSWERS, failed=False))
    clock.advance(gap_s)
    assert rate.add(answers(15, failed=True)) is stops
    assert rate.answers == (MIN_ANSWERS if stops else MIN_ANSWERS + 15)


def test_a_sparse_run_is_judged_on_its_last_answers():
    """A request a minute never fills a 30 s window with the minimum: the last MIN_ANSWERS decide."""
    clock = FakeClock()
    rate = ErrorRate(0.5, clock)
    for _ in range(MIN_ANSWERS - 1):
        assert not rate.add(answers(1, failed=True))
        clock.advance(60.0)
    assert rate.add(answers(1, failed=True)) and rate.answers == MIN_ANSWERS


def test_rate_0_stops_at_one_failure_rate_1_never():
    zero = ErrorRate(0.0, FakeClock())
    assert not zero.add(answers(MIN_ANSWERS, failed=False))
    assert zero.add(answers(1, failed=True))
    one = ErrorRate(1.0, FakeClock())
    assert not one.add(answers(10 * MIN_ANSWERS, failed=True))


def test_the_label_names_the_limit():
    assert error_rate_label(0.5) == "run aborted: error rate over 0.5"
    assert error_rate_label(0.0) == "run aborted: error rate over 0"
    assert error_rate_label(0.125) == "run aborted: error rate over 0.125"


# -- the option ------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -0.1, 1.5])
def test_max_error_rate_out_of_range_is_one_line_naming_the_option(value):
    options = ReplayOptions(trace="t.jsonl", tokenizer="tok", max_error_rate=value)
    with pytest.raises(OptionError) as e:
        options.check()
    assert str(e.value) == f"--max-error-rate {value}: must be 0 to 1 (1: never stop)"


def test_max_error_rate_not_a_number_is_refused_by_the_parser(capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).max_error_rate == 0.5
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--max-error-rate", "half"])
    assert e.value.code == 2 and "argument --max-error-rate: must be 0 to 1, got 'half'" in capsys.readouterr().err


# -- what the servers serve ---------------------------------------------------------------------------


def test_the_answers_are_read_by_api():
    assert read_models({"object": "list", "data": [{"id": "a", "max_model_len": 4096}, {"id": "b"}]}) == \
        {"a": 4096, "b": None}
    assert read_models({"detail": "Not Found"}) is None and read_models([1]) is None
    assert read_info({"model_id": "org/m", "max_input_tokens": 4095, "max_total_tokens": 4096}) == {"org/m": 4095}
    assert read_info({"model_id": "org/m", "max_input_length": 1024}) == {"org/m": 1024}  # before TGI 2
    assert read_info({"error": "x"}) is None


A = Served("http://a", {"m": 4096})
B = Served("http://b", {"m": 2048})
OTHER = Served("http://c", {"x": None, "y": None})
DEAD = Served("http://d", problem="did not answer GET /v1/models (connection refused)")


def test_the_model_is_taken_when_every_endpoint_serves_one_and_the_same():
    assert only_model((A, B)) == "m" and prompt_limit((A, B), "m") == 2048
    assert only_model((A, OTHER)) is None and only_model((A, DEAD)) is None and only_model(()) is None
    assert refusal((A, B), "m") is None


def test_refusals_name_each_endpoint_and_what_it_serves():
    assert refusal((A, DEAD), "m") == "http://d did not answer GET /v1/models (connection refused)"
    assert refusal((A, OTHER), "m") == "--model m: http://c serves x, y"
    assert refusal((A, Served("http://e", {})), "m") == "--model m: http://e serves no model"
    assert refusal((A, OTHER), None) == ("no --model, and the endpoints do not serve one and the same model: "
                                         "http://a serves m; http://c serves x, y; pass --model NAME")


def test_each_endpoint_is_asked_by_its_api(toy_tokenizer_dir):
    """The sim's answers (vLLM's /v1/models, TGI's /info), a key it wants (HTTP 401) and a dead port."""
    dead = f"http://127.0.0.1:{free_port()}"
    with sim_process(toy_tokenizer_dir, "--model", "org/m", "--max-model-len", "512",
                     "--require-authorization", "Bearer k") as sim:
        key = {"Authorization": "Bearer k"}
        assert ask_served([sim.url], "openai-chat", key) == (Served(sim.url, {"org/m": 512}),)
        assert ask_served([sim.url], "tgi", key) == (Served(sim.url, {"org/m": 511}),)
        assert ask_served([sim.url, dead], "openai-completions") == (
            Served(sim.url, problem="answered GET /v1/models with HTTP 401"),
            Served(dead, problem="did not answer GET /v1/models (connection refused)"))


# -- end to end: real Locust against `replay sim` --------------------------------------------------------


def test_a_dead_endpoint_and_a_wrong_model_end_before_the_first_send(tmp_path, toy_tokenizer_dir, sim):
    """Exit 2 in seconds, one line naming the endpoint and what it serves (or why it said
    nothing), every row recorded as refused, and the run's files written."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=12, gap_ms=10)
    dead = f"http://127.0.0.1:{free_port()}"
    cases = [
        (["--endpoints", f"{sim.url},{dead}"], f"{dead} did not answer GET /v1/models (connection refused)"),
        (["--model", "gpt-x"], f"--model gpt-x: {sim.url} serves sim"),
    ]
    for n, (flags, reason) in enumerate(cases):
        output = tmp_path / f"run{n}.jsonl"
        proc = run_locust([*replay_args(trace, toy_tokenizer_dir, sim.url, output), *flags], tmp_path, exit_code=2,
                          timeout=60)
        errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
        assert len(errors) == 2 and errors[0].endswith(
            f"replay: {reason}: nothing was sent; every row is recorded as {REFUSED!r}"), proc.stderr[-3000:]
        assert errors[1].endswith("12 of 12 rows failed: exit code 2")  # the summary's line
        records = list(read_records(output))
        assert sorted(r["request_id"] for r in records) == list(range(12))
        assert {r["error"] for r in records} == {f"{REFUSED}: {reason}"} and not any(r["sent_at"] for r in records)
        assert summary_path(output).exists() and read_run_metadata(output)["trace"]["rows"] == 12
    assert requests_received(sim) == 0


def test_in_the_web_uis_mode_a_refusal_records_nothing(tmp_path, toy_tokenizer_dir):
    """No run was asked for yet (no --headless): the line and exit 2, no file."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=4, gap_ms=10)
    dead = f"http://127.0.0.1:{free_port()}"
    output = tmp_path / "run.jsonl"
    proc = run_locust(web_args(trace, toy_tokenizer_dir, dead, output, free_port()), tmp_path, exit_code=2, timeout=60)
    assert f"replay: {dead} did not answer GET /v1/models (connection refused): nothing was sent\n" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("run.jsonl")) == []


def requests_received(sim) -> int:
    return requests.get(sim.url + "/debug/requests", timeout=5).json()["total"]


def test_without_model_the_one_served_is_used(tmp_path, toy_tokenizer_dir, fast_sim):
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=6, gap_ms=10)
    output = tmp_path / "run.jsonl"
    args = [a for a in replay_args(trace, toy_tokenizer_dir, fast_sim.url, output) if a not in ("--model", "sim")]
    proc = run_locust(args, tmp_path, timeout=60)
    assert "no --model: every endpoint serves 'sim', the run's model" in proc.stderr
    assert all(r["ok"] for r in read_records(output)) and read_run_metadata(output)["options"]["model"] == "sim"


def test_a_server_failing_every_request_stops_the_run(tmp_path, toy_tokenizer_dir):
    """The trace would take a minute; the run stops within seconds of MIN_ANSWERS failures, exit 1."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=600, gap_ms=100)
    output = tmp_path / "run.jsonl"
    with sim_process(toy_tokenizer_dir, "--block-size", str(BLOCK), "--error-rate", "1", "--ttft-ms", "1") as sim:
        proc = run_locust(replay_args(trace, toy_tokenizer_dir, sim.url, output), tmp_path, exit_code=1, timeout=60)
    label = error_rate_label(0.5)
    assert "more than --max-error-rate 0.5" in proc.stderr
    records = list(read_records(output))
    assert sorted(r["request_id"] for r in records) == list(range(600))
    failed = [r for r in records if r["error"] != label]
    assert MIN_ANSWERS <= len(failed) < 100 and all(r["status"] == 500 for r in failed)
    assert summary_path(output).exists() and read_run_metadata(output)["complete"]  # every file whole

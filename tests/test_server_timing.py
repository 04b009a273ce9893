"""The server's side of a request (replay/rules/server_timing.py): the fields every source fills."""

from __future__ import annotations

import math

import pytest

from replay.rules.server_timing import (
    ANSWER_TTFT_SUM_BOUND_MS,
    SERVER_TIMING_FIELDS,
    answer_fields,
    empty,
    fill_missing,
    server_work_ms,
    span_fields,
    ttft_source,
)


def test_answer_metrics_become_the_fields_with_ttft_as_queue_plus_prefill():
    fields, problems = answer_fields({"queue_time_ms": 12.5, "time_to_first_token_ms": 30.25,
                                      "generation_time_ms": 100, "mean_itl_ms": 10.0, "tokens_per_second": 9.1})
    assert problems == []
    assert fields == {"server_queue_ms": 12.5, "server_prefill_ms": 30.25, "server_decode_ms": 100.0,
                      "server_ttft_ms": 42.75, "server_e2e_ms": None, "server_mean_itl_ms": 10.0,
                      "server_timing_source": "answer"}
    assert abs(fields["server_ttft_ms"] - (fields["server_queue_ms"] + fields["server_prefill_ms"])) <= ANSWER_TTFT_SUM_BOUND_MS


@pytest.mark.parametrize("bad", ["12", True, -1.0, math.nan, math.inf, [1], {"ms": 1}])
def test_a_metric_that_is_not_a_duration_is_dropped_and_named(bad):
    fields, problems = answer_fields({"queue_time_ms": bad, "time_to_first_token_ms": 5.0})
    assert fields["server_queue_ms"] is None and fields["server_ttft_ms"] is None  # no sum with a missing part
    assert fields["server_prefill_ms"] == 5.0 and fields["server_timing_source"] == "answer"
    assert len(problems) == 1 and "queue_time_ms" in problems[0]


@pytest.mark.parametrize("bad", ["fast", 3, [], True])
def test_metrics_that_are_not_an_object_give_nothing_and_are_named(bad):
    fields, problems = answer_fields(bad)
    assert fields == empty() and len(problems) == 1


def test_no_metrics_and_empty_metrics_are_all_null_without_a_problem():
    assert answer_fields(None) == (empty(), [])
    assert answer_fields({}) == (empty(), [])
    assert set(empty()) == set(SERVER_TIMING_FIELDS) and empty()["server_timing_source"] is None


def test_a_span_fills_only_what_the_answer_left_null():
    record = {**empty(), **answer_fields({"queue_time_ms": 1.0, "time_to_first_token_ms": 2.0})[0]}
    span = span_fields(queue_ms=9.0, prefill_ms=9.0, decode_ms=7.0, ttft_ms=20.0, e2e_ms=30.0)
    assert fill_missing(record, span)
    assert (record["server_queue_ms"], record["server_prefill_ms"]) == (1.0, 2.0)  # the answer's kept
    # the answer states no TTFT (only its queue + prefill, after the front end): the span's, from arrival
    assert record["server_ttft_ms"] == 20.0 and ttft_source(record) == "span"
    assert (record["server_decode_ms"], record["server_e2e_ms"]) == (7.0, 30.0)
    assert record["server_timing_source"] == "answer"
    answer_only = {**empty(), **answer_fields({"queue_time_ms": 1.0, "time_to_first_token_ms": 2.0})[0]}
    assert ttft_source(answer_only) == "answer" and ttft_source(empty()) is None
    alone = empty()
    assert fill_missing(alone, span) and alone["server_timing_source"] == "span"
    assert not fill_missing(alone, empty())


def test_server_work_is_the_span_e2e_else_the_sum_of_the_three_parts():
    assert server_work_ms(span_fields(queue_ms=1, prefill_ms=2, decode_ms=3, e2e_ms=10)) == 10
    assert server_work_ms(answer_fields({"queue_time_ms": 1, "time_to_first_token_ms": 2,
                                         "generation_time_ms": 3})[0]) == 6
    assert server_work_ms(answer_fields({"queue_time_ms": 1})[0]) is None


def test_every_record_carries_the_server_fields_named_once():
    from replay.results.records import RECORD_FIELDS
    from replay.rules.server_timing import SERVER_TIMING_PROBLEM

    assert RECORD_FIELDS[-len(SERVER_TIMING_FIELDS) - 1:] == (*SERVER_TIMING_FIELDS, SERVER_TIMING_PROBLEM)

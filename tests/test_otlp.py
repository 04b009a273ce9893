"""--otlp-receiver (docs/otlp.md): the servers' spans joined to the records by request id.

Against `replay sim --otlp-endpoint`, whose queue and step times are its own model's and so
known exactly: every ok record joined, the split as the sim planned it. Faults with real
processes: the port in use, spans that never come, garbage and huge bodies, spans of another
run. The matching rule and the body reading are pure functions, tested as such.
"""

from __future__ import annotations

import gzip
import json
import os
import socket
import threading
import time

import pytest
import requests

from replay.errors import OptionError
from replay.protocol.otlp import PROTOBUF, BadBody, TooLarge, decode, export_body, unzip
from replay.results.otlp_receiver import SpanReceiver, split_listen
from replay.results.span_join import SpanTable, replay_request
from replay.rules.run_files import spans_path, summary_path
from replay.rules.server_timing import SERVER_TIMING_FIELDS
from replay.sim.generation import EARLY_S
from replay.sim.process import sim_process
from support.ports import free_port
from support.processes import replay_args, run_locust, run_replay
from support.traces import BLOCK, mooncake_trace

TTFT_MS, ITL_MS = 20.0, 3.0
ROUNDING_MS = 0.002  # each field is rounded to 1 us in the record
# The sim may write a token up to EARLY_S before it is due (its timer's margin): the client's
# TTFT is then that much under the server's planned one.
EARLY_MS = EARLY_S * 1000


def span(request_id: str, **attributes) -> dict:
    return {"name": "llm_request", "start_ns": 1, "end_ns": 2,
            "attributes": {"gen_ai.request.id": request_id, **attributes}}


def records(output) -> list[dict]:
    return [json.loads(line) for line in output.read_text().splitlines()]


# -- the rule ------------------------------------------------------------------------------


@pytest.mark.parametrize("span_id, found", [
    ("chatcmpl-0123456789ab-17", ("0123456789ab", 17)),  # vLLM's chat completions
    ("cmpl-0123456789ab-17-0", ("0123456789ab", 17)),  # completions: the prompt's index follows
    ("0123456789ab-17", ("0123456789ab", 17)),  # TGI, a router: the X-Request-Id as sent
    ("chatcmpl-9f86d081884c7d659a2feaa0c55ad015", None),  # vLLM's own id: no X-Request-Id
    ("chatcmpl-0123456789ab", None),
    ("", None),
])
def test_the_matching_rule(span_id, found):
    assert replay_request(span_id) == found


@pytest.mark.parametrize("listen", ["4318", "localhost", ":4318", "host:port", "host:70000"])
def test_a_listen_address_not_host_port_is_refused_naming_the_option(listen):
    with pytest.raises(OptionError, match=f"^--otlp-receiver {listen}: give HOST:PORT"):
        split_listen(listen)


def test_an_address_not_this_hosts_is_refused_naming_it(tmp_path):
    assert split_listen("[::1]:4318") == ("::1", 4318)
    with pytest.raises(OptionError, match="^--otlp-receiver 192.0.2.1:4318: cannot listen there: "):
        SpanReceiver.start("192.0.2.1:4318", tmp_path / "spans.jsonl")  # TEST-NET-1: no host's own


def test_the_receiver_stops_at_once_with_an_exporters_connection_open(tmp_path):
    """An exporter keeps its connection between batches: the end does not wait for it."""
    receiver = SpanReceiver.start("127.0.0.1:0", tmp_path / "spans.jsonl")
    with requests.Session() as exporter:
        answer = exporter.post(f"http://127.0.0.1:{receiver.port}/v1/traces", data=export_body([span("x")], "t"),
                               headers={"Content-Type": PROTOBUF}, timeout=10)
        assert answer.status_code == 200 and answer.headers["Content-Type"] == PROTOBUF
        started = time.monotonic()
        receiver.stop()
        assert time.monotonic() - started < 2.0
    assert json.loads((tmp_path / "spans.jsonl").read_text())["attributes"] == {"gen_ai.request.id": "x"}


# -- the bodies ------------------------------------------------------------------------------


def test_protobuf_json_and_gzip_bodies_decode_to_the_same_span():
    body = export_body([span("chatcmpl-0123456789ab-3", **{"gen_ai.latency.time_in_queue": 0.25,
                                                            "gen_ai.usage.completion_tokens": 4})], "test")
    (decoded,) = decode(unzip(gzip.compress(body), "gzip", 1 << 20), PROTOBUF)
    assert decoded["attributes"] == {"gen_ai.request.id": "chatcmpl-0123456789ab-3",
                                     "gen_ai.latency.time_in_queue": 0.25, "gen_ai.usage.completion_tokens": 4}
    as_json = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [{
        "traceId": "5b8efff798038103d269b633813fc60c", "spanId": "eee19b7ec3c1b174", "name": "llm_request",
        "startTimeUnixNano": "1", "endTimeUnixNano": "2", "kind": 2, "attributes": [
            {"key": "gen_ai.request.id", "value": {"stringValue": "chatcmpl-0123456789ab-3"}},
            {"key": "gen_ai.latency.time_in_queue", "value": {"doubleValue": 0.25}},
            {"key": "gen_ai.usage.completion_tokens", "value": {"intValue": "4"}},
            {"key": "other", "value": {"stringValue": "not kept"}}]}]}]}]})
    assert decode(as_json.encode(), "application/json; charset=utf-8") == [decoded]


def test_garbage_and_bombs_are_refused():
    with pytest.raises(BadBody):
        decode(b"\x0a\xff\xff\xff", PROTOBUF)
    with pytest.raises(BadBody):
        decode(b"{not json", "application/json")
    with pytest.raises(BadBody):
        decode(b"", "text/plain")
    with pytest.raises(BadBody):
        unzip(b"not gzip", "gzip", 100)
    with pytest.raises(TooLarge):
        unzip(gzip.compress(b"\0" * 10_000), "gzip", 1000)  # refused inflating, not after
    whole = gzip.compress(export_body([span("chatcmpl-0123456789ab-1")], "sim"))
    for cut in (10, len(whole) // 2, len(whole) - 4):  # a body cut short: its spans lost, never an empty export
        with pytest.raises(BadBody):
            unzip(whole[:cut], "gzip", 1 << 20)
    with pytest.raises(BadBody):
        unzip(whole + b"trailing", "gzip", 1 << 20)


# -- the join --------------------------------------------------------------------------------


def test_the_answers_values_are_kept_and_the_span_fills_the_rest(tmp_path):
    path = tmp_path / "spans.jsonl"
    lines = [span("chatcmpl-0123456789ab-10", **{"gen_ai.latency.time_in_queue": 0.5,
                                                  "gen_ai.latency.time_in_model_prefill": 0.1,
                                                  "gen_ai.latency.time_in_model_decode": 0.3,
                                                  "gen_ai.latency.time_to_first_token": 0.6,
                                                  "gen_ai.latency.e2e": 0.9, "gen_ai.usage.completion_tokens": 4}),
             span("chatcmpl-0123456789ab-11", **{"gen_ai.latency.time_in_queue": 0.5}),
             span("chatcmpl-0123456789ab-11"),  # a second span for row 11
             span("chatcmpl-ffffffffffff-10"),  # another run's
             span("chatcmpl-0123456789ab-99"),  # this run's id, no such row
             {"name": "other", "start_ns": 0, "end_ns": 0, "attributes": {}},
             {"rejected": "body of 99 bytes", "status": 413, "bytes": 99}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"name": "half a li')
    table = SpanTable(path, "0123456789ab", 10, bytearray([1, 1, 1]), lambda request_id: request_id in (10, 11, 12))
    table.read()
    answered = {"request_id": 10, "server_queue_ms": 7.0, "server_timing_source": "answer"}
    assert table.fill(answered)
    assert answered == {"request_id": 10, "server_queue_ms": 7.0, "server_prefill_ms": 100.0, "server_decode_ms": 300.0,
                        "server_ttft_ms": 600.0, "server_e2e_ms": 900.0, "server_mean_itl_ms": 100.0,
                        "server_timing_source": "answer"}
    only_span = {"request_id": 11}
    table.fill(only_span)
    assert only_span["server_queue_ms"] == 500.0 and only_span["server_timing_source"] == "span"
    none = {"request_id": 12}
    table.fill(none)
    assert all(none[name] is None for name in SERVER_TIMING_FIELDS) and none["server_timing_source"] is None
    assert table.section() == {"spans": 6, "llm_request": 5, "joined": 2, "other_run": 1, "not_replay": 0,
                               "no_record": 1, "duplicate": 1, "other_name": 1, "bodies_too_large": 1,
                               "bodies_bad": 0, "ok_records": 3, "ok_records_without_span": 1}


# -- against replay sim ------------------------------------------------------------------------


@pytest.fixture
def receiver_port() -> int:
    return free_port()


@pytest.fixture
def exporting_sim(toy_tokenizer_dir, receiver_port):
    """A sim with a queue (2 running at once) and exact times, exporting to the run's receiver."""
    with sim_process(toy_tokenizer_dir, "--block-size", str(BLOCK), "--ttft-ms", str(TTFT_MS), "--itl-ms",
                     str(ITL_MS), "--prefill-ms-per-1k", "0", "--max-num-seqs", "2",
                     "--otlp-endpoint", f"http://127.0.0.1:{receiver_port}/v1/traces") as server:
        yield server


def test_spans_join_every_record_with_the_sims_times(exporting_sim, receiver_port, toy_tokenizer_dir, tmp_path):
    trace = mooncake_trace(tmp_path / "trace.jsonl", 40, 10)  # 4 rows in the time 2 slots serve 1: a queue
    output = tmp_path / "run.jsonl"
    proc = run_locust(replay_args(trace, toy_tokenizer_dir, exporting_sim.url, output,
                                  "--otlp-receiver", f"127.0.0.1:{receiver_port}"), tmp_path)
    rows = records(output)
    assert len(rows) == 40 and all(r["ok"] for r in rows)
    for r in rows:
        assert r["server_timing_source"] == "span", r
        assert abs(r["server_prefill_ms"] - TTFT_MS) <= ROUNDING_MS, r  # the sim's planned prefill, exactly
        assert abs(r["server_decode_ms"] - ITL_MS * (r["output_tokens"] - 1)) <= ROUNDING_MS, r
        assert abs(r["server_queue_ms"] + r["server_prefill_ms"] - r["server_ttft_ms"]) <= ROUNDING_MS, r
        assert abs(r["server_ttft_ms"] + r["server_decode_ms"] - r["server_e2e_ms"]) <= ROUNDING_MS, r
        assert r["server_ttft_ms"] <= r["ttft_ms"] + EARLY_MS, r
    assert max(r["server_queue_ms"] for r in rows) > TTFT_MS  # the queue is the server's, and seen
    section = json.loads(summary_path(output).read_text())["spans"]
    assert section["joined"] == section["ok_records"] == 40 and section["ok_records_without_span"] == 0
    assert "server spans: 40 joined of 40 ok records; 0 ok records without a span" in proc.stdout


def test_a_port_in_use_is_refused_before_the_run(fast_sim, toy_tokenizer_dir, tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    trace = mooncake_trace(tmp_path / "trace.jsonl", 5, 10)
    output = tmp_path / "run.jsonl"
    try:
        proc = run_replay(replay_args(trace, toy_tokenizer_dir, fast_sim.url, output,
                                      "--otlp-receiver", f"127.0.0.1:{port}"), tmp_path)
    finally:
        taken.close()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"replay: --otlp-receiver 127.0.0.1:{port}: cannot listen there: Address already in use" in proc.stderr
    assert not output.exists()  # nothing sent, no record
    assert not spans_path(output).exists()  # nor a spans file that would refuse the rerun as "an earlier run's"
    assert requests.get(fast_sim.url + "/debug/requests", timeout=5).json()["total"] == 0
    again = run_replay(replay_args(trace, toy_tokenizer_dir, fast_sim.url, output), tmp_path)  # the port freed
    assert again.returncode == 0, again.stderr[-2000:]


def test_spans_that_never_come_leave_null_fields_counted(fast_sim, toy_tokenizer_dir, tmp_path):
    trace = mooncake_trace(tmp_path / "trace.jsonl", 8, 10)
    output = tmp_path / "run.jsonl"
    started = time.monotonic()
    proc = run_locust(replay_args(trace, toy_tokenizer_dir, fast_sim.url, output, "--otlp-receiver",
                                  f"127.0.0.1:{free_port()}", "--otlp-wait", "1"), tmp_path)
    assert time.monotonic() - started < 60
    rows = records(output)
    assert all(r["ok"] for r in rows)
    assert all(r[name] is None for r in rows for name in (*SERVER_TIMING_FIELDS, "server_timing_source"))
    section = json.loads(summary_path(output).read_text())["spans"]
    assert section["ok_records"] == 8 and section["ok_records_without_span"] == 8 and section["joined"] == 0
    assert "0 joined of 8 ok records; 8 ok records without a span" in proc.stdout
    assert "8 of 8 ok records got no server span within --otlp-wait 1 s" in proc.stderr


def _post_when_listening(port: int, bodies: list[tuple[bytes, dict]], answers: list) -> None:
    deadline = time.monotonic() + 60
    url = f"http://127.0.0.1:{port}/v1/traces"
    while time.monotonic() < deadline:
        try:
            for body, headers in bodies:
                answers.append(requests.post(url, data=body, headers=headers, timeout=10).status_code)
            return
        except requests.ConnectionError:
            if answers:  # the huge body's connection is closed unread: its answer may be lost
                answers.append("closed")
                return
            time.sleep(0.05)


def test_garbage_huge_and_foreign_bodies_are_answered_and_counted(exporting_sim, receiver_port, toy_tokenizer_dir,
                                                                   tmp_path):
    """While a run is joined: garbage (400), a gzip bomb and a huge body (413), another run's
    span and a span of no replay (ignored): every one counted, the run's own spans all joined."""
    foreign = export_body([span("chatcmpl-0123456789ab-3"), span("chatcmpl-not-a-replay")], "other")
    bodies = [(b"\x0a\xff\xff\xff garbage", {"Content-Type": PROTOBUF}),
              (b"{]", {"Content-Type": "application/json"}),
              (gzip.compress(b"\0" * (32 << 20)), {"Content-Type": PROTOBUF, "Content-Encoding": "gzip"}),
              (foreign, {"Content-Type": PROTOBUF}),
              (b"\0" * (17 << 20), {"Content-Type": PROTOBUF})]
    answers: list = []
    poster = threading.Thread(target=_post_when_listening, args=(receiver_port, bodies, answers))
    poster.start()
    trace = mooncake_trace(tmp_path / "trace.jsonl", 20, 50)
    output = tmp_path / "run.jsonl"
    proc = run_locust(replay_args(trace, toy_tokenizer_dir, exporting_sim.url, output,
                                  "--otlp-receiver", f"127.0.0.1:{receiver_port}"), tmp_path)
    poster.join()
    assert answers[:4] == [400, 400, 413, 200] and answers[4] in (413, "closed"), answers
    section = json.loads(summary_path(output).read_text())["spans"]
    assert section["bodies_bad"] == 2 and section["bodies_too_large"] == 2, section
    assert section["other_run"] == 1 and section["not_replay"] == 1, section
    assert section["joined"] == 20 and section["ok_records_without_span"] == 0, section
    assert "server spans ignored: 1 of another run, 1 not a replay's request" in proc.stdout
    assert "OTLP bodies refused: 2 too large (413), 2 not OTLP (400)" in proc.stdout
    assert spans_path(output).stat().st_size < 1 << 20  # what was refused is a line, not its body


def test_a_replay_without_the_receiver_imports_no_protobuf():
    """A replay's process imports its start and end (preflight, finish) without protobuf and the
    OTLP messages: they are imported where a body is read or written."""
    import subprocess
    import sys

    code = ("import sys, replay.run.preflight, replay.run.finish, replay.results.span_join; "
            "assert 'google.protobuf' not in sys.modules, 'protobuf imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_a_spans_figure_no_request_can_take_is_left_null(tmp_path):
    """Seconds in a span, the bound in ms: 1e7 s (four months) is no request's queue."""
    path = tmp_path / "spans.jsonl"
    line = span("chatcmpl-0123456789ab-10", **{"gen_ai.latency.time_in_queue": 1e7,
                                                "gen_ai.latency.time_in_model_prefill": 0.1})
    path.write_text(json.dumps(line) + "\n")
    table = SpanTable(path, "0123456789ab", 10, bytearray([1]), lambda request_id: request_id == 10)
    table.read()
    record = {"request_id": 10}
    table.fill(record)
    assert record["server_queue_ms"] is None and record["server_prefill_ms"] == 100.0, record


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2, reason="needs 2 cores and affinity calls")
def test_a_replay_pinned_to_a_core_leaves_it_to_its_sends(tmp_path):
    """The receiver child of a process pinned to core 0 runs on the other cores."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})
    try:
        receiver = SpanReceiver.start("127.0.0.1:0", tmp_path / "spans.jsonl")
    finally:
        os.sched_setaffinity(0, before)
    try:
        assert 0 not in os.sched_getaffinity(receiver.pid)
    finally:
        receiver.stop()

"""The replay engine in-process, without Locust: a Coordinator and a local Dispatcher wired by
LocalLink, against a real `replay sim`. What the Locust adapter (replay.locust.plugin) would
hand in is given here as plain callbacks."""

from __future__ import annotations

import subprocess
import sys

import gevent

from conftest import BLOCK, check_records, mooncake_trace
from replay.engine.coordinator import Coordinator
from replay.engine.dispatcher import Dispatcher
from replay.engine.options import ReplayOptions
from replay.engine.transport import LOCAL_CLIENT, LocalLink
from replay.results.metadata import meta_path, read_run_metadata, summary_path


def test_engine_imports_without_locust():
    code = ("import sys, replay.engine.coordinator, replay.engine.dispatcher, replay.engine.live; "
            "assert 'locust' not in sys.modules, 'the engine imported locust'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_coordinator_and_dispatcher_in_process(tmp_path, sim, toy_tokenizer_dir):
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=30, gap_ms=20)
    output = tmp_path / "run.jsonl"
    options = ReplayOptions(trace=str(trace), block_size=BLOCK, tokenizer=str(toy_tokenizer_dir), model="sim",
                            output=str(output))
    link = LocalLink()
    answered: list[dict] = []
    exit_codes: list[int] = []
    part = Dispatcher(link, local=True, on_request=answered.append)
    coordinator = Coordinator(link, options, local_part=part, endpoints=[sim.url], host=lambda: sim.url,
                              on_exit_code=exit_codes.append)

    coordinator.begin([(LOCAL_CLIENT, 0)])  # the dispatcher's greenlets start on the plan and the go
    assert coordinator.finished.wait(timeout=60), f"{coordinator.recorded} of {coordinator.total} rows recorded"
    gevent.spawn(coordinator.end).join(timeout=60)

    records = check_records(output, trace)  # one ok record per row, prompt_tokens == input_length
    assert len(records) == 30 and coordinator.end_reason == "complete"
    assert {r["worker"] for r in records} == {0} and {r["endpoint"] for r in records} == {sim.url}
    assert sorted(r["request_id"] for r in answered) == list(range(30))  # on_request: once per answer
    assert exit_codes == []  # no failed row: the exit code is left alone
    meta = read_run_metadata(output)
    assert meta_path(output).exists() and summary_path(output).exists()
    assert meta["trace"]["rows"] == 30 and meta["endpoints"] == [sim.url]
    assert [(w["index"], w["client_id"], w["rows_assigned"]) for w in meta["workers"]] == [(0, LOCAL_CLIENT, 30)]

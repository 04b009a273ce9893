"""Run metadata: what a Coordinator knows is written beside the results, and `replay report`
then needs nothing else (trace, block size, tokenizer, api, seed, SLO come from it).

The Coordinator is built in a child process: importing Locust monkey-patches the whole
interpreter (gevent), which the rest of the test session must not inherit.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from replay.results.metadata import read_run_metadata
from replay.results.records import RECORD_FIELDS
from replay.rules.run_files import meta_path
from replay.synth.tokenizer import load_chat_template
from support.traces import mooncake_trace

T0 = 1_700_000_000.0


COORDINATOR = """
import sys
from replay.engine.coordinator import Coordinator, WorkerState
from replay.run import preflight
from replay.engine.options import ReplayOptions
from replay.engine.transport import LocalLink
from replay.results.metadata import write_run_metadata

trace, tokenizer, output, t0 = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
options = ReplayOptions(trace=trace, block_size=16, tokenizer=tokenizer, api="openai-completions", model="m",
                        prompt_format="token-ids", scale=2.0, seed=7, slo="e2e_ms=1000", output=output,
                        header=["Authorization: Bearer secret"])
c = Coordinator(preflight.load(options, "http://127.0.0.1:9"), LocalLink())
c.workers["local"] = WorkerState("local", 0, c.schedule.partition(1)[0], part=None, window=None, plan=None,
                                plan_window=None, go_window=None, round_window=None, ready=True, clock_offset_ms=0.25,
                                rtt_ms=0.1)
c.epoch, c.started_at = t0 + 0.5, t0
print(write_run_metadata(output, c.metadata()))
"""


@pytest.fixture
def run(tmp_path, toy_tokenizer_dir):
    """(results path, trace path, metadata) of a 12-row run whose Coordinator wrote the metadata."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=12, gap_ms=100)
    results = tmp_path / "run.jsonl"
    proc = subprocess.run([sys.executable, "-c", COORDINATOR, str(trace), str(toy_tokenizer_dir), str(results), str(T0)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(meta_path(results)) and meta_path(results).name == "run.jsonl.meta.json"
    return results, trace, read_run_metadata(results)


def test_coordinator_metadata(run, toy_tokenizer_dir):
    results, trace, meta = run
    assert meta["trace"]["format"] == "mooncake" and meta["trace"]["block_size"] == 16
    assert meta["trace"]["rows"] == 12 and meta["trace"]["window_s"] == pytest.approx(1.1 / 2.0)
    assert (meta["trace"]["rows_in_file"], meta["trace"]["rows_skipped"], meta["trace"]["skipped"]) == (12, 0, [])
    assert len(meta["trace"]["sha256"]) == 64
    assert meta["template_sha256"] == load_chat_template(toy_tokenizer_dir).sha256
    assert (meta["api"], meta["model"], meta["seed"], meta["scale"]) == ("openai-completions", "m", 7, 2.0)
    assert meta["endpoints"] == ["http://127.0.0.1:9"]
    assert meta["workers"] == [{"index": 0, "client_id": "local", "host": meta["workers"][0]["host"],
                                "clock_offset_ms": 0.25, "rtt_ms": 0.1, "rows_assigned": 12, "lost": False}]  # fmt: skip
    assert meta["versions"]["locust"] and meta["versions"]["python"]
    assert meta["options"]["prompt_format"] == "token-ids"
    text = json.dumps(meta)
    assert "secret" not in text and meta["options"]["header_names"] == ["Authorization"]


def test_report_reads_everything_from_metadata(tmp_path, run, toy_tokenizer_dir):
    results, trace, meta = run
    with open(results, "w") as f:
        for k, line in enumerate(open(trace)):
            row = json.loads(line)
            r = {key: None for key in RECORD_FIELDS}
            r.update(request_id=k, api="openai-completions", status=200, ok=True, sent_at=T0 + k,
                     finished_at=T0 + k + 0.5, e2e_ms=500.0 + 100 * (k % 2) * 10, drift_ms=0.1, cached_tokens=0,
                     prompt_tokens=row["input_length"], output_tokens=row["output_length"],
                     input_length=row["input_length"], output_length=row["output_length"])  # fmt: skip
            f.write(json.dumps(r) + "\n")

    def report(*extra):
        out = tmp_path / f"s{len(extra)}.json"
        proc = subprocess.run([sys.executable, "-m", "replay", "report", str(results), "--json", str(out), *extra],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return json.loads(out.read_text())

    from_meta = report("--server-block-size", "32")
    explicit = report("--server-block-size", "32", "--trace", str(trace), "--block-size", "16",
                      "--tokenizer", str(toy_tokenizer_dir), "--api", "openai-completions", "--seed", "7",
                      "--slo", "e2e_ms=1000")  # fmt: skip
    assert from_meta["cache"] is not None
    assert from_meta["cache"]["expected_cached_tokens"] == explicit["cache"]["expected_cached_tokens"] > 0
    assert "seed 7" in from_meta["cache"]["method"]
    assert "token-id prompts" in from_meta["cache"]["method"]  # the run's --prompt-format
    assert from_meta["goodput_rps"] == explicit["goodput_rps"]  # the run's --slo
    assert from_meta["requests_good"] == 6

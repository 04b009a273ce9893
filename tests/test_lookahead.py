"""Bodies built ahead in steps that fit between sends (replay/engine/lookahead.py): a long
prompt is made in steps with the sends due meanwhile let go first, the same prompt as in one
go, the built bodies' bytes bounded; and a burst of long prompts due together, among a busy
trace's sends, is sent on time (its bodies built before they are due, not when due)."""

from __future__ import annotations

import json
import time

import gevent
import pytest

from replay.engine import dispatcher, lookahead
from replay.engine.dispatcher import Dispatcher
from replay.engine.lookahead import Bodies, BuildSteps
from replay.engine.options import ReplayOptions
from replay.engine.transport import LOCAL_CLIENT, LocalLink
from replay.results.records import read_records
from replay.run import driver, preflight
from replay.synth.prompts import PAUSE_BLOCKS, PromptSynthesizer
from replay.synth.tokenizer import ServerTokenizer
from replay.trace.record import TraceRow

BLOCK = 16


def test_a_prompt_made_in_steps_is_the_same_prompt(toy_tokenizer_dir):
    synth = PromptSynthesizer(ServerTokenizer.load(toy_tokenizer_dir), "openai-chat", block_size=BLOCK)
    row = TraceRow(request_id=1, timestamp_s=0.0, input_length=200 * BLOCK, output_length=4,
                   hash_ids=tuple(range(200)))
    pauses: list[int] = []
    stepped = synth.prompt(row, lambda: pauses.append(1))
    whole = synth.prompt(row)
    assert (stepped.messages, stepped.fingerprint) == (whole.messages, whole.fingerprint)
    assert len(pauses) == 200 // PAUSE_BLOCKS


def test_bodies_count_their_bytes(monkeypatch):
    monkeypatch.setattr(lookahead, "AHEAD_BYTES", 10)
    bodies = Bodies()
    bodies[0], bodies[1], bodies[2] = b"12345", ValueError("cannot build"), b"1234"
    assert bodies.held == 9 and not bodies.full
    bodies[3] = b"12"
    assert bodies.full
    assert bodies.pop(0) == b"12345" and bodies.held == 6 and not bodies.full
    assert isinstance(bodies.pop(1), ValueError) and bodies.pop(7, None) is None and bodies.held == 6


def test_steps_let_a_send_due_soon_go_first_but_never_wait_for_their_own_row():
    due = [time.time() + 0.0005]  # the next send, whose body is ready: within a few steps' time
    next_position = [0]
    steps = BuildSteps(lambda: due[0], lambda: next_position[0])
    steps.start(5)
    gevent.get_hub().loop.update_now()  # the loop's clock, idle since the last test, counts the 30 ms from now
    sent = gevent.spawn_later(0.03, lambda: (due.__setitem__(0, float("inf")), next_position.__setitem__(0, 1)))
    started = time.monotonic()
    steps()  # waits for the send, then goes on
    assert time.monotonic() - started >= 0.025 and sent.ready()
    due[0], next_position[0] = time.time() - 1.0, 5  # the row being built is the one due (the builder fell behind)
    started = time.monotonic()
    steps()
    assert time.monotonic() - started < 0.02


@pytest.mark.alone  # a bound on send lag: another test's load moves it
def test_a_burst_of_long_prompts_among_busy_sends_goes_on_time(tmp_path, sim, toy_tokenizer_dir, monkeypatch):
    """8 rows of 30,000 tokens due at the same millisecond, among sends every 5 ms: before
    the builder worked in steps, it found no gap as long as a whole build of such a row, built
    each one when it fell due, and the last of the burst left ~300 ms late. The window is
    made 1 s here, so that the burst (at 2 s) is built while the run sends, not before its go."""
    monkeypatch.setattr(dispatcher, "AHEAD_S", 1.0)
    trace = tmp_path / "trace.jsonl"
    with open(trace, "w") as f:
        for k in range(600):  # 3 s of short rows, 5 ms apart
            f.write(json.dumps({"timestamp": 5.0 * k, "input_length": BLOCK, "output_length": 2,
                                "hash_ids": [10**6 + k]}) + "\n")
        for k in range(8):
            f.write(json.dumps({"timestamp": 2000.0, "input_length": 30000, "output_length": 2,
                                "hash_ids": [10**5 * (k + 1) + j for j in range(30000 // BLOCK)]}) + "\n")
    output = tmp_path / "run.jsonl"
    options = ReplayOptions(trace=str(trace), block_size=BLOCK, tokenizer=str(toy_tokenizer_dir), model="sim",
                            output=str(output), server_metrics_interval=0, verify_server="off")
    link = LocalLink()
    coordinator = driver.start(preflight.load(options, sim.url), link, local_part=Dispatcher(link, local=True))
    coordinator.begin([(LOCAL_CLIENT, 0)])
    assert coordinator.finished.wait(timeout=60), f"{coordinator.recorded} of {coordinator.total} rows recorded"
    gevent.spawn(coordinator.end).join(timeout=60)
    records = list(read_records(output))
    burst = sorted(r["drift_ms"] for r in records if r["input_length"] == 30000)
    assert len(burst) == 8 and all(r["ok"] for r in records)
    assert burst[-1] < 25.0, burst  # on an idle core all within 5 ms (bench: docs/bench/2026-11-28-costs.md)

"""A server's usage is its claim; the stream is what arrived. Records keep both (`output_tokens`
the claim, `received_tokens` the content events counted) and flag the claims that cannot be
true in `usage_mismatch`; the summary counts those rows. A flag, never a failure.

Before this a server reporting prompt_tokens 1 for a 66-token prompt, or 99,999 completion
tokens for 40 streamed, was recorded as ok with nothing said, and the summary's generated-token
total was the false figure. `replay sim --false-usage` is the lying server.
"""

from __future__ import annotations

import json

import pytest

from replay.results.records import read_records
from replay.rules.run_files import summary_path
from replay.rules.usage import disagreements, max_tokens_asked, output_tokens_believed
from replay.sim.process import sim_process
from support.processes import replay_args, run_locust
from support.traces import BLOCK, mooncake_trace


def test_disagreements_flag_only_what_cannot_be_true():
    honest = dict(input_length=66, output_length=40, received_tokens=40, prompt_tokens=66, output_tokens=40,
                  cached_tokens=32)
    assert disagreements(**honest) == []
    assert disagreements(**{**honest, "received_tokens": 20}) == []  # several tokens an event: possible
    assert disagreements(**{**honest, "output_tokens": 12}) == ["output_tokens 12 < received_tokens 40"]
    assert disagreements(**{**honest, "output_tokens": 99_999}) == ["output_tokens 99999 > max_tokens 40"]
    assert disagreements(**{**honest, "prompt_tokens": 1, "cached_tokens": 0}) == ["prompt_tokens 1 != input_length 66"]
    assert disagreements(**{**honest, "cached_tokens": 67}) == ["cached_tokens 67 > prompt_tokens 66"]
    assert disagreements(**{**honest, "input_length": None}) == []  # a row of its own messages says no length
    assert disagreements(**{**honest, "received_tokens": None, "output_tokens": 2000}) == \
        ["output_tokens 2000 > max_tokens 40"]  # fmt: skip
    assert max_tokens_asked(0) == 1 and disagreements(**{**honest, "output_length": 0, "output_tokens": 1,
                                                          "received_tokens": 1}) == []  # fmt: skip


def test_output_figures_believe_only_a_claim_that_can_be_true():
    def believed(claim, received, output_length=40):
        return output_tokens_believed(output_tokens=claim, received_tokens=received, output_length=output_length)

    assert believed(40, 40) == 40 and believed(40, 20) == 40  # several tokens an event: the claim stands
    assert believed(99_999, 40) == 40 and believed(12, 40) == 40  # impossible: the events received
    assert believed(2000, None) == 40 and believed(30, None) == 30  # not streamed: at most max_tokens
    assert believed(None, 17) == 17 and believed(None, None) is None


def replay_against(tmp_path, toy_tokenizer_dir, false_usage: dict, *extra: str) -> tuple[list[dict], dict, str]:
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=12, gap_ms=10)
    output = tmp_path / "run.jsonl"
    with sim_process(toy_tokenizer_dir, "--block-size", str(BLOCK), "--ttft-ms", "2", "--itl-ms", "1",
                     "--false-usage", json.dumps(false_usage)) as sim:
        proc = run_locust(replay_args(trace, toy_tokenizer_dir, sim.url, output, *extra), tmp_path)
    return list(read_records(output)), json.loads(summary_path(output).read_text()), proc.stdout


@pytest.mark.parametrize("false_usage, stream, expected", [
    ({"prompt_tokens": 1, "completion_tokens": 99_999, "cached_tokens": 0}, True,
     "prompt_tokens 1 != input_length {input_length}; output_tokens 99999 > max_tokens {max_tokens}"),
    ({"completion_tokens": 2000}, False, "output_tokens 2000 > max_tokens {max_tokens}"),
    ({"completion_tokens": 0}, True, "output_tokens 0 < received_tokens {output_length}"),
    ({"cached_tokens": 100_000}, True, "cached_tokens 100000 > prompt_tokens {input_length}"),
    ({"prompt_tokens": -3, "completion_tokens": "12", "cached_tokens": 2.5}, True,
     "usage prompt_tokens -3 is not a count; usage output_tokens '12' is not a count; "
     "usage cached_tokens 2.5 is not a count"),
], ids=["prompt-and-output", "output-over-max-tokens-no-stream", "output-under-received", "cached-over-prompt",
        "not-counts"])
def test_impossible_usage_is_flagged_and_counted(tmp_path, toy_tokenizer_dir, false_usage, stream, expected):
    records, summary, printed = replay_against(tmp_path, toy_tokenizer_dir, false_usage,
                                               *(() if stream else ("--no-stream",)))
    assert len(records) == 12
    for r in records:
        assert r["ok"] and r["status"] == 200, r  # the answer itself was complete: still ok
        assert r["received_tokens"] == (r["output_length"] if stream else None)  # one token an event (the sim)
        assert r["usage_mismatch"] == expected.format(input_length=r["input_length"], output_length=r["output_length"],
                                                      max_tokens=max(1, r["output_length"])), r
        for key in ("prompt_tokens", "output_tokens", "cached_tokens"):  # only counts are kept
            assert r[key] is None or (type(r[key]) is int and r[key] >= 0), r
    assert summary["requests_usage_mismatch"] == 12
    # output figures take the claim only where it can be true: 99,999 tokens in a 40-token stream
    # neither inflates the total nor shrinks TPOT to nothing (the sim's gap is 1 ms a token)
    believed = [output_tokens_believed(output_tokens=r["output_tokens"], received_tokens=r["received_tokens"],
                                       output_length=r["output_length"]) for r in records]
    assert summary["total_output_tokens"] == sum(b or 0 for b in believed)
    assert all(b is None or b <= max_tokens_asked(r["output_length"]) for b, r in zip(believed, records))
    # TPOT is over the believed count: checked against the record's own times, not a clock
    # bound (a loaded machine can read a whole stream in one go and make any TPOT tiny)
    for b, r in zip(believed, records):
        if r["tpot_ms"] is not None:
            assert r["tpot_ms"] == pytest.approx((r["e2e_ms"] - r["ttft_ms"]) / (b - 1), abs=0.002), (b, r)
    assert "Usage disagreements:" in printed and "12" in printed.split("Usage disagreements:")[1].splitlines()[0]


def test_an_honest_server_has_no_disagreement(tmp_path, toy_tokenizer_dir):
    records, summary, printed = replay_against(tmp_path, toy_tokenizer_dir, {})
    assert all(r["usage_mismatch"] is None and r["received_tokens"] == r["output_tokens"] == r["output_length"]
               for r in records)
    assert summary["requests_usage_mismatch"] == 0
    assert "Usage disagreements:" not in printed

"""Proof of the synthesizer's claim: re-encode every prompt with the server's rule and compare.

This is the slow path the replay itself never takes (one tokenizer encode per prompt).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import replace

from replay.synth.chat_template import ChatTemplateError
from replay.synth.prompts import PromptSynthesizer, server_count
from replay.trace.convert import rescale_length
from replay.trace.record import TraceRow


def rescale_rows(rows: Iterable[TraceRow], block_from: int, block_to: int) -> list[TraceRow]:
    """Rows as if the trace had blocks of block_to tokens (same hash ids, shorter prompts)."""
    return [replace(row, input_length=rescale_length(row.input_length, block_from, block_to)) for row in rows]


def check_prompts(synth: PromptSynthesizer, rows: Iterable[TraceRow]) -> dict:
    """Totals and the mismatching rows; `exact` counts rows whose server count == input_length;
    `unsaid` the rows that give their own messages (rendered, not compared). A row
    the chat template fails on raises ChatTemplateError naming the row."""
    started = time.perf_counter()
    requests = exact = max_abs_error = unsaid = 0
    claims_wrong = 0
    mismatches = []
    for row in rows:
        try:
            prompt = synth.prompt(row)
            counted = server_count(synth.tokenizer, prompt)
        except ChatTemplateError as err:  # a row's own messages the template refuses: a bad input, named
            raise err.about(f"row {row.request_id} (trace line {row.line})") from None
        requests += 1
        if row.said_input_length is None:
            unsaid += 1
            continue
        error = counted - row.input_length
        if prompt.expected_tokens != counted:
            claims_wrong += 1
        if error == 0:
            exact += 1
            continue
        max_abs_error = max(max_abs_error, abs(error))
        mismatches.append(
            {
                "request_id": row.request_id,
                "line": row.line,
                "input_length": row.input_length,
                "server_tokens": counted,
                "expected_tokens": prompt.expected_tokens,
                "error": error,
            }
        )
    return {
        "requests": requests,
        "exact": exact,
        "unsaid": unsaid,
        "max_abs_error": max_abs_error,
        "expected_wrong": claims_wrong,
        "tokenizer": synth.tokenizer.name,
        "chat_template_sha256": synth.tokenizer.chat_template.sha256 if synth.tokenizer.chat_template else None,
        "api": synth.api,
        "token_ids": synth.token_ids,
        "block_size": synth.block_size,
        "template_overhead_tokens": synth.template_overhead_tokens,
        "verified_each_prompt": synth.verified,
        "safe_vocab_size": len(synth.vocab),
        "warnings": synth.warnings,
        "elapsed_s": round(time.perf_counter() - started, 3),
        "mismatches": mismatches,
    }

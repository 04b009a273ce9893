"""What a server's `usage` can truthfully claim, stated once: the request bodies ask for
`max_tokens_asked`, and the records flag the claims that disagree with what was sent or seen.

A server's usage is its word; a request's stream is what arrived. Each content event of a
stream carries at least one token (vLLM, SGLang and `replay sim` send one a token; a server may
send several in one event, e.g. with speculative decoding, never less than one), so the events
counted are a lower bound of the output. The disagreements flagged:

- a figure that is not a count (not a non-negative integer): dropped, the field left null;
- `prompt_tokens` other than the row's `input_length`: prompts are built to count exactly that
  many tokens as the server counts them, so a difference means the server counts otherwise
  (or a row shorter than the chat template, whose prompt cannot be that short);
- `output_tokens` over the `max_tokens` asked: no server generates past it;
- `output_tokens` under the content events received: each carried at least one token;
- `cached_tokens` over `prompt_tokens`: no more of a prompt can be cached than it has.

A disagreement is a flag, never a failure: the answer itself may be complete. The figures a
run computes from output tokens (TPOT, token totals and throughput, Locust's response length)
take `output_tokens_believed`: the server's claim when it can be true, else the events received
(not streamed: the max_tokens asked), so one false claim never moves a summary.
"""

from __future__ import annotations


def max_tokens_asked(output_length: int) -> int:
    """The `max_tokens` a row's request asks for: its output_length, but at least 1 (servers
    reject 0, and one token is the nearest request that still measures a time to first token)."""
    return max(1, output_length)


def is_count(value: object) -> bool:
    """A usage figure that can be a token count: a non-negative int (not a bool, float or string)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def disagreements(*, input_length: int | None, output_length: int, received_tokens: int | None, prompt_tokens: int | None,
                  output_tokens: int | None, cached_tokens: int | None) -> list[str]:
    """The claims of a request's usage that disagree with what was asked or received (see the
    module's docstring), each as one short phrase; `received_tokens` None: not streamed."""
    found = []
    if prompt_tokens is not None and input_length is not None and prompt_tokens != input_length:
        found.append(f"prompt_tokens {prompt_tokens} != input_length {input_length}")
    if output_tokens is not None:
        asked = max_tokens_asked(output_length)
        if output_tokens > asked:
            found.append(f"output_tokens {output_tokens} > max_tokens {asked}")
        if received_tokens is not None and output_tokens < received_tokens:
            found.append(f"output_tokens {output_tokens} < received_tokens {received_tokens}")
    if cached_tokens is not None and prompt_tokens is not None and cached_tokens > prompt_tokens:
        found.append(f"cached_tokens {cached_tokens} > prompt_tokens {prompt_tokens}")
    return found


def output_tokens_believed(*, output_tokens: int | None, received_tokens: int | None,
                           output_length: int) -> int | None:
    """The output count a run computes with: the server's `output_tokens` unless it cannot be
    true (over the max_tokens asked, under the events received), then `received_tokens`, or, not
    streamed, the max_tokens asked (no answer is longer); None when nothing is known."""
    if output_tokens is None:
        return received_tokens
    asked = max_tokens_asked(output_length)
    if received_tokens is not None and not received_tokens <= output_tokens <= asked:
        return received_tokens
    return min(output_tokens, asked)

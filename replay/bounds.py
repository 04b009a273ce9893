"""The range of every number a command takes: one `Bound` per numeric option.

A number that parses is not yet a number that makes sense: `--cooldown 1e300` waited for ever,
`--search-precision 1e-300` bisected for ever, `--scale 1e-300` never sent. So each numeric
option declares its range once, as its argparse `type`: the same object parses the flag
(argparse: exit 2, "argument --cooldown: must be ..."), checks the value that came another way
(a `--replay-config` file, the web UI's form: `problem`), and states the range in the docs
(`words`). tests/test_bounds.py feeds every numeric option of every command nan, inf, 0, a
negative, 1e-300 and 1e300, so an option declared with a bare `int` or `float` fails it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

DEFAULT_MAX_PROMPT_TOKENS = 1_048_576
"""Longest prompt, in tokens, that a row may ask for when the server reports no max_model_len.

A row of 10^9 tokens is a broken trace, not a load test: it would make the replay build a
prompt of gigabytes. 2^20 is above any context window served today, so no real row is refused.
`replay trace validate --max-prompt-tokens` and the replay use it as their default.
"""

MAX_BLOCK_SIZE = DEFAULT_MAX_PROMPT_TOKENS
"""Most tokens a hash id block may stand for (--block-size, a row's block_size, the server's).

A block is part of one prompt, so one longer than the longest prompt a row may ask for is a
typo, not a trace: it would only make the replay hash and hold a block of that many tokens
(10^8 stalled the start-up for half a minute, 10^12 ran out of memory).
"""

MAX_TRACE_SPAN_S = 10 * 365.25 * 86400
"""Most trace seconds between a trace's earliest and latest row, and most seconds a replay may
last (the window divided by --scale): ten years. Time origins (a unix-epoch timestamp) are
free; a span beyond this is a broken field, and a send time beyond it would never come
(1e300 ms made the worker's timer wrap and spin a core)."""

MAX_INT = (1 << 63) - 1
"""Largest count or id a field may hold: what a 64-bit integer holds. orjson reads a longer
JSON integer as a float (99999999999999999999999 as 1e+23), so such a value is refused as
too long, never taken as the float's rounded digits."""

MINUTE_S = 60.0
HOUR_S = 3600.0
DAY_S = 86400.0
WEEK_S = 7 * DAY_S


def _number(value: float) -> str:
    """`value` as the docs and messages write it: 604800, 0.001, 1e+13, 9223372036854775807."""
    if isinstance(value, int):
        return str(value)
    return f"{value:.15g}"


@dataclass(frozen=True)
class Bound:
    """The values an option accepts: `lo` to `hi` (`lo` itself excluded when `above`), whole
    numbers only when `integer`, and `off`, one value outside that range which means "off" or
    "no limit" (0, said in the option's help). `unit` names what the number counts ("seconds",
    "tokens"), for the message; `why` says in a few words what a value beyond the range
    would do, when the range alone does not tell."""

    lo: float
    hi: float
    integer: bool = False
    unit: str = ""
    off: float | None = None
    above: bool = False
    why: str = ""

    @property
    def __name__(self) -> str:  # argparse names a type that raises ValueError by it
        return "integer" if self.integer else "number"

    def words(self) -> str:
        """The range in words, as a message ends: '0.001 to 604800 seconds', 'above 0, at most 1'."""
        unit = f" {self.unit}" if self.unit else ""
        lo = f"above {_number(self.lo)}, at most" if self.above else f"{_number(self.lo)} to"
        text = f"{lo} {_number(self.hi)}{unit}"
        return f"0 (off) or {text}" if self.off == 0 else text

    def problem(self, value: float) -> str | None:
        """Why `value` is refused ('must be ...'), None when it is accepted."""
        if self.integer and (isinstance(value, bool) or not isinstance(value, int)):
            return f"must be a whole number, {self.words()}"
        if value == self.off:
            return None
        inside = (self.lo < value if self.above else self.lo <= value) and value <= self.hi  # NaN: False
        if not inside:
            return f"must be {self.words()}" + (f" ({self.why})" if self.why else "")
        return None

    def __call__(self, text: str) -> float:
        """The argparse type: the flag's text as a number in range, or ArgumentTypeError."""
        try:
            value = int(text) if self.integer else float(text)
        except ValueError:
            whole = "a whole number, " if self.integer else ""
            raise argparse.ArgumentTypeError(f"must be {whole}{self.words()}, got {text!r}") from None
        if problem := self.problem(value):
            raise argparse.ArgumentTypeError(f"{problem}, got {text}")
        return value


# Ranges more than one command shares: each is stated once, here.
SEED = Bound(0, MAX_INT, integer=True)
COUNT = Bound(0, MAX_INT, integer=True)  # of rows: 0 is a count like any other
SHARE = Bound(0.0, 1.0)  # a fraction of requests, of rows
BLOCK_SIZE = Bound(1, MAX_BLOCK_SIZE, integer=True, unit="tokens",  # trace.fields.block_size_problem's rule
                   why="a block is never longer than the longest prompt")
CACHE_BLOCKS = Bound(0, 1 << 32, integer=True, unit="blocks")  # a KV cache of 2^32 blocks is past any GPU's
PROMPT_TOKENS = Bound(0, MAX_INT, integer=True, unit="tokens")  # a --max-prompt-tokens; 0: no limit
# A time scale (`run --scale`, `trace convert --time-scale`): beyond it a replay of a second of
# trace takes hours, or a day of trace is sent within a few seconds.
SCALE = Bound(0.001, 10_000.0)
# A point on a trace's own time axis: its origin is free (a unix-epoch timestamp is a trace
# second), but beyond this no trace has rows (the readers refuse one: trace.fields.span_message).
MAX_TRACE_TIME_S = 1e13
START = Bound(-MAX_TRACE_TIME_S, MAX_TRACE_TIME_S, unit="trace seconds")
DURATION = Bound(0.001, MAX_TRACE_SPAN_S, unit="trace seconds")  # a window: 1 ms to the longest trace span
# Times a trace's load (`trace amplify --factor`, a capacity search's --search-range): beyond
# it the output is ten thousand times the file, below it no session is kept.
LOAD_FACTOR = Bound(0.001, 10_000.0)

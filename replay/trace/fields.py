"""Field checks shared by the readers. Each raises RowError naming the field, so the reader
can add the file and line and turn it into a BadLine."""

from __future__ import annotations

import math
from typing import Any

from replay.bounds import MAX_BLOCK_SIZE, MAX_INT, MAX_TRACE_SPAN_S, MAX_TRACE_TIME_S

DEFAULT_BLOCK_SIZE = 512
"""Tokens per hash id when a trace does not say (Mooncake's published traces): the formats'
default, and what synth, the workers and the fidelity check assume when a trace has none; one
constant, since a prompt built at one block size and checked at another breaks fidelity."""


_INT_ONLY = {int}


class RowError(Exception):
    """A rule broken by one field of one row; the reader knows the file and the line."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


def require(record: dict, key: str) -> Any:
    value = record.get(key)
    if value is None:
        raise RowError(key, "missing (required)")
    return value


def required_int(record: dict, key: str) -> int:
    """to_int(require(record, key), key): a count >= 0. A plain int, what JSON gives, returns
    after one test: this runs for every row, and the calls cost more than the checks."""
    value = record.get(key)
    if type(value) is int and 0 <= value <= MAX_INT:
        return value
    return to_int(require(record, key), key)


def required_time(record: dict, key: str) -> float:
    """to_time(require(record, key), key), with the same shortcut for a plain int or a
    finite float (a bool is neither)."""
    value = record.get(key)
    if type(value) is int:
        return float(value)
    if type(value) is float and math.isfinite(value):
        return value
    return to_time(require(record, key), key)


def to_int(value: Any, key: str, minimum: int | None = 0) -> int:
    """An integer count; integral floats (12.0) and numeric strings (CSV) are accepted."""
    if isinstance(value, bool):
        raise RowError(key, f"expected an integer, got {value!r}")
    if isinstance(value, int):
        number = value
    elif isinstance(value, float) and value.is_integer():
        if abs(value) > MAX_INT:
            raise RowError(key, too_long(value))
        number = int(value)
    elif isinstance(value, str):
        text = value.strip()
        try:
            number = int(text)
        except ValueError:
            try:
                as_float = float(text)
            except ValueError:
                raise RowError(key, f"expected an integer, got {value!r}") from None
            if not as_float.is_integer():
                raise RowError(key, f"expected an integer, got {value!r}") from None
            number = int(as_float)
    else:
        raise RowError(key, f"expected an integer, got {value!r}")
    if minimum is not None and number < minimum:
        raise RowError(key, f"must be >= {minimum}, got {number}")
    if number > MAX_INT:
        raise RowError(key, too_long(value))
    return number


def too_long(value: Any) -> str:
    """The message for an integer beyond MAX_INT (or a float standing for one)."""
    if isinstance(value, float):
        return f"an integer beyond 64 bits (a JSON integer this long is read as the float {value!r})"
    return f"an integer beyond 64 bits: {value}"


def to_time(value: Any, key: str, minimum: float | None = None) -> float:
    """A finite number (int, float or numeric string)."""
    if isinstance(value, bool):
        raise RowError(key, f"expected a number, got {value!r}")
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            raise RowError(key, f"unparsable timestamp {value!r}") from None
    else:
        raise RowError(key, f"expected a number, got {value!r}")
    if not math.isfinite(number):
        raise RowError(key, f"must be finite, got {value!r}")
    if minimum is not None and number < minimum:
        raise RowError(key, f"must be >= {minimum:g}, got {value!r}")
    return number


def to_hash_ids(value: Any, key: str = "hash_ids") -> tuple[int, ...]:
    """A list of integers (never booleans) as a tuple.

    The item types are checked at C speed (the set of them); only a list that fails that is
    walked in Python, to name its first bad item. Walking every list took a third of
    read_trace's time on Mooncake.
    """
    if not isinstance(value, list):
        raise RowError(key, f"expected a list of integers, got {type(value).__name__}")
    if not set(map(type, value)) <= _INT_ONLY:
        for i, item in enumerate(value):
            if isinstance(item, float) and item.is_integer() and abs(item) > MAX_INT:
                raise RowError(key, f"item {i} is {too_long(item)}")
            if not isinstance(item, int) or isinstance(item, bool):
                raise RowError(key, f"item {i} is not an integer: {item!r}")
    return tuple(value)  # (the loop lets int subclasses other than bool through, as it always did)


def check_prompt_limit(input_length: int, max_input_tokens: int | None) -> None:
    """The --max-prompt-tokens rule: a row longer than any server takes is a bad row."""
    if max_input_tokens is not None and input_length > max_input_tokens:
        raise RowError(
            "input_length", f"{input_length} tokens is over the limit of {max_input_tokens} (--max-prompt-tokens)"
        )


def block_size_problem(value: int) -> str | None:
    """Why `value` cannot be a block size (None when it can): the one rule for every option
    and field that gives one."""
    if 1 <= value <= MAX_BLOCK_SIZE:
        return None
    return f"must be 1 to {MAX_BLOCK_SIZE} tokens (a block is never longer than the longest prompt)"


def span_message(time_s: float, earliest: float, latest: float) -> str:
    """What is wrong with a row at `time_s` that breaks the span rule (TraceStream applies it:
    one place, so `replay trace validate` refuses exactly the rows a replay would), given the
    earliest and latest times of the rows before it."""
    if not math.isfinite(time_s):
        return f"must be finite, got {time_s!r}"
    if abs(time_s) > MAX_TRACE_TIME_S:
        return f"{time_s:g} s is past any trace's time (at most {MAX_TRACE_TIME_S:g} s from 0, in either direction)"
    other = earliest if time_s > latest else latest
    return (f"{time_s:g} s is {abs(time_s - other):g} s from an earlier row's {other:g} s; a trace spans at most "
            f"{MAX_TRACE_SPAN_S:.0f} s (10 years)")


def check_blocks(hash_ids: tuple[int, ...] | None, input_length: int, block_size: int | None) -> None:
    """The rule that makes hash ids meaningful: one id per block, the last one possibly partial."""
    if hash_ids is None or block_size is None:
        return
    expected = -(-input_length // block_size)
    if len(hash_ids) != expected:
        raise RowError(
            "hash_ids",
            f"has {len(hash_ids)} ids but input_length {input_length} needs "
            f"ceil({input_length}/{block_size}) = {expected}",
        )

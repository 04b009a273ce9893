"""Field checks shared by the readers. Each raises RowError naming the field, so the reader
can add the file and line and turn it into a BadLine."""

from __future__ import annotations

import math
from typing import Any


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


def to_int(value: Any, key: str, minimum: int | None = 0) -> int:
    """An integer count; integral floats (12.0) and numeric strings (CSV) are accepted."""
    if isinstance(value, bool):
        raise RowError(key, f"expected an integer, got {value!r}")
    if isinstance(value, int):
        number = value
    elif isinstance(value, float) and value.is_integer():
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
    return number


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
    if not isinstance(value, list):
        raise RowError(key, f"expected a list of integers, got {type(value).__name__}")
    for i, item in enumerate(value):
        if not isinstance(item, int) or isinstance(item, bool):
            raise RowError(key, f"item {i} is not an integer: {item!r}")
    return tuple(value)


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

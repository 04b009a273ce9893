"""The JSON objects of a JSON-lines log, each with its line number: what `replay trace anonymize`
reads (a raw log, LiteLLM's payloads, an OpenAI batch's files). Blank lines are skipped; a line
that is not a JSON object stops the read with one line naming the file and the line."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson


def json_objects(path: Path, error: type[ValueError]) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each line of `path`; raises `error` (the caller's own kind)."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                record = orjson.loads(raw)
            except orjson.JSONDecodeError as e:
                raise error(f"{path}:{number}: not JSON: {e}") from None
            if not isinstance(record, dict):
                raise error(f"{path}:{number}: expected a JSON object")
            yield number, record

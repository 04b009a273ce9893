"""An OpenAI Batch API job as a log of requests for `replay trace anonymize --from openai-batch`.

A batch's output file (one line a request: `custom_id`, `response` {`status_code`, `body`: the
chat.completion or text_completion}, `error` {`code`, `message`}; its error file has the same
lines with `response` null) holds the answers but not the requests, which are in the batch's
input file (`custom_id`, `method`, `url`, `body`). The two are joined by `custom_id`, which the
Batch API requires to be unique within a batch, in bounded memory: both files' lines are spooled
to disk sorted by a 64-bit digest of their `custom_id` (replay/trace/sorted_spool.py) and read
back together, so that only the lines of one digest are held at a time.

A batch says nothing of when a request arrived: it ran when the Batch API chose. A row's arrival
is its completion's `created` (unix seconds); a request that got no completion (a failed one) is
put at the batch's first `created`. Requests of the input with no line in the output never ran
(an expired or cancelled batch): they make no row, and are counted.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from replay.record.json_lines import json_objects
from replay.record.rows import api_of
from replay.trace.sorted_spool import SortedSpool


class BatchError(ValueError):
    """A line of a batch file that cannot be read or joined: file, line and field in one line."""


@dataclass
class Joined:
    """The raw-log lines (replay.record.anonymize's shape) of a batch, each with its input line."""

    lines: Iterator[tuple[int, dict]]
    not_in_output: list[int]  # filled once `lines` is exhausted


def looks_like_output(first: dict) -> bool:
    return "custom_id" in first and ("response" in first or "error" in first)


def looks_like_input(first: dict) -> bool:
    return "custom_id" in first and "body" in first and "response" not in first


def _digest(custom_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(custom_id.encode("utf-8", "surrogateescape"), digest_size=8).digest(), "big")


def _custom_id(record: dict, where: str) -> str:
    value = record.get("custom_id")
    if not isinstance(value, str) or not value:
        raise BatchError(f"{where}: field 'custom_id': expected a string, got {value!r}")
    return value


def join(output: str | Path, batch_input: str | Path) -> Joined:
    """The batch's requests joined to their answers, in no particular order (the caller sorts
    them by arrival). Raises BatchError."""
    output, batch_input = Path(output), Path(batch_input)
    not_in_output: list[int] = []
    return Joined(_joined(output, batch_input, not_in_output), not_in_output)


def _joined(output: Path, batch_input: Path, not_in_output: list[int]) -> Iterator[tuple[int, dict]]:
    first_created: float | None = None
    with SortedSpool(tempfile.gettempdir(), key_type=int) as spool:
        for number, record in json_objects(batch_input, BatchError):
            where = f"{batch_input}:{number}"
            custom_id = _custom_id(record, where)
            if looks_like_output(record):
                raise BatchError(f"{where}: a batch's output line (response, error), not its input line: give the "
                                 "output file as IN and the input file as --batch-input")
            if not isinstance(record.get("body"), dict):
                raise BatchError(f"{where}: field 'body': expected the request body (a JSON object)")
            if not isinstance(record.get("url"), str):
                raise BatchError(f"{where}: field 'url': expected the request's path, got {record.get('url')!r}")
            spool.add(_digest(custom_id), 2 * number, orjson.dumps([number, custom_id, record["url"], record["body"]]) + b"\n")
        for number, record in json_objects(output, BatchError):
            where = f"{output}:{number}"
            custom_id = _custom_id(record, where)
            created = _created(record, where)
            if created is not None:
                first_created = created if first_created is None else min(first_created, created)
            spool.add(_digest(custom_id), 2 * number + 1, orjson.dumps([number, custom_id, record]) + b"\n")
        group: list[tuple[int, bytes]] = []
        key = None
        for digest, seq, data in spool.merged():
            if digest != key and group:
                yield from _matched(group, output, batch_input, first_created or 0.0, not_in_output)
                group = []
            key = digest
            group.append((seq, data))
        if group:
            yield from _matched(group, output, batch_input, first_created or 0.0, not_in_output)


def _created(record: dict, where: str) -> float | None:
    response = record.get("response")
    if response is None:
        return None
    if not isinstance(response, dict):
        raise BatchError(f"{where}: field 'response': expected an object or null, got {response!r}")
    body = response.get("body")
    created = body.get("created") if isinstance(body, dict) else None
    if created is None:
        return None
    if isinstance(created, bool) or not isinstance(created, (int, float)):
        raise BatchError(f"{where}: field 'response.body.created': expected unix seconds, got {created!r}")
    return float(created)


def _matched(group: list[tuple[int, bytes]], output: Path, batch_input: Path, first_created: float,
             not_in_output: list[int]) -> Iterator[tuple[int, dict]]:
    """The lines of one digest (almost always one input line and its output line) paired by custom_id."""
    requests: dict[str, tuple[int, str, dict]] = {}
    answers: dict[str, tuple[int, dict]] = {}
    for seq, data in group:
        if seq % 2 == 0:
            number, custom_id, url, body = orjson.loads(data)
            if custom_id in requests:
                raise BatchError(f"{batch_input}:{number}: field 'custom_id': {custom_id!r} repeats line "
                                 f"{requests[custom_id][0]}")
            requests[custom_id] = (number, url, body)
        else:
            number, custom_id, record = orjson.loads(data)
            if custom_id in answers:
                raise BatchError(f"{output}:{number}: field 'custom_id': {custom_id!r} repeats line "
                                 f"{answers[custom_id][0]}")
            answers[custom_id] = (number, record)
    for custom_id, (number, _) in answers.items():
        if custom_id not in requests:
            raise BatchError(f"{output}:{number}: field 'custom_id': {custom_id!r} is not in {batch_input}")
    for custom_id, (number, url, body) in requests.items():
        if custom_id not in answers:
            not_in_output.append(number)
            continue
        answer_line, record = answers[custom_id]
        if api_of(url) is None:
            continue  # embeddings, responses: not a generation request a trace replays
        yield number, _raw_line(url, body, record, f"{output}:{answer_line}", first_created)


def _raw_line(url: str, body: dict, record: dict, where: str, first_created: float) -> dict:
    """An input line's request and its output line's answer as a raw-log line."""
    response = record.get("response") if isinstance(record.get("response"), dict) else None
    answer_body: dict = response["body"] if response is not None and isinstance(response.get("body"), dict) else {}
    status = response.get("status_code") if response is not None else None
    if response is not None and (isinstance(status, bool) or not isinstance(status, int)):
        raise BatchError(f"{where}: field 'response.status_code': expected an integer, got {status!r}")
    created = _created(record, where)
    arrival = first_created if created is None else created
    usage: dict = answer_body["usage"] if isinstance(answer_body.get("usage"), dict) else {}
    choices = answer_body.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    error = _error(record.get("error")) or (_error(answer_body.get("error")) if status != 200 else None)
    if error is None and status != 200:
        error = "no response" if status is None else f"status {status}"
    answer = {"output_tokens": usage.get("completion_tokens"), "prompt_tokens": usage.get("prompt_tokens"),
              "counted": "usage", "message": choice.get("message") if isinstance(choice.get("message"), dict) else None,
              "text": str(choice.get("text") or ""), "error": None}
    user = body.get("user")
    return {"arrival": arrival, "end": arrival, "path": url, "status": 500 if status is None else status,
            "error": error, "session_name": user if isinstance(user, str) and user else None, "client_id": None,
            "request": body, "answer": answer}


def _error(value: object) -> str | None:
    """An error object's `code: message` (the Batch API's, or an error body's)."""
    if not isinstance(value, dict):
        return None
    code, message = value.get("code"), value.get("message")
    return ": ".join(str(part) for part in (code, message) if part) or None


__all__ = ["BatchError", "Joined", "join", "looks_like_input", "looks_like_output"]

"""`replay trace anonymize IN OUT`: the trace `replay record` would have written, made from a
log of requests that already happened, with the same hashing, sessions and privacy rules.

Three log shapes, one JSON object a line (`--from`, detected from the first line):

- `record`: `replay record --raw-log`'s lines: `arrival`, `end` (unix s), `path`, `status`,
  `error`, `session_name`, `client_id`, `request` (the body), `answer` (`output_tokens`,
  `prompt_tokens`, `counted`, `message`, `text`, `error`);
- `litellm`: LiteLLM's StandardLoggingPayload: `startTime`, `endTime`, `call_type`, `model`,
  `messages`, `model_parameters`, `response`, `prompt_tokens`, `completion_tokens`, `status`,
  `error_str`, `end_user`;
- `openai-batch`: an OpenAI Batch API job's output file, joined by `custom_id` to its input file
  (`--batch-input`): replay/record/batch.py.

Lines may come in any order (LiteLLM logs a request when it ends): they are sorted by arrival
on disk (replay/trace/sorted_spool.py), so memory stays bounded by a chunk of lines and the
sessions' digests, never the whole log.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import orjson

from replay.record import batch
from replay.record.hashing import BlockHasher
from replay.record.json_lines import json_objects
from replay.record.recorder import new_file
from replay.record.rows import CHAT, COMPLETIONS, Answer, Exchange, PromptTokens, RowMaker
from replay.results.files import AppendFile, write_atomically
from replay.rules.run_files import meta_path
from replay.trace.sorted_spool import SortedSpool

LOG_FORMATS = ("auto", "record", "litellm", "openai-batch")
PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions"}
TEXT_CALLS = ("text_completion", "atext_completion")


class LogError(ValueError):
    """A line of the log that cannot be read: file, line and field in one line (exit 2)."""


def detect(first: dict) -> str:
    if "arrival" in first and "answer" in first:
        return "record"
    if "startTime" in first:
        return "litellm"
    if batch.looks_like_output(first):
        return "openai-batch"
    if batch.looks_like_input(first):
        raise LogError("a batch's INPUT file (custom_id, body): give the batch's output file as IN and this one as "
                       "--batch-input")
    raise LogError("neither replay record's raw log (arrival, answer), LiteLLM's StandardLoggingPayload "
                   "(startTime) nor an OpenAI batch output file (custom_id, response): give --from")


def _number(record: dict, key: str, where: str) -> float:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LogError(f"{where}: field {key!r}: expected unix seconds, got {value!r}")
    return float(value)


def normalized(record: dict, log_format: str, where: str) -> dict:
    """A line of either shape as the raw log's fields."""
    if log_format == "record":
        arrival = _number(record, "arrival", where)
        return {**record, "arrival": arrival, "end": float(record.get("end") or arrival)}
    arrival = _number(record, "startTime", where)
    end = record.get("endTime")
    end = float(end) if isinstance(end, (int, float)) and not isinstance(end, bool) else arrival
    api = COMPLETIONS if record.get("call_type") in TEXT_CALLS else CHAT
    params = record.get("model_parameters") if isinstance(record.get("model_parameters"), dict) else {}
    messages = record.get("messages")
    body: dict = {"model": record.get("model")}
    if api == COMPLETIONS:
        body["prompt"] = messages if isinstance(messages, str) else _text_of(messages)
    else:
        body["messages"] = [{"role": "user", "content": messages}] if isinstance(messages, str) else messages
    body.update({k: v for k, v in params.items() if k in ("max_tokens", "max_completion_tokens", "tools", "stream",
                                                            "ignore_eos", "chat_template_kwargs", "user")})
    response = record.get("response") if isinstance(record.get("response"), dict) else {}
    choice = ((response.get("choices") or [{}])[0]) or {}
    ok = record.get("status", "success") == "success"
    answer = {"output_tokens": record.get("completion_tokens"), "prompt_tokens": record.get("prompt_tokens"),
              "counted": "usage", "message": choice.get("message") if isinstance(choice, dict) else None,
              "text": str(choice.get("text") or "") if isinstance(choice, dict) else "",
              "error": None}
    return {"arrival": arrival, "end": end, "path": PATHS[api], "status": 200 if ok else 500,
            "error": None if ok else str(record.get("error_str") or "failed"), "session_name": record.get("end_user") or None,
            "client_id": None, "request": body, "answer": answer}


def _text_of(messages) -> str:
    if isinstance(messages, list):
        return "".join(str(m.get("content") or "") if isinstance(m, dict) else str(m) for m in messages)
    return "" if messages is None else str(messages)


def anonymize(source: str | Path, out: str | Path, *, log_format: str, tokens: PromptTokens, hasher: BlockHasher,
              session_names: bool, keep_text: bool, meta: dict, batch_input: str | Path | None = None) -> dict:
    """Write OUT (and OUT.meta.json); returns the meta. `batch_input`: an OpenAI batch's input
    file, with its output file as `source`. Raises LogError, OutputError."""
    rows = RowMaker(tokens, hasher, "name" if session_names else None, keep_text, session_user=session_names)
    source = Path(source)
    not_in_output: list[int] = []
    with SortedSpool(tempfile.gettempdir()) as spool:
        fmt = None if log_format == "auto" else log_format
        for number, record in json_objects(source, LogError):
            where = f"{source}:{number}"
            if fmt is None:
                try:
                    fmt = detect(record)
                except LogError as e:
                    raise LogError(f"{where}: {e}") from None
            if fmt == "openai-batch":
                break  # read with its input file, below
            line = normalized(record, fmt, where)
            spool.add(line["arrival"], number, orjson.dumps(line) + b"\n")
        if (fmt == "openai-batch") != (batch_input is not None):
            raise LogError("--batch-input is for --from openai-batch (an OpenAI batch's output file as IN)"
                           if batch_input is not None else
                           f"{source}: an OpenAI batch's output file: give the batch's input file as --batch-input "
                           "(the requests are there)")
        if batch_input is not None:
            try:
                joined = batch.join(source, batch_input)
                for number, line in joined.lines:  # ties (one `created` second) keep the input file's order
                    spool.add(line["arrival"], number, orjson.dumps(line) + b"\n")
            except batch.BatchError as e:
                raise LogError(str(e)) from None
            not_in_output = joined.not_in_output
        written = failed = 0
        origin = None
        file = AppendFile(out, fd=new_file(out))
        try:
            for arrival, _, data in spool.merged():
                line = orjson.loads(data)
                origin = arrival if origin is None else origin
                x = Exchange(0, line["path"], line["arrival"], origin, line["end"], line["status"], line["error"],
                             line.get("session_name"), line.get("client_id"))
                body = line.get("request") if isinstance(line.get("request"), dict) else None
                answer = Answer(**line["answer"]) if isinstance(line.get("answer"), dict) else None
                row = rows.row_of(x, body, answer)
                failed += "error" in row
                file.append(orjson.dumps(row) + b"\n")
                written += 1
        finally:
            file.close()
    meta = {**meta, "log_format": fmt, "rows": written, "rows_marked_failed": failed, "tokens": tokens.method,
            "complete": True}
    if fmt == "openai-batch":
        meta["batch_input"] = Path(batch_input).name if batch_input is not None else None
        meta["arrival"] = "each completion's created (unix s); a failed request at the batch's first created"
        meta["not_in_output"] = len(not_in_output)
    write_atomically(meta_path(out), orjson.dumps(meta, option=orjson.OPT_INDENT_2) + b"\n")
    return meta


__all__ = ["LOG_FORMATS", "LogError", "anonymize"]

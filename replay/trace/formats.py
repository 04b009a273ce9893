"""One row parser per trace format, and the FORMATS registry that names them.

A parser turns one decoded record (a JSON object, or a CSV row as {column: text}) into a
TraceRow, raising RowError for the first broken rule. Parsers keep the little state a
format needs (previous row time for `delay`, the parent chain for bailian sessions, the
first datetime for azure). finish(), once the whole file is read, returns the sessions that
later rows changed ({request_id: session}), so that rows need not be held to be fixed up.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from replay.trace.fields import (
    DEFAULT_BLOCK_SIZE,
    RowError,
    block_size_problem,
    check_blocks,
    require,
    required_int,
    required_time,
    to_hash_ids,
    to_int,
    to_time,
)
from replay.trace.record import TraceRow

# AIPerf's single_turn and multi_turn datasets' keys: no trace (no length, no hash ids), refused by name
AIPERF_DATASET_KEYS = frozenset({"text", "texts", "turns"})
# jsonl's keys, not mooncake's (with AIPerf's dataset keys, so such a file reads as jsonl and is refused)
EXTENDED_KEYS = frozenset({"messages", "text_input", "delay", "session_id", "tools", "gap_ms"}) | AIPERF_DATASET_KEYS


class JsonRows:
    """mooncake and jsonl (AIPerf mooncake_trace) rows; timestamps in milliseconds.

    Both honour a per-row "block_size" field, which `replay trace convert` writes when the
    block size is not the default, so that a rescaled file reads right without options.
    jsonl also accepts `delay` (ms after the previous row of the same session, or of the
    file when rows have no session; a session's first row counts from 0, as AIPerf starts
    every session at once), `messages`/`text_input` (+`tools`) instead of input_length,
    `session_id`, and `gap_ms` (a turn's think time after its previous turn's answer, which
    `--turn-timing after-answer` keeps).

    A mooncake row that carries one of jsonl's keys makes the rest of the file read as jsonl:
    the format is told from the first lines, and a session or a prompt of its own further down
    must not be dropped in silence (a plain row reads the same either way).
    """

    def __init__(self, block_size: int | None, default_block: int | None, extended: bool):
        self.block_size = block_size if block_size is not None else default_block
        self.fixed = block_size is not None
        self.extended = extended
        self.rows_seen = 0
        self.last_time = 0.0
        self.last_time_by_session: dict[str, float] = {}
        self.time_field = "timestamp"  # the field the last row's time came from, for errors

    def _block(self, value: Any, first: bool) -> int | None:
        """The block size of a row that declares one: the first row's, which all others repeat."""
        declared = to_int(value, "block_size", minimum=1)
        if problem := block_size_problem(declared):
            raise RowError("block_size", f"{declared}: {problem}")
        if first:
            self.block_size = declared
        elif declared != self.block_size:
            raise RowError("block_size", f"is {declared} but earlier rows use {self.block_size}")
        return self.block_size

    def parse(self, record: dict, index: int, line: int) -> TraceRow:
        first = self.rows_seen == 0
        self.rows_seen += 1
        block_size = record.get("block_size")
        if block_size is None or self.fixed:
            block_size = self.block_size
        else:
            block_size = self._block(block_size, first)
        session_id = None
        messages = tools = None
        gap_s = None
        if not self.extended and (len(record) != 4 or "timestamp" not in record) \
                and not EXTENDED_KEYS.isdisjoint(record):  # a plain mooncake row: two quick tests
            self.extended = True
        if self.extended:
            session_id = _session(record.get("session_id"))
            if record.get("gap_ms") is not None:
                gap_s = to_time(record["gap_ms"], "gap_ms") / 1000.0
            messages, tools = _messages(record)
            timestamp_s = self._time(record, session_id)
        else:
            timestamp_s = self.last_time = required_time(record, "timestamp") / 1000.0
        declared_length = record.get("input_length")
        if messages is not None and declared_length is None:
            input_length = 0  # the prompt is the messages; only a tokenizer can count it
        elif "input_length" in record:
            input_length = required_int(record, "input_length")
        else:
            raise RowError("input_length", _missing_length(record))
        output_length = required_int(record, "output_length")
        hash_ids = record.get("hash_ids")
        if hash_ids is not None:
            hash_ids = to_hash_ids(hash_ids)
            if declared_length is not None:
                check_blocks(hash_ids, input_length, block_size)
        # Positional, in TraceRow's field order (keywords cost a share of read_trace's time worth saving):
        # request_id, timestamp_s, input_length, output_length, hash_ids, session_id, messages, tools, turn, line, gap_s
        return TraceRow(
            index, timestamp_s, input_length, output_length, hash_ids, session_id, messages, tools, None, line, gap_s
        )

    def _time(self, record: dict, session_id: str | None) -> float:
        if record.get("timestamp") is not None:
            if record.get("delay") is not None:
                raise RowError("delay", "a row gives a timestamp or a delay, not both")
            self.time_field = "timestamp"
            timestamp_s = to_time(record["timestamp"], "timestamp") / 1000.0
        else:
            self.time_field = "delay"
            delay = record.get("delay")
            delay_s = 0.0 if delay is None else to_time(delay, "delay", minimum=0) / 1000.0
            if session_id is None:
                base = self.last_time
            else:
                base = self.last_time_by_session.get(session_id, 0.0)
            timestamp_s = base + delay_s
        self.last_time = timestamp_s
        if session_id is not None:
            self.last_time_by_session[session_id] = timestamp_s
        return timestamp_s

    def finish(self) -> dict[int, str]:
        return {}


def _session(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise RowError("session_id", f"expected a string or integer, got {value!r}")
    return str(value)


def _missing_length(record: dict) -> str:
    """What a row with neither input_length nor a prompt of its own is missing, in the words of
    the file it most likely is."""
    if not AIPERF_DATASET_KEYS.isdisjoint(record):
        return ("missing (required): `text`, `texts` and `turns` are AIPerf's single_turn and multi_turn "
                "datasets, not a trace; give `text_input` or `messages` (jsonl), or input_length")
    return "missing (required)"


def _messages(record: dict) -> tuple[list | None, list | None]:
    messages = record.get("messages")
    if messages is None and record.get("text_input") is not None:
        text = record["text_input"]
        if not isinstance(text, str):
            raise RowError("text_input", f"expected a string, got {type(text).__name__}")
        messages = [{"role": "user", "content": text}]
    if messages is not None:
        if not isinstance(messages, list) or not messages:
            raise RowError("messages", "expected a non-empty list of messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise RowError("messages", f"item {i} is not an object with a string 'role'")
    tools = record.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RowError("tools", f"expected a list, got {type(tools).__name__}")
    return messages, tools


class BailianRows:
    """Alibaba Bailian rows: timestamps in seconds, sessions from the parent_chat_id chain.

    A session is the root chat_id of the chain. Parents normally come first, so the root is
    known when the child is read; finish() resolves the whole chain again so that any order
    and any depth work, and a chain whose top parent is absent (a cut window) groups under
    that missing parent id.
    """

    time_field = "timestamp"

    def __init__(self, block_size: int | None, default_block: int | None):
        self.block_size = block_size if block_size is not None else default_block
        self.parent_of: dict[int, int] = {}
        self.line_of: dict[int, int] = {}
        self.root_of: dict[int, int] = {}
        self.chat_of_row: list[tuple[int, int, str]] = []  # (request_id, chat_id, session when read)

    def parse(self, record: dict, index: int, line: int) -> TraceRow:
        chat_id = required_int(record, "chat_id")
        said = record.get("parent_chat_id")  # none or null: a first turn, as AIPerf reads it (-1)
        parent = -1 if said is None else to_int(said, "parent_chat_id", minimum=-1)
        if chat_id in self.line_of:
            raise RowError("chat_id", f"duplicate of line {self.line_of[chat_id]}")
        if parent == chat_id:
            raise RowError("parent_chat_id", "a chat cannot be its own parent")
        timestamp_s = required_time(record, "timestamp")
        input_length = required_int(record, "input_length")
        output_length = required_int(record, "output_length")
        kind = record.get("type")
        if kind is not None and not isinstance(kind, str):
            raise RowError("type", f"expected a string, got {kind!r}")
        turn = None if record.get("turn") is None else to_int(record["turn"], "turn")
        hash_ids = None
        if record.get("hash_ids") is not None:
            hash_ids = to_hash_ids(record["hash_ids"])
            check_blocks(hash_ids, input_length, self.block_size)
        self.parent_of[chat_id] = parent
        self.line_of[chat_id] = line
        session = str(self._root(chat_id))
        self.chat_of_row.append((index, chat_id, session))
        return TraceRow(
            request_id=index,
            timestamp_s=timestamp_s,
            input_length=input_length,
            output_length=output_length,
            hash_ids=hash_ids,
            session_id=session,
            turn=turn,
            line=line,
        )

    def _root(self, chat_id: int) -> int:
        """Top of the chain among chats read so far (iterative, memoised: chains may be long)."""
        path = [chat_id]
        seen = {chat_id}
        node = chat_id
        while True:
            if node in self.root_of:
                root = self.root_of[node]
                break
            parent = self.parent_of.get(node, -1)
            if parent == -1:
                root = node
                break
            if parent not in self.parent_of:
                return parent  # the parent is not in the file (yet): group under its id
            if parent in seen:
                return min(seen)  # a cycle has no root; pick a stable member
            seen.add(parent)
            path.append(parent)
            node = parent
        for member in path:  # a chain that reaches a true root never changes again
            self.root_of[member] = root
        return root

    def finish(self) -> dict[int, str]:
        changed = {}
        for request_id, chat_id, session in self.chat_of_row:
            root = str(self._root(chat_id))
            if root != session:
                changed[request_id] = root
        return changed


class AzureRows:
    """Azure LLM inference CSV: TIMESTAMP is a zone-less datetime with 100 ns digits.

    Times are relative to the first row, computed in integer nanoseconds so that all 7
    digits survive (datetime itself stops at microseconds).
    """

    time_field = "TIMESTAMP"

    def __init__(self, block_size: int | None, default_block: int | None):
        self.block_size = block_size if block_size is not None else default_block
        self.origin: int | None = None

    def parse(self, record: dict, index: int, line: int) -> TraceRow:
        nanoseconds = parse_datetime(require(record, "TIMESTAMP"), "TIMESTAMP")
        input_length = to_int(require(record, "ContextTokens"), "ContextTokens")
        output_length = to_int(require(record, "GeneratedTokens"), "GeneratedTokens")
        if self.origin is None:
            self.origin = nanoseconds
        return TraceRow(
            request_id=index,
            timestamp_s=(nanoseconds - self.origin) / 1e9,
            input_length=input_length,
            output_length=output_length,
            line=line,
        )

    def finish(self) -> dict[int, str]:
        return {}


_EPOCH = datetime(1970, 1, 1)


def parse_datetime(text: str, key: str) -> int:
    """Nanoseconds since 1970 (UTC) of 'YYYY-MM-DD HH:MM:SS[.fffffffff][zone]'.

    Azure's 2023 traces write no zone and seven decimals; its 2024 traces write a UTC offset
    (`+00:00`), with six decimals or none, in one file. A zone-less time is taken as UTC, so the
    two read alike; a zoned one is moved to UTC, so rows in different zones keep their order.
    An integer, because a float of seconds since 1970 only resolves about 240 ns.
    """
    found = _DATETIME.fullmatch(text.strip())
    if found is None:
        raise RowError(key, f"unparsable datetime {text!r} (expected 'YYYY-MM-DD HH:MM:SS[.fff][+HH:MM]')")
    date, clock, fraction, zone = found.groups()
    try:
        moment = datetime.fromisoformat(f"{date} {clock}")
        zoned = None if zone in (None, "Z") else datetime.strptime(zone.replace(":", ""), "%z").utcoffset()
    except ValueError:
        raise RowError(key, f"unparsable datetime {text!r}") from None
    since = moment - _EPOCH - (zoned or timedelta(0))
    seconds = since.days * 86400 + since.seconds
    return seconds * 1_000_000_000 + int(((fraction or "") + "000000000")[:9])


_DATETIME = re.compile(r"(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2})(?:\.(\d{1,9})\d*)?\s*(Z|[+-]\d{2}:?\d{2})?")


class BurstGptRows:
    """BurstGPT CSV: Timestamp in seconds; Model and Log Type are not needed to replay."""

    time_field = "Timestamp"

    def __init__(self, block_size: int | None, default_block: int | None):
        self.block_size = block_size if block_size is not None else default_block

    def parse(self, record: dict, index: int, line: int) -> TraceRow:
        return TraceRow(
            request_id=index,
            timestamp_s=to_time(require(record, "Timestamp"), "Timestamp"),
            input_length=to_int(require(record, "Request tokens"), "Request tokens"),
            output_length=to_int(require(record, "Response tokens"), "Response tokens"),
            line=line,
        )

    def finish(self) -> dict[int, str]:
        return {}


@dataclass(frozen=True)
class Format:
    name: str
    default_block: int | None
    csv_columns: tuple[str, ...] | None  # required header columns; None for JSON lines
    new_parser: Callable[[int | None, int | None], Any]  # (block_size override, default) -> parser

    @property
    def is_csv(self) -> bool:
        return self.csv_columns is not None


FORMATS: dict[str, Format] = {
    "mooncake": Format("mooncake", DEFAULT_BLOCK_SIZE, None, lambda b, d: JsonRows(b, d, extended=False)),
    "bailian": Format("bailian", 16, None, BailianRows),
    "jsonl": Format("jsonl", DEFAULT_BLOCK_SIZE, None, lambda b, d: JsonRows(b, d, extended=True)),
    "azure": Format("azure", None, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"), AzureRows),
    "burstgpt": Format("burstgpt", None, ("Timestamp", "Request tokens", "Response tokens"), BurstGptRows),
}

"""The one in-memory shape of a trace row that every other part of the code reads."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TraceRow:
    """One request of a trace, in trace-independent units.

    timestamp_s is seconds from the start of the trace (the first row of datetime traces
    is 0; numeric traces keep their own origin, converted to seconds), before --scale.
    hash_ids are block hash ids of `block_size` tokens each, or None when the trace has
    none (such a row shares no prefix with any other row).
    """

    request_id: int  # 0-based index of the row among the trace file's data rows
    timestamp_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] | None = None
    session_id: str | None = None
    messages: list | None = None  # rows that carry their own chat messages are sent as they are
    tools: list | None = None
    turn: int | None = None
    line: int = 0  # 1-based line number in the source file, for error messages
    # A session turn's think time: from the previous turn's answer end to this turn's arrival, as
    # `replay record` measures it (jsonl's `gap_ms`); None where the trace does not say.
    gap_s: float | None = None

    @property
    def said_input_length(self) -> int | None:
        """The prompt length the replay answers for, None for a row that gives its own `messages`
        (or `text_input`): that text is sent as it is, so only the server counts it, and an
        `input_length` beside it is the trace's claim about its own text, not the replay's to keep."""
        return None if self.messages is not None else self.input_length


@dataclass(slots=True)
class BadLine:
    """A row that broke a trace rule; kept so that skipping is counted, never silent."""

    path: str
    line: int
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: field '{self.field}': {self.message}"


class TraceError(ValueError):
    """A trace rule was broken; the message names file, line and field."""

    def __init__(self, bad: BadLine):
        super().__init__(str(bad))
        self.bad = bad


@dataclass
class Trace:
    path: str
    format: str
    block_size: int | None  # tokens per hash id block; None when the format has no hash ids
    rows: list[TraceRow]
    skipped: list[BadLine] = field(default_factory=list)

    @property
    def duration_s(self) -> float:
        if not self.rows:
            return 0.0
        times = [r.timestamp_s for r in self.rows]
        return max(times) - min(times)

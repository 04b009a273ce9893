"""Which rows run, when, and on which worker: all decided on the master (or local runner).

A trace can hold millions of rows, so the master keeps none of them in memory: one pass reads
and validates the file, writes each row of the window to a spool file (the rows as the workers
get them) and keeps per row only what scheduling needs, in arrays: its request id, trace time,
session and place in the spool (36 bytes a row). Rows are read back from the spool when shipped.
"""

from __future__ import annotations

import os
import tempfile
from array import array
from collections.abc import Callable, Iterable, Iterator

import orjson

from replay.bounds import MAX_TRACE_SPAN_S
from replay.errors import OptionError
from replay.rules.send_time import replay_seconds
from replay.trace.reader import TraceStream
from replay.trace.record import TraceRow
from replay.trace.sessions import Sessions, find_sessions
from replay.trace.window import check_window, window


def check_replay_length(window_s: float, scale: float, start: float | None) -> None:
    """Refuse a window whose last send would come later than any replay lasts (or never: a
    send offset that is not finite), naming --scale (and --start when the window starts there)."""
    seconds = replay_seconds(window_s, scale)
    if seconds <= MAX_TRACE_SPAN_S:
        return
    since = f" (from --start {start:g})" if start is not None else ""
    raise OptionError(f"--scale {scale:g}: the window's {window_s:g} trace seconds{since} would take {seconds:g} s "
                      f"to replay; a replay lasts at most {MAX_TRACE_SPAN_S:.0f} s (10 years)")


class Schedule:
    """The rows of the window in send order (trace time, then request id), on disk.

    The window is --start/--duration in trace seconds, then the first --max-requests of those
    rows in file order (replay.trace.window's rule). Rows whose input is longer than
    `max_prompt_tokens` are kept out of the schedule, in `oversized`: they are never synthesized.
    """

    def __init__(self, stream: TraceStream, start: float | None = None, duration: float | None = None,
                 max_requests: int | None = None, max_prompt_tokens: int | None = None):
        self.stream = stream
        self._spool = tempfile.TemporaryFile(prefix="replay-rows-")  # gone when closed or the process ends
        self.request_ids = array("q")
        self.times = array("d")
        self._offsets = array("q")
        self._lengths = array("I")
        self.oversized: list[tuple[int, int, int]] = []  # (request id, spool offset, length)
        self.trace_rows = 0  # good rows in the file
        self._session_numbers: dict[str, int] = {}
        self._sessions = array("q")  # per position: a number for the row's session, -1 for none
        self._found: Sessions | None = None  # found_sessions()
        rows, begin, end, first = window(stream, start, duration)
        cap = float("inf") if max_requests is None else max_requests
        limit = max_prompt_tokens or float("inf")
        in_order, last_time, offset, chosen = True, float("-inf"), 0, 0
        latest, earliest = float("-inf"), float("inf")  # the trace's last and first times, in the window or not
        shortest, longest = 1 << 62, 0
        write, dumps = self._spool.write, orjson.dumps
        add_id, add_time, add_offset, add_length, add_session = (
            self.request_ids.append, self.times.append, self._offsets.append, self._lengths.append,
            self._sessions.append)
        for row in rows:  # the hot loop of a big trace's start-up: names bound, one test per rule
            self.trace_rows += 1
            time_s = row.timestamp_s
            if time_s > latest:
                latest = time_s
            if time_s < earliest:
                earliest = time_s
            if chosen >= cap or not begin <= time_s < end:
                continue  # read on all the same: every row is validated before anything is sent
            chosen += 1
            line = dumps(encode_row(row)) + b"\n"
            write(line)
            if row.input_length > limit:
                self.oversized.append((row.request_id, offset, len(line)))
            else:
                if time_s < last_time:
                    in_order = False
                last_time = time_s
                length = row.input_length
                if length < shortest:
                    shortest = length
                if length > longest:
                    longest = length
                add_id(row.request_id)
                add_time(time_s)
                add_offset(offset)
                add_length(len(line))
                add_session(-1 if row.session_id is None else self._session_number(row.session_id))
            offset += len(line)
        self._spool.flush()
        check_window(first, duration, earliest)
        self.latest = latest
        # the window's extremes among sent rows, for the server check's sample (replay.synth.server_check)
        self.input_lengths = (shortest, longest) if longest else ()
        self._fixups = stream.sessions  # sessions that later rows re-rooted
        if not in_order:  # a stable sort by time keeps file order, i.e. request id order, on ties
            order = sorted(range(len(self.times)), key=self.times.__getitem__)
            self.request_ids = array("q", (self.request_ids[i] for i in order))
            self.times = array("d", (self.times[i] for i in order))
            self._offsets = array("q", (self._offsets[i] for i in order))
            self._lengths = array("I", (self._lengths[i] for i in order))
            self._sessions = array("q", (self._sessions[i] for i in order))
        self.origin = start if start is not None else (self.times[0] if self.times else 0.0)

    def _session_number(self, session: str | None) -> int:
        if session is None:
            return -1
        number = self._session_numbers.get(session)
        if number is None:
            number = self._session_numbers[session] = len(self._session_numbers)
        return number

    def __len__(self) -> int:
        return len(self.times)

    @property
    def sessions(self) -> int:
        """The sessions of the window's rows (sent ones)."""
        return len(self._session_numbers)

    def has_turns(self) -> bool:
        """Whether a session has two or more turns in the window (one a closed-loop --turn-timing
        could hold); a session re-rooted by a later row (bailian) may join two, so it counts."""
        in_sessions = len(self._sessions) - self._sessions.count(-1)
        return in_sessions > self.sessions or bool(self._fixups)

    @property
    def window_s(self) -> float:
        """Trace seconds from the origin to the last row's time (before --scale)."""
        return self.times[-1] - self.origin if self.times else 0.0

    def request_id_range(self) -> tuple[int, int]:
        """The lowest and highest request id of every row the run must record (oversized included)."""
        ids = [rid for rid, _, _ in self.oversized]
        if self.request_ids:
            ids += [min(self.request_ids), max(self.request_ids)]
        return (min(ids), max(ids)) if ids else (0, -1)

    def encoded(self, position: int) -> list:
        """Row `position` as shipped to workers (encode_row's form)."""
        return self._read(self._offsets[position], self._lengths[position])

    def _read(self, offset: int, length: int) -> list:
        # pread of the line itself: a seek and readline would refill an 8 KB buffer per row
        data = orjson.loads(os.pread(self._spool.fileno(), length, offset))
        if self._fixups and data[0] in self._fixups:
            data[5] = self._fixups[data[0]]
        return data

    def rows(self, positions: Iterable[int]) -> Iterator[TraceRow]:
        for position in positions:
            yield decode_row(self.encoded(position))

    def found_sessions(self) -> Sessions:
        """The window's sessions, the trace's own or inferred from hash ids (what a search by
        amplify copies), found once: preflight's look at the lowest probe and the probes share them."""
        if self._found is None:
            self._found = find_sessions(lambda: self.rows(range(len(self))))
        return self._found

    def oversized_rows(self) -> Iterator[TraceRow]:
        for _, offset, length in self.oversized:
            yield decode_row(self._read(offset, length))

    def partition(self, workers: int, how: str = "round-robin") -> list[array]:
        """Positions per worker, each in send order (`PARTITIONERS[how]`)."""
        if how not in PARTITIONERS:
            raise ValueError(f"--partition {how!r}: expected one of {', '.join(PARTITIONS)}")
        return PARTITIONERS[how](self._sessions, workers)

    def close(self) -> None:
        self._spool.close()


def _by_turn(sessions: array, workers: int) -> list[array]:
    """Row i to worker i mod workers."""
    return [array("q", range(w, len(sessions), workers)) for w in range(workers)]


def _by_session(sessions: array, workers: int) -> list[array]:
    """Every session on one worker (so its turns go out in order from one place), each new
    session to the worker with the fewest rows so far; a row of no session (-1) to the fewest too."""
    parts = [array("q") for _ in range(workers)]
    owner: dict[int, int] = {}
    for position, session in enumerate(sessions):
        index = owner.get(session) if session >= 0 else None
        if index is None:
            index = min(range(workers), key=lambda w: len(parts[w]))
            if session >= 0:
                owner[session] = index
        parts[index].append(position)
    return parts


# Each --partition choice and how it splits the rows (their session ids, in send order) among
# the workers: the option's choices are this table's names.
PARTITIONERS: dict[str, Callable[[array, int], list[array]]] = {"round-robin": _by_turn, "session": _by_session}
PARTITIONS = tuple(PARTITIONERS)


def encode_row(row: TraceRow) -> list:
    """A compact msgpack-friendly form for master -> worker messages."""
    return [
        row.request_id, row.timestamp_s, row.input_length, row.output_length,
        list(row.hash_ids) if row.hash_ids is not None else None,
        row.session_id, row.messages, row.tools, row.turn, row.line, row.gap_s,
    ]  # fmt: skip


def decode_row(data: list) -> TraceRow:
    rid, ts, inp, out, hashes, session, messages, tools, turn, line, gap_s = data
    return TraceRow(
        request_id=rid, timestamp_s=ts, input_length=inp, output_length=out,
        hash_ids=tuple(hashes) if hashes is not None else None,
        session_id=session, messages=messages, tools=tools, turn=turn, line=line, gap_s=gap_s,
    )  # fmt: skip

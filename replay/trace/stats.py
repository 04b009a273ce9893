"""What a trace asks of a server: load, lengths, and the prefix reuse an ideal cache would get.

Read in one pass over a stream, holding per row only its time (8 bytes); lengths and session
sizes are counted per distinct value, and hash ids per distinct id and prefix (the ideal
cache's trie and the set of ids, each a replay.trace.pairs.PairIndex: 20-24 bytes a distinct
prefix, as many a distinct id), so `replay trace stats` grows with a trace's distinct ids,
never with its rows.
"""

from __future__ import annotations

import math
import tempfile
from array import array
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Mapping

from replay.trace.pairs import PairIndex
from replay.trace.prefix import IdealHits
from replay.trace.reader import TraceStream
from replay.trace.record import Trace
from replay.trace.sessions_on_disk import SessionFiles


def nearest_rank(counts: Mapping[int, int], q: float) -> int:
    """Nearest-rank percentile of data given as {value: how many times}: always a value of the
    data, so a trace's token counts and turns stay integers in `replay trace stats`. Not
    results.summary.percentile (linear interpolation, the usual definition for latencies): the
    two answer different questions and their figures are published, so each keeps its own,
    under a name that says which."""
    total = sum(counts.values())
    if not total:
        raise ValueError("percentile of no values")
    rank = max(1, math.ceil(q / 100.0 * total))
    seen = 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= rank:
            return value
    raise AssertionError("unreachable: the ranks add up to the total")


def length_stats(counts: Mapping[int, int]) -> dict | None:
    """mean, nearest-rank p50/p90/p99 and max of a trace's values counted as {value: how many}
    (None for none); the run's summary of records is results.summary.summarize."""
    total = sum(counts.values())
    if not total:
        return None
    return {
        "mean": sum(value * n for value, n in counts.items()) / total,
        "p50": nearest_rank(counts, 50),
        "p90": nearest_rank(counts, 90),
        "p99": nearest_rank(counts, 99),
        "max": max(counts),
    }


def trace_stats(trace: Trace | TraceStream) -> dict:
    """The `replay trace stats --json` document (the keys tools rely on), of a
    read trace or, in one pass, of a stream."""
    rows = trace.rows if isinstance(trace, Trace) else trace
    times = array("d")
    inputs: Counter = Counter()
    outputs: Counter = Counter()
    distinct = PairIndex()  # (0, id) per distinct hash id
    ideal = IdealHits()
    session_numbers: dict[str, int] = {}
    session_rows, session_of = array("q"), array("q")  # request id and session number of each row with one
    with_hashes = with_messages = 0
    block = None
    for row in rows:
        if block is None:  # final once the first row is read (a jsonl file's own block_size)
            block = trace.block_size
        times.append(row.timestamp_s)
        inputs[row.input_length] += 1
        outputs[row.output_length] += 1
        hits = ideal.add(row, block) if block is not None else 0
        if row.hash_ids is not None:
            with_hashes += 1
            distinct.add_new(0, row.hash_ids[hits:])  # a block the ideal cache held has an id seen before
        if row.messages is not None:
            with_messages += 1
        if row.session_id is not None:
            session_rows.append(row.request_id)
            session_of.append(session_numbers.setdefault(row.session_id, len(session_numbers)))
    if isinstance(trace, TraceStream):  # sessions that later rows re-rooted (bailian chains)
        for request_id, session in trace.sessions.items():
            position = bisect_left(session_rows, request_id)
            if position < len(session_rows) and session_rows[position] == request_id:  # not a skipped row
                session_of[position] = session_numbers.setdefault(session, len(session_numbers))
    first = min(times, default=0.0)
    duration = max(times) - first if times else 0.0
    per_second = Counter(int(t - first) for t in times)
    sessions = Counter(session_of)
    stats = {
        "path": trace.path,
        "format": trace.format,
        "block_size": trace.block_size,
        "requests": len(times),
        "skipped": trace.bad_rows if isinstance(trace, TraceStream) else len(trace.skipped),
        "duration_s": duration,
        "mean_rps": len(times) / duration if duration > 0 else None,
        "peak_rps_1s": max(per_second.values()) if per_second else 0,
        "input_length": length_stats(inputs),
        "output_length": length_stats(outputs),
        "input_tokens": sum(value * n for value, n in inputs.items()),
        "output_tokens": sum(value * n for value, n in outputs.items()),
        "rows_with_hash_ids": with_hashes,
        "rows_with_messages": with_messages,
        "distinct_hash_ids": len(distinct),
        "sessions": len(sessions) if sessions else None,
        "turns_per_session": length_stats(Counter(sessions.values())) if sessions else None,
    }
    stats.update(ideal_prefix_hit_ratios(ideal if block is not None and with_hashes else None))
    return stats


def ideal_prefix_hit_ratios(ideal: IdealHits | None) -> dict:
    """Hit ratios of an infinite prefix cache, by blocks and by tokens.

    Rows without hash ids count as all-miss (they share nothing), so the ratios describe the
    whole trace. None when no row has hash ids or the block size is unknown (ideal is None).
    """
    if ideal is None:
        return {"ideal_prefix_hit_ratio": None, "ideal_prefix_hit_ratio_tokens": None}
    return {
        "ideal_prefix_hit_ratio": ideal.hit_blocks / ideal.total_blocks if ideal.total_blocks else None,
        "ideal_prefix_hit_ratio_tokens": ideal.hit_tokens / ideal.total_tokens if ideal.total_tokens else None,
    }


def _num(value, digits: int = 2) -> str:
    """A figure as the stats print it: whole numbers with thousands separators, n/a for None."""
    if value is None:
        return "n/a"
    if isinstance(value, int) or float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:,.{digits}f}"


def format_stats(stats: dict) -> str:
    """The human-readable form of trace_stats()."""

    def dist(d: dict | None) -> str:
        if d is None:
            return "n/a"
        return "  ".join(f"{k} {_num(d[k], 1)}" for k in ("mean", "p50", "p90", "p99", "max"))

    lines = [
        f"trace       {stats['path']} ({stats['format']}, block size {_num(stats['block_size'])})",
        f"requests    {_num(stats['requests'])}" + (f"  (skipped {_num(stats['skipped'])} bad rows)" if stats["skipped"] else ""),
        f"duration    {_num(stats['duration_s'], 1)} s   mean {_num(stats['mean_rps'])} req/s   "
        f"peak {_num(stats['peak_rps_1s'])} req in 1 s",
        f"input len   {dist(stats['input_length'])}",
        f"output len  {dist(stats['output_length'])}",
        f"hash ids    {_num(stats['distinct_hash_ids'])} distinct over {_num(stats['rows_with_hash_ids'])} rows",
        f"ideal hit   {_num(stats['ideal_prefix_hit_ratio'], 4)} (blocks)   "
        f"{_num(stats['ideal_prefix_hit_ratio_tokens'], 4)} (tokens)   infinite prefix cache",
    ]
    if stats["sessions"]:
        lines.append(f"sessions    {_num(stats['sessions'])}   turns/session {dist(stats['turns_per_session'])}")
    if stats["rows_with_messages"]:
        lines.append(f"messages    {_num(stats['rows_with_messages'])} rows carry their own messages")
    return "\n".join(lines)


def inferred_sessions(stream_of: Callable[[], TraceStream], global_min_rows: int) -> dict:
    """The sessions keys of trace_stats() for a trace without sessions of its own, found as
    `replay trace amplify` finds them (replay.trace.sessions_on_disk: one more pass, or two, in
    bounded memory, its temporary files in the system's temporary folder)."""
    with SessionFiles(tempfile.gettempdir()) as files:
        sessions = files.find(stream_of, global_min_rows)
        return {
            "sessions": len(sessions) or None,
            "turns_per_session": length_stats(sessions.turns()),
            "sessions_inferred": True,
        }


def format_comparison(first: dict, second: dict) -> str:
    """Two trace_stats() side by side, with the second's ratio to the first (a difference, in
    points, for the hit ratios): `replay trace stats IN OUT`."""

    def ratio(a, b) -> str:
        return f"x{b / a:.3f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a else ""

    def points(a, b) -> str:
        return f"{100 * (b - a):+.2f} pt" if a is not None and b is not None else ""

    def sessions(stats: dict) -> str:
        return _num(stats["sessions"]) + (" (inferred)" if stats.get("sessions_inferred") else "")

    lines = [("", "first", "second", "second/first"),
             ("trace", f"{first['path']} ({first['format']})", f"{second['path']} ({second['format']})", "")]
    for label, key in (("requests", "requests"), ("duration s", "duration_s"), ("mean req/s", "mean_rps"),
                       ("peak req in 1 s", "peak_rps_1s"), ("input tokens", "input_tokens"),
                       ("distinct hash ids", "distinct_hash_ids")):
        lines.append((label, _num(first[key]), _num(second[key]), ratio(first[key], second[key])))
    lines.append(("sessions", sessions(first), sessions(second), ratio(first["sessions"], second["sessions"])))
    for label, key in (("input len", "input_length"), ("output len", "output_length"),
                       ("turns/session", "turns_per_session")):
        for part in ("mean", "p50", "p90", "p99", "max"):
            a = first[key][part] if first[key] else None
            b = second[key][part] if second[key] else None
            lines.append((f"{label} {part}", _num(a, 1), _num(b, 1), "same" if a == b and a is not None else ratio(a, b)))
    for label, key in (("ideal hit (blocks)", "ideal_prefix_hit_ratio"),
                       ("ideal hit (tokens)", "ideal_prefix_hit_ratio_tokens")):
        lines.append((label, _num(first[key], 4), _num(second[key], 4), points(first[key], second[key])))
    widths = [max(len(line[i]) for line in lines) for i in range(4)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines)

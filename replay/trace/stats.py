"""What a trace asks of a server: load, lengths, and the prefix reuse an ideal cache would get."""

from __future__ import annotations

import math
from collections import Counter
from typing import Sequence

from replay.trace.prefix import ideal_hits
from replay.trace.record import Trace


def nearest_rank(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: always a value of the data, so a trace's token counts and turns
    stay integers in `replay trace stats`. Not results.summary.percentile (linear interpolation,
    the usual definition for latencies): the two answer different questions and their figures
    are published, so each keeps its own, under a name that says which."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return sorted_values[rank - 1]


def length_stats(values: Sequence[float]) -> dict | None:
    """mean, nearest-rank p50/p90/p99 and max of a trace's values (None for none); the run's
    summary of records is results.summary.summarize."""
    if not values:
        return None
    ordered = sorted(values)
    return {
        "mean": sum(ordered) / len(ordered),
        "p50": nearest_rank(ordered, 50),
        "p90": nearest_rank(ordered, 90),
        "p99": nearest_rank(ordered, 99),
        "max": ordered[-1],
    }


def trace_stats(trace: Trace) -> dict:
    """The `replay trace stats --json` document (design.md names the required keys)."""
    rows = trace.rows
    times = [r.timestamp_s for r in rows]
    first = min(times, default=0.0)
    duration = max(times) - first if rows else 0.0
    per_second = Counter(int(t - first) for t in times)
    with_hashes = [r for r in rows if r.hash_ids is not None]
    sessions = Counter(r.session_id for r in rows if r.session_id is not None)
    stats = {
        "path": trace.path,
        "format": trace.format,
        "block_size": trace.block_size,
        "requests": len(rows),
        "skipped": len(trace.skipped),
        "duration_s": duration,
        "mean_rps": len(rows) / duration if duration > 0 else None,
        "peak_rps_1s": max(per_second.values()) if per_second else 0,
        "input_length": length_stats([r.input_length for r in rows]),
        "output_length": length_stats([r.output_length for r in rows]),
        "input_tokens": sum(r.input_length for r in rows),
        "output_tokens": sum(r.output_length for r in rows),
        "rows_with_hash_ids": len(with_hashes),
        "rows_with_messages": sum(1 for r in rows if r.messages is not None),
        "distinct_hash_ids": len({h for r in with_hashes for h in r.hash_ids}),
        "sessions": len(sessions) if sessions else None,
        "turns_per_session": length_stats(list(sessions.values())) if sessions else None,
    }
    stats.update(ideal_prefix_hit_ratios(trace))
    return stats


def ideal_prefix_hit_ratios(trace: Trace) -> dict:
    """Hit ratios of an infinite prefix cache, by blocks and by tokens.

    Rows without hash ids count as all-miss (they share nothing), so the ratios describe the
    whole trace. None when no row has hash ids or the block size is unknown.
    """
    block = trace.block_size
    if block is None or not any(r.hash_ids is not None for r in trace.rows):
        return {"ideal_prefix_hit_ratio": None, "ideal_prefix_hit_ratio_tokens": None}
    hit_blocks, total_blocks, hit_tok, total_tok = ideal_hits(trace.rows, block)
    return {
        "ideal_prefix_hit_ratio": hit_blocks / total_blocks if total_blocks else None,
        "ideal_prefix_hit_ratio_tokens": hit_tok / total_tok if total_tok else None,
    }


def format_stats(stats: dict) -> str:
    """The human-readable form of trace_stats()."""

    def num(value, digits: int = 2) -> str:
        if value is None:
            return "n/a"
        if isinstance(value, int) or float(value).is_integer():
            return f"{int(value):,}"
        return f"{value:,.{digits}f}"

    def dist(d: dict | None) -> str:
        if d is None:
            return "n/a"
        return "  ".join(f"{k} {num(d[k], 1)}" for k in ("mean", "p50", "p90", "p99", "max"))

    lines = [
        f"trace       {stats['path']} ({stats['format']}, block size {num(stats['block_size'])})",
        f"requests    {num(stats['requests'])}" + (f"  (skipped {num(stats['skipped'])} bad rows)" if stats["skipped"] else ""),
        f"duration    {num(stats['duration_s'], 1)} s   mean {num(stats['mean_rps'])} req/s   "
        f"peak {num(stats['peak_rps_1s'])} req in 1 s",
        f"input len   {dist(stats['input_length'])}",
        f"output len  {dist(stats['output_length'])}",
        f"hash ids    {num(stats['distinct_hash_ids'])} distinct over {num(stats['rows_with_hash_ids'])} rows",
        f"ideal hit   {num(stats['ideal_prefix_hit_ratio'], 4)} (blocks)   "
        f"{num(stats['ideal_prefix_hit_ratio_tokens'], 4)} (tokens)   infinite prefix cache",
    ]
    if stats["sessions"]:
        lines.append(f"sessions    {num(stats['sessions'])}   turns/session {dist(stats['turns_per_session'])}")
    if stats["rows_with_messages"]:
        lines.append(f"messages    {num(stats['rows_with_messages'])} rows carry their own messages")
    return "\n".join(lines)

"""The end-of-run summary, computed from records. Percentiles are computed here and only here
(numpy's default linear interpolation, as vLLM's benchmark reports them)."""

from __future__ import annotations

import math
from collections import Counter
from typing import Iterable, Sequence

DISTRIBUTION_KEYS = ("mean", "median", "std", "p25", "p50", "p75", "p90", "p99")


def percentile(sorted_values: Sequence[float], p: float) -> float | None:
    """Linear interpolation between closest ranks; `sorted_values` must be sorted."""
    n = len(sorted_values)
    if n == 0:
        return None
    k = (n - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def distribution(values: Iterable[float]) -> dict[str, float | None]:
    v = sorted(x for x in values if x is not None)
    if not v:
        return {k: None for k in DISTRIBUTION_KEYS}
    mean = sum(v) / len(v)
    std = math.sqrt(sum((x - mean) ** 2 for x in v) / len(v))
    out = {"mean": mean, "median": percentile(v, 50), "std": std}
    for p in (25, 50, 75, 90, 99):
        out[f"p{p}"] = percentile(v, p)
    return out


def failure_reason(record: dict) -> str:
    """One label per failed record: 'HTTP 503' for error statuses, else the error text's head."""
    status = record.get("status") or 0
    if status and not 200 <= status < 300:
        return f"HTTP {status}"
    error = str(record.get("error") or "no error text")
    return error if len(error) <= 80 else error[:77] + "..."


def failures(records: Iterable[dict]) -> tuple[dict[str, int], dict[str, int]]:
    """Failed records counted by reason and by HTTP status (0 = no response)."""
    by_reason: Counter[str] = Counter()
    by_status: Counter[str] = Counter()
    for r in records:
        if not r.get("ok"):
            by_reason[failure_reason(r)] += 1
            by_status[str(r.get("status") or 0)] += 1
    return dict(by_reason.most_common()), dict(by_status.most_common())


def summarize(records: list[dict]) -> dict:
    """design.md's summary keys that records alone can give (goodput and cache come later)."""
    ok = [r for r in records if r.get("ok")]
    sent = [r for r in records if r.get("sent_at") is not None]
    start = min((r["sent_at"] for r in sent), default=None)
    end = max((r["finished_at"] for r in sent if r.get("finished_at")), default=None)
    duration = (end - start) if start is not None and end is not None else 0.0
    input_tokens = sum(r.get("prompt_tokens") or r.get("input_length") or 0 for r in ok)
    output_tokens = sum(r.get("output_tokens") or 0 for r in ok)
    drifts = sorted(r["drift_ms"] for r in sent if r.get("drift_ms") is not None)
    return {
        "requests": len(records),
        "requests_ok": len(ok),
        "requests_failed": len(records) - len(ok),
        "failures": failures(records)[0],
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "input_token_throughput": input_tokens / duration if duration else 0.0,
        "output_token_throughput": output_tokens / duration if duration else 0.0,
        "ttft_ms": distribution(r.get("ttft_ms") for r in ok),
        "tpot_ms": distribution(r.get("tpot_ms") for r in ok),
        "itl_ms": distribution(x for r in ok for x in (r.get("itl_ms") or ())),
        "e2e_ms": distribution(r.get("e2e_ms") for r in ok),
        "drift_ms": {"p50": percentile(drifts, 50), "p99": percentile(drifts, 99), "max": drifts[-1] if drifts else None},
    }

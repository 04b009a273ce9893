"""`replay compare`'s figures: BASE and NEW, the change, its 95% interval and a verdict.

A trace replay sends the same row at the same time with the same prompt in both runs, so the
runs are compared row by row: rows are matched by request id and resampled together
(replay.results.bootstrap), which cancels what a row is (a long prompt, a cache miss) and
leaves what the server did differently.

Several runs on a side are pooled, not averaged per row: each run's values enter its side's
distribution, and a drawn row brings all of its runs' values. A per-row mean over runs would
be a narrower distribution than any one run's (its p99 falls as runs are added), so sides with
different numbers of runs would differ by construction; pooled, a side's p99 is the p99 a run
of it measures, and the extra runs only tighten the interval.

Figures that exist once per run (throughput, the server's peaks) have no rows to resample:
they are shown, with their change, and not tested ("not tested").
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from replay.results.bootstrap import Draw, Share, Weighted, block_rows, draw, interval, sample, std
from replay.results.metadata import read_run_metadata
from replay.results.records import Record, prompt_tokens_of, read_records
from replay.results.report import ReportBuilder, meets_slo, parse_slo
from replay.results.server_metrics import read_server_section
from replay.results.summary import percentile

BETTER, WORSE, SAME, NOT_TESTED = "better", "worse", "no detectable difference", "not tested"
CONFIDENCE = 0.95
MDE_FACTOR = 1.959964 + 0.841621  # z of 97.5% + z of 80%: a 5% two-sided test with 80% power
MIN_TAIL_ROWS = 10  # a quantile is tested only with this many rows beyond it (p99: 1,000 rows)
ITL_CAP = 20_000  # inter-token gaps per side the resampling carries (a request's gaps thinned evenly)
LATENCIES = ("ttft", "tpot", "itl", "e2e")
QUANTILES = (50, 90, 99)
MDE_METRICS = ("ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99")


class CompareError(ValueError):
    """Runs that cannot be compared, or bad input: the message names the file or option."""


@dataclass(frozen=True)
class Metric:
    name: str
    label: str
    unit: str  # "ms", "share" (a fraction, changes in points) or "" (a run-level figure)
    lower_is_better: bool
    quantile: float | None = None
    tested: bool = True


def metric_table(slo: bool) -> list[Metric]:
    """Every figure compared, in the table's order."""
    out = []
    for lat in LATENCIES:
        for p in QUANTILES:
            out.append(Metric(f"{lat}_p{p}", f"{lat.upper()} p{p}", "ms", True, quantile=p))
        out.append(Metric(f"{lat}_mean", f"{lat.upper()} mean", "ms", True))
    if slo:
        out.append(Metric("goodput", "goodput (share meeting --slo)", "share", False))
    out.append(Metric("failure_rate", "failure rate", "share", True))
    out.append(Metric("cached_share", "cached-token share", "share", False))
    out += [Metric("request_throughput", "requests/s", "", False, tested=False),
            Metric("output_throughput", "output tokens/s", "", False, tested=False),
            Metric("kv_usage_peak", "KV-cache usage peak", "share", True, tested=False),
            Metric("queue_peak", "queue peak (waiting)", "", True, tested=False),
            Metric("preemptions", "preemptions", "", True, tested=False)]  # fmt: skip
    return out


@dataclass
class Run:
    path: str
    meta: dict | None
    records: list[Record]


def load_run(path: str) -> Run:
    """A run's records and metadata (CompareError naming the file when they cannot be read)."""
    try:
        meta = read_run_metadata(path)
        records = list(read_records(path))
    except (ValueError, OSError) as e:
        raise CompareError(str(e)) from None
    if not records:
        raise CompareError(f"{path}: no records: expected the per-request JSONL a replay writes (its --output)")
    return Run(path, meta, records)


# What makes two runs the same experiment: (what it is called, where the metadata says it).
COMPARED_META: tuple[tuple[str, Callable[[dict], object]], ...] = (
    ("trace fingerprint (sha256)", lambda m: (m.get("trace") or {}).get("sha256")),
    ("trace window (start, duration, max requests, rows)",
     lambda m: tuple((m.get("trace") or {}).get(k) for k in ("start", "duration", "max_requests", "rows"))),
    ("seed", lambda m: m.get("seed")),
    ("api", lambda m: m.get("api")),
    ("prompt format", lambda m: (m.get("options") or {}).get("prompt_format")),
    ("scale", lambda m: m.get("scale")),
    ("stream", lambda m: m.get("stream")),
)  # fmt: skip


def differences(runs: list[Run]) -> list[str]:
    """How each run differs from the first in what makes runs comparable, one line each."""
    first = runs[0]
    out = []
    for run in runs:
        if run.meta is None:
            out.append(f"{run.path}: no run metadata beside it ({run.path}.meta.json): cannot tell what it replayed")
    for run in runs[1:]:
        if first.meta is None or run.meta is None:
            continue
        for name, get in COMPARED_META:
            a, b = get(first.meta), get(run.meta)
            if a != b:
                out.append(f"{name}: {first.path} has {a!r}, {run.path} has {b!r}")
    return out


def slo_of(runs: list[Run], given: dict[str, float] | None) -> dict[str, float] | None:
    """The --slo given, else the runs' own when they all agree (replay.results.report.parse_slo's form)."""
    if given:
        return given
    texts = {((r.meta or {}).get("options") or {}).get("slo") for r in runs}
    if len(texts) == 1:
        return parse_slo(texts.pop()) or None
    return None


class Side:
    """One side's values as the resampling needs them, over the matched rows (0..n-1)."""

    def __init__(self, runs: list[Run], index: dict[int, int], slo: dict[str, float] | None, block: int) -> None:
        n = len(index)
        self.runs = runs
        pairs: dict[str, list[tuple[float, int]]] = {lat: [] for lat in LATENCIES}
        itl_rows: list[tuple[int, list[float]]] = []
        self.requests, self.failed, self.good = [0] * n, [0] * n, [0] * n
        self.cached, self.prompt = [0] * n, [0] * n
        for run in runs:
            for r in run.records:
                row = index.get(r["request_id"])
                if row is None:
                    continue
                self.requests[row] += 1
                if slo and meets_slo(r, slo):
                    self.good[row] += 1
                if not r.get("ok"):
                    self.failed[row] += 1
                    continue
                for lat in ("ttft", "tpot", "e2e"):
                    value = r.get(f"{lat}_ms")
                    if value is not None:
                        pairs[lat].append((value, row))
                if r.get("itl_ms"):
                    itl_rows.append((row, r["itl_ms"]))
                if r.get("cached_tokens") is not None:
                    self.cached[row] += r["cached_tokens"]
                    self.prompt[row] += prompt_tokens_of(r)
        self.itl_all = sorted(v for _, gaps in itl_rows for v in gaps)  # the point figures: every gap
        pairs["itl"] = thinned(itl_rows, ITL_CAP)
        self.rows_with = {lat: len({row for _, row in pairs[lat]}) for lat in LATENCIES}
        self.weighted = {lat: Weighted(pairs[lat], n, block) for lat in LATENCIES}
        self.shares = {"failure_rate": Share(self.failed, self.requests, block),
                       "cached_share": Share(self.cached, self.prompt, block)}
        if slo:
            self.shares["goodput"] = Share(self.good, self.requests, block)

    def figures(self, d: Draw) -> dict[str, float | None]:
        """Every tested figure of this side for one resample."""
        out: dict[str, float | None] = {}
        for lat, w in self.weighted.items():
            for p, q in zip(QUANTILES, w.quantiles(d, QUANTILES)):
                out[f"{lat}_p{p}"] = q
            out[f"{lat}_mean"] = w.mean(d)
        for name, share in self.shares.items():
            out[name] = share.value(d)
        return out

    def point(self) -> dict[str, float | None]:
        """The side's figures: the resampling's rule at every count 1, ITL from every gap."""
        out = self.figures(sample(len(self.requests)))
        for p in QUANTILES:
            out[f"itl_p{p}"] = percentile(self.itl_all, p)
        out["itl_mean"] = sum(self.itl_all) / len(self.itl_all) if self.itl_all else None
        return out


def thinned(itl_rows: list[tuple[int, list[float]]], cap: int) -> list[tuple[float, int]]:
    """Every request's gaps, or where they are more than `cap` in all, each request's evenly
    spaced order statistics, its share of `cap` (at least one): each request keeps its shape."""
    total = sum(len(g) for _, g in itl_rows)
    keep = max(1, cap // max(1, len(itl_rows))) if total > cap else None
    out = []
    for row, gaps in itl_rows:
        if keep is None or len(gaps) <= keep:
            out.extend((v, row) for v in gaps)
        else:
            s = sorted(gaps)
            out.extend((s[int((i + 0.5) * len(s) / keep)], row) for i in range(keep))
    return out


def run_figures(run: Run, slo: dict[str, float] | None) -> dict[str, float | None]:
    """The run-level figures of one run, as `replay report` computes them."""
    builder = ReportBuilder(slo)
    for r in run.records:
        builder.add(r)
    report = builder.report()
    server = read_server_section(run.path, report["endpoints"])
    total = (server or {}).get("total") or {}
    return {"request_throughput": report["request_throughput"], "output_throughput": report["output_token_throughput"],
            "kv_usage_peak": total.get("peak_kv_cache_usage"), "queue_peak": total.get("peak_waiting"),
            "preemptions": total.get("preemptions")}  # fmt: skip


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _tail_problem(metric: Metric, rows: int) -> str | None:
    """Why a quantile cannot be tested with `rows` rows (too few beyond it), else None."""
    if metric.quantile is None:
        return None
    share = min(metric.quantile, 100 - metric.quantile) / 100.0
    if rows * share >= MIN_TAIL_ROWS:
        return None
    return (f"too few rows for p{metric.quantile:g}: {rows} rows leave {rows * share:g} beyond it, "
            f"{math.ceil(MIN_TAIL_ROWS / share)} rows needed")  # fmt: skip


def verdict(metric: Metric, ci: tuple[float, float] | None, problem: str | None) -> str:
    """`worse`/`better` only when the whole interval lies on one side of no change."""
    if not metric.tested:
        return NOT_TESTED
    if ci is None or problem:
        return SAME
    lo, hi = ci
    if lo > 0:
        return WORSE if metric.lower_is_better else BETTER
    if hi < 0:
        return BETTER if metric.lower_is_better else WORSE
    return SAME


def compare(base: list[Run], new: list[Run], *, slo: dict[str, float] | None = None, resamples: int = 1000,
            seed: int = 0, block: int | None = None) -> dict:
    """The comparison document (docs/compare.md): the runs, the method, one entry per metric,
    the minimal detectable effects. Rows are those every run has (matched by request id)."""
    ids = set.intersection(*({r["request_id"] for r in run.records} for run in (*base, *new)))
    if not ids:
        raise CompareError("the runs have no request id in common: not replays of the same trace rows")
    index = {rid: row for row, rid in enumerate(sorted(ids))}  # request ids are trace order
    n = len(index)
    block = block or block_rows(n)
    sides = Side(base, index, slo, block), Side(new, index, slo, block)
    metrics = metric_table(bool(slo))
    tested = [m for m in metrics if m.tested]
    diffs: dict[str, list[float]] = {m.name: [] for m in tested}
    rels: dict[str, list[float]] = {m.name: [] for m in tested}
    rng = random.Random(seed)
    for _ in range(resamples):
        d = draw(rng, n, block)
        b, a = sides[0].figures(d), sides[1].figures(d)
        for m in tested:
            if b[m.name] is not None and a[m.name] is not None:
                diffs[m.name].append(a[m.name] - b[m.name])
                if b[m.name]:
                    rels[m.name].append((a[m.name] - b[m.name]) / b[m.name])
    points = sides[0].point(), sides[1].point()
    run_level = [[run_figures(r, slo) for r in side] for side in (base, new)]
    entries = []
    for m in metrics:
        if m.tested:
            bv, nv = points[0][m.name], points[1][m.name]
        else:
            bv, nv = (_mean([f[m.name] for f in figs]) for figs in run_level)
        lat = m.name.split("_")[0]
        rows = min(s.rows_with[lat] for s in sides) if m.quantile is not None else n
        problem = _tail_problem(m, rows)
        ci = interval(diffs[m.name], CONFIDENCE) if m.tested else None
        ci_rel = interval(rels[m.name], CONFIDENCE) if m.tested else None
        entries.append({
            "metric": m.name, "label": m.label, "unit": m.unit, "lower_is_better": m.lower_is_better,
            "base": bv, "new": nv,
            "change": None if bv is None or nv is None else nv - bv,
            "relative_change": None if not bv or nv is None else (nv - bv) / bv,
            "ci": list(ci) if ci else None, "relative_ci": list(ci_rel) if ci_rel else None,
            "verdict": verdict(m, ci, problem), "note": problem if m.tested else "one figure per run: no interval",
        })  # fmt: skip
    mde = {}
    for name in MDE_METRICS:
        entry = next(e for e in entries if e["metric"] == name)
        sd = std(diffs[name])
        if entry["note"] or sd is None:
            mde[name] = {"ms": None, "relative": None, "note": entry["note"] or "no values"}
        else:
            effect = MDE_FACTOR * sd
            mde[name] = {"ms": effect, "relative": effect / entry["base"] if entry["base"] else None, "note": None}
    return {
        "base": [r.path for r in base], "new": [r.path for r in new],
        "rows_matched": n,
        "rows_unmatched": len({r["request_id"] for run in (*base, *new) for r in run.records}) - n,
        "slo": slo,
        "bootstrap": {"method": "paired circular block bootstrap over rows matched by request id",
                      "resamples": resamples, "seed": seed, "block_rows": block, "confidence": CONFIDENCE,
                      "min_tail_rows": MIN_TAIL_ROWS},
        "metrics": entries,
        "mde": mde,
    }  # fmt: skip


def paths_exist(paths: list[str]) -> None:
    for p in paths:
        if not Path(p).is_file():
            raise CompareError(f"{p}: no such file (a run's --output)")

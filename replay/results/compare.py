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

Rows are compared where every run has the server's answer (ok or not): a row one run never
sent, or cut off by its own stop, is no latency change and no failure, so it is counted apart
(replay.results.compare_runs says which rows a run answered and whether it is whole). In a run
stopped early, the rows from the first one its stop left unanswered on are left out too:
the ones that finished after it are its fast ones.

Figures that exist once per run (throughput, the server's peaks) have no rows to resample:
they are shown, with their change, and not tested ("not tested").
"""

from __future__ import annotations

import math
import random
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from replay.results.bootstrap import Draw, Share, Total, Weighted, block_rows, draw, interval, sample, std
from replay.results.compare_runs import OK, SERVER_PARTS, UNANSWERED, RunRows, read_run
from replay.results.report import parse_slo

BETTER, WORSE, SAME, NOT_TESTED = "better", "worse", "no detectable difference", "not tested"
CONFIDENCE = 0.95
MDE_FACTOR = 1.959964 + 0.841621  # z of 97.5% + z of 80%: a 5% two-sided test with 80% power
MIN_TAIL_ROWS = 10  # a quantile is tested only with this many rows beyond it (p99: 1,000 rows)
LATENCIES = ("ttft", "tpot", "itl", "e2e")
QUANTILES = (50, 90, 99)
MDE_METRICS = ("ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99")
MAX_ID_SPAN = 1 << 28  # request ids are trace rows: a span wider than this is no run's


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


# The server's own parts (replay.results.compare_runs.server_parts), compared when a run has them.
SERVER_LABELS = {"queue": "server queue", "prefill": "server prefill", "decode": "server decode",
                 "rest": "TTFT rest (network, client)"}


def metric_table(slo: bool, server: bool = False) -> list[Metric]:
    """Every figure compared, in the table's order; `server`: the servers' own parts too."""
    out = []
    for lat in LATENCIES:
        for p in QUANTILES:
            out.append(Metric(f"{lat}_p{p}", f"{lat.upper()} p{p}", "ms", True, quantile=p))
        out.append(Metric(f"{lat}_mean", f"{lat.upper()} mean", "ms", True))
    for part in SERVER_PARTS if server else ():
        for p in QUANTILES:
            out.append(Metric(f"{part}_p{p}", f"{SERVER_LABELS[part]} p{p}", "ms", True, quantile=p))
        out.append(Metric(f"{part}_mean", f"{SERVER_LABELS[part]} mean", "ms", True))
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


def load_run(path: str, slo: dict[str, float] | None = None) -> RunRows:
    """A run's records (as columns) and metadata; CompareError naming the file (and line) when
    they cannot be read."""
    try:
        return read_run(path, slo)
    except (ValueError, OSError) as e:
        raise CompareError(str(e)) from None


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
    # the prompts' text: another tokenizer or template synthesizes other prompts (a run from before
    # the field: not known, not told apart)
    ("tokenizer and chat template (fingerprint)", lambda m: m.get("tokenizer_fingerprint")),
    ("ignore_eos (--no-ignore-eos lets answers end early)", lambda m: (m.get("options") or {}).get("no_ignore_eos")),
)  # fmt: skip


# Figures a run may not have (older metadata, no tokenizer check): not known there, so not a difference.
UNKNOWN_WHEN_NONE = ("tokenizer and chat template (fingerprint)",)


# What a run recorded from another (replay.results.recorded_pair) need not share with it.
RECORDED_DIFFER = ("trace fingerprint (sha256)", "trace window (start, duration, max requests, rows)", "scale")


def differences(runs: list[RunRows], recorded: Mapping[int, int] | None = None) -> list[str]:
    """How each run differs from the first in what makes runs comparable, one line each.
    `recorded`: run -> the run its trace was recorded from (by index in `runs`): the two traces
    differ by construction, and only --scale 1 replays the recording's pace."""
    recorded = recorded or {}
    first = runs[0]
    out = []
    for run in runs:
        if run.meta is None:
            out.append(f"{run.path}: no run metadata beside it ({run.path}.meta.json): cannot tell what it replayed")
        elif (run.meta.get("options") or {}).get("capacity_search"):
            # Its later probes reuse request ids at the factors its own outcomes chose.
            out.append(f"{run.path} is a capacity search: its probes' rows are at the load factors its outcomes "
                       f"chose, so row by row they pair rows of other loads (its {run.path}.capacity.json has "
                       f"its result)")
    for k, run in enumerate(runs):
        if k in recorded and run.meta is not None and run.meta.get("scale") != 1.0:
            out.append(f"scale: {run.path} replays a recorded trace (the recording's own times) at --scale "
                       f"{run.meta.get('scale')!r}: only 1 replays the recorded run's pace")
    for k, run in enumerate(runs[1:], 1):
        if first.meta is None or run.meta is None:
            continue
        for name, get in COMPARED_META:
            if (recorded.get(k) == 0 or recorded.get(0) == k) and name in RECORDED_DIFFER:
                continue
            a, b = get(first.meta), get(run.meta)
            if a != b and not (name in UNKNOWN_WHEN_NONE and None in (a, b)):
                out.append(f"{name}: {first.path} has {a!r}, {run.path} has {b!r}")
    return list(dict.fromkeys(out))  # a run given twice (compared with itself) is said once


def slo_of(metas: list[dict | None], given: dict[str, float] | None) -> dict[str, float] | None:
    """The --slo given, else the runs' own when they all agree (replay.results.report.parse_slo's form)."""
    if given:
        return given
    texts = {((m or {}).get("options") or {}).get("slo") for m in metas}
    if len(texts) == 1:
        return parse_slo(texts.pop()) or None
    return None


@dataclass
class Matched:
    """The rows compared: answered in every run, before the first row a run-wide stop left
    unanswered (`stop`, a request id, or None), in request id order (trace order)."""

    ids: array  # the compared rows' request ids, ascending
    low: int  # the least request id of any run: row_of's origin
    row_of: array  # request id - low -> its row among the compared, -1: not compared
    stop: int | None
    rows_after_stop: int  # request ids of any run from `stop` on
    all_ids: int  # distinct request ids over the runs
    common_ids: int  # request ids every run has a record of


def match(runs: list[RunRows]) -> Matched:
    low = min(min(r.ids) for r in runs)
    span = max(max(r.ids) for r in runs) - low + 1
    if span > MAX_ID_SPAN:
        raise CompareError(f"request ids from {low} span {span} rows: more than {MAX_ID_SPAN} (not one trace's rows)")
    stops = [r.first_stop for r in runs if r.first_stop is not None]
    stop = min(stops) if stops else None
    answered, present = bytearray(span), bytearray(span)
    for run in runs:
        for rid, state in zip(run.ids, run.state):
            present[rid - low] += 1
            if state != UNANSWERED and (stop is None or rid < stop):
                answered[rid - low] += 1
    want = len(runs)
    ids = array("q", [low + k for k, c in enumerate(answered) if c == want])
    row_of = array("q", [-1]) * span
    for row, rid in enumerate(ids):
        row_of[rid - low] = row
    after = span - (stop - low) - present.count(0, stop - low) if stop is not None else 0
    return Matched(ids, low, row_of, stop, after, span - present.count(0), present.count(want))


class Side:
    """One side's values as the resampling needs them, over the compared rows (0..n-1)."""

    def __init__(self, runs: list[RunRows], matched: Matched, slo: dict[str, float] | None, block: int,
                 server: bool = False, timed: Mapping[str, bytearray] | None = None) -> None:
        """`server`: the servers' own parts too (compare_runs.SERVER_PARTS), on the rows `timed`
        marks per part (`timed_rows`)."""
        n = len(matched.ids)
        low, row_of = matched.low, matched.row_of
        values = {lat: (array("d"), array("q")) for lat in ("ttft", "tpot", "e2e", *(SERVER_PARTS if server else ()))}
        gaps, gap_rows, gap_weights = array("d"), array("q"), array("d")
        zeros = bytes(8 * n)
        requests, failed, good = array("d", zeros), array("d", zeros), array("d", zeros)
        cached, prompt = array("d", zeros), array("d", zeros)
        itl_sum, itl_count = array("d", zeros), array("d", zeros)
        self.gaps_total = 0
        for run in runs:
            rows = array("q", [row_of[rid - low] for rid in run.ids])
            for i, row in enumerate(rows):
                if row < 0:
                    continue
                requests[row] += 1
                good[row] += run.good[i]
                if run.state[i] != OK:
                    failed[row] += 1
                    continue
                for lat, column in (("ttft", run.ttft), ("tpot", run.tpot), ("e2e", run.e2e),
                                    *((part, run.server[part]) for part in SERVER_PARTS if server)):
                    v = column[i]
                    if v == v and (timed is None or lat not in timed or timed[lat][row]):  # not nan: the record has it
                        values[lat][0].append(v)
                        values[lat][1].append(row)
                if run.cached[i] >= 0:
                    cached[row] += run.cached[i]
                    prompt[row] += run.prompt[i]
                if run.itl_count[i]:
                    itl_sum[row] += run.itl_sum[i]
                    itl_count[row] += run.itl_count[i]
                    self.gaps_total += run.itl_count[i]
            for v, i, w in zip(run.gap_value, run.gap_record, run.gap_weight):
                if rows[i] >= 0:
                    gaps.append(v)
                    gap_rows.append(rows[i])
                    gap_weights.append(w)
        self.gaps_kept = len(gaps)
        self.weighted = {lat: Weighted(v, o, n, block, ps=QUANTILES) for lat, (v, o) in values.items()}
        # ITL: quantiles over the kept gaps, each weighing as the gaps it stands for; the mean
        # over every gap (each row's sum and count): the point and the resamples alike.
        thinned = gap_weights.count(1.0) < len(gap_weights)
        self.weighted["itl"] = Weighted(gaps, gap_rows, n, block, gap_weights if thinned else None, QUANTILES)
        self.itl_sum, self.itl_count = Total(itl_sum, block), Total(itl_count, block)
        self.rows_with = {lat: w.rows_with for lat, w in self.weighted.items()}
        self.shares = {"failure_rate": Share(failed, requests, block), "cached_share": Share(cached, prompt, block)}
        if slo:
            self.shares["goodput"] = Share(good, requests, block)

    def figures(self, d: Draw) -> dict[str, float | None]:
        """Every tested figure of this side for one resample (the sample itself: `sample`)."""
        out: dict[str, float | None] = {}
        for lat, w in self.weighted.items():
            for p, q in zip(QUANTILES, w.quantiles(d, QUANTILES)):
                out[f"{lat}_p{p}"] = q
            out[f"{lat}_mean"] = w.mean(d)
        count = self.itl_count.of(d)
        out["itl_mean"] = self.itl_sum.of(d) / count if count else None
        for name, share in self.shares.items():
            out[name] = share.value(d)
        return out


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


def _missing(base: float | None, new: float | None) -> str | None:
    """Which side has no value of a figure (no answered ok request has it), else None."""
    sides = [name for name, value in (("BASE", base), ("NEW", new)) if value is None]
    return f"no value on {' and '.join(sides)}: no ok answer has it" if sides else None


def _point_problem(change: float | None, ci: tuple[float, float] | None) -> str | None:
    """Why an interval cannot judge its own point: the point change lies outside it (a
    bootstrap distribution of few distinct values, or one skewed by ties), else None."""
    if change is None or ci is None or ci[0] <= change <= ci[1]:
        return None
    return "the change lies outside its own interval: the resampling cannot judge this figure"


def verdict(metric: Metric, ci: tuple[float, float] | None, problem: str | None) -> str:
    """`worse`/`better` only when the whole interval lies on one side of no change (and no
    `problem`: too few rows, or a point outside its interval)."""
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


def timed_rows(runs: list[RunRows], matched: Matched) -> dict[str, bytearray]:
    """Per server part, the compared rows every run's ok record has it for (1) or not (0). A part
    is compared on those rows only: a run whose server timed half its rows (a fleet with one
    server without metrics) against one that timed all would compare two sets of requests."""
    n = len(matched.ids)
    timed = {part: bytearray(b"\1" * n) for part in SERVER_PARTS}
    for run in runs:
        for i, rid in enumerate(run.ids):
            row = matched.row_of[rid - matched.low]
            if row < 0 or run.state[i] != OK:
                continue
            for part, mask in timed.items():
                if run.server[part][i] != run.server[part][i]:  # nan: this run's record lacks it
                    mask[row] = 0
    return timed


def run_entry(run: RunRows, side: str, matched: Matched) -> dict:
    """What compare says about one run: its records, what it left unanswered, whether it is whole."""
    return {"path": run.path, "side": side, "records": len(run), "answered": len(run) - run.state.count(UNANSWERED),
            "unanswered": dict(run.unanswered.most_common()), "incomplete": run.incomplete()}  # fmt: skip


def compare(base: list[RunRows], new: list[RunRows], *, slo: dict[str, float] | None = None, resamples: int = 1000,
            seed: int = 0, block: int | None = None) -> dict:
    """The comparison document (docs/compare.md): the runs, the method, one entry per metric,
    the minimal detectable effects. Rows are those every run answered (matched by request id)."""
    matched = match([*base, *new])
    n = len(matched.ids)
    if not n:
        if not matched.common_ids:
            raise CompareError("the runs have no request id in common: not replays of the same trace rows")
        raise CompareError(f"no row that every run answered{' before the stop' if matched.stop is not None else ''}: "
                           "nothing to compare (every run's records: " + "; ".join(
                               f"{r.path}: {', '.join(r.incomplete()) or 'whole'}" for r in (*base, *new)) + ")")
    if block is not None and block > n:
        raise CompareError(f"--block-rows {block}: more than the {n} rows compared (1 to {n})")
    block = block or block_rows(n)
    # the servers' own parts are compared where any run has them: both sides then have the columns
    server = any(run.server_timed for run in (*base, *new))
    timed = timed_rows([*base, *new], matched) if server else None
    sides = Side(base, matched, slo, block, server, timed), Side(new, matched, slo, block, server, timed)
    metrics = metric_table(bool(slo), server)
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
    whole = sample(n)
    points = sides[0].figures(whole), sides[1].figures(whole)
    run_level = [[r.figures for r in side] for side in (base, new)]
    entries = []
    for m in metrics:
        if m.tested:
            bv, nv = points[0][m.name], points[1][m.name]
        else:
            bv, nv = (_mean([f[m.name] for f in figs]) for figs in run_level)
        change = None if bv is None or nv is None else nv - bv
        lat = m.name.split("_")[0]
        rows = min(s.rows_with[lat] for s in sides) if m.quantile is not None else n
        ci = interval(diffs[m.name], CONFIDENCE) if m.tested else None
        ci_rel = interval(rels[m.name], CONFIDENCE) if m.tested else None
        problem = (_missing(bv, nv) or _tail_problem(m, rows) or _point_problem(change, ci)) if m.tested else None
        entries.append({
            "metric": m.name, "label": m.label, "unit": m.unit, "lower_is_better": m.lower_is_better,
            "base": bv, "new": nv,
            "change": change,
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
    itl = {side: {"gaps": s.gaps_total, "kept": s.gaps_kept} for side, s in zip(("base", "new"), sides)}
    return {
        "base": [r.path for r in base], "new": [r.path for r in new],
        "runs": [run_entry(r, "BASE", matched) for r in base] + [run_entry(r, "NEW", matched) for r in new],
        "rows_matched": n,
        "rows_unmatched": matched.all_ids - n,
        "stop": None if matched.stop is None else {"request_id": matched.stop, "rows_from_it": matched.rows_after_stop},
        "slo": slo,
        "bootstrap": {"method": "paired circular block bootstrap over rows matched by request id",
                      "resamples": resamples, "seed": seed, "block_rows": block, "confidence": CONFIDENCE,
                      "min_tail_rows": MIN_TAIL_ROWS, "itl_gaps": itl},
        "metrics": entries,
        "mde": mde,
    }  # fmt: skip

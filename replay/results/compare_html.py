"""`replay compare --html`: BASE and NEW side by side in one self-contained file: the CDFs of
TTFT and E2E, each row's change over trace time, the verdict table. Drawn as the run report
is (replay.results.html: matplotlib from the `report` extra, inline SVG, no JavaScript)."""

from __future__ import annotations

import html
import time
from pathlib import Path

from replay.results.compare import Matched, match
from replay.results.compare_runs import RunRows
from replay.results.files import write_atomically
from replay.results.html import _cdf, _matplotlib, figure_svg

CDF_POINTS = 20_000  # values a side's CDF is drawn from (its evenly spaced order statistics)
ROW_POINTS = 5_000  # about the rows the change-over-time plot draws (every k-th request id)
PLOTS = (
    ("compare-cdf", "TTFT and end-to-end latency of the rows compared, cumulative distribution: BASE and NEW"),
    ("compare-rows", "Each row's change (NEW - BASE, mean over a side's runs) over trace time"),
)


def _thinned(values: list[float], most: int) -> list[float]:
    """At most `most` evenly spaced order statistics of `values`: the same curve, a drawable page."""
    v = sorted(values)
    if len(v) <= most:
        return v
    return [v[int((i + 0.5) * len(v) / most)] for i in range(most)]


def _ok_values(runs: list[RunRows], key: str, matched: Matched) -> list[float]:
    """The ok values of the rows compared (the table's rows: not those only some run answered)."""
    row_of, low = matched.row_of, matched.low
    return _thinned([v for run in runs for rid, v in zip(run.ids, getattr(run, key))
                     if v == v and row_of[rid - low] >= 0], CDF_POINTS)  # fmt: skip


def _row_means(runs: list[RunRows], key: str, stride: int, matched: Matched) -> dict[int, tuple[float, float]]:
    """request id -> (its mean over the runs that answered it, its scheduled offset in s), of
    every `stride`-th request id compared (a drawable page)."""
    sums: dict[int, list[float]] = {}
    row_of, low = matched.row_of, matched.low
    for run in runs:
        t0 = min((t for t in run.scheduled if t == t), default=0.0)
        for rid, value, at in zip(run.ids, getattr(run, key), run.scheduled):
            if value == value and at == at and rid % stride == 0 and row_of[rid - low] >= 0:
                s = sums.setdefault(rid, [0.0, 0.0, 0])
                s[0] += value
                s[1] += at - t0
                s[2] += 1
    return {rid: (s[0] / s[2], s[1] / s[2]) for rid, s in sums.items()}


def render_figures(base: list[RunRows], new: list[RunRows]) -> dict:
    Figure = _matplotlib()
    matched = match([*base, *new])
    figures = {}
    fig = Figure(figsize=(9, 3.4), layout="constrained")
    axes = fig.subplots(1, 2)
    for ax, key, title in ((axes[0], "ttft", "TTFT"), (axes[1], "e2e", "End-to-end")):
        _cdf(ax, _ok_values(base, key, matched), "BASE")
        _cdf(ax, _ok_values(new, key, matched), "NEW")
        ax.set(xlabel=f"{title} (ms)", title=title)
        ax.legend(loc="lower right")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("share of requests")
    figures["compare-cdf"] = fig

    scale = float(((base[0].meta or {}).get("scale")) or 1.0)
    fig = Figure(figsize=(9, 3.6), layout="constrained")
    ax = fig.subplots()
    for key, label in (("ttft", "TTFT"), ("e2e", "E2E")):
        stride = max(1, max(len(r) for r in (*base, *new)) // ROW_POINTS)
        b, n = _row_means(base, key, stride, matched), _row_means(new, key, stride, matched)
        ids = sorted(b.keys() & n.keys())
        ax.scatter([b[i][1] * scale for i in ids], [n[i][0] - b[i][0] for i in ids], s=7, alpha=0.6, label=label)
    ax.axhline(0.0, color="grey", lw=1)
    ax.set(xlabel=f"trace time (s){'' if scale == 1 else f', run time x {scale:g}'}", ylabel="NEW - BASE (ms)")
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    figures["compare-rows"] = fig
    return figures


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>tracereplay comparison</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 62em; color: #222; }}
pre {{ background: #f6f6f6; padding: 1em; overflow-x: auto; font-size: 0.85em; }}
table {{ border-collapse: collapse; font-size: 0.9em; }} td, th {{ padding: 0.2em 0.7em; text-align: right; }}
td:first-child, th:first-child, td:last-child {{ text-align: left; }} tr:nth-child(even) {{ background: #f6f6f6; }}
.worse {{ color: #b00; font-weight: 600; }} .better {{ color: #070; font-weight: 600; }}
figure {{ margin: 1.5em 0; }} figcaption {{ font-weight: 600; margin-bottom: 0.4em; }}
svg {{ max-width: 100%; height: auto; }}
</style></head><body>
<h1>tracereplay comparison</h1>
<p>{subtitle}</p>
<table id="verdicts"><tr>{header}</tr>
{rows}
</table>
{figures}
<pre id="summary">{summary}</pre>
</body></html>
"""


def render_html(result: dict, figures: dict, table: list[tuple[str, ...]], summary: str) -> str:
    """The page: `table` and `summary` are the comparison's rows and text as the command prints them."""
    header = "".join(f"<th>{html.escape(h)}</th>" for h in ("metric", "BASE", "NEW", "change", "95% interval", "verdict"))
    rows = []
    for cells in table:
        kind = cells[-1] if cells[-1] in ("worse", "better") else ""
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells[:-1])
                    + f'<td class="{kind}">{html.escape(cells[-1])}</td></tr>')  # fmt: skip
    parts = [f'<figure id="plot-{name}" class="plot"><figcaption>{html.escape(caption)}</figcaption>\n'
             f"{figure_svg(figures[name])}</figure>" for name, caption in PLOTS]  # fmt: skip
    subtitle = (f"BASE {html.escape(', '.join(result['base']))} | NEW {html.escape(', '.join(result['new']))} | "
                f"{result['rows_matched']} rows | " + time.strftime("generated %Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    return PAGE.format(subtitle=subtitle, header=header, rows="\n".join(rows), figures="\n".join(parts),
                       summary=html.escape(summary))  # fmt: skip


def write_compare_html(path: str | Path, result: dict, base: list[RunRows], new: list[RunRows],
                       table: list[tuple[str, ...]], summary: str) -> Path:
    return write_atomically(path, render_html(result, render_figures(base, new), table, summary).encode("utf-8"))

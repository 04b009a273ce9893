"""The HTML report: one self-contained file, the summary block and plots as inline SVG.

matplotlib (the `report` extra) draws the plots: it is the long-kept standard, renders SVG
with no browser-side JavaScript or network fetches, and the same figures save as PNG for a
README. It is imported only here, so the text and JSON report work without it.
"""

from __future__ import annotations

import html
import io
import time
from pathlib import Path

from replay.errors import OutputError
from replay.results.files import write_atomically
from replay.results.gpu_metrics import DCGM, gpus
from replay.results.report import format_report
from replay.results.server_metrics import COUNTERS, GAUGES, pick
from replay.results.server_time import E2E_PARTS, PART_LABELS, split
from replay.rules.capacity_result import quotable_line

EXTRA_HINT = "pip install 'tracereplay[report]'"
PLOTS = (
    ("latency-cdf", "TTFT and end-to-end latency, cumulative distribution"),
    ("latency-time", "Latency over trace time (by scheduled send)"),
    ("throughput-time", "Throughput over time (by completion)"),
    ("inflight-time", "Requests in flight over time"),
    ("drift-hist", "Dispatch drift (sent - scheduled)"),
    ("cache-scatter", "Cached tokens per request: observed vs expected"),
)


SERVER_TIME_PLOT = ("server-time", "Where the time went: mean end-to-end latency split into the server's queue, "
                                   "prefill and decode and the rest (by scheduled send)")
CAPACITY_PLOT = ("capacity", "Capacity search: goodput and latency against load factor")
TURN_WAITS_PLOT = ("turn-waits", "Session turns sent after their trace time: wait for the previous answer (waited_ms)")


class PlottingMissing(RuntimeError):
    """The plotting extra is not installed."""


def _matplotlib():
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError:
        raise PlottingMissing(
            f"--html needs matplotlib, which is not installed: {EXTRA_HINT} "
            "(the text summary and --json work without it)"
        ) from None
    matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text: smaller, searchable
    matplotlib.rcParams["svg.hashsalt"] = "tracereplay"  # stable ids from run to run
    return Figure


def _cdf(ax, values: list[float], label: str) -> None:
    v = sorted(values)
    if v:
        ax.step(v, [(i + 1) / len(v) for i in range(len(v))], where="post", label=label)


def _times(records: list[dict]) -> tuple[float, list[dict]]:
    """The run's time origin (first scheduled send) and the records that were sent."""
    sent = [r for r in records if r.get("sent_at") is not None]
    t0 = min((r.get("scheduled_at") or r["sent_at"] for r in sent), default=0.0)
    return t0, sent


def _bin_width(span: float) -> float:
    return max(1.0, span / 120.0)


def cumulative_ratio(events: list[tuple[float, float, float]]) -> tuple[list[float], list[float]]:
    """(x, hit ratio so far) from (x, hit tokens, looked-up tokens) events, in x order."""
    xs, ys, hit, total = [], [], 0.0, 0.0
    for x, h, n in sorted(events):
        hit, total = hit + h, total + n
        if total:
            xs.append(x)
            ys.append(hit / total)
    return xs, ys


def server_figures(Figure, samples: list[dict], records: list[dict], checks, t0: float, scale: float) -> dict:
    """Per endpoint with metrics: running and waiting requests with KV-cache usage, and the
    prefix-cache hit ratio three ways (the server's counters since the first sample, the
    records' cached_tokens, the ideal of an infinite cache when the cache check ran), all
    cumulative and over trace time, like the latency plot."""
    figures = {}
    expected = {c.request_id: c.expected for c in checks or ()}
    endpoints = sorted({s["endpoint"] for s in samples if s.get("ok") and not s.get("exporter")})
    for n, url in enumerate(endpoints):
        mine = [s for s in samples if s["endpoint"] == url and s.get("ok")]
        x = [(s["t"] - t0) * scale for s in mine]
        fig = Figure(figsize=(9, 5.2), layout="constrained")
        a, b = fig.subplots(2, 1, sharex=True)
        for roles, label in ((GAUGES["running"], "running"), (GAUGES["waiting"], "waiting")):
            a.step(x, [pick(s["metrics"], roles) for s in mine], where="post", label=label)
        a.set(ylabel="requests", title=url)
        usage = [pick(s["metrics"], GAUGES["kv_cache_usage"]) for s in mine]
        handles = a.get_lines()
        if any(u is not None for u in usage):
            a2 = a.twinx()
            a2.plot(x, [None if u is None else 100 * u for u in usage], color="tab:green", label="KV-cache usage %")
            a2.set_ylabel("KV-cache usage %")
            handles = [*handles, *a2.get_lines()]
        a.legend(handles=handles, loc="upper left")
        hits = [pick(s["metrics"], COUNTERS["prefix_cache_hits"]) for s in mine]
        queries = [pick(s["metrics"], COUNTERS["prefix_cache_queries"]) for s in mine]
        if hits and hits[0] is not None and queries[0] is not None:
            pts = [(xi, (h - hits[0]) / (q - queries[0])) for xi, h, q in zip(x, hits, queries)
                   if h is not None and q is not None and q > queries[0]]  # fmt: skip
            b.plot([p[0] for p in pts], [p[1] for p in pts], label="server (prefix-cache counters)")
        answered = [r for r in records if r.get("endpoint") == url and r.get("ok") and r.get("prompt_tokens")
                    and r.get("cached_tokens") is not None and r.get("finished_at")]  # fmt: skip
        at = [((r["finished_at"] - t0) * scale, r) for r in answered]
        b.plot(*cumulative_ratio([(xi, r["cached_tokens"], r["prompt_tokens"]) for xi, r in at]),
               label="clients (cached_tokens)")  # fmt: skip
        if expected:
            b.plot(*cumulative_ratio([(xi, expected.get(r["request_id"], 0), r["prompt_tokens"]) for xi, r in at]),
                   linestyle="--", label="ideal (infinite cache)")  # fmt: skip
        b.set(xlabel=f"trace time (s){'' if scale == 1 else f', run time x {scale:g}'}", ylabel="prefix hit ratio",
              ylim=(0, 1))  # fmt: skip
        b.legend(loc="lower right")
        for ax in (a, b):
            ax.grid(alpha=0.3)
        fig.set_label(f"Server {url}: requests, KV-cache usage, prefix-cache hit ratio")  # the caption
        figures[f"server-{n}"] = fig
    return figures


def gpu_figures(Figure, samples: list[dict], t0: float, scale: float) -> dict:
    """Per GPU of the --metrics-endpoint exporters (replay.results.gpu_metrics): utilisation,
    memory used, power, SM clock and temperature over trace time, one panel each."""
    series: dict[tuple[str, str], list[tuple[float, dict]]] = {}
    for s in samples:
        if s.get("exporter") and s.get("ok"):
            for name, gpu in gpus(s.get("metrics") or {}).items():
                series.setdefault((s["endpoint"], name), []).append(((s["t"] - t0) * scale, gpu))
    figures = {}
    panels = [(field, f"{label} ({unit})") for field, label, unit in DCGM.values() if field != "fb_free_mib"]
    for n, ((url, name), points) in enumerate(sorted(series.items())):
        fig = Figure(figsize=(9, 7), layout="constrained")
        axes = fig.subplots(len(panels), 1, sharex=True)
        for ax, (field, ylabel) in zip(axes, panels):
            ax.plot([x for x, _ in points], [g.get(field) for _, g in points])
            ax.set_ylabel(ylabel, fontsize=8)
            ax.grid(alpha=0.3)
        model = points[-1][1].get("model")
        axes[0].set_title(f"{name}" + (f" ({model})" if model else ""))
        axes[-1].set_xlabel(f"trace time (s){'' if scale == 1 else f', run time x {scale:g}'}")
        fig.set_label(f"GPU {name} ({url}): utilisation, memory, power, SM clock, temperature")
        figures[f"gpu-{n}"] = fig
    return figures


def capacity_figure(Figure, capacity: dict):
    """A capacity search's probes (OUTPUT.capacity.json): goodput, and TTFT and E2E p99,
    against the load factor, with the target and the bracket [largest pass, smallest fail]
    marked; a probe that says nothing of the server's capacity (client-limited, invalid, outage,
    server errors, stopped) is drawn hollow."""
    fig = Figure(figsize=(9, 3.4), layout="constrained")
    a, b = fig.subplots(1, 2)
    judged = [p for p in capacity["probes"] if p["verdict"] in ("pass", "fail", "fail early")]
    other = [p for p in capacity["probes"] if p not in judged]
    for verdict, color in (("pass", "tab:green"), ("fail", "tab:red")):
        mine = [p for p in judged if p["verdict"].startswith(verdict)]
        a.scatter([p["factor"] for p in mine], [p["goodput"] for p in mine], color=color, label=verdict, zorder=3)
    if other:
        a.scatter([p["factor"] for p in other], [p["goodput"] for p in other], facecolors="none", edgecolors="grey",
                  label="not counted", zorder=3)  # fmt: skip
    a.axhline(capacity["goodput_target"], color="grey", lw=1, ls="--", label="target")
    a.set(xlabel="load factor (x this trace's load)", ylabel="goodput", title="Goodput", ylim=(-0.02, 1.02))
    ordered = sorted(judged, key=lambda p: p["factor"])
    for key, label in (("ttft_ms", "TTFT p99"), ("e2e_ms", "E2E p99")):
        points = [(p["factor"], p[key]["p99"]) for p in ordered if p[key]["p99"] is not None]
        if points:
            b.plot(*zip(*points), marker="o", label=label)
    # the servers' own queue, where they tell it (replay.results.server_time): the part a load past capacity grows
    queue = [(p["factor"], split["queue"]["p99"]) for p in ordered
             if (split := (p.get("server_timing") or {}).get("e2e_ms") or {}).get("requests")
             and split["queue"]["p99"]]  # fmt: skip  # a log axis: no 0
    if queue:
        b.plot(*zip(*queue), marker="s", ls=":", label="server queue p99")
    for key, limit in capacity["slo"].items():
        b.axhline(limit, color="grey", lw=1, ls="--", label=f"{key} <= {limit:g}")
    b.set(xlabel="load factor (x this trace's load)", ylabel="ms", title="Latency p99", yscale="log")
    from matplotlib.ticker import FuncFormatter, LogLocator

    best, worst = capacity["bracket"]
    factors = [p["factor"] for p in capacity["probes"]]
    times = FuncFormatter(lambda v, _: f"{v:.3g}x")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(times)
        if max(factors) / min(factors) <= 4:  # a narrow search: label between the powers of 2 too
            ax.xaxis.set_minor_locator(LogLocator(base=2, subs=(1.25, 1.5, 1.75)))
            ax.xaxis.set_minor_formatter(times)
        if best is not None and worst is not None:
            ax.axvspan(best, worst, color="tab:blue", alpha=0.15, label="bracket")
        elif best is not None or worst is not None:
            ax.axvline(best if best is not None else worst, color="tab:blue", lw=1.5, label="bracket")
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    b.yaxis.set_major_formatter(plain)
    b.yaxis.set_minor_formatter(plain)
    return fig


def server_time_figure(Figure, ok: list[dict], t0: float, scale: float):
    """The E2E split of the ok records with the server's own times (replay.results.server_time),
    averaged per bin of trace time and stacked: queue, prefill, decode, server other, rest.
    Means add up, so each bin's stack is the mean client E2E of its requests. None when no
    record has them."""
    points = [(((r.get("scheduled_at") or r["sent_at"]) - t0) * scale, parts) for r in ok
              if (parts := split(r, "e2e_ms")) is not None]
    if not points:
        return None
    width = _bin_width(max(x for x, _ in points))
    bins: dict[int, list[dict]] = {}
    for x, parts in points:
        bins.setdefault(int(x / width), []).append(parts)
    xs = [(i + 0.5) * width for i in sorted(bins)]
    names = [name for name in E2E_PARTS if name != "server_other" or any(abs(p["server_other"]) > 1e-6 for _, p in points)]
    stacks = [[sum(p[name] for p in bins[i]) / len(bins[i]) for i in sorted(bins)] for name in names]
    fig = Figure(figsize=(9, 3.4), layout="constrained")
    ax = fig.subplots()
    if len(xs) == 1:  # one bin: a bar, a stack of nothing wide is invisible
        bottom = 0.0
        for name, values in zip(names, stacks):
            ax.bar(xs, values, width=width * 0.8, bottom=bottom, label=PART_LABELS[name])
            bottom += values[0]
    else:
        ax.stackplot(xs, *stacks, labels=[PART_LABELS[name] for name in names], step="mid")
    ax.set(xlabel=f"trace time (s){'' if scale == 1 else f', run time x {scale:g}'}", ylabel="mean E2E (ms)")
    ax.legend(loc="upper left", fontsize="small")
    ax.grid(alpha=0.3)
    return fig


def render_figures(records: list[dict], report: dict, checks=None, meta: dict | None = None,
                   samples: list[dict] | None = None, capacity: dict | None = None) -> dict:
    """{plot id: matplotlib Figure}: a capacity search's first (`capacity`: its
    OUTPUT.capacity.json), then one per entry of PLOTS, then one per endpoint whose /metrics
    was scraped (`samples`: replay.results.server_metrics' lines)."""
    Figure = _matplotlib()
    scale = float((meta or {}).get("scale") or 1.0)
    ok = [r for r in records if r.get("ok")]
    t0, sent = _times(records)
    figures = {}
    if capacity is not None and capacity.get("probes"):
        figures[CAPACITY_PLOT[0]] = capacity_figure(Figure, capacity)

    fig = Figure(figsize=(9, 3.4), layout="constrained")
    a, b = fig.subplots(1, 2)
    _cdf(a, [r["ttft_ms"] for r in ok if r.get("ttft_ms") is not None], "TTFT")
    a.set(xlabel="TTFT (ms)", ylabel="share of requests", title="TTFT")
    _cdf(b, [r["e2e_ms"] for r in ok if r.get("e2e_ms") is not None], "E2E")
    b.set(xlabel="end-to-end latency (ms)", title="End-to-end")
    for ax in (a, b):
        ax.grid(alpha=0.3)
    figures["latency-cdf"] = fig

    fig = Figure(figsize=(9, 3.4), layout="constrained")
    ax = fig.subplots()
    x = [((r.get("scheduled_at") or r["sent_at"]) - t0) * scale for r in ok]
    ax.scatter(x, [r.get("e2e_ms") for r in ok], s=6, label="E2E", alpha=0.6)
    ax.scatter([xi for xi, r in zip(x, ok) if r.get("ttft_ms") is not None],
               [r["ttft_ms"] for r in ok if r.get("ttft_ms") is not None], s=6, label="TTFT", alpha=0.6)  # fmt: skip
    failed = [r for r in sent if not r.get("ok")]
    if failed:
        ax.scatter([((r.get("scheduled_at") or r["sent_at"]) - t0) * scale for r in failed],
                   [r.get("e2e_ms") or 0.0 for r in failed], s=14, marker="x", color="red", label="failed")  # fmt: skip
    ax.set(xlabel=f"trace time (s){'' if scale == 1 else f', run time x {scale:g}'}", ylabel="ms", yscale="log")
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    figures["latency-time"] = fig
    if (fig := server_time_figure(Figure, ok, t0, scale)) is not None:
        figures[SERVER_TIME_PLOT[0]] = fig

    fig = Figure(figsize=(9, 3.4), layout="constrained")
    ax = fig.subplots()
    done = [r for r in ok if r.get("finished_at") is not None]
    if done:
        span = max(r["finished_at"] for r in done) - t0
        width = _bin_width(span)
        bins = [0.0] * (int(span / width) + 1)
        reqs = [0.0] * len(bins)
        for r in done:
            i = int((r["finished_at"] - t0) / width)
            bins[i] += (r.get("output_tokens") or 0) / width
            reqs[i] += 1 / width
        xs = [i * width for i in range(len(bins))]
        ax.step(xs, bins, where="post", label="output tokens/s")
        ax2 = ax.twinx()
        ax2.step(xs, reqs, where="post", color="tab:orange", label="requests/s")
        ax2.set_ylabel("requests/s")
        ax.legend(handles=[*ax.get_lines(), *ax2.get_lines()], loc="upper left")
    ax.set(xlabel="run time (s)", ylabel="output tokens/s")
    ax.grid(alpha=0.3)
    figures["throughput-time"] = fig

    fig = Figure(figsize=(9, 3.0), layout="constrained")
    ax = fig.subplots()
    events = sorted([(r["sent_at"], 1) for r in sent] + [(r["finished_at"], -1) for r in sent if r.get("finished_at")])
    level, xs, ys = 0, [], []
    for t, step in events:
        level += step
        xs.append(t - t0)
        ys.append(level)
    ax.step(xs, ys, where="post")
    ax.set(xlabel="run time (s)", ylabel="requests in flight")
    ax.grid(alpha=0.3)
    figures["inflight-time"] = fig

    fig = Figure(figsize=(9, 3.0), layout="constrained")
    ax = fig.subplots()
    drifts = [r["drift_ms"] for r in sent if r.get("drift_ms") is not None]
    if drifts:
        ax.hist(drifts, bins=60)
    ax.set(xlabel="drift (ms)", ylabel="requests", yscale="log" if drifts else "linear")
    ax.grid(alpha=0.3)
    figures["drift-hist"] = fig

    waits = [r["waited_ms"] for r in sent if r.get("waited_ms")]  # a closed-loop --turn-timing's late turns
    if waits:
        fig = Figure(figsize=(9, 3.0), layout="constrained")
        ax = fig.subplots()
        ax.hist(waits, bins=60)
        ax.set(xlabel="waited (ms)", ylabel="session turns", yscale="log")
        ax.grid(alpha=0.3)
        figures[TURN_WAITS_PLOT[0]] = fig

    fig = Figure(figsize=(5.2, 5.0), layout="constrained")
    ax = fig.subplots()
    compared = [c for c in checks or () if c.observed is not None]
    if compared:
        top = max(max(c.expected, c.observed) for c in compared) or 1
        ax.plot([0, top], [0, top], color="grey", lw=1, label="observed = expected")
        good = [c for c in compared if c.matches]
        bad = [c for c in compared if not c.matches]
        ax.scatter([c.expected for c in good], [c.observed for c in good], s=10, label=f"match ({len(good)})")
        if bad:
            ax.scatter([c.expected for c in bad], [c.observed for c in bad], s=14, color="red", marker="x",
                       label=f"mismatch ({len(bad)})")  # fmt: skip
        ax.legend(loc="upper left")
    else:
        ax.text(0.5, 0.5, "no cache check:\npass --trace and --server-block-size", ha="center", va="center",
                transform=ax.transAxes)  # fmt: skip
    ax.set(xlabel="expected cached tokens", ylabel="observed cached tokens")
    ax.grid(alpha=0.3)
    figures["cache-scatter"] = fig
    figures.update(server_figures(Figure, samples or [], records, checks, t0, scale))
    figures.update(gpu_figures(Figure, samples or [], t0, scale))
    return figures


def figure_svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    text = buf.getvalue()
    return text[text.index("<svg") :]  # drop the XML prolog and doctype: inline SVG needs neither


def save_pngs(figures: dict, directory: str | Path, dpi: int = 110) -> list[Path]:
    out = Path(directory)
    try:  # the folder itself when missing, as --png-dir documents, never its parents
        out.mkdir(exist_ok=True)
    except OSError as e:
        raise OutputError(out, e) from None
    paths = []
    for name, fig in figures.items():
        path = out / f"{name}.png"
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=dpi)
        write_atomically(path, buffer.getvalue())
        paths.append(path)
    return paths


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 62em; color: #222; }}
pre {{ background: #f6f6f6; padding: 1em; overflow-x: auto; font-size: 0.85em; }}
figure {{ margin: 1.5em 0; }} figcaption {{ font-weight: 600; margin-bottom: 0.4em; }}
svg {{ max-width: 100%; height: auto; }}
</style></head><body>
<h1>{title}</h1>
<p>{subtitle}</p>
{capacity}<pre id="summary">{summary}</pre>
{figures}
</body></html>
"""


def render_html(records: list[dict], report: dict, checks=None, meta: dict | None = None, figures=None,
                capacity: dict | None = None) -> str:
    figures = figures or render_figures(records, report, checks, meta, capacity=capacity)
    parts = []
    for name, fig in figures.items():
        caption = dict((*PLOTS, CAPACITY_PLOT, TURN_WAITS_PLOT, SERVER_TIME_PLOT)).get(name) or fig.get_label()
        parts.append(f'<figure id="plot-{name}" class="plot"><figcaption>{html.escape(caption)}</figcaption>\n'
                     f"{figure_svg(fig)}</figure>")  # fmt: skip
    meta = meta or {}
    trace = (meta.get("trace") or {}).get("path")
    subtitle = " | ".join(
        s for s in (
            f"trace {html.escape(str(trace))}" if trace else None,
            f"api {html.escape(str(meta['api']))}" if meta.get("api") else None,
            f"scale {meta['scale']:g}" if meta.get("scale") else None,
            f"{report['requests']} requests",
            time.strftime("generated %Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        ) if s
    )  # fmt: skip
    line = f'<p id="capacity"><b>{html.escape(quotable_line(capacity))}</b></p>\n' if capacity else ""
    return PAGE.format(title="tracereplay report", subtitle=subtitle, summary=html.escape(format_report(report)),
                       figures="\n".join(parts), capacity=line)  # fmt: skip


def write_html(path: str | Path, report: dict, records: list[dict], checks=None, meta: dict | None = None,
               png_dir: str | Path | None = None, samples: list[dict] | None = None,
               capacity: dict | None = None) -> Path:  # fmt: skip
    """`capacity`: a capacity search's OUTPUT.capacity.json, whose plot and line come first."""
    figures = render_figures(records, report, checks, meta, samples, capacity)
    out = write_atomically(path, render_html(records, report, checks, meta, figures, capacity).encode("utf-8"))
    if png_dir is not None:
        save_pngs(figures, png_dir)
    return out

"""`replay compare BASE NEW`: is NEW better than BASE, beyond the noise? (docs/compare.md)

Exit codes: 0 compared (every --fail-on gate held), 1 a gate failed (or an output file could
not be written), 2 the runs cannot be compared or the options are wrong (the message says why).
"""

from __future__ import annotations

import sys

from replay.bounds import MAX_INT, SEED, Bound
from replay.output_claim import OUTPUT
from replay.results.compare import NOT_TESTED, SAME, CompareError, compare, differences, load_run, slo_of
from replay.results.gates import evaluate, parse_gate
from replay.results.metadata import RUN, read_run_metadata
from replay.results.outputs import write_outputs
from replay.results.recorded_pair import recorded_pairs
from replay.results.report import ReportError, parse_slo

# Fewer draws than this put a 95% interval's ends on a handful of them; more only take longer.
RESAMPLES = Bound(100, 1_000_000, integer=True)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "compare",
        help="compare two runs of one trace row by row: changes, 95%% intervals, verdicts, CI gates",
        description="Compare runs of the same trace (BASE against NEW) request by request: each figure's change, "
        "its 95%% interval from a paired bootstrap over the rows, and a verdict. Several runs a side: "
        "--base A1 --base A2 --new B1.",
    )
    p.add_argument("runs", nargs="*", type=RUN, metavar="RUN", help="BASE NEW: two runs' merged JSONL (their --output)")
    p.add_argument("--base", action="append", type=RUN, default=[], help="a BASE run (repeatable)")
    p.add_argument("--new", action="append", type=RUN, default=[], help="a NEW run (repeatable)")
    p.add_argument("--allow-different", action="store_true",
                   help="compare runs whose trace, window, seed, api, prompt format, scale or stream differ")
    p.add_argument("--allow-incomplete", action="store_true",
                   help="compare runs that are not whole (stopped, workers lost, files not written) on the rows "
                   "every run answered")
    p.add_argument("--slo", default=None, help="ttft_ms=..,tpot_ms=..,e2e_ms=.. for goodput (default: the runs')")
    p.add_argument("--fail-on", action="append", default=[], metavar="EXPR",
                   help="exit 1 when the change's whole interval lies beyond a bound, e.g. ttft_p99>+5%%, "
                   "e2e_p50>+20ms, goodput<-1pt (repeatable)")
    p.add_argument("--resamples", type=RESAMPLES, default=1000, help="bootstrap resamples (default 1000)")
    p.add_argument("--seed", type=SEED, default=0, help="the bootstrap's seed (default 0)")
    p.add_argument("--block-rows", type=Bound(1, MAX_INT, integer=True, unit="rows"), default=None,
                   help="rows per resampled block (default: the cube root of the rows; 1: the plain paired bootstrap)")
    p.add_argument("--json", dest="json_out", type=OUTPUT, default=None, help="write the comparison as JSON here")
    p.add_argument("--html", dest="html_out", type=OUTPUT, default=None, help="write a self-contained HTML comparison here")
    p.set_defaults(func=run)


def _sides(args) -> tuple[list[str], list[str]]:
    if args.runs and (args.base or args.new):
        raise CompareError("give the runs either as BASE NEW or as --base/--new, not both")
    if args.runs:
        if len(args.runs) != 2:
            raise CompareError(f"expected two runs, BASE NEW; got {len(args.runs)}")
        return [args.runs[0]], [args.runs[1]]
    if not args.base or not args.new:
        raise CompareError("expected BASE NEW, or at least one --base and one --new")
    return args.base, args.new


def _meta(path: str) -> dict | None:
    try:
        return read_run_metadata(path)
    except (ValueError, OSError) as e:
        raise CompareError(str(e)) from None


def run(args) -> int:
    try:
        gates = [parse_gate(text) for text in args.fail_on]
        base_paths, new_paths = _sides(args)
        slo = slo_of([_meta(p) for p in (*base_paths, *new_paths)], parse_slo(args.slo) if args.slo else None)
        base, new = [load_run(p, slo) for p in base_paths], [load_run(p, slo) for p in new_paths]
        recorded = recorded_pairs([*base, *new])
        different = differences([*base, *new], {k: source for k, (source, _) in recorded.items()})
        if different and not args.allow_different:
            raise CompareError("the runs are not comparable: " + "; ".join(different)
                               + " (--allow-different compares them anyway)")
        incomplete = [f"{side} {r.path}: {'; '.join(r.incomplete())}" for side, runs in (("BASE", base), ("NEW", new))
                      for r in runs if r.incomplete()]  # fmt: skip
        if incomplete and not args.allow_incomplete:
            raise CompareError("a run is not whole: " + " | ".join(incomplete)
                               + " (--allow-incomplete compares the rows every run answered)")
        result = compare(base, new, slo=slo, resamples=args.resamples, seed=args.seed, block=args.block_rows)
        result["differences"] = different
        result["recorded_from"] = [line for _, line in recorded.values()]
        result["gates"] = [evaluate(g, result) for g in gates]
    except (CompareError, ReportError) as e:
        print(f"replay compare: {e}", file=sys.stderr)
        return 2
    code = 1 if any(not g["held"] for g in result["gates"]) else 0
    result["exit_code"] = code
    print(format_compare(result))

    def draw(path: str) -> None:
        from replay.results.compare_html import write_compare_html

        write_compare_html(path, result, base, new, list(table_rows(result)), format_compare(result))

    return write_outputs("replay compare", result, args.json_out, args.html_out, draw, "HTML comparison") or code


def _value(entry: dict, value: float | None) -> str:
    if value is None:
        return "n/a"
    if entry["unit"] == "ms":
        return f"{value:.2f} ms"
    if entry["unit"] == "share":
        return f"{100 * value:.2f}%"
    return f"{value:.2f}"


def _change(entry: dict) -> str:
    if entry["change"] is None:
        return "n/a"
    if entry["unit"] == "share":
        return f"{100 * entry['change']:+.2f} pt"
    rel = entry["relative_change"]
    return f"{rel * 100:+.1f}%" if rel is not None else f"{entry['change']:+.2f}"


def _interval(entry: dict) -> str:
    if entry["unit"] == "share" and entry["ci"]:
        lo, hi = entry["ci"]
        return f"[{100 * lo:+.2f}, {100 * hi:+.2f}] pt"
    if entry["relative_ci"]:
        lo, hi = entry["relative_ci"]
        return f"[{100 * lo:+.1f}%, {100 * hi:+.1f}%]"
    return "-"


def table_rows(result: dict) -> list[tuple[str, str, str, str, str, str]]:
    """(metric, BASE, NEW, change, 95% interval, verdict) per metric, as the terminal shows them."""
    rows = []
    for e in result["metrics"]:
        verdict = e["verdict"] + (" *" if e["verdict"] == SAME and e["note"] else "")
        rows.append((e["metric"], _value(e, e["base"]), _value(e, e["new"]), _change(e), _interval(e), verdict))
    return rows


def rows_line(result: dict) -> str:
    """How many rows the verdicts stand on, and which were left out and why."""
    line = f"{result['rows_matched']} rows matched by request id, answered in every run"
    left = []
    if result["stop"]:
        left.append(f"{result['stop']['rows_from_it']} from request id {result['stop']['request_id']} on, "
                    "where a run was stopped")
    unanswered = sum(sum(r["unanswered"].values()) for r in result["runs"])
    if unanswered:
        left.append(f"{unanswered} records unanswered (" + "; ".join(
            f"{r['side']} {r['path']}: " + ", ".join(f"{n} {label!r}" for label, n in r["unanswered"].items())
            for r in result["runs"] if r["unanswered"]) + ")")  # fmt: skip
    if result["rows_unmatched"]:
        return f"{line} ({result['rows_unmatched']} rows left out: {'; '.join(left) or 'in only some runs'})"
    return line


def format_compare(result: dict) -> str:
    b = result["bootstrap"]
    out = [f"BASE: {', '.join(result['base'])}", f"NEW:  {', '.join(result['new'])}"]
    for run in result["runs"]:
        if run["incomplete"]:
            out.append(f"INCOMPLETE (--allow-incomplete): {run['side']} {run['path']}: {'; '.join(run['incomplete'])}")
    out.append(rows_line(result))
    for line in result.get("recorded_from") or ():
        out.append(f"paired through the recording: {line}")
    for d in result.get("differences") or ():
        out.append(f"differs (--allow-different): {d}")
    header = ("metric", "BASE", "NEW", "change", "95% interval", "verdict")
    rows = [header, *table_rows(result)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        out.append("  ".join(cell.ljust(w) if i in (0, 5) else cell.rjust(w) for i, (cell, w) in
                             enumerate(zip(r, widths))).rstrip())  # fmt: skip
    notes = sorted({e["note"] for e in result["metrics"] if e["note"] and e["verdict"] == SAME})
    for note in notes:
        out.append(f"* {note}")
    if any(e["verdict"] == NOT_TESTED for e in result["metrics"]):
        out.append("not tested: one figure per run, no rows to resample (shown for reading, not judged)")
    out.append(f"{b['method']}: {b['resamples']} resamples, seed {b['seed']}, blocks of {b['block_rows']} rows")
    gaps = b["itl_gaps"]
    if any(g["kept"] < g["gaps"] for g in gaps.values()):
        out.append("ITL quantiles over " + ", ".join(f"{g['kept']:,} of {g['gaps']:,} gaps ({side.upper()})"
                                                     for side, g in gaps.items())
                   + ": each request's evenly spaced quantiles, weighing as its gaps; ITL mean over every gap")
    mde = []
    for name, m in result["mde"].items():
        if m["ms"] is None:
            mde.append(f"{name} n/a ({m['note']})")
        else:
            rel = f", {100 * m['relative']:.1f}%" if m["relative"] is not None else ""
            mde.append(f"{name} {m['ms']:.2f} ms{rel}")
    out.append("minimal detectable effect (80% power, 5% two-sided): " + "; ".join(mde))
    for g in result.get("gates") or ():
        out.append(f"gate {g['gate']}: {'held' if g['held'] else 'FAILED'}: {g['why']}")
    return "\n".join(out)

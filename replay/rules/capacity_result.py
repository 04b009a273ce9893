"""A capacity search's results as every stage names them (docs/capacity.md): the search
(replay.engine.capacity) decides one, the run's end prints its quotable line and sets the exit
code from it, and `replay report --html` shows the line again. Pure: a report in, text out.
"""

from __future__ import annotations

CLIENT_DRIFT_P99_MS = 10.0  # a probe whose sends were later than this at p99 measured the client, not the server
CLIENT_CPU_PERCENT = 90.0  # nor one during which a worker reported this much CPU use (Locust's own warning's)

CLIENT_LIMITED = "client-limited"
# Verdicts and results both: the failures that failed a probe were mostly not the load's (Probe.failed_by)
OUTAGE = "outage"  # requests the servers never answered: refused or reset connections, no answer in time
SERVER_ERRORS = "server errors"  # error answers (HTTP errors but 429, broken or unreadable replies)
FOUND, BELOW_LO, AT_LEAST_HI = "found", "below LO", "at least HI"
WORKERS_LOST = "workers lost"  # a probe and its repeat were both invalid: the search ended there
STOPPED = "stopped"  # the user (or a fault) stopped the run before the search had its answer; also the probe's verdict
WORKER_SIGNALLED = "worker stopped"  # a worker got a stop signal of its own (not the user's stop): the search ended there
REFUSED_BEFORE_SEND = "refused"  # the run was refused before its first send (servers down, a model not served): no probe ran
# Why a failing probe failed, when the servers tell their own times (replay.engine.capacity.why_failed):
# the server's part that grew most from the largest passing probe, or GREW_REST: none of them did.
GREW_REST = "neither: client or network"
WHY_FAILED = {"queue": "the servers' queue", "prefill": "their prefill", "decode": "their decode",
              "server_other": "their time outside queue, prefill and decode",
              GREW_REST: "none of the servers' parts but the rest (the client, the network or a router)"}
NO_ANSWER = (BELOW_LO, CLIENT_LIMITED, WORKERS_LOST, STOPPED, WORKER_SIGNALLED, OUTAGE, SERVER_ERRORS,
             REFUSED_BEFORE_SEND)  # results whose exit code is at least 1


def quotable_line(report: dict) -> str:
    """The summary's last line, one a person can quote."""
    best, worst = report["bracket"]
    limits = " and ".join(f"{k} <= {v:g} ms" for k, v in report["slo"].items())
    at = f"at goodput >= {_pct(report['goodput_target'])}% with {limits}"
    result = report["result"]
    if result == BELOW_LO:
        return f"Capacity: below {report['range'][0]:g}x this trace's load ({worst:g}x fails) {at}"
    if result == AT_LEAST_HI:
        return f"Capacity: at least {best:g}x this trace's load (the most tried, --search-range) {at}"
    if result == CLIENT_LIMITED:
        return ("Capacity: not measured: the client could not send on time (dispatch drift p99 over "
                f"{CLIENT_DRIFT_P99_MS:g} ms, or a worker's CPU at {CLIENT_CPU_PERCENT:g}%); add workers and run "
                "the search again")
    if result == WORKERS_LOST:
        return (f"Capacity: not measured: workers were lost during a probe and again during its repeat "
                f"(the bracket so far: {_side(best)} passes, {_side(worst)} fails); run the search again")
    if result in (OUTAGE, SERVER_ERRORS):
        probe = report["probes"][-1]
        what = ("the servers stopped answering" if result == OUTAGE else
                "the servers answered errors that are not the load's")
        reasons = "; ".join(f"{n} x {reason}" for reason, n in (probe.get("not_load_reasons") or {}).items())
        retry = "" if report.get("on_outage") == "retry" else ", or with --on-outage retry"  # not when it was
        return (f"Capacity: not measured: {what} during the probe at {probe['factor']:.3g}x ({reasons}; the bracket "
                f"so far: {_side(best)} passes, {_side(worst)} fails); search again once they serve{retry}")
    if result == REFUSED_BEFORE_SEND:
        return f"Capacity: not measured: {report.get('ended_because') or 'the run was refused before the first send'}"
    if result == WORKER_SIGNALLED:
        return (f"Capacity: not measured: a worker was stopped by a signal of its own during the search "
                f"(the bracket so far: {_side(best)} passes, {_side(worst)} fails); run the search again")
    if result != FOUND:  # stopped (by the user, or a fault it names): a bracket so far is no answer
        fault = report.get("ended_because")
        so_far = "" if best is None and worst is None else f"; the bracket so far: {_side(best)} passes, {_side(worst)} fails"
        return f"Capacity: not known (the search was {result}{': ' + fault if fault else ''}{so_far}) {at}"
    return f"Capacity: {best:.3g}x this trace's load ({best:.3g}x passes, {worst:.3g}x fails) {at}{_because(report)}"


def _because(report: dict) -> str:
    """'; at 4x the servers' queue grew most (+372 ms mean TTFT)', or nothing without the servers' times."""
    why = report.get("failed_because")
    if not why or why.get("grew_most") is None:
        return ""
    part, figure = why["grew_most"], "TTFT" if why["figure"] == "ttft_ms" else "E2E"
    grown = why["growth_ms"]["rest" if part == GREW_REST else part]
    return (f"; at {report['bracket'][1]:.3g}x {WHY_FAILED.get(part, part)} grew most "
            f"({grown:+.0f} ms of {why['growth_ms']['client']:+.0f} ms mean {figure})")


def probe_table(report: dict) -> str:
    """A search's probes, one line each, for `replay report`: what its pooled figures are made of."""
    lines = [f"{'probe':>5}  {'factor':>7}  {'rows':>6}  {'sent':>6}  {'goodput':>7}  verdict"]
    for p in report["probes"]:
        goodput = "-" if p.get("goodput") is None else f"{p['goodput']:.4f}"
        lines.append(f"{p['probe']:>5}  {p['factor']:>6g}x  {p['rows']:>6}  {p.get('sent', '-'):>6}  {goodput:>7}  "
                     f"{p['verdict']}")
    return "\n".join(lines)


def _side(factor: float | None) -> str:
    return "none" if factor is None else f"{factor:.3g}x"


def _pct(target: float) -> str:
    return f"{target * 100:g}"

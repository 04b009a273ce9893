"""`replay compare --fail-on EXPR`: a gate fails only when the change's whole 95% interval lies
beyond its bound, so noise never fails a gate (and a gate on a figure the runs cannot test,
such as a p99 of too few rows, holds).

    ttft_p99>+5%     the relative change of TTFT p99 is above +5%
    e2e_p50>+20ms    E2E p50 grew by more than 20 ms
    goodput<-1pt     the share meeting --slo fell by more than 1 percentage point
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from replay.results.compare import CompareError, metric_table

GATE = re.compile(r"\s*([a-z0-9_]+)\s*([<>])\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+))\s*(%|ms|pt)\s*")


@dataclass(frozen=True)
class Gate:
    text: str
    metric: str
    above: bool  # '>': fails when the interval lies above the bound
    bound: float  # in the unit's own terms: a fraction for %, ms, a fraction for pt
    unit: str


def parse_gate(text: str) -> Gate:
    """A --fail-on expression, or CompareError naming it and saying what is wrong."""
    match = GATE.fullmatch(text)
    if not match:
        raise CompareError(f"--fail-on {text!r}: expected METRIC>BOUND or METRIC<BOUND with a unit of %, ms or pt, "
                           "e.g. ttft_p99>+5% or goodput<-1pt")  # fmt: skip
    name, sign, number, unit = match.groups()
    metrics = {m.name: m for m in metric_table(slo=True, server=True)}
    metric = metrics.get(name)
    if metric is None:
        raise CompareError(f"--fail-on {text!r}: no metric {name!r}; one of {', '.join(metrics)}")
    if not metric.tested:
        raise CompareError(f"--fail-on {text!r}: {name} is one figure per run, with no interval to gate on")
    if unit == "ms" and metric.unit != "ms":
        raise CompareError(f"--fail-on {text!r}: {name} is a share: use pt (percentage points) or %")
    if unit == "pt" and metric.unit != "share":
        raise CompareError(f"--fail-on {text!r}: {name} is in ms: use ms or %")
    bound = float(number) / 100.0 if unit in ("%", "pt") else float(number)
    return Gate(text, name, sign == ">", bound, unit)


def evaluate(gate: Gate, result: dict) -> dict:
    """{gate, held, why}: whether the gate held on the comparison `result` (compare's document)."""
    entry = next((e for e in result["metrics"] if e["metric"] == gate.metric), None)
    if entry is None and gate.metric == "goodput":  # no row of goodput without an SLO
        raise CompareError(f"--fail-on {gate.text!r}: goodput needs an SLO (--slo, or the runs' own)")
    if entry is None:  # a server part's, and no run has the servers' own times
        raise CompareError(f"--fail-on {gate.text!r}: no run has the servers' own times (their records' server_* "
                           "fields are null: vLLM without --enable-per-request-metrics)")
    ci = entry["relative_ci"] if gate.unit == "%" else entry["ci"]
    if ci is None:
        why = "goodput needs an SLO (--slo, or the runs' own)" if gate.metric == "goodput" and not result["slo"] \
            else entry["note"] or "no values to compare"  # fmt: skip
        raise CompareError(f"--fail-on {gate.text!r}: {why}")
    scale = 100.0 if gate.unit in ("%", "pt") else 1.0
    shown = f"[{ci[0] * scale:+.2f}, {ci[1] * scale:+.2f}]{gate.unit}"
    if entry["note"]:
        return {"gate": gate.text, "held": True, "why": f"not tested: {entry['note']}"}
    failed = ci[0] > gate.bound if gate.above else ci[1] < gate.bound
    where = "above" if gate.above else "below"
    if failed:
        return {"gate": gate.text, "held": False, "why": f"the interval {shown} lies wholly {where} the bound"}
    return {"gate": gate.text, "held": True, "why": f"the interval {shown} does not lie wholly {where} the bound"}

"""The run report: replay.results.summary's numbers plus failures by cause, goodput and the
cache section, printed in the block layout of vLLM's `bench serve` so the two read side by side.

Goodput follows vLLM (vllm/benchmarks/serve.py, calculate_metrics): a request is "good" when
it succeeded and meets *every* SLO given (value <= limit, in ms), and goodput is the good
requests per second of the benchmark duration. A request with one output token has no TPOT;
vLLM scores it 0.0 for goodput, and so does this module. A request missing a metric an SLO
needs (e.g. no TTFT because it was not streamed) cannot be shown to meet it, so it is not good.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable

from replay.results.certificate import format_certificate
from replay.results.records import Record, output_tokens_of
from replay.results.server_metrics import format_server
from replay.results.server_time import ServerTimeBuilder, Timing, format_server_time, timing_of
from replay.results.summary import SummaryBuilder, percentile, sorted_array

SLO_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms")
LATENCIES = (
    ("ttft_ms", "TTFT", "Time to First Token"),
    ("tpot_ms", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl_ms", "ITL", "Inter-token Latency"),
    ("e2e_ms", "E2EL", "End-to-end Latency"),
)
WIDTH = 50


class ReportError(ValueError):
    """Bad report input (an SLO, a results file) with what to fix."""


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft_ms=500,tpot_ms=50' -> {'ttft_ms': 500.0, 'tpot_ms': 50.0}."""
    if not text:
        return {}
    slo: dict[str, float] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in SLO_KEYS:
            raise ReportError(f"--slo {text!r}: {part.strip()!r} is not one of {', '.join(k + '=MS' for k in SLO_KEYS)}")
        try:
            limit = float(value)
        except ValueError:
            raise ReportError(f"--slo {text!r}: {key} needs a number of milliseconds, got {value.strip()!r}") from None
        if not (math.isfinite(limit) and limit > 0):  # nan compares false with every record: no SLO at all
            raise ReportError(f"--slo {text!r}: {key} must be a finite number > 0, got {value.strip()}")
        slo[key] = limit
    return slo


def meets_slo(record: Record, slo: dict[str, float]) -> bool:
    """Succeeded and within every limit of `slo` (see the module's docstring for goodput)."""
    if not record.get("ok"):
        return False
    for key, limit in slo.items():
        value = record.get(key)
        if value is None and key == "tpot_ms" and output_tokens_of(record) <= 1:
            value = 0.0  # vLLM: no TPOT with one output token, scored as 0
        if value is None or value > limit:
            return False
    return True


class EndpointStats:
    """One server of a fleet: its requests, how many were ok, the TTFT and E2E values of the
    ok ones (array('d'), for p50/p99), and the prompt and cached tokens it reported (to set
    against its own counters: replay.results.server_metrics)."""

    def __init__(self) -> None:
        self.requests = 0
        self.requests_ok = 0
        self.ttft = array("d")
        self.e2e = array("d")
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.server_time = ServerTimeBuilder()

    def add(self, record: Record, timing: Timing | None | bool = True) -> None:
        """`timing`: the record's server timing, as ReportBuilder read it (replay.results.server_time.timing_of)."""
        self.server_time.add(record, timing)
        self.requests += 1
        self.prompt_tokens += record.get("prompt_tokens") or 0
        self.cached_tokens += record.get("cached_tokens") or 0
        if record.get("ok"):
            self.requests_ok += 1
            for key, values in (("ttft_ms", self.ttft), ("e2e_ms", self.e2e)):
                if record.get(key) is not None:
                    values.append(record[key])

    def entry(self) -> dict:
        self.ttft, self.e2e = sorted_array(self.ttft), sorted_array(self.e2e)
        entry = {"requests": self.requests, "requests_ok": self.requests_ok,
                 "requests_failed": self.requests - self.requests_ok}  # fmt: skip
        for key, values in (("ttft_ms", self.ttft), ("e2e_ms", self.e2e)):
            entry[key] = {"p50": percentile(values, 50), "p99": percentile(values, 99)}
        entry["prompt_tokens"] = self.prompt_tokens
        entry["cached_tokens"] = self.cached_tokens
        entry["server_timing"] = self.server_time.section()  # type: ignore[assignment]  # as the others above
        return entry


class ReportBuilder:
    """The run report from records added one at a time, so that a run of millions of rows is
    reported without holding its records: what it keeps is SummaryBuilder's (counters and the
    values that need percentiles), the count of requests meeting `slo`, and per endpoint the
    counts and TTFT/E2E values.

    The per-endpoint part shows one slow or failing server of a fleet instead of letting it
    vanish in the mean; rows never sent have no endpoint and are left out of it (the totals
    count them as unsent)."""

    def __init__(self, slo: dict[str, float] | None = None) -> None:
        self.slo = dict(slo) if slo else None
        self.summary = SummaryBuilder()
        self.server_time = ServerTimeBuilder()
        self.requests_good = 0
        self.endpoints: dict[str, EndpointStats] = {}

    def add(self, record: Record) -> None:
        self.summary.add(record)
        timing = timing_of(record)  # read once, for the run's section and its endpoint's
        self.server_time.add(record, timing)
        if self.slo and meets_slo(record, self.slo):
            self.requests_good += 1
        if record.get("endpoint"):
            self.endpoints.setdefault(record["endpoint"], EndpointStats()).add(record, timing)

    def report(self, cache: dict | None = None) -> dict:
        """The summary keys (docs/reports.md), the totals vLLM prints, failure breakdowns, goodput, the
        `cache` section as given (replay.results.fidelity's) and the per-endpoint lines. The
        `server` section (replay.results.server_metrics) needs the per-endpoint lines: the
        caller fills it in."""
        report = self.summary.summary()
        report["failures_by_status"] = self.summary.failures.most_common()[1]
        report["requests_unsent"] = self.summary.requests - self.summary.requests_sent
        report["total_input_tokens"] = self.summary.input_tokens
        report["total_output_tokens"] = self.summary.output_tokens
        duration = report["duration_s"]
        total = report["total_input_tokens"] + report["total_output_tokens"]
        report["total_token_throughput"] = total / duration if duration else 0.0
        report["slo"] = dict(self.slo) if self.slo else None
        if self.slo:
            report["requests_good"] = self.requests_good
            report["goodput_rps"] = self.requests_good / duration if duration else 0.0
        else:
            report["requests_good"] = None
            report["goodput_rps"] = None
        report["cache"] = cache
        report["server_timing"] = self.server_time.section()  # where the time went (replay.results.server_time)
        report["endpoints"] = {endpoint: self.endpoints[endpoint].entry() for endpoint in sorted(self.endpoints)}
        report["server"] = None  # the run's server-metrics samples, when it has some (see above)
        return report


def build_report(records: Iterable[Record], slo: dict[str, float] | None = None, cache: dict | None = None) -> dict:
    """ReportBuilder's report of `records` (a list, or a stream read once)."""
    builder = ReportBuilder(slo)
    for record in records:
        builder.add(record)
    return builder.report(cache)


def _line(label: str, value) -> str:
    return f"{label:<40} {value:<10}"


def _num(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def format_report(report: dict) -> str:
    """vLLM's "Serving Benchmark Result" block, with the replay's own lines added."""
    out = ["{s:=^{n}}".format(s=" Serving Benchmark Result ", n=WIDTH)]
    out.append(_line("Successful requests:", report["requests_ok"]))
    out.append(_line("Failed requests:", report["requests_failed"]))
    if report["requests_unsent"]:
        out.append(_line("  of which never sent:", report["requests_unsent"]))
    for reason, count in list(report["failures"].items())[:8]:
        out.append(f"  {count} x {reason}")
    out.append(_line("Benchmark duration (s):", _num(report["duration_s"])))
    out.append(_line("Total input tokens:", report["total_input_tokens"]))
    out.append(_line("Total generated tokens:", report["total_output_tokens"]))
    if report.get("requests_usage_mismatch"):
        out.append(_line("Usage disagreements:", report["requests_usage_mismatch"]))
        out.append("  (rows whose usage cannot be true: see their usage_mismatch; output totals count their events received)")
    out.append(_line("Request throughput (req/s):", _num(report["request_throughput"])))
    if report.get("goodput_rps") is not None:
        slo = ",".join(f"{k}={v:g}" for k, v in report["slo"].items())
        out.append(_line("Request goodput (req/s):", _num(report["goodput_rps"])))
        out.append(_line(f"  meeting {slo}:", f"{report['requests_good']} of {report['requests']}"))
    out.append(_line("Input token throughput (tok/s):", _num(report["input_token_throughput"])))
    out.append(_line("Output token throughput (tok/s):", _num(report["output_token_throughput"])))
    out.append(_line("Total Token throughput (tok/s):", _num(report["total_token_throughput"])))
    for key, name, header in LATENCIES:
        d = report[key]
        out.append("{s:-^{n}}".format(s=header, n=WIDTH))
        out.append(_line(f"Mean {name} (ms):", _num(d["mean"])))
        out.append(_line(f"Median {name} (ms):", _num(d["median"])))
        out.append(_line(f"Std {name} (ms):", _num(d["std"])))
        for p in (25, 50, 75, 90, 99):
            out.append(_line(f"P{p} {name} (ms):", _num(d[f"p{p}"])))
    drift = report["drift_ms"]
    out.append("{s:-^{n}}".format(s="Dispatch Drift (sent - scheduled)", n=WIDTH))
    for key in ("p50", "p99", "max"):
        out.append(_line(f"{key.upper() if key != 'max' else 'Max'} drift (ms):", _num(drift[key])))
    if report.get("sessions"):  # a closed-loop --turn-timing: turns sent after their trace time
        sessions = report["sessions"]
        out.append(_line("Session turns shifted (median/p99 ms):",
                         f"{sessions['turns_shifted']} ({_num(sessions['shift_ms']['p50'])}/"
                         f"{_num(sessions['shift_ms']['p99'])})"))
    cache = report.get("cache")
    if cache:
        out.extend(format_cache(cache))
    if report.get("endpoints"):
        out.extend(format_endpoints(report["endpoints"]))
    out.extend(format_server_time(report.get("server_timing") or {}, WIDTH, report.get("endpoints")))
    if report.get("server"):
        out.extend(format_server(report["server"], WIDTH))
    if report.get("fidelity"):
        out.extend(format_certificate(report["fidelity"], WIDTH))
    out.append("=" * WIDTH)
    return "\n".join(out)


def format_cache(cache: dict) -> list[str]:
    out = ["{s:-^{n}}".format(s="Prefix Cache Fidelity", n=WIDTH)]
    out.append(_line("Expected cached tokens:", cache["expected_cached_tokens"]))
    out.append(_line("Observed cached tokens:", cache["observed_cached_tokens"]))
    out.append(_line("Observed / expected:", _num(cache["ratio"], 4)))
    out.append(_line("Requests matching:", f"{cache['requests_matching']} of {cache['requests_compared']} "
                                           f"({100 * (cache['requests_matching_share'] or 0):.2f}%)"))
    if cache.get("requests_explained_by_reordering"):
        out.append(_line("Others explained by requests in flight:", cache["requests_explained_by_reordering"]))
    if cache.get("requests_without_cached_tokens"):
        out.append(_line("Requests without cached_tokens:", cache["requests_without_cached_tokens"]))
    if cache.get("requests_prompt_mismatch"):
        out.append(_line("Requests with prompt_tokens != expected:", cache["requests_prompt_mismatch"]))
    for w in cache.get("worst", [])[:5]:
        out.append(f"  request {w['request_id']}: observed {w['observed']}, expected {w['expected']} "
                   f"(prompt {w['prompt_tokens']})")
    out.append(f"  ({cache['method']})")
    return out


def format_endpoints(endpoints: dict[str, dict]) -> list[str]:
    """One line per endpoint: requests, failures, TTFT and E2E p50/p99 in ms."""
    out = ["{s:-^{n}}".format(s="Per Endpoint", n=WIDTH)]
    out.append(f"{'endpoint':<30} {'req':>6} {'failed':>6} {'TTFT p50/p99':>17} {'E2EL p50/p99':>17}")
    for endpoint, e in endpoints.items():
        ttft = f"{_num(e['ttft_ms']['p50'], 1)}/{_num(e['ttft_ms']['p99'], 1)}"
        e2e = f"{_num(e['e2e_ms']['p50'], 1)}/{_num(e['e2e_ms']['p99'], 1)}"
        out.append(f"{endpoint:<30} {e['requests']:>6} {e['requests_failed']:>6} {ttft:>17} {e2e:>17}")
    return out

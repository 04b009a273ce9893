"""The server's side of a run: what each endpoint's Prometheus `/metrics` said during it.

The master scrapes every endpoint (replay.engine.scraper) and writes one JSON line per scrape
per endpoint to OUTPUT.server-metrics.jsonl:

    {"t": <unix s, master clock>, "endpoint": URL, "ok": true|false, "metrics": {name: value}}

(`"error"` is added on a failed scrape; every endpoint of one scrape round has the same `t`,
so the fleet's totals line up). A `--metrics-endpoint` exporter's lines (GPU telemetry) have
`"exporter": true` and every series of its page, keyed as the page writes it, `NAME{labels}`
(replay.protocol.prometheus's `parse_series`); they are no LLM server's, so the `server` section leaves them out, and
replay.results.gpu_metrics reads them. This module knows the series worth keeping (vLLM, SGLang, TGI),
reads the sample lines it keeps (replay.protocol.prometheus reads the format), and turns a file of samples into the summary's
`server` section: counters as their change over the run, gauges as their peak.

Roles: one meaning, whichever server names it. The first name of a role present in a sample
is the one used, so a vLLM v1 server's kv_cache_usage_perc wins over the older
gpu_cache_usage_perc name.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

import orjson

from replay.protocol.prometheus import sample
from replay.results.gpu_metrics import exporter_section, format_exporters
from replay.rules.run_files import metrics_path

# name, {labels} (quoted values with escapes), value, an optional timestamp; blanks are spaces or tabs


VLLM = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
)  # fmt: skip
SGLANG = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate",
          "sglang:prompt_tokens_total", "sglang:generation_tokens_total")  # fmt: skip
TGI = ("tgi_queue_size", "tgi_batch_current_size")
KNOWN = VLLM + SGLANG + TGI

# role -> the names that mean it, preferred first
GAUGES = {
    "running": ("vllm:num_requests_running", "sglang:num_running_reqs", "tgi_batch_current_size"),
    "waiting": ("vllm:num_requests_waiting", "sglang:num_queue_reqs", "tgi_queue_size"),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"),
}
COUNTERS = {
    "prefix_cache_queries": ("vllm:prefix_cache_queries_total",),
    "prefix_cache_hits": ("vllm:prefix_cache_hits_total",),
    "prompt_tokens": ("vllm:prompt_tokens_total", "sglang:prompt_tokens_total"),
    "generation_tokens": ("vllm:generation_tokens_total", "sglang:generation_tokens_total"),
    "preemptions": ("vllm:num_preemptions_total",),
}
FLEET_NAMES = frozenset(n for names in GAUGES.values() for n in names)
SGLANG_HIT_RATE = "sglang:cache_hit_rate"  # SGLang has a ratio gauge, no hit counters
# Fractions: several series of one name (vLLM's data-parallel engines) are averaged, not added.
FRACTIONS = frozenset({"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage",
                       SGLANG_HIT_RATE})  # fmt: skip
OTHER_TRAFFIC = ("the server counted {diff:+d} prompt tokens against the records: other traffic on the server, "
                 "or requests the records do not count (failed or lost)")  # fmt: skip
FALSE_USAGE = ("the server counted {diff:+d} prompt tokens against the records: its counter counted exactly the "
               "prompt tokens the run sent, so the records' usage is false (the fidelity certificate's usage line)")


def parse(text: str, wanted: Iterable[str]) -> dict[str, float]:
    """The `wanted` sample names found in a Prometheus text exposition, each summed over its
    label sets (averaged for FRACTIONS). Raises ValueError on text that is not the format.

    Only sample lines are read, under their names as written (`vllm:prefix_cache_hits_total`,
    TGI's `tgi_queue_size`), and of those only the wanted ones: vLLM's page is mostly histogram
    buckets, and on a single process (the local runner) parsing shares the dispatcher's core.
    The labels are skipped whole (quoted values may hold spaces, braces and escaped quotes).
    prometheus_client's parser cost more, in its imports per process and per scrape
    (docs/bench/2026-11-28-figures.md)."""
    wanted = set(wanted)
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    seen = False
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        head = line.split("{", 1)[0].split(None, 1)  # [] for a line of no name (a JSON page's "{...")
        if not head or head[0] not in wanted:
            continue
        name, value = sample(line)
        seen = True
        if not math.isnan(value):
            sums[name] += value
            counts[name] += 1
    if not seen:  # none of ours: is it the format at all? (a proxy's HTML page is not)
        for line in text.splitlines():
            if line.strip() and line[0] != "#":
                sample(line)
    return {name: (sums[name] / counts[name] if name in FRACTIONS else sums[name]) for name in sums}


def sample_line(t: float, endpoint: str, metrics: dict[str, float] | None, error: str | None = None,
                exporter: bool = False) -> bytes:
    """One line of the samples file (`exporter`: a --metrics-endpoint's, not a server's)."""
    line = {"t": round(t, 3), "endpoint": endpoint, "ok": error is None, "metrics": metrics or {}}
    if exporter:
        line["exporter"] = True
    if error is not None:
        line["error"] = error
    return orjson.dumps(line) + b"\n"


def read_samples(path: str | Path) -> Iterator[dict]:
    """The samples of a file, in file order; a line cut off by a killed master is skipped."""
    with open(path, "rb") as f:
        for line in f:
            try:
                yield orjson.loads(line)
            except orjson.JSONDecodeError:
                continue


def pick(metrics: dict[str, float], names: tuple[str, ...]) -> float | None:
    """The value of the first of `names` present."""
    for name in names:
        if name in metrics:
            return metrics[name]
    return None


def server_kind(names: Iterable[str]) -> str | None:
    names = set(names)
    for kind, known in (("vllm", VLLM), ("sglang", SGLANG), ("tgi", TGI)):
        if names & set(known):
            return kind
    return None


class CounterChange:
    """A counter's increase over a run, as Prometheus' increase(): a drop is a restart of the
    server, after which the counter counts from zero again."""

    def __init__(self) -> None:
        self.last: float | None = None
        self.total = 0.0

    def add(self, value: float) -> None:
        if self.last is not None:
            self.total += value - self.last if value >= self.last else value
        self.last = value


class EndpointSeries:
    """One endpoint's samples, folded: counter changes, gauge peaks, failures."""

    def __init__(self) -> None:
        self.samples = 0
        self.failed = 0
        self.error: str | None = None
        self.names: set[str] = set()
        self.counters = {role: CounterChange() for role in COUNTERS}
        self.peaks: dict[str, float | None] = dict.fromkeys(GAUGES)
        self.hit_rate_last: float | None = None
        self.others: dict[str, dict[str, float]] = {}

    def add(self, sample: dict, extra: Iterable[str] = ()) -> None:
        self.samples += 1
        if not sample.get("ok"):
            self.failed += 1
            self.error = self.error or sample.get("error")
            return
        metrics = sample.get("metrics") or {}
        self.names.update(metrics)
        for role, names in COUNTERS.items():
            value = pick(metrics, names)
            if value is not None:
                self.counters[role].add(value)
        for role, names in GAUGES.items():
            value = pick(metrics, names)
            if value is not None and (self.peaks[role] is None or value > self.peaks[role]):
                self.peaks[role] = value
        if SGLANG_HIT_RATE in metrics:
            self.hit_rate_last = metrics[SGLANG_HIT_RATE]
        for name in extra:
            if name in metrics:
                other = self.others.setdefault(name, {"last": metrics[name], "max": metrics[name]})
                other["last"], other["max"] = metrics[name], max(other["max"], metrics[name])

    def entry(self, records: dict | None) -> dict:
        """The summary's entry; `records` is the report's per-endpoint entry (its prompt and
        cached token sums), to set the server's count against."""
        ok = self.samples - self.failed
        kind = server_kind(self.names)
        changes = {role: (int(c.total) if c.last is not None else None) for role, c in self.counters.items()}
        entry = {
            "server": kind,
            "samples": self.samples,
            "samples_failed": self.failed,
            "error": self.error if not ok else None,
            **changes,
            "prefix_cache_hit_ratio": _ratio(changes["prefix_cache_hits"], changes["prefix_cache_queries"]),
            "peak_running": self.peaks["running"],
            "peak_waiting": self.peaks["waiting"],
            "peak_kv_cache_usage": self.peaks["kv_cache_usage"],
            "records_prompt_tokens": (records or {}).get("prompt_tokens"),
            "records_cached_tokens": (records or {}).get("cached_tokens"),
            "prompt_tokens_difference": None,
            "note": None,
        }
        if entry["prefix_cache_hit_ratio"] is None and self.hit_rate_last is not None:
            entry["prefix_cache_hit_ratio"] = self.hit_rate_last  # SGLang's own gauge, last value
        if not ok:
            entry["note"] = f"no metrics: {self.error}" if self.error else "no metrics"
        elif changes["prompt_tokens"] is not None and entry["records_prompt_tokens"] is not None:
            diff = changes["prompt_tokens"] - entry["records_prompt_tokens"]
            entry["prompt_tokens_difference"] = diff
            if diff:
                entry["note"] = OTHER_TRAFFIC.format(diff=diff)
        if self.others:
            entry["other_metrics"] = self.others
        return entry


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def _add(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else a + b


def fleet_peaks(samples: list[dict]) -> dict[str, float | None]:
    """Peaks of the fleet as a whole: per scrape round (one `t`), running and waiting added
    up over the endpoints, KV-cache usage averaged; then the highest round."""
    rounds: dict[float, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for s in samples:
        if s.get("ok"):
            for role, names in GAUGES.items():
                value = pick(s.get("metrics") or {}, names)
                if value is not None:
                    rounds[s["t"]][role].append(value)
    peaks: dict[str, float | None] = dict.fromkeys(GAUGES)
    for values in rounds.values():
        for role, vs in values.items():
            v = sum(vs) / len(vs) if role == "kv_cache_usage" else sum(vs)
            if peaks[role] is None or v > peaks[role]:
                peaks[role] = v
    return peaks


def server_section(samples: Iterable[dict], endpoints: dict[str, dict] | None = None,
                   extra: Iterable[str] = ()) -> dict | None:
    """The summary's `server` section from a run's samples; None when there are none.
    `endpoints` is the report's per-endpoint section (records' prompt and cached tokens).
    Exporters' samples go to its `exporters` (replay.results.gpu_metrics), never into the servers'."""

    endpoints = endpoints or {}
    extra = tuple(extra)
    series: dict[str, EndpointSeries] = {}
    kept: list[dict] = []
    exporters: list[dict] = []
    for s in samples:
        if s.get("exporter"):
            exporters.append(s)
            continue
        series.setdefault(s["endpoint"], EndpointSeries()).add(s, extra)
        kept.append({"t": s["t"], "ok": s.get("ok"), "metrics": {k: v for k, v in (s.get("metrics") or {}).items()
                                                                  if k in FLEET_NAMES}})  # fmt: skip
    if not series and not exporters:
        return None
    entries = {url: series[url].entry(endpoints.get(url)) for url in sorted(series)}
    total: dict = {"samples": sum(e["samples"] for e in entries.values()),
                   "samples_failed": sum(e["samples_failed"] for e in entries.values())}  # fmt: skip
    with_metrics = [e for e in entries.values() if e["samples"] > e["samples_failed"]]
    for key in (*COUNTERS, "records_prompt_tokens", "records_cached_tokens"):
        value = None
        for e in with_metrics:
            value = _add(value, e[key])
        total[key] = value
    total["prefix_cache_hit_ratio"] = _ratio(total["prefix_cache_hits"], total["prefix_cache_queries"])
    peaks = fleet_peaks(kept)
    total.update({"peak_running": peaks["running"], "peak_waiting": peaks["waiting"],
                  "peak_kv_cache_usage": peaks["kv_cache_usage"]})  # fmt: skip
    # the records of endpoints without metrics are left out of the comparison
    diff = None
    if total["prompt_tokens"] is not None and total["records_prompt_tokens"] is not None:
        diff = total["prompt_tokens"] - total["records_prompt_tokens"]
    total["prompt_tokens_difference"] = diff
    total["note"] = OTHER_TRAFFIC.format(diff=diff) if diff else None
    total["endpoints_without_metrics"] = [url for url, e in entries.items() if e["samples"] == e["samples_failed"]]
    section = {"endpoints": entries, "total": total}
    if exporters:
        section["exporters"] = exporter_section(exporters)
    return section



def read_server_section(results: str | Path, endpoints: dict[str, dict] | None = None,
                        extra: Iterable[str] = ()) -> dict | None:
    """The `server` section of the run whose records are `results`, None without a samples file."""
    path = metrics_path(results)
    if not path.exists():
        return None
    section = server_section(read_samples(path), endpoints, extra)
    if section is not None:
        section["file"] = str(path)
    return section


def _num(value, digits: int = 0) -> str:
    if value is None:
        return "n/a"
    return f"{value:.{digits}f}" if digits else f"{int(value)}"


def judge_usage(section: dict | None, usage: dict | None) -> None:
    """Reword the section's prompt-token notes by the certificate's check of the usage against
    the counters (`usage`): where it found the usage false, a difference is that, not other
    traffic. The summary's JSON and its printed lines read the same notes."""
    if section is None or ((usage or {}).get("prompt_tokens") or {}).get("status") != "disagrees":
        return
    for entry in (*section["endpoints"].values(), section["total"]):
        if entry.get("prompt_tokens_difference"):
            entry["note"] = FALSE_USAGE.format(diff=entry["prompt_tokens_difference"])


def format_server(section: dict, width: int = 50) -> list[str]:
    """The summary's lines for the server's side."""
    out = ["{s:-^{n}}".format(s="Server Metrics (Prometheus)", n=width)]

    def lines(e: dict) -> None:
        ratio = e["prefix_cache_hit_ratio"]
        queried = (f" ({_num(e['prefix_cache_hits'])} of {_num(e['prefix_cache_queries'])} tokens)"
                   if e["prefix_cache_queries"] is not None else "")  # fmt: skip
        out.append("{:<40} {}".format("  Prefix cache hit ratio:", _num(ratio, 4) + queried))
        out.append("{:<40} {} / {}".format("  Prompt tokens (server / records):", _num(e["prompt_tokens"]),
                                           _num(e["records_prompt_tokens"])))  # fmt: skip
        out.append("{:<40} {}".format("  Generation tokens:", _num(e["generation_tokens"])))
        out.append("{:<40} {}".format("  Preemptions:", _num(e["preemptions"])))
        out.append("{:<40} {} / {}".format("  Peak running / waiting:", _num(e["peak_running"]),
                                           _num(e["peak_waiting"])))  # fmt: skip
        usage = e["peak_kv_cache_usage"]
        out.append("{:<40} {}".format("  Peak KV-cache usage:", "n/a" if usage is None else f"{100 * usage:.2f}%"))

    for url, e in section["endpoints"].items():
        kind = f" ({e['server']})" if e["server"] else ""
        if e["samples"] == e["samples_failed"]:
            out.append(f"{url}: {e['note']}")
            continue
        out.append(f"{url}{kind}: {e['samples'] - e['samples_failed']} samples")
        lines(e)
        if e["note"]:
            out.append(f"  note: {e['note']}")
    total = section["total"]
    if len(section["endpoints"]) - len(total["endpoints_without_metrics"]) > 1:  # one: its own lines said it
        out.append("all endpoints with metrics:")
        lines(total)
        if total.get("note"):
            out.append(f"  note: {total['note']}")
    if section.get("exporters"):

        out.extend(format_exporters(section["exporters"]))
    return out

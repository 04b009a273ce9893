"""The fidelity certificate of a run: how faithfully it reproduced its trace, with the evidence
(docs/fidelity.md). Written at the end of every run as OUTPUT.fidelity.json, and a section of
the summary, of `replay report` (and its --json) and of the HTML report.

It is built from the records alone, one at a time in the pass that builds the summary
(`CertificateBuilder.add`), then finished with what that pass computed already: the summary's
send lag percentiles (its drift_ms: one computation of them) and the run's cache section
(replay.results.fidelity's, made in a child process). What it keeps per record is the send's
due and sent times (replay.results.arrivals); everything else is counters and the worst ten
of each list in a heap. It loads no tokenizer.

Sections: schedule, prompts, outputs, cache and the verdict, each line with its threshold
below. The cache lines that judge (the miss causes) come from the finite-cache model of the
server, through one hook: `miss_attribution` (see there).
"""

from __future__ import annotations

import heapq
import math
from typing import TypedDict

from replay.results.arrivals import ArrivalComparison
from replay.results.records import Record
from replay.rules.usage import max_tokens_asked, output_tokens_believed

WORST = 10
ON_TIME_MS = 1.0  # a send within this of its due time (either way) is on time
ON_TIME_SHARE_MIN = 0.99  # the verdict: at least this share of the sends on time
LATE_MS = 10.0  # a send later than this is listed
PROMPTS_EXACT_MIN = 1.0  # the verdict: every prompt the server counted has the trace's length
FAITHFUL, UNFAITHFUL = "faithful", "unfaithful"

# The causes of a request's cache miss (observed cached tokens below the infinite-cache
# expectation) or of a hit beyond it, as the finite-cache model names them (docs/fidelity.md#cache).
MISS_CAUSES = ("evicted", "routed-elsewhere", "partial-block", "prompt-differs", "in-flight", "warm-at-start",
               "unexplained")
FAILING_CAUSES = ("prompt-differs", "unexplained")  # the verdict: none of these


class CauseCount(TypedDict):
    requests: int
    tokens: int  # cached tokens lost (a miss) or gained (a hit beyond the expectation)


class MissAttribution(TypedDict, total=False):
    """What the finite-cache model of the server says of a run's cache (the hook's value)."""

    causes: dict[str, CauseCount]  # every cause of MISS_CAUSES: the whole run
    endpoints: dict[str, dict[str, CauseCount]]  # the same, per endpoint
    predicted_exact_share: float | None  # requests whose observed cached tokens the model predicts exactly
    block_size: int | None  # the server's, as detected or given
    capacity_blocks: int | None
    notes: list[str]  # what the reader should do (e.g. "the server's cache was warm: --reset-server-cache")


def miss_attribution(cache: dict | None) -> MissAttribution | None:
    """THE HOOK of the finite-cache model: the miss causes of the run whose cache section
    (replay.results.fidelity's, computed in replay.results.cache_child) is `cache`, or None when
    nothing attributed them. The model runs in the cache child, where the prompts' block hashes
    are, and puts its MissAttribution in the section under "misses"; this function is the one
    place the certificate reads it, so the verdict's cache line follows whatever fills it."""
    if not cache:
        return None
    misses = cache.get("misses")
    return misses if isinstance(misses, dict) and isinstance(misses.get("causes"), dict) else None


def _push(heap: list, key: tuple, item: dict) -> None:
    """Keep the WORST largest `key`s (a min-heap)."""
    if len(heap) < WORST:
        heapq.heappush(heap, (key, item))
    elif key > heap[0][0]:
        heapq.heapreplace(heap, (key, item))


def _worst(heap: list) -> list[dict]:
    return [item for _, item in sorted(heap, key=lambda entry: entry[0], reverse=True)]


def _share(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def _finite(value) -> bool:
    if type(value) is float:  # a record's times and lags, read from JSON: checked once a field per record
        return math.isfinite(value)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class CertificateBuilder:
    """The certificate's counts from records added one at a time (docs/fidelity.md).
    `ignore_eos`: whether the run asked for exact output lengths (not --no-ignore-eos)."""

    def __init__(self, *, ignore_eos: bool = True) -> None:
        self.ignore_eos = ignore_eos
        self.rows = self.sends = self.on_time = self.late = 0
        self._late: list = []
        self.arrivals = ArrivalComparison()
        self.ok = self.prompt_exact = self.prompt_mismatch = self.prompt_uncounted = 0
        self._mismatches: list = []
        self.outputs = {"exact": 0, "early stop allowed": 0, "server cut": 0, "error": 0, "no count": 0}

    def add(self, record: Record) -> None:
        self.rows += 1
        due, sent = record.get("due_at"), record.get("sent_at")
        if due is None:  # a record from before due_at (a closed-loop turn's may be later than scheduled_at)
            due = record.get("scheduled_at")
        if _finite(due) and _finite(sent):
            self._add_send(record, due, sent)
        if sent is not None:
            self._add_output(record)
        if record.get("ok"):
            self._add_prompt(record)

    def _add_send(self, record: Record, due: float, sent: float) -> None:
        self.sends += 1
        self.arrivals.add(due, sent)
        lag = record.get("drift_ms")
        lag = lag if _finite(lag) else (sent - due) * 1000.0
        self.on_time += abs(lag) <= ON_TIME_MS
        if lag > LATE_MS:
            self.late += 1
            _push(self._late, (lag, -record["request_id"]),
                  {"request_id": record["request_id"], "worker": record.get("worker"), "lag_ms": lag})

    def _add_prompt(self, record: Record) -> None:
        self.ok += 1
        counted = record.get("prompt_tokens")
        if counted is None:
            self.prompt_uncounted += 1
        elif counted == record["input_length"]:
            self.prompt_exact += 1
        else:
            self.prompt_mismatch += 1
            difference = counted - record["input_length"]
            _push(self._mismatches, (abs(difference), -record["request_id"]),
                  {"request_id": record["request_id"], "prompt_tokens": counted,
                   "input_length": record["input_length"], "difference": difference})

    def _add_output(self, record: Record) -> None:
        if not record.get("ok"):
            self.outputs["error"] += 1
            return
        got = output_tokens_believed(output_tokens=record.get("output_tokens"),
                                     received_tokens=record.get("received_tokens"),
                                     output_length=record["output_length"])
        if got is None:
            self.outputs["no count"] += 1
        elif got == max_tokens_asked(record["output_length"]):
            self.outputs["exact"] += 1
        else:  # fewer: the believed count is never over the max_tokens asked
            self.outputs["server cut" if self.ignore_eos else "early stop allowed"] += 1

    def certificate(self, lag: dict | None, cache: dict | None, cache_skipped: str | None = None) -> dict:
        """The certificate (docs/fidelity.md): `lag` is the summary's drift_ms (p50, p99, max
        over the same sends), `cache` the run's cache section or None (`cache_skipped`: why, when
        it is not for want of the server's block size). Called once."""
        lag = lag or {}
        schedule = {
            "rows": self.rows,
            "sends": self.sends,
            "unsent": self.rows - self.sends,
            "lag_ms": {"p50": lag.get("p50"), "p99": lag.get("p99"), "max": lag.get("max")},
            "on_time_ms": ON_TIME_MS,
            "on_time_share": _share(self.on_time, self.sends),
            "late_ms": LATE_MS,
            "late": self.late,
            "late_worst": _worst(self._late),
            **self.arrivals.result(),
        }
        counted = self.prompt_exact + self.prompt_mismatch
        prompts = {
            "ok_rows": self.ok,
            "counted": counted,
            "exact": self.prompt_exact,
            "exact_share": _share(self.prompt_exact, counted),
            "mismatches": self.prompt_mismatch,
            "mismatch_worst": _worst(self._mismatches),
            "uncounted": self.prompt_uncounted,
        }
        answered = sum(self.outputs.values())
        outputs = {
            "sent": answered,
            "ignore_eos": self.ignore_eos,
            "exact": self.outputs["exact"],
            "exact_share": _share(self.outputs["exact"], answered),
            "others": {reason: n for reason, n in self.outputs.items() if reason != "exact"},
        }
        cert = {"schedule": schedule, "prompts": prompts, "outputs": outputs, "cache": cache_lines(cache, cache_skipped)}
        cert["verdict"], cert["failing"], cert["unchecked"] = verdict(cert)
        return cert


def cache_lines(cache: dict | None, skipped: str | None = None) -> dict:
    """The certificate's cache section: the infinite-cache comparison as the run computed it,
    and the finite-cache model's miss causes where the hook gives them; `skipped`: why there is
    no comparison, when not for want of the server's block size."""
    if not cache:
        return {"infinite": None, "misses": None, **({"skipped": skipped} if skipped else {})}
    infinite = {key: value for key, value in cache.items() if key != "misses"}
    return {"infinite": infinite, "misses": miss_attribution(cache)}


def verdict(cert: dict) -> tuple[str, list[str], list[str]]:
    """(faithful or unfaithful, the failing lines, the lines nothing could check). A line with
    nothing to judge is unchecked and fails nothing, but a run that sent nothing fails."""
    failing: list[str] = []
    unchecked: list[str] = []
    s = cert["schedule"]
    if not s["sends"]:
        failing.append("schedule: no request was sent")
    elif s["on_time_share"] < ON_TIME_SHARE_MIN:
        failing.append(f"schedule: {100 * s['on_time_share']:.2f}% of sends within {ON_TIME_MS:g} ms of their time "
                       f"(needs >= {100 * ON_TIME_SHARE_MIN:g}%); {s['late']} late by > {LATE_MS:g} ms")
    p = cert["prompts"]
    if not p["counted"]:
        unchecked.append("prompts: the server counted no prompt (no usage)")
    elif p["exact_share"] < PROMPTS_EXACT_MIN:
        failing.append(f"prompts: {p['mismatches']} of {p['counted']} prompts the server counted differ from the "
                       f"trace's input_length (needs 100% exact)")
    misses = cert["cache"]["misses"]
    if misses is None:
        unchecked.append("cache: no miss attribution (no finite-cache model of the server)")
    else:
        for cause in FAILING_CAUSES:
            n = (misses["causes"].get(cause) or {}).get("requests") or 0
            if n:
                failing.append(f"cache: {n} requests {cause} (needs 0)")
    return (UNFAITHFUL if failing else FAITHFUL), failing, unchecked


def _ms(value) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _pct(value) -> str:
    return "n/a" if value is None else f"{100 * value:.2f}%"


def format_certificate(cert: dict, width: int) -> list[str]:
    """The certificate's lines in the summary's block layout."""
    line = lambda label, value: f"{label:<40} {value!s:<10}"  # noqa: E731
    s, p, o, c = cert["schedule"], cert["prompts"], cert["outputs"], cert["cache"]
    out = ["{s:-^{n}}".format(s="Fidelity Certificate", n=width)]
    out.append(line("Verdict:", cert["verdict"]))
    out.extend(f"  failing: {f}" for f in cert["failing"])
    out.extend(f"  not checked: {u}" for u in cert["unchecked"])
    out.append(line("Send lag p50/p99/max (ms):",
                    f"{_ms(s['lag_ms']['p50'])}/{_ms(s['lag_ms']['p99'])}/{_ms(s['lag_ms']['max'])}"))
    out.append(line(f"Sends within {ON_TIME_MS:g} ms:", f"{_pct(s['on_time_share'])} of {s['sends']}"))
    out.append(line(f"Sends late by > {LATE_MS:g} ms:", s["late"]))
    for w in s["late_worst"][:5]:
        out.append(f"  request {w['request_id']} (worker {w['worker']}): {w['lag_ms']:.2f} ms late")
    if s["inter_arrival_ks"] is not None:
        out.append(line("Inter-arrival KS (achieved vs due):",
                        f"{s['inter_arrival_ks']:.4f} (2.3% bins)"))
    if s["count_gap_s"] is not None:
        out.append(line("Largest cumulative-count gap:",
                        f"{s['count_gap_requests']} req, {s['count_gap_s']:.3f} s"))
    out.append(line("Prompts exact (server-counted):", f"{_pct(p['exact_share'])} of {p['counted']}"))
    if p["mismatches"]:
        for w in p["mismatch_worst"][:5]:
            out.append(f"  request {w['request_id']}: {w['prompt_tokens']} counted, input_length "
                       f"{w['input_length']} ({w['difference']:+d})")
    if p["uncounted"]:
        out.append(line("  ok rows without a server count:", p["uncounted"]))
    out.append(line("Outputs of exact length:", f"{_pct(o['exact_share'])} of {o['sent']}"))
    for reason, n in o["others"].items():
        if n:
            out.append(f"  {n} x {reason}")
    misses = c["misses"]
    if misses is not None:
        for cause in MISS_CAUSES:
            count = misses["causes"].get(cause) or {}
            if count.get("requests"):
                out.append(f"  cache {cause}: {count['requests']} requests, {count.get('tokens', 0)} tokens")
        out.extend(f"  {note}" for note in misses.get("notes") or ())
    elif c["infinite"] is None:
        out.append(f"  cache: not computed ({c.get('skipped') or 'the server said no block size: pass --server-block-size N'})")
    return out

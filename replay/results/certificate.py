"""The fidelity certificate of a run: how faithfully it reproduced its trace, with the evidence
(docs/fidelity.md). Written at the end of every run as OUTPUT.fidelity.json, and a section of
the summary, of `replay report` (and its --json) and of the HTML report.

It is built from the records alone, one at a time in the pass that builds the summary
(`CertificateBuilder.add`), then finished with what that pass computed already: the summary's
send lag percentiles (its drift_ms: one computation of them) and the run's cache section
(replay.results.fidelity's, made in a child process). What it keeps per record is the send's
due and sent times (replay.results.arrivals); everything else is counters and the worst ten
of each list in a heap. It loads no tokenizer.

Sections: schedule, prompts, outputs, usage, cache and the verdict, each line with its
threshold below. The cache lines that judge (the miss causes) come from the finite-cache model
of the server, through one hook: `miss_attribution` (see there). The server's usage is set
against its own /metrics counters (the run's `server` section): where they disagree, its
usage is not evidence, and the prompts and cache lines are judged from the counters. The
prompts as sent are judged from the records' fingerprints against the cache section's
re-synthesis (its `fingerprints`, replay.rules.prompt_fingerprint): the only evidence that
blames the replay's prompts. The
verdict names whose doing a failure is (VERDICTS), each with its remedy: the replay's
(`unfaithful`), the server's cache warm from before the run (`warm-cache`), other clients of
the server during the run (`shared-server`), or a host busy with other work while the sends
were late (`busy-host`, replay.results.host_load).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from typing import Any, TypedDict, cast

from replay.results.arrivals import ArrivalComparison
from replay.results.fidelity import scheduled
from replay.results.host_load import busy_host, client_limited, describe
from replay.results.records import Record
from replay.rules.server_timing import (
    FROM_ANSWER,
    FROM_SPAN,
    SERVER_OVER_CLIENT_MS,
    SERVER_TTFT_MS,
    ttft_source,
)
from replay.rules.usage import max_tokens_asked, output_tokens_believed

WORST = 10
ON_TIME_MS = 1.0  # a send within this of its due time (either way) is on time
ON_TIME_SHARE_MIN = 0.99  # the verdict: at least this share of the sends on time
LATE_MS = 10.0  # a send later than this is listed
PROMPTS_EXACT_MIN = 1.0  # the verdict: every prompt the server counted has the trace's length
QUEUED_SHARE = 0.5  # late sends this share of which waited for other sends: the replay's pace, not the host
# The client's TTFT against the server's own (replay.rules.server_timing): a client TTFT over a trace
# span's (from the server's arrival) by more than this is the client's or the network's, not the server's;
# the verdict fails when more than CLIENT_EXCESS_SHARE of the requests compared are.
CLIENT_EXCESS_MS = 50.0
CLIENT_EXCESS_SHARE = 0.01
FAITHFUL, UNFAITHFUL = "faithful", "unfaithful"
WARM_CACHE = "warm-cache"  # hits came from prompts the server's cache held before the run
SHARED_SERVER = "shared-server"  # hits came from other clients' prompts the server served during the run
BUSY_HOST = "busy-host"  # sends were late while other work had the host's CPUs
NOTHING_SENT = "nothing-sent"  # no request left: nothing of the replay to judge, and no one's fault to name here
VERDICTS = (FAITHFUL, NOTHING_SENT, UNFAITHFUL, WARM_CACHE, SHARED_SERVER, BUSY_HOST)  # the first found wins
REMEDIES = {
    WARM_CACHE: "the server's cache held prompts from before this run, so its hits are not the trace's: replay with "
                "--reset-server-cache (vLLM with VLLM_SERVER_DEV_MODE=1, replay sim) or against a freshly started "
                "server",
    SHARED_SERVER: "the server served other clients during the run, and its cache held their prompts too: replay "
                   "against a server no one else uses",
    BUSY_HOST: "the sends were late while the host was busy with other work: rerun on a quiet host (or give the "
               "replay cores of its own); the replay itself kept up",
    NOTHING_SENT: "the run sent no request: its records say why (refused before the first send: the servers' "
                  "answer to the preflight; stopped: the stop)",
}

# The causes of a request's cache miss (observed cached tokens below the infinite-cache
# expectation) or of a hit beyond it, as the finite-cache model names them (docs/fidelity.md#cache).
MISS_CAUSES = ("evicted", "routed-elsewhere", "partial-block", "prompt-differs", "server-missed", "no-fingerprint",
               "in-flight", "warm-at-start", "unexplained")
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
        self.ok = self.prompt_exact = self.prompt_mismatch = self.prompt_uncounted = self.prompt_unsaid = 0
        self._mismatches: list = []
        self.outputs = {"exact": 0, "early stop allowed": 0, "server cut": 0, "error": 0, "no count": 0}
        self.sent_tokens: dict[str, int] = {}  # per endpoint: input_length of the requests the server took in
        self.sent_unsaid: set[str] = set()  # the endpoints that took rows of their own prompts (no input_length)
        self.cached_counted = 0  # ok records whose usage has cached_tokens
        self.ttft_compared: dict[str, int] = {}  # by server_timing_source: ok records with both TTFTs
        self.ttft_over: dict[str, int] = {}  # of those, the client's over the server's by > CLIENT_EXCESS_MS
        self._ttft_over: list = []
        self.server_over_client = 0  # the server's TTFT over the client's: not true

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
        if scheduled(record) and (endpoint := record.get("endpoint")):
            said = record["input_length"]
            if said is None:  # its own prompt: only the server counts what was sent
                self.sent_unsaid.add(endpoint)
            self.sent_tokens[endpoint] = self.sent_tokens.get(endpoint, 0) + (said or 0)

    def _add_send(self, record: Record, due: float, sent: float) -> None:
        self.sends += 1
        self.arrivals.add(due, sent)
        lag = record.get("drift_ms")
        lag = lag if _finite(lag) else (sent - due) * 1000.0
        self.on_time += abs(lag) <= ON_TIME_MS
        if lag > ON_TIME_MS:
            self.arrivals.add_late(due, sent)
        if lag > LATE_MS:
            self.late += 1
            _push(self._late, (lag, -record["request_id"]),
                  {"request_id": record["request_id"], "worker": record.get("worker"), "lag_ms": lag})

    def _add_server_ttft(self, record: Record) -> None:
        """The client's TTFT against the server's own, where the server told it."""
        fields = cast(Mapping[str, Any], record)  # a field named by a constant
        client, server = fields.get("ttft_ms"), fields.get(SERVER_TTFT_MS)
        if not _finite(client) or not _finite(server):
            return
        source = str(ttft_source(fields))
        self.ttft_compared[source] = self.ttft_compared.get(source, 0) + 1
        excess = client - server
        if excess < -SERVER_OVER_CLIENT_MS:
            self.server_over_client += 1
        elif excess > CLIENT_EXCESS_MS:
            self.ttft_over[source] = self.ttft_over.get(source, 0) + 1
            _push(self._ttft_over, (excess, -record["request_id"]),
                  {"request_id": record["request_id"], "source": source, "ttft_ms": client, "server_ttft_ms": server,
                   "excess_ms": round(excess, 3)})

    def _add_prompt(self, record: Record) -> None:
        self._add_server_ttft(record)
        self.ok += 1
        self.cached_counted += record.get("cached_tokens") is not None
        counted = record.get("prompt_tokens")
        if record["input_length"] is None:  # its own messages: no length to match
            self.prompt_unsaid += 1
        elif counted is None:
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

    def certificate(self, lag: dict | None, cache: dict | None, server: dict | None = None,
                    host: dict | None = None, cache_skipped: str | None = None) -> dict:
        """The certificate (docs/fidelity.md): `lag` is the summary's drift_ms (p50, p99, max
        over the same sends), `cache` the run's cache section or None (`cache_skipped`: why, when
        it is not for want of the server's block size), `server` the run's server section
        (replay.results.server_metrics: the /metrics counters over the run) or None, `host` how
        busy the host was while the run sent (replay.results.host_load.figures) or None. Called once."""
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
            "host": host,
        }
        # late sends that mostly waited for other sends to leave are the replay's own pace, on any host
        schedule["queued"] = bool(schedule["late_queued"]) and \
            schedule["late_queued"] >= QUEUED_SHARE * schedule["late_checked"]
        schedule["busy_host"] = None if schedule["queued"] else busy_host(host)
        counted = self.prompt_exact + self.prompt_mismatch
        prompts = {
            "ok_rows": self.ok,
            "counted": counted,
            "exact": self.prompt_exact,
            "exact_share": _share(self.prompt_exact, counted),
            "mismatches": self.prompt_mismatch,
            "mismatch_worst": _worst(self._mismatches),
            "uncounted": self.prompt_uncounted,
            "unsaid": self.prompt_unsaid,
        }
        answered = sum(self.outputs.values())
        outputs = {
            "sent": answered,
            "ignore_eos": self.ignore_eos,
            "exact": self.outputs["exact"],
            "exact_share": _share(self.outputs["exact"], answered),
            "others": {reason: n for reason, n in self.outputs.items() if reason != "exact"},
        }
        server_ttft = {"compared": dict(sorted(self.ttft_compared.items())), "bound_ms": CLIENT_EXCESS_MS,
                       "over_bound": dict(sorted(self.ttft_over.items())), "over_worst": _worst(self._ttft_over),
                       "server_over_client": self.server_over_client}
        cert: dict[str, Any] = {
            "schedule": schedule, "prompts": prompts, "outputs": outputs,
            "usage": usage_check(server, self.sent_tokens, self.cached_counted > 0, self.sent_unsaid),
            "cache": cache_lines(cache, cache_skipped), "server_ttft": server_ttft,
        }  # fmt: skip
        if smaller := smaller_than_declared(server, cert["cache"]["misses"]):
            cert["cache"]["smaller_than_declared"] = smaller
        cert["verdict"], cert["failing"], cert["unchecked"], cert["remedies"] = verdict(cert)
        return cert


def cache_lines(cache: dict | None, skipped: str | None = None) -> dict:
    """The certificate's cache section: the infinite-cache comparison as the run computed it,
    and the finite-cache model's miss causes where the hook gives them; `skipped`: why there is
    no comparison, when not for want of the server's block size."""
    if not cache:
        return {"infinite": None, "misses": None, **({"skipped": skipped} if skipped else {})}
    infinite = {key: value for key, value in cache.items() if key != "misses"}
    return {"infinite": infinite, "misses": miss_attribution(cache)}


AGREES, DISAGREES, ABSENT, UNKNOWN = "agrees", "disagrees", "absent", "unknown"


def usage_check(server: dict | None, sent_tokens: dict[str, int], cached_present: bool,
                sent_unsaid: set[str] | None = None) -> dict | None:
    """The server's usage (the records' prompt and cached tokens) against its own /metrics
    counters over the run, over the endpoints that have them; None without counters. Each
    figure's `status`: `agrees` (equal), `disagrees` (they differ while the prompt-token counter
    counted exactly the tokens the run sent, so no other traffic explains it: the usage is false),
    `absent` (no ok record has cached_tokens), `unknown` (no counter, preemptions, or other traffic).
    `sent` is None when an endpoint with counters took rows of their own prompts (`sent_unsaid`):
    only the server counted those, so nothing tells its usage from its counters."""
    total = (server or {}).get("total")
    if not total:
        return None
    without = set(total.get("endpoints_without_metrics") or ())
    sent = None if (sent_unsaid or set()) - without else sum(n for endpoint, n in sent_tokens.items() if endpoint not in without)
    counted_prompts, usage_prompts = total.get("prompt_tokens"), total.get("records_prompt_tokens")
    hits, usage_hits = total.get("prefix_cache_hits"), total.get("records_cached_tokens")
    alone = counted_prompts == sent and not total.get("preemptions")  # the counters count this run's prompts only

    def status(counter, usage, present: bool = True) -> str:
        if counter is None or usage is None:
            return UNKNOWN
        if not present:
            return ABSENT
        if counter == usage:
            return AGREES
        return DISAGREES if alone else UNKNOWN

    return {
        "prompt_tokens": {"usage": usage_prompts, "counters": counted_prompts, "sent": sent,
                          "status": status(counted_prompts, usage_prompts)},
        "cached_tokens": {"usage": usage_hits, "counters": hits,
                          "status": status(hits, usage_hits, cached_present)},
    }


SMALLER_FACTOR, SMALLER_MARGIN = 2.0, 0.05  # a server's KV usage above the model's peak by this much


def smaller_than_declared(server: dict | None, misses: dict | None) -> list[dict]:
    """The endpoints whose KV-cache usage (vllm:kv_cache_usage_perc, its peak over the run's
    scrapes) went well above the most the model of their declared pool ever held: their cache is
    smaller than the pool size the model was given, so a block it "must hold" proves nothing
    (their must-hold prompt-differs are not judged). An honest server's sampled peak is at most
    the model's (which takes a request's output blocks at its start)."""
    endpoints = (server or {}).get("endpoints") or {}
    out = []
    for name, figures in ((misses or {}).get("model") or {}).get("endpoints", {}).items():
        said = (endpoints.get(name) or {}).get("peak_kv_cache_usage")
        modelled = figures.get("peak_usage")
        if said is None or modelled is None or said <= SMALLER_FACTOR * modelled + SMALLER_MARGIN:
            continue
        out.append({"endpoint": name, "server_peak_usage": said, "model_peak_usage": modelled,
                    "num_gpu_blocks": figures.get("num_gpu_blocks"),
                    "prompt_differs_held": figures.get("prompt_differs_held") or 0})
    return out


def _untrusted(usage: dict | None) -> list[str]:
    """The usage figures the server's counters contradict."""
    return [name for name, figure in (usage or {}).items() if figure["status"] == DISAGREES]


def _counter_judgement(cert: dict) -> tuple[str, str] | None:
    """The cache line judged from the server's prefix-cache hit counter, where its usage cannot
    be (false, or no cached_tokens): (kind, failing text), ("", "") when it passes, None when
    nothing can judge it. The counter must lie in the range the run's own prompts allow: the
    infinite cache's low and high over every request (the server's order of requests in flight
    together), the low end lowered to the finite-cache model's prediction (evictions). Nothing
    judges where the server counted prompts the run did not send (others' hits are counted too)."""
    usage, c = cert["usage"], cert["cache"]
    if usage is None or c["infinite"] is None or "all_requests" not in c["infinite"]:
        return None
    hits, prompts = usage["cached_tokens"]["counters"], usage["prompt_tokens"]
    if hits is None or prompts["counters"] is None or prompts["sent"] is None or prompts["counters"] > prompts["sent"]:
        return None
    every = c["infinite"]["all_requests"]
    low, high = every["low"], every["high"]
    misses = c["misses"]
    if misses is not None and misses.get("model", {}).get("predicted_cached_tokens_all") is not None:
        low = min(low, misses["model"]["predicted_cached_tokens_all"])
    c["counters"] = {"prefix_cache_hits": hits, "low": low, "high": high}
    if low <= hits <= high:
        return "", ""
    if hits > high and misses is not None and misses.get("served_before"):
        return WARM_CACHE, (f"cache: the server's counters show {hits} prefix-cache hit tokens, more than the {high} "
                            "this run's prompts can give: its cache held prompts from before the run")
    return UNFAITHFUL, (f"cache: the server's counters show {hits} prefix-cache hit tokens, outside the {low}..{high} "
                        "this run's prompts give (its usage cannot name the requests)")


def _fingerprints_differ(cache: dict) -> str | None:
    """The failing line of prompts sent otherwise than the trace says: their records' fingerprints
    against the re-synthesis of the cache section (replay.rules.prompt_fingerprint). Direct
    evidence of a replay bug, whatever the server says."""
    found = (cache.get("infinite") or {}).get("fingerprints") or {}
    if not found.get("differ"):
        return None
    first = found["examples"][0]
    return (f"prompts: {found['differ']} of {found['checked']} prompts sent differ from the trace's (their "
            f"prompt_fingerprint against the re-synthesis; request {first['request_id']} agreed only through "
            f"token {first['agreed_tokens']})")


def verdict(cert: dict) -> tuple[str, list[str], list[str], list[str]]:
    """(the verdict, the failing lines, the lines nothing could check, the remedies). A line with
    nothing to judge is unchecked and fails nothing, but a run that sent nothing fails. Each
    failing line has a kind (VERDICTS); the verdict is the first kind found, in that order. The
    cache section gets `judged_from` (and, judged from the counters, `counters`)."""
    failing: list[tuple[str, str]] = []
    unchecked: list[str] = []
    s = cert["schedule"]
    if not s["sends"]:
        failing.append((NOTHING_SENT, "schedule: no request was sent"))
    elif s["on_time_share"] < ON_TIME_SHARE_MIN:
        text = (f"schedule: {100 * s['on_time_share']:.2f}% of sends within {ON_TIME_MS:g} ms of their time "
                f"(needs >= {100 * ON_TIME_SHARE_MIN:g}%); {s['late']} late by > {LATE_MS:g} ms")
        busy = s.get("busy_host")
        if s.get("queued"):
            failing.append((UNFAITHFUL, f"{text}; {s['late_queued']} of the {s['late_checked']} sends over "
                                        f"{ON_TIME_MS:g} ms late waited for other sends to leave: the replay could not "
                                        "send this fast (more workers: --processes N, docs/distributed.md)"))
        elif busy:
            failing.append((BUSY_HOST, f"{text}; the host was busy: {busy}"))
        else:
            limited = client_limited(s.get("host"))
            failing.append((UNFAITHFUL, f"{text}; {limited}" if limited else text))
    usage = cert.get("usage")
    untrusted = _untrusted(usage)
    p = cert["prompts"]
    if "prompt_tokens" in untrusted:
        pass  # the counter counted exactly the tokens sent (what `disagrees` means): the prompts are exact
    elif not p["counted"] and p["ok_rows"] and p.get("unsaid") == p["ok_rows"]:
        unchecked.append("prompts: every row gave its own prompt, sent as it is: no length to match")
    elif not p["counted"]:
        unchecked.append("prompts: the server counted no prompt (no usage)")
    elif p["exact_share"] < PROMPTS_EXACT_MIN:
        failing.append((UNFAITHFUL, f"prompts: {p['mismatches']} of {p['counted']} prompts the server counted differ "
                                    "from the trace's input_length (needs 100% exact)"))
    if differ := _fingerprints_differ(cert["cache"]):
        failing.append((UNFAITHFUL, differ))
    misses = cert["cache"]["misses"]
    cached_status = (usage or {}).get("cached_tokens", {}).get("status")
    if untrusted or cached_status == ABSENT:
        judged = _counter_judgement(cert)
        cert["cache"]["judged_from"] = "counters" if judged is not None else None
        if judged is None:
            unchecked.append("cache: the server's usage cannot be taken and its counters cannot judge (none, or they "
                             "count other traffic too)")
        elif judged[0]:
            failing.append(judged)
    elif misses is None:
        unchecked.append("cache: no miss attribution (no finite-cache model of the server)")
    else:
        cert["cache"]["judged_from"] = "usage"
        for smaller in cert["cache"].get("smaller_than_declared") or ():
            unchecked.append(
                f"cache: {smaller['endpoint']}'s KV-cache usage peaked at {100 * smaller['server_peak_usage']:.1f}% where "
                f"its declared {smaller['num_gpu_blocks']} blocks would have held at most "
                f"{100 * smaller['model_peak_usage']:.2f}%: its cache is smaller than that, so its "
                f"{smaller['prompt_differs_held']} misses of blocks such a cache must hold are not judged (pass "
                "--server-cache-blocks with its real size)")
        prompts = (usage or {}).get("prompt_tokens") or {}
        others = (prompts["counters"] - prompts["sent"]  # prompt tokens the server counted that the run did not send
                  if prompts.get("counters") is not None and prompts.get("sent") is not None else 0)
        beyond = ((misses.get("model") or {}).get("beyond_causes") or {}).get("unexplained", {}).get("requests", 0)
        if others > 0 and beyond:  # more hits than this run's prompts give, while others' prompts were served
            failing.append((SHARED_SERVER, f"cache: {beyond} requests hit more than this run's prompts give while the "
                                           f"server served other traffic ({others} prompt tokens the run did not send)"))
        unverifiable = prompts.get("counters") is not None and prompts.get("sent") is None
        for cause in FAILING_CAUSES:
            n = (misses["causes"].get(cause) or {}).get("requests") or 0
            if cause == "unexplained" and others > 0:
                n = max(n - beyond, 0)
            if n and cause == "unexplained" and unverifiable:  # the usage may be false; nothing can tell
                unchecked.append(f"cache: {n} requests unexplained are not blamed: the run sent rows of their own "
                                 "prompts, which only the server counts, so its usage cannot be checked against its "
                                 "counters")
            elif n:
                failing.append((UNFAITHFUL, f"cache: {n} requests {cause} (needs 0)"))
        unproven = (misses["causes"].get("no-fingerprint") or {}).get("requests") or 0
        if unproven:
            why = ((cert["cache"]["infinite"] or {}).get("fingerprints") or {}).get("unchecked")
            why = (f"the records' prompt fingerprints were not compared: {why}" if why else
                   "their records have no prompt_fingerprint (a run from before it)")
            unchecked.append(f"cache: {unproven} misses the model finds no cause for are not blamed: {why}, so whether "
                             "the prompt sent differed from the trace's is not known")
        warm = (misses["causes"].get("warm-at-start") or {}).get("requests") or 0
        if warm:
            failing.append((WARM_CACHE, f"cache: {warm} requests hit prompts cached before this run (warm-at-start)"))
    ttft_failing, ttft_unchecked = _server_ttft_lines(cert.get("server_ttft"))
    failing += ttft_failing
    unchecked += ttft_unchecked
    kinds = {kind for kind, _ in failing}
    found = next((kind for kind in VERDICTS[1:] if kind in kinds), FAITHFUL)
    remedies = [REMEDIES[kind] for kind in VERDICTS[1:] if kind in kinds and kind in REMEDIES]
    return found, [text for _, text in failing], unchecked, remedies


def _server_ttft_lines(section: dict | None) -> tuple[list[tuple[str, str]], list[str]]:
    """(failing, unchecked) of the client's TTFT against the server's own. A trace span's counts
    from the server's arrival: a client over it by more than CLIENT_EXCESS_MS was slow to send or
    to read, or its network was: the run's TTFT is then not the server's, which fails it (more
    than CLIENT_EXCESS_SHARE of the spans' requests). An answer's counts from its engine's queue,
    after the server's front end (its parsing and tokenization, which a busy server queues too),
    so the excess is not judged from answers alone. A server TTFT over the client's is no truth."""
    if not section or not section["compared"]:
        return [], []
    failing, unchecked = [], []
    spans, over = section["compared"].get(FROM_SPAN, 0), section["over_bound"].get(FROM_SPAN, 0)
    if spans and over > CLIENT_EXCESS_SHARE * spans:
        failing.append((UNFAITHFUL, f"server TTFT: {over} of {spans} requests' TTFT exceeds the server's own (its trace "
                                    f"span's, from its arrival) by > {section['bound_ms']:g} ms (needs <= "
                                    f"{100 * CLIENT_EXCESS_SHARE:g}%): their TTFT is the client's or the network's, "
                                    "not the server's"))
    answers = section["compared"].get(FROM_ANSWER, 0)
    if answers and not spans:
        unchecked.append(f"server TTFT: {answers} requests' server TTFT is their answers' (queue + prefill), which "
                         "leaves out the server's front end: the client's excess over it is not judged (trace spans "
                         "time the front end: --otlp-receiver)")
    if section["server_over_client"]:
        unchecked.append(f"server TTFT: {section['server_over_client']} requests' server TTFT exceeds the client's by "
                         f"> {SERVER_OVER_CLIENT_MS:g} ms, which cannot be true: the server's timing is not evidence")
    return failing, unchecked


def _ms(value) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _pct(value) -> str:
    return "n/a" if value is None else f"{100 * value:.2f}%"


def _arrival_lines(s: dict, line) -> list[str]:
    """The inter-arrival KS lines, said not to be judged (each send's own lag is); where the
    statistic with gaps under the on-time tolerance taken as 0 is much lower, that one too, and
    why: rows due at one instant leave one after another, microseconds apart."""
    if s["inter_arrival_ks"] is None:
        return []
    out = [line("Inter-arrival KS (achieved vs due):", f"{s['inter_arrival_ks']:.4f} (not judged: each send's lag is)")]
    coarse = s.get("inter_arrival_ks_at_resolution")
    if coarse is not None and s["inter_arrival_ks"] - coarse >= 0.05:
        out.append(f"  {coarse:.4f} with gaps under {s['inter_arrival_ks_resolution_ms']:g} ms as 0: rows due at one "
                   "instant leave one after another, microseconds apart")
    return out


def format_certificate(cert: dict, width: int) -> list[str]:
    """The certificate's lines in the summary's block layout."""
    line = lambda label, value: f"{label:<40} {value!s:<10}"  # noqa: E731
    s, p, o, c = cert["schedule"], cert["prompts"], cert["outputs"], cert["cache"]
    out = ["{s:-^{n}}".format(s="Fidelity Certificate", n=width)]
    out.append(line("Verdict:", cert["verdict"]))
    out.extend(f"  failing: {f}" for f in cert["failing"])
    out.extend(f"  remedy: {r}" for r in cert.get("remedies") or ())
    out.extend(f"  not checked: {u}" for u in cert["unchecked"])
    out.append(line("Send lag p50/p99/max (ms):",
                    f"{_ms(s['lag_ms']['p50'])}/{_ms(s['lag_ms']['p99'])}/{_ms(s['lag_ms']['max'])}"))
    out.append(line(f"Sends within {ON_TIME_MS:g} ms:", f"{_pct(s['on_time_share'])} of {s['sends']}"))
    out.append(line(f"Sends late by > {LATE_MS:g} ms:", s["late"]))
    for w in s["late_worst"][:5]:
        out.append(f"  request {w['request_id']} (worker {w['worker']}): {w['lag_ms']:.2f} ms late")
    if host := describe(s.get("host")):
        out.append(line("Host while sending:", host))
    out.extend(_arrival_lines(s, line))
    if s["count_gap_s"] is not None:
        out.append(line("Largest cumulative-count gap:",
                        f"{s['count_gap_requests']} req, {s['count_gap_s']:.3f} s"))
    usage = cert.get("usage") or {}
    for name, figure in usage.items():
        if figure["status"] in (DISAGREES, ABSENT):
            said = "none in usage" if figure["status"] == ABSENT else f"usage {figure['usage']}"
            out.append(line(f"Server {name} (usage / /metrics):",
                            f"{said} / {figure['counters']}: {figure['status']}, judged from /metrics"))
    if "prompt_tokens" in _untrusted(usage):
        figure = usage["prompt_tokens"]
        out.append(line("Prompts exact (server /metrics):", f"{figure['counters']} tokens counted of {figure['sent']} "
                                                            "sent"))
    else:
        out.append(line("Prompts exact (server-counted):", f"{_pct(p['exact_share'])} of {p['counted']}"))
    if p["mismatches"] and "prompt_tokens" not in _untrusted(usage):
        for w in p["mismatch_worst"][:5]:
            out.append(f"  request {w['request_id']}: {w['prompt_tokens']} counted, input_length "
                       f"{w['input_length']} ({w['difference']:+d})")
    if p["uncounted"]:
        out.append(line("  ok rows without a server count:", p["uncounted"]))
    if p.get("unsaid"):
        out.append(line("  ok rows of their own prompts (not compared):", p["unsaid"]))
    fingerprints = (c["infinite"] or {}).get("fingerprints")
    if fingerprints and (fingerprints["checked"] or fingerprints["without"]):
        out.append(line("Prompts as sent (fingerprints):", f"{fingerprints['checked'] - fingerprints['differ']} of "
                                                           f"{fingerprints['checked']} the trace's"
                                                           + (f", {fingerprints['without']} without"
                                                              if fingerprints["without"] else "")))
        for e in fingerprints["examples"][:5]:
            out.append(f"  request {e['request_id']}: agreed only through token {e['agreed_tokens']}")
    ttft = cert.get("server_ttft") or {}
    if compared := sum((ttft.get("compared") or {}).values()):
        over = sum((ttft.get("over_bound") or {}).values())
        out.append(line(f"Client TTFT over server's by > {ttft['bound_ms']:g} ms:", f"{over} of {compared}"))
        for w in ttft["over_worst"][:3]:
            out.append(f"  request {w['request_id']}: client {w['ttft_ms']:.1f} ms, server {w['server_ttft_ms']:.1f} ms "
                       f"({w['source']})")
    out.append(line("Outputs of exact length:", f"{_pct(o['exact_share'])} of {o['sent']}"))
    for reason, n in o["others"].items():
        if n:
            out.append(f"  {n} x {reason}")
    misses = c["misses"]
    if c.get("judged_from") == "counters":
        counters = c.get("counters") or {}
        if counters:
            out.append(line("Cache hits (server /metrics, expected):",
                            f"{counters['prefix_cache_hits']}, {counters['low']}..{counters['high']}"))
        if misses is not None and _untrusted(usage):
            out.append("  (the per-request causes rest on the server's usage, which its counters contradict: "
                       "not judged)")
    elif misses is not None:
        for cause in MISS_CAUSES:
            count = misses["causes"].get(cause) or {}
            if count.get("requests"):
                out.append(f"  cache {cause}: {count['requests']} requests, {count.get('tokens', 0)} tokens")
        out.extend(f"  {note}" for note in misses.get("notes") or ())
    elif c["infinite"] is None:
        out.append(f"  cache: not computed ({c.get('skipped') or 'the server said no block size: pass --server-block-size N'})")
    return out

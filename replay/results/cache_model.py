"""A model of the SERVER's finite prefix cache, and a cause for every cached-token count that
differs from the infinite-cache expectation (replay/results/fidelity.py).

Each endpoint gets vLLM's block pool (replay.rules.block_pool) at the server's block size and
number of blocks (vllm:cache_config_info, or --server-block-size / --server-cache-blocks), fed
with the requests that went there in the order the server received them: a request takes its
blocks when the server scheduled it (`started_at`: its send, or later when it waited in the
server's queue, `scheduled_at`; first come first served, so never before an earlier one) and
gives them back at its end (`finished_at`), so running requests' blocks are pinned and freed
blocks are evicted least recently used, a prefix's tail first. Its prediction for a request is
what the pool holds of the prompt when it is scheduled.

Causes, one per request whose observed count differs from the expectation (`expected`: the
fleet-wide infinite cache in send order; or the trace's own `ideal` when the caller gives it and
it is larger), decided by the first server block the server did not give (`observed // block`):

below the expectation (a miss):
- `prompt-differs`: the record's fingerprint of the prompt as sent (replay.rules.prompt_fingerprint)
  differs from the trace's before the end of the expected hits, or the missing block was last
  cached by a request whose fingerprint differs there: our prompts do not share what the trace
  says they share. Only this evidence blames the replay;
- `server-missed`: the fingerprint proves the prompt the trace's through the expected hits, yet
  the server counted another length of it, or did not give a block its pool must hold (cached
  there and held by a running request, or the pool never had to evict): the server's doing;
- `no-fingerprint`: the same two findings on a record without a fingerprint (a run from before
  it): whether the prompt differed is not known, so nobody is blamed;
- `in-flight`: the count lies in the range the reorder window allows (CacheCheck.explained: a
  request sent within the window of its prefix's first one may reach the server first);
- `partial-block`: the server gave every whole block the expectation has: the rest of the
  shared prefix ends inside a server block (only with an `ideal`);
- `routed-elsewhere`: the missing block is cached on another endpoint of the fleet, not here;
- `evicted`: it is cached nowhere (the fleet's infinite cache had it: a pool let it go), or
  here in a block the pool could evict while it evicts (the server let it go a little sooner
  than the model);
- `unexplained`: a count of no whole number of blocks (vLLM's hits are whole blocks).

above the expectation: `in-flight` (within the reorder window's range), `warm-at-start` (the
server's prefix-cache counters showed prompts served before this run's first send: its cache
may hold them), or `unexplained`.

Streaming and memory: requests come in send order (by sent_at, then request_id: what
replay.results.cache_child's order gives); ends wait in a heap of each endpoint's running requests; so the
state is the pools (bounded by their sizes), the running requests and the reorder window.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from replay.results.fidelity import CacheCheck, answered_at, scheduled, send_order_checks
from replay.results.records import Record
from replay.results.server_metrics import read_samples
from replay.rules.block_pool import BlockPool
from replay.rules.prefix_cache import block_hashes, hit_tokens
from replay.rules.prompt_fingerprint import agreed_tokens

EVICTED = "evicted"
ROUTED_ELSEWHERE = "routed-elsewhere"
PARTIAL_BLOCK = "partial-block"
PROMPT_DIFFERS = "prompt-differs"
SERVER_MISSED = "server-missed"
NO_FINGERPRINT = "no-fingerprint"
IN_FLIGHT = "in-flight"
WARM_AT_START = "warm-at-start"
UNEXPLAINED = "unexplained"
MISS_CAUSES = (EVICTED, ROUTED_ELSEWHERE, PARTIAL_BLOCK, PROMPT_DIFFERS, SERVER_MISSED, NO_FINGERPRINT, IN_FLIGHT,
               UNEXPLAINED)
BEYOND_CAUSES = (IN_FLIGHT, WARM_AT_START, UNEXPLAINED)
EXAMPLES = 10  # request ids kept per cause and endpoint
DIFFERS_NOTE = ("prompts as sent (their fingerprints) do not share what the trace says they share: "
                "a replay bug")  # the note of prompt-differs


@dataclass(frozen=True)
class ServerCache:
    """One endpoint's cache as the server says it (vllm:cache_config_info): its pool's blocks
    (vLLM's num_gpu_blocks, the null block included) and whether it had served prompts before
    the run's first send (its prefix-cache counters at the start: its cache may be warm)."""

    num_gpu_blocks: int
    served_before: bool = False


class ModelPrompt(NamedTuple):
    """A request the server took in, as the model needs it (a SentPrompt's fields first: it is
    one for send_order_checks too)."""

    request_id: int
    sent_at: float
    reported_prompt_tokens: int | None  # the server's count (usage)
    observed: int | None  # the server's cached tokens
    hashes: Sequence[int]  # its prompt's full server blocks' chain hashes (rules.prefix_cache.block_hashes)
    prompt_tokens: int  # its prompt's length, as we made it
    endpoint: str
    finished_at: float | None  # None: it ended at once
    output_tokens: int  # tokens it generated: blocks it held while it ran
    ideal: int | None = None  # the trace's own expectation (trace blocks), when the caller has one
    started_at: float | None = None  # when the server scheduled it, as estimated (`scheduled_at`); None: sent_at
    answered_at: float | None = None  # its first token came back: scheduled by then (replay.results.fidelity)
    # server tokens from its start its prompt as sent is proven the trace's by its fingerprint
    # (replay.rules.prompt_fingerprint.agreed_tokens: math.inf, all of it); None: no fingerprint
    agreed: float | None = None


@dataclass(slots=True)
class CacheVerdict:
    """The model's word on one request."""

    request_id: int
    endpoint: str
    expected: int  # the reference: max(the infinite cache's, the trace's ideal)
    predicted: int  # what the endpoint's pool held of the prompt when the server scheduled it
    observed: int | None
    cause: str | None  # None: observed equals the expectation (or no count)
    check: CacheCheck

    @property
    def exact(self) -> bool:
        return self.observed == self.predicted

    @property
    def difference(self) -> int:
        """Tokens above (> 0) or below (< 0) the expectation."""
        return (self.observed or 0) - self.expected if self.observed is not None else 0


class _Endpoint:
    def __init__(self, block_size: int, server: ServerCache):
        self.server = server
        self.pool = BlockPool(block_size, server.num_gpu_blocks)
        self.running: list[tuple[float, int, list[int]]] = []  # a heap of (finished_at, serial, blocks)
        self.last_start = float("-inf")  # the server schedules first come, first served
        self.peak_usage = 0.0  # the most of the pool running requests held (vLLM's kv_cache_usage_perc)
        self.held_differs = 0  # misses of a block the pool must hold (server-missed, no-fingerprint; not by a count)

    def end_until(self, t: float) -> None:
        running = self.running
        while running and running[0][0] <= t:
            self.pool.free(heapq.heappop(running)[2])

    @property
    def pressed(self) -> bool:
        """Has the pool had to evict (or lend beyond its size)?"""
        return bool(self.pool.evictions or self.pool.overflow)


class CacheModel:
    """The pools of a fleet, fed one request at a time in send order (`observe`), then `close`d."""

    def __init__(self, block_size: int, servers: Mapping[str, ServerCache], default: ServerCache | None = None):
        if block_size < 1:
            raise ValueError(f"server block size must be positive, got {block_size}")
        self.block_size = block_size
        self.servers = dict(servers)
        self.default = default
        self.endpoints: dict[str, _Endpoint] = {}
        self._serial = 0
        self.tally = CauseTally()
        # blocks whose latest sender's fingerprint differs there: the server cached other words
        self.tainted: set[int] = set()

    def _endpoint(self, name: str) -> _Endpoint | None:
        if name not in self.endpoints:
            server = self.servers.get(name, self.default)
            if server is None:
                return None
            self.endpoints[name] = _Endpoint(self.block_size, server)
        return self.endpoints[name]

    def observe(self, prompt: ModelPrompt, check: CacheCheck) -> CacheVerdict:
        """The verdict on `prompt` (the next in send order; `check`: its infinite-cache check)."""
        size = self.block_size
        here = self._endpoint(prompt.endpoint)
        start = prompt.sent_at if prompt.started_at is None else max(prompt.started_at, prompt.sent_at)
        if here is not None:
            start = here.last_start = max(start, here.last_start)
            here.end_until(start)
        hashes, length = prompt.hashes, prompt.prompt_tokens
        hit = here.pool.hit_blocks(hashes, length) if here else 0
        predicted = hit_tokens(hit, size, length)
        expected = max(check.expected, prompt.ideal or 0)
        cause = None
        observed = prompt.observed
        if observed is not None and observed != expected:
            cause = (self._miss(prompt, check, here, expected) if observed < expected
                     else self._beyond(check, here))  # fmt: skip
        if here is not None:
            _, held = here.pool.allocate(hashes, length, max(prompt.output_tokens, 0), hit)
            here.peak_usage = max(here.peak_usage, here.pool.usage())
            if cause in (SERVER_MISSED, NO_FINGERPRINT) and prompt.reported_prompt_tokens in (None, length):
                here.held_differs += 1
            end = prompt.finished_at if prompt.finished_at is not None else start
            self._serial += 1
            heapq.heappush(here.running, (max(end, start), self._serial, held))
        if prompt.agreed is not None and (self.tainted or prompt.agreed != math.inf):
            self._taint(hashes, prompt.agreed)
        verdict = CacheVerdict(prompt.request_id, prompt.endpoint, expected, predicted, observed, cause, check)
        self.tally.add(verdict)
        return verdict

    def _miss(self, prompt: ModelPrompt, check: CacheCheck, here: _Endpoint | None, expected: int) -> str:
        size, observed = self.block_size, prompt.observed
        if prompt.agreed is not None and prompt.agreed < expected:  # the sent prompt differs where it should hit
            return PROMPT_DIFFERS
        # the prompt differs by indirect evidence only: blamed on the replay by none of these
        differs = NO_FINGERPRINT if prompt.agreed is None else SERVER_MISSED
        reported = prompt.reported_prompt_tokens
        if reported is not None and reported != prompt.prompt_tokens:
            return differs
        if observed >= check.expected:  # every whole block the infinite cache has: the ideal's rest is in a block
            return PARTIAL_BLOCK
        if check.low <= observed <= check.high:
            return IN_FLIGHT
        if observed % size or here is None:
            return UNEXPLAINED
        missing = prompt.hashes[observed // size]
        if missing in self.tainted:  # the request that cached it sent other words there (its fingerprint)
            return PROMPT_DIFFERS
        if missing in here.pool:
            return EVICTED if here.pressed and not here.pool.holds(missing) else differs
        if any(missing in other.pool for name, other in self.endpoints.items() if other is not here):
            return ROUTED_ELSEWHERE
        return EVICTED

    def _taint(self, hashes: Sequence[int], agreed: float) -> None:
        """A request whose fingerprint proves its first `agreed` tokens the trace's cached `hashes`:
        its blocks past them hold other words than the trace's (chain hashes: every later one too),
        those before are the trace's again."""
        first = len(hashes) if agreed == math.inf else int(agreed) // self.block_size
        for k, h in enumerate(hashes):
            if k < first:
                self.tainted.discard(h)
            else:
                self.tainted.add(h)

    @staticmethod
    def _beyond(check: CacheCheck, here: _Endpoint | None) -> str:
        if check.low <= check.observed <= check.high:
            return IN_FLIGHT
        if here is not None and here.server.served_before:
            return WARM_AT_START
        return UNEXPLAINED

    def close(self) -> None:
        """Every request has ended: the pools get their blocks back."""
        for endpoint in self.endpoints.values():
            endpoint.end_until(float("inf"))


def model_checks(prompts: Iterable[ModelPrompt], block_size: int, servers: Mapping[str, ServerCache], *,
                 default: ServerCache | None = None, reorder_window_ms: float = 0.0,
                 model: CacheModel | None = None) -> Iterator[CacheVerdict]:
    """A CacheVerdict per prompt of `prompts` (in send order: sorted by (sent_at, request_id)),
    drawn one at a time; the infinite-cache checks are send_order_checks' over the same prompts.
    `model`: a CacheModel to feed (its `tally` counts them all), else a new one."""
    model = model or CacheModel(block_size, servers, default)
    pending: deque[ModelPrompt] = deque()  # drawn by send_order_checks, not yet modelled (the window)

    def drawn() -> Iterator[ModelPrompt]:
        for prompt in prompts:
            pending.append(prompt)
            yield prompt

    for check in send_order_checks(drawn(), block_size, reorder_window_ms):
        yield model.observe(pending.popleft(), check)
    model.close()


@dataclass
class _Count:
    requests: int = 0
    tokens: int = 0
    examples: list[int] = field(default_factory=list)

    def add(self, tokens: int, request_id: int) -> None:
        self.requests += 1
        self.tokens += tokens
        if len(self.examples) < EXAMPLES:
            self.examples.append(request_id)

    def to_dict(self) -> dict:
        return {"requests": self.requests, "tokens": self.tokens, "examples": self.examples}


@dataclass
class _EndpointTally:
    compared: int = 0
    exact: int = 0
    predicted: int = 0
    observed: int = 0
    misses: dict[str, _Count] = field(default_factory=dict)
    beyond: dict[str, _Count] = field(default_factory=dict)


class CauseTally:
    """Counts of verdicts, per endpoint and cause (none is kept but a few request ids)."""

    def __init__(self) -> None:
        self.endpoints: dict[str, _EndpointTally] = {}
        self.predicted_all = 0  # every request's prediction, with a count or not: against the server's counters

    def add(self, v: CacheVerdict) -> None:
        self.predicted_all += v.predicted
        if v.observed is None:
            return
        t = self.endpoints.setdefault(v.endpoint, _EndpointTally())
        t.compared += 1
        t.exact += v.exact
        t.predicted += v.predicted
        t.observed += v.observed
        if v.cause is not None:
            causes = t.misses if v.observed < v.expected else t.beyond
            causes.setdefault(v.cause, _Count()).add(abs(v.difference), v.request_id)

    def section(self, model: CacheModel | None = None) -> dict:
        """The cache model's figures: per endpoint and for the fleet, requests compared, the share
        the model predicted exactly, and per cause the requests and tokens lost (misses) or
        gained (beyond) with a few request ids; `model` adds each pool's size and evictions."""
        fleet = _EndpointTally()
        endpoints = {}
        for name, t in sorted(self.endpoints.items()):
            _merge(fleet, t)
            endpoints[name] = _figures(t)
            if model is not None and name in model.endpoints:
                pool = model.endpoints[name].pool
                endpoints[name].update(num_gpu_blocks=pool.num_gpu_blocks, evictions=pool.evictions,
                                       overflow_blocks=pool.overflow, peak_usage=model.endpoints[name].peak_usage,
                                       prompt_differs_held=model.endpoints[name].held_differs)
        return {**_figures(fleet), "predicted_cached_tokens_all": self.predicted_all, "endpoints": endpoints}


def attribution(model: CacheModel, notes: Sequence[str] = ()) -> dict:
    """The certificate's MissAttribution (replay.results.certificate) of a fed and closed
    `model`: per cause, the requests and the tokens lost (misses) or gained (hits beyond the
    expectation) over the fleet and per endpoint; the share predicted exactly; the block size
    and pool size; the notes (`notes` first, then what the causes call for); and under
    "model" the tally's full figures (examples, per endpoint pools)."""
    section = model.tally.section(model)
    sizes = {e.pool.num_gpu_blocks for e in model.endpoints.values()}
    return {
        "causes": _causes(section),
        "endpoints": {name: _causes(figures) for name, figures in section["endpoints"].items()},
        "predicted_exact_share": section["exact_share"],
        "block_size": model.block_size,
        "capacity_blocks": sizes.pop() if len(sizes) == 1 else None,  # None: the endpoints' differ (see model)
        "served_before": sorted(name for name, server in model.servers.items() if server.served_before),
        "notes": [*notes, *_notes(section)],
        "model": section,
    }


def _causes(figures: dict) -> dict[str, dict[str, int]]:
    """{cause: {"requests", "tokens"}} of every cause: a miss's and a hit beyond's added."""
    out = {cause: {"requests": 0, "tokens": 0} for cause in (*MISS_CAUSES, WARM_AT_START)}
    for causes in (figures["miss_causes"], figures["beyond_causes"]):
        for cause, count in causes.items():
            out[cause]["requests"] += count["requests"]
            out[cause]["tokens"] += count["tokens"]
    return out


def _notes(section: dict) -> list[str]:
    """What the causes found call for, one line each."""
    notes = []
    warm = section["beyond_causes"].get(WARM_AT_START)
    if warm:
        notes.append(f"the server's cache was warm at the start ({warm['requests']} requests hit blocks this run had "
                     "not cached): replay with --reset-server-cache (vLLM with VLLM_SERVER_DEV_MODE=1, replay sim) "
                     "or another --seed")
    routed = section["miss_causes"].get(ROUTED_ELSEWHERE)
    if routed:
        notes.append(f"{routed['requests']} misses found their prefix cached on another endpoint: --routing session "
                     "keeps a session's turns on one")
    differs = section["miss_causes"].get(PROMPT_DIFFERS)
    if differs:
        notes.append(f"{differs['requests']} {DIFFERS_NOTE} (requests {', '.join(map(str, differs['examples'][:5]))})")
    missed = section["miss_causes"].get(SERVER_MISSED)
    if missed:
        notes.append(f"{missed['requests']} misses of prompts their fingerprints prove the trace's: the server did not "
                     "give blocks its pool must hold, or counted the prompt otherwise (requests "
                     f"{', '.join(map(str, missed['examples'][:5]))})")
    unproven = section["miss_causes"].get(NO_FINGERPRINT)
    if unproven:
        notes.append(f"{unproven['requests']} misses the model cannot explain are nobody's: no prompt fingerprint "
                     "proves whether the prompt sent differed (none in their records, or not compared)")
    return notes


def _merge(into: _EndpointTally, t: _EndpointTally) -> None:
    into.compared += t.compared
    into.exact += t.exact
    into.predicted += t.predicted
    into.observed += t.observed
    for mine, theirs in ((into.misses, t.misses), (into.beyond, t.beyond)):
        for cause, count in theirs.items():
            c = mine.setdefault(cause, _Count())
            c.requests += count.requests
            c.tokens += count.tokens
            c.examples = (c.examples + count.examples)[:EXAMPLES]


def _figures(t: _EndpointTally) -> dict:
    misses = sum(c.requests for c in t.misses.values())
    unexplained = t.misses.get(UNEXPLAINED, _Count()).requests
    return {
        "requests_compared": t.compared,
        "requests_exact": t.exact,
        "exact_share": t.exact / t.compared if t.compared else None,
        "predicted_cached_tokens": t.predicted,
        "observed_cached_tokens": t.observed,
        "misses": misses,
        "misses_attributed_share": (misses - unexplained) / misses if misses else None,
        "miss_causes": {cause: t.misses[cause].to_dict() for cause in MISS_CAUSES if cause in t.misses},
        "beyond": sum(c.requests for c in t.beyond.values()),
        "beyond_causes": {cause: t.beyond[cause].to_dict() for cause in BEYOND_CAUSES if cause in t.beyond},
    }


# -- inputs: records in memory, the servers' caches -------------------------------------------------
def model_prompts(records: Iterable[Record], server_ids, block_size: int, fingerprint=None) -> list[ModelPrompt]:
    """The ModelPrompts of the records the server took in, in send order, from records in memory;
    `server_ids(request_id)` is the prompt's token ids as the server counts them (a
    PromptSynthesizer's server_ids of the row), `fingerprint(request_id)` its fingerprint (the
    prompt's; None: the records' fingerprints are not checked). For tests and small runs:
    replay/results/cache_child.py streams the same from files."""
    sent = sorted((r for r in records if scheduled(r)), key=lambda r: (r["sent_at"], r["request_id"]))
    starts = StartEstimates()
    out = []
    for r in sent:
        ids = server_ids(r["request_id"])
        output = r.get("output_tokens")
        endpoint = r.get("endpoint") or ""
        out.append(ModelPrompt(
            r["request_id"], r["sent_at"], r.get("prompt_tokens"), r.get("cached_tokens"), block_hashes(ids, block_size),
            len(ids), endpoint, r.get("finished_at"), output if output is not None else r.get("output_length") or 0,
            None, starts.started_at(endpoint, r["sent_at"], r.get("ttft_ms")), answered_at(r),
            None if fingerprint is None else agreed_tokens(r.get("prompt_fingerprint"), fingerprint(r["request_id"])),
        ))  # fmt: skip
    return out


def scheduled_at(sent_at: float, ttft_ms: float | None, least_ttft_ms: float | None) -> float:
    """When the server likely scheduled a request (and took its blocks): its first token less
    the endpoint's least time to first token (that of a request that did not wait), so a
    request that waited in the server's queue starts late; never before its send."""
    if ttft_ms is None or least_ttft_ms is None:
        return sent_at
    return sent_at + max(ttft_ms - least_ttft_ms, 0.0) / 1000.0


class StartEstimates:
    """`scheduled_at` for requests given in send order, each endpoint's least time to first
    token taken over its requests sent up to the one asked about (itself included). A prefix's
    least, not the whole run's: a request's estimate then depends only on what was sent before
    it, so the model gives the same answer whether it runs at the end or while the run replays
    (replay.results.cache_child --follow), where later requests are not known yet."""

    def __init__(self) -> None:
        self._least: dict[str, float] = {}

    def started_at(self, endpoint: str, sent_at: float, ttft_ms: float | None) -> float:
        least = self._least.get(endpoint)
        if ttft_ms is not None and (least is None or ttft_ms < least):
            least = self._least[endpoint] = ttft_ms
        return scheduled_at(sent_at, ttft_ms, least)


def start_counters(metrics_file: str | Path) -> dict[str, dict[str, float]]:
    """Each endpoint's prefix-cache counters in its first sample of OUTPUT.server-metrics.jsonl
    (the scraper's first round is taken before the first send): {endpoint: {"queries", "hits"}};
    endpoints without the counters (or whose first scrape failed) are left out."""
    found: dict[str, dict[str, float]] = {}
    seen: set[str] = set()
    for sample in read_samples(metrics_file):
        endpoint = sample.get("endpoint")
        if endpoint in seen or sample.get("exporter"):  # a GPU exporter has no cache
            continue
        seen.add(endpoint)
        metrics = sample.get("metrics") or {}
        if "vllm:prefix_cache_queries_total" in metrics:
            found[endpoint] = {"queries": metrics["vllm:prefix_cache_queries_total"],
                               "hits": metrics.get("vllm:prefix_cache_hits_total", 0.0)}
    return found


def server_caches(meta_caches: Mapping[str, Mapping] | None, counters: Mapping[str, Mapping] | None = None,
                  ) -> dict[str, ServerCache]:
    """The ServerCache of each endpoint whose pool size is known, from the run meta's
    `server_cache` ({endpoint: {"block_size", "num_gpu_blocks", ...}}) and the counters at the
    start (`start_counters`)."""
    counters = counters or {}
    out = {}
    for endpoint, cache in (meta_caches or {}).items():
        blocks = cache.get("num_gpu_blocks")
        if blocks is not None:
            out[endpoint] = ServerCache(int(blocks), (counters.get(endpoint) or {}).get("queries", 0) > 0)
    return out

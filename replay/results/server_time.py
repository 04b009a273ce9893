"""Where the time went: the client's TTFT and E2E split into the server's own parts and the rest.

A record's server fields (replay/rules/server_timing.py) say how long the request waited in
the server's queue, how long its prefill and its decode took. Set against the client's own
measure of the same request, the rest is what the server did not see: the network, a router,
the client's own lag, the server's HTTP front end. Per request,

    client TTFT = queue + prefill + server other + rest
    client E2E  = queue + prefill + decode + server other + rest

where `server other` is the server's time outside those parts (its TTFT or e2e less their
sum: 0 from an answer, whose TTFT is queue + prefill; a span's front end and tokenization) and
`rest` the client's measure less the server's. Each part gets its own percentiles (p50, p90,
p99: a percentile of a sum is not the sum of percentiles), and its `share`: its mean over the
client's mean. Means add up, so the shares of a split sum to 1, and the part whose share grew
is the part that made the client's figure grow: what a capacity probe's failure and `replay
compare` attribute a change to.

Only ok records with every part of a split count in it (a request not streamed has no client
TTFT: it counts in the E2E split only); the section counts the ok records that lacked the
server's fields altogether. A record whose server times exceed the client's own (its TTFT or
its E2E, by more than SERVER_OVER_CLIENT_MS) counts in neither split: a server whose figures
cannot be true is no evidence of where the time went, and blaming its queue would be a
confident wrong answer; the section counts those records too.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Mapping
from typing import Any

from replay.results.summary import percentile, sorted_array
from replay.rules.server_timing import (
    SERVER_DECODE_MS,
    SERVER_OVER_CLIENT_MS,
    SERVER_PREFILL_MS,
    SERVER_QUEUE_MS,
    SERVER_TIMING_PROBLEM,
    SERVER_TIMING_SOURCE,
    SERVER_TTFT_MS,
    server_work_ms,
)

PERCENTILES = (50, 90, 99)
# Each split: the client's figure, then its parts in the order a request meets them.
TTFT_PARTS = ("queue", "prefill", "server_other", "rest")
E2E_PARTS = ("queue", "prefill", "decode", "server_other", "rest")
SPLITS = {"ttft_ms": TTFT_PARTS, "e2e_ms": E2E_PARTS}
# How the parts are named where they are printed or drawn.
PART_LABELS = {"queue": "server queue", "prefill": "server prefill", "decode": "server decode",
               "server_other": "server other", "rest": "rest (network, client, router)"}


# A record's timing, read once (`timing_of`): its source, each split's values in its columns'
# order (client, server, then the parts), None where a part is unknown, and whether the server's
# times exceed the client's (then both splits are None: not evidence).
Timing = tuple[str, tuple[float, ...] | None, tuple[float, ...] | None, bool]


def timing_of(record: Mapping[str, Any]) -> Timing | None:
    """The splits of an ok record with the server's times (None: not ok, or no source said)."""
    source = record.get(SERVER_TIMING_SOURCE)
    if source is None or not record.get("ok"):
        return None
    queue, prefill, decode = record.get(SERVER_QUEUE_MS), record.get(SERVER_PREFILL_MS), record.get(SERVER_DECODE_MS)
    ttft, server_ttft = record.get("ttft_ms"), record.get(SERVER_TTFT_MS)
    ttft_split = None
    if ttft is not None and server_ttft is not None and queue is not None and prefill is not None:
        ttft_split = (ttft, server_ttft, queue, prefill, server_ttft - (queue + prefill), ttft - server_ttft)
    e2e, work = record.get("e2e_ms"), server_work_ms(record)
    e2e_split = None
    if e2e is not None and work is not None and queue is not None and prefill is not None and decode is not None:
        e2e_split = (e2e, work, queue, prefill, decode, work - (queue + prefill + decode), e2e - work)
    if any(s is not None and s[-1] < -SERVER_OVER_CLIENT_MS for s in (ttft_split, e2e_split)):
        return source, None, None, True
    return source, ttft_split, e2e_split, False


def split(record: Mapping[str, Any], figure: str) -> dict[str, float] | None:
    """The ok record's `figure` ("ttft_ms" or "e2e_ms") split into its parts, by name (with the
    client's figure as "client" and the server's as "server"), or None when a part is unknown."""
    timing = timing_of(record)
    if timing is None:
        return None
    values = timing[1] if figure == "ttft_ms" else timing[2]
    return None if values is None else dict(zip(("client", "server", *SPLITS[figure]), values))


class _Split:
    """The values of one split's columns, over the records that had every part."""

    def __init__(self, parts: tuple[str, ...]) -> None:
        self.columns = {name: array("d") for name in ("client", "server", *parts)}

    def add(self, values: tuple[float, ...]) -> None:
        for column, value in zip(self.columns.values(), values):
            column.append(value)

    def section(self) -> dict:
        """Each column's mean and percentiles, and each part's share. The columns are sorted in
        place of the unsorted ones (only their marginals are reported), and summed in sorted
        order, so the figures do not depend on the order of the records."""
        count = len(self.columns["client"])
        sums = {}
        out: dict = {"requests": count}
        for name in self.columns:
            values = self.columns[name] = sorted_array(self.columns[name])
            sums[name] = sum(values)
            out[name] = {"mean": sums[name] / count if count else None,
                         **{f"p{p}": percentile(values, p) for p in PERCENTILES}}
        out["share"] = {name: (sums[name] / sums["client"] if sums["client"] else None)
                        for name in self.columns if name not in ("client", "server")}
        return out


class ServerTimeBuilder:
    """The "where the time went" section from records added one at a time (a run's records are
    never all held: the values that need percentiles are kept in arrays, 8 bytes each)."""

    def __init__(self) -> None:
        self.requests_ok = 0
        self.sources: Counter[str] = Counter()
        self.problems = 0
        self.over_client = 0
        self.ttft, self.e2e = _Split(TTFT_PARTS), _Split(E2E_PARTS)

    def add(self, record: Mapping[str, Any], timing: Timing | None | bool = True) -> None:
        """`timing`: the record's `timing_of`, when the caller read it already (True: read it here)."""
        if record.get(SERVER_TIMING_PROBLEM):
            self.problems += 1
        if not record.get("ok"):
            return
        self.requests_ok += 1
        if timing is True:
            timing = timing_of(record)
        if not timing:
            return
        source, ttft_split, e2e_split, over_client = timing
        self.sources[source] += 1
        self.over_client += over_client
        if ttft_split is not None:
            self.ttft.add(ttft_split)
        if e2e_split is not None:
            self.e2e.add(e2e_split)

    def section(self) -> dict:
        timed = sum(self.sources.values())
        return {
            "requests_ok": self.requests_ok,
            "requests_with_server_timing": timed,
            "requests_lacking_server_timing": self.requests_ok - timed,
            "by_source": dict(sorted(self.sources.items())),
            "requests_timing_problem": self.problems,
            "requests_server_over_client": self.over_client,
            "ttft_ms": self.ttft.section(),
            "e2e_ms": self.e2e.section(),
        }


def largest_part(split_section: dict) -> str | None:
    """The part with the largest share of a split's client mean, or None without one."""
    shares = {k: v for k, v in (split_section.get("share") or {}).items() if v is not None}
    return max(shares, key=shares.__getitem__) if shares else None


def growth(before: dict, after: dict) -> dict[str, float] | None:
    """How much each part's mean grew from one split section to another (ms; the client's as
    "client"), or None when either has no request: the means add up, so the parts' growths sum
    to the client's."""
    if not before.get("requests") or not after.get("requests"):
        return None
    names = ["client", *(name for name in after if name in PART_LABELS)]
    return {name: after[name]["mean"] - before[name]["mean"] for name in names}


def most_grown(before: dict, after: dict) -> str | None:
    """The part whose mean grew most from `before` to `after` (split sections of one figure),
    None when either has no request or no part grew."""
    grown = growth(before, after)
    if not grown:
        return None
    parts = {name: value for name, value in grown.items() if name != "client"}
    best = max(parts, key=parts.__getitem__)
    return best if parts[best] > 0 else None


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def format_server_time(section: dict, width: int, endpoints: dict[str, dict] | None = None) -> list[str]:
    """The report's block: per split, p50/p90/p99 and share of each part; per endpoint of a
    fleet, the TTFT split's p50s. Nothing when no ok record had the server's fields."""
    if not section or not section.get("requests_with_server_timing"):
        return []
    out = ["{s:-^{n}}".format(s="Where the Time Went", n=width)]
    out.append(f"{'':<32} {'p50/p90/p99 ms':>22} {'share':>6}")
    for figure, title in (("ttft_ms", "TTFT"), ("e2e_ms", "E2E")):
        s = section[figure]
        if not s["requests"]:
            continue
        out.append(f"{title} ({s['requests']} requests):")
        for name in ("client", *SPLITS[figure]):
            d = s[name]
            values = "/".join(_ms(d[f"p{p}"]) for p in PERCENTILES)
            share = "" if name == "client" else f"{round(100 * (s['share'][name] or 0), 1) + 0.0:5.1f}%"  # no -0.0
            out.append(f"  {('client ' + title) if name == 'client' else PART_LABELS[name]:<30} {values:>22} {share:>6}")
    lacking = section["requests_lacking_server_timing"]
    if lacking:
        out.append(f"  {lacking} of {section['requests_ok']} ok requests lacked the server's times")
    if section.get("requests_server_over_client"):
        out.append(f"  {section['requests_server_over_client']} of {section['requests_ok']} ok requests' server times "
                   "exceed the client's own, which cannot be true: left out")
    if section.get("requests_timing_problem"):
        out.append(f"  {section['requests_timing_problem']} answers sent timing figures that are not durations "
                   "(see server_timing_problem)")
    if endpoints and len(endpoints) > 1:
        out.append(f"{'endpoint':<30} {'TTFT queue/prefill/rest p50':>30}")
        for endpoint, e in endpoints.items():
            s = (e.get("server_timing") or {}).get("ttft_ms") or {}
            if s.get("requests"):
                cells = "/".join(_ms(s[name]["p50"]) for name in ("queue", "prefill", "rest"))
                out.append(f"{endpoint:<30} {cells:>30}")
    return out

"""ReportBuilder: the report built one record at a time equals, float for float, the report the
records-list code gave before it (kept here, only as the oracle), and its memory is the values
that need percentiles, never the records: 2,000,000 rows never sent cost only counters."""

from __future__ import annotations

import math
import random
import tracemalloc
from array import array
from collections import Counter
from collections.abc import Iterable, Sequence

import orjson
import pytest

from replay.results import summary
from replay.results.records import RECORD_FIELDS, RUN_STOPPED, STOPPED_IN_FLIGHT, WORKER_LOST, unsent_record
from replay.results.report import ReportBuilder, build_report, meets_slo
from replay.results.summary import SORT_RUN, failures, sorted_array, summarize
from replay.trace.record import TraceRow

T0 = 1_700_000_000.0
ENDPOINTS = ("http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000")


# -- the oracle: build_report as it was when it took a list of records ------------------------


def old_percentile(sorted_values: Sequence[float], p: float) -> float | None:
    n = len(sorted_values)
    if n == 0:
        return None
    k = (n - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def old_distribution(values: Iterable[float]) -> dict:
    v = sorted(x for x in values if x is not None)
    if not v:
        return {k: None for k in ("mean", "median", "std", "p25", "p50", "p75", "p90", "p99")}
    mean = sum(v) / len(v)
    std = math.sqrt(sum((x - mean) ** 2 for x in v) / len(v))
    out = {"mean": mean, "median": old_percentile(v, 50), "std": std}
    for p in (25, 50, 75, 90, 99):
        out[f"p{p}"] = old_percentile(v, p)
    return out


def old_failures(records: list[dict]) -> tuple[dict, dict]:
    by_reason: Counter[str] = Counter()
    by_status: Counter[str] = Counter()
    for r in records:
        if not r.get("ok"):
            by_reason[summary.failure_reason(r)] += 1
            by_status[str(r.get("status") or 0)] += 1
    return dict(by_reason.most_common()), dict(by_status.most_common())


def old_summarize(records: list[dict]) -> dict:
    ok = [r for r in records if r.get("ok")]
    sent = [r for r in records if r.get("sent_at") is not None]
    start = min((r["sent_at"] for r in sent), default=None)
    end = max((r["finished_at"] for r in sent if r.get("finished_at")), default=None)
    duration = (end - start) if start is not None and end is not None else 0.0
    input_tokens = sum(r.get("prompt_tokens") or r.get("input_length") or 0 for r in ok)
    output_tokens = sum(r.get("output_tokens") or 0 for r in ok)
    drifts = sorted(r["drift_ms"] for r in sent if r.get("drift_ms") is not None)
    return {
        "requests": len(records),
        "requests_ok": len(ok),
        "requests_failed": len(records) - len(ok),
        "failures": old_failures(records)[0],
        "requests_usage_mismatch": sum(1 for r in records if r.get("usage_mismatch")),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "input_token_throughput": input_tokens / duration if duration else 0.0,
        "output_token_throughput": output_tokens / duration if duration else 0.0,
        "ttft_ms": old_distribution(r.get("ttft_ms") for r in ok),
        "tpot_ms": old_distribution(r.get("tpot_ms") for r in ok),
        "itl_ms": old_distribution(x for r in ok for x in (r.get("itl_ms") or ())),
        "e2e_ms": old_distribution(r.get("e2e_ms") for r in ok),
        "drift_ms": {"p50": old_percentile(drifts, 50), "p99": old_percentile(drifts, 99),
                     "max": drifts[-1] if drifts else None},  # fmt: skip
    }


def old_endpoint_breakdown(records: list[dict]) -> dict:
    by_endpoint: dict[str, list[dict]] = {}
    for r in records:
        if r.get("endpoint"):
            by_endpoint.setdefault(r["endpoint"], []).append(r)
    out = {}
    for endpoint in sorted(by_endpoint):
        recs = by_endpoint[endpoint]
        ok = [r for r in recs if r.get("ok")]
        entry = {"requests": len(recs), "requests_ok": len(ok), "requests_failed": len(recs) - len(ok)}
        for key in ("ttft_ms", "e2e_ms"):
            values = sorted(r[key] for r in ok if r.get(key) is not None)
            entry[key] = {"p50": old_percentile(values, 50), "p99": old_percentile(values, 99)}
        entry["prompt_tokens"] = sum(r.get("prompt_tokens") or 0 for r in recs)
        entry["cached_tokens"] = sum(r.get("cached_tokens") or 0 for r in recs)
        entry["server_timing"] = old_server_timing(recs)
        out[endpoint] = entry
    return out


def old_server_timing(records: list[dict]) -> dict:
    """replay.results.server_time's section, from the whole list: each split's columns per record."""
    ok = [r for r in records if r.get("ok")]
    timed = [r for r in ok if r.get("server_timing_source") is not None]
    section = {"requests_ok": len(ok), "requests_with_server_timing": len(timed),
               "requests_lacking_server_timing": len(ok) - len(timed),
               "by_source": dict(sorted(Counter(r["server_timing_source"] for r in timed).items())),
               "requests_timing_problem": sum(1 for r in records if r.get("server_timing_problem"))}

    def over_client(r: dict) -> bool:  # its server's time over the client's by more than 1 ms: in no split
        parts = (r["server_queue_ms"], r["server_prefill_ms"], r["server_decode_ms"])
        work = r["server_e2e_ms"] if r["server_e2e_ms"] is not None else (
            None if None in parts else sum(parts))
        return any(client is not None and server is not None and None not in parts[:2] and server - client > 1.0
                   for client, server in ((r["ttft_ms"], r["server_ttft_ms"]),
                                          (r["e2e_ms"], work if None not in parts else None)))

    section["requests_server_over_client"] = sum(1 for r in timed if over_client(r))
    for figure, parts in (("ttft_ms", ("queue", "prefill", "server_other", "rest")),
                          ("e2e_ms", ("queue", "prefill", "decode", "server_other", "rest"))):
        rows = []
        for r in timed:
            if over_client(r):
                continue
            named = {"queue": r["server_queue_ms"], "prefill": r["server_prefill_ms"]}
            if figure == "ttft_ms":
                server = r["server_ttft_ms"]
            else:
                named["decode"] = r["server_decode_ms"]
                server = r["server_e2e_ms"]
                if server is None and None not in named.values():
                    server = sum(named.values())
            if r[figure] is None or server is None or None in named.values():
                continue
            rows.append({"client": r[figure], "server": server, **named,
                         "server_other": server - sum(named.values()), "rest": r[figure] - server})
        out: dict = {"requests": len(rows)}
        for name in ("client", "server", *parts):
            values = sorted(row[name] for row in rows)
            out[name] = {"mean": sum(values) / len(values) if values else None,
                         **{f"p{p}": old_percentile(values, p) for p in (50, 90, 99)}}
        client = sum(sorted(row["client"] for row in rows))
        out["share"] = {name: sum(sorted(row[name] for row in rows)) / client if client else None for name in parts}
        section[figure] = out
    return section


def old_build_report(records: list[dict], slo: dict | None = None, cache: dict | None = None) -> dict:
    report = old_summarize(records)
    report["failures_by_status"] = old_failures(records)[1]
    ok = [r for r in records if r.get("ok")]
    report["requests_unsent"] = sum(1 for r in records if r.get("sent_at") is None)
    report["total_input_tokens"] = sum(r.get("prompt_tokens") or r.get("input_length") or 0 for r in ok)
    report["total_output_tokens"] = sum(r.get("output_tokens") or 0 for r in ok)
    duration = report["duration_s"]
    total = report["total_input_tokens"] + report["total_output_tokens"]
    report["total_token_throughput"] = total / duration if duration else 0.0
    report["slo"] = dict(slo) if slo else None
    if slo:
        good = sum(1 for r in records if meets_slo(r, slo))
        report["requests_good"] = good
        report["goodput_rps"] = good / duration if duration else 0.0
    else:
        report["requests_good"] = None
        report["goodput_rps"] = None
    report["cache"] = cache
    report["server_timing"] = old_server_timing(records)
    report["endpoints"] = old_endpoint_breakdown(records)
    report["server"] = None
    return report


# -- records of every kind ---------------------------------------------------------------------


def row(rid: int) -> TraceRow:
    return TraceRow(request_id=rid, timestamp_s=rid * 0.01, input_length=100 + rid % 900, output_length=1 + rid % 50)


def ok_record(rid: int, rng: random.Random, streamed: bool = True) -> dict:
    scheduled = T0 + rid * 0.01
    drift = round(rng.uniform(0.01, 4.0), 3) if rng.random() < 0.9 else rng.randint(0, 3)  # ints too
    sent = scheduled + drift / 1000
    out = rng.randint(1, 60)
    ttft = round(rng.lognormvariate(5, 0.6), 3) if streamed else None
    itl = [round(rng.uniform(3, 40), 3) for _ in range(out - 1)] if streamed else None
    e2e = round((ttft or 0) + sum(itl or ()) + rng.uniform(1, 500), 3 if rng.random() < 0.9 else None)  # ints too
    tpot = round((e2e - ttft) / (out - 1), 3) if streamed and out > 1 else None
    inp = rng.randint(10, 8000)
    r = dict.fromkeys(RECORD_FIELDS)
    r.update(request_id=rid, worker=rid % 3, endpoint=rng.choice(ENDPOINTS), api="openai-chat",
             scheduled_at=scheduled, sent_at=sent, finished_at=sent + e2e / 1000, drift_ms=drift, ttft_ms=ttft,
             tpot_ms=tpot, e2e_ms=e2e, itl_ms=itl, status=200, ok=True, input_length=inp, output_length=out,
             prompt_tokens=inp if rng.random() < 0.9 else None, output_tokens=out, cached_tokens=0)  # fmt: skip
    if rid % 11 == 0:  # a server's usage that cannot be true (no draw from rng: the rest stays as it was)
        r["usage_mismatch"] = f"output_tokens {out} > max_tokens {out - 1}"
    if rid % 4:  # the server's own times (no draw from rng either): from the answer, or a span's too
        queue, prefill, decode = (rid % 17) * 1.5, rid % 5 + 0.25, (rid % 7) * 3.0
        r.update(server_queue_ms=queue, server_prefill_ms=prefill, server_decode_ms=decode,
                 server_ttft_ms=queue + prefill + (rid % 2) * 0.5, server_timing_source="answer" if rid % 3 else "span",
                 server_e2e_ms=queue + prefill + decode + 1.0 if rid % 3 == 0 else None)
        if rid % 13 == 0:
            r.update(server_queue_ms=None, server_timing_problem="metrics queue_time_ms '1' is not a duration")
    return r


def records_of_every_kind(n: int, seed: int) -> list[dict]:
    """ok (streamed or not, one-token replies), failed after sending, sent and cut off, never sent."""
    rng = random.Random(seed)
    out = []
    for rid in range(n):
        kind = rng.random()
        if kind < 0.55:
            out.append(ok_record(rid, rng))
        elif kind < 0.65:
            out.append(ok_record(rid, rng, streamed=False))
        elif kind < 0.72:  # an error status or a reset after sending
            r = ok_record(rid, rng)
            r.update(ok=False, ttft_ms=None, tpot_ms=None, itl_ms=None, output_tokens=None,
                     status=rng.choice((500, 503, 429, 200)), error=rng.choice(("HTTP 5xx: boom", "reset " * 20)))  # fmt: skip
            out.append(r)
        elif kind < 0.77:  # sent, then the run stopped: keeps where and when
            out.append(unsent_record(row(rid), worker=0, api="openai-chat", scheduled_at=T0 + rid * 0.01,
                                     reason=STOPPED_IN_FLIGHT, endpoint=rng.choice(ENDPOINTS),
                                     sent_at=T0 + rid * 0.01 + 0.002))  # fmt: skip
        else:
            out.append(unsent_record(row(rid), worker=None, api="openai-chat", scheduled_at=T0 + rid * 0.01,
                                     reason=rng.choice((RUN_STOPPED, WORKER_LOST))))  # fmt: skip
    ones = [r for r in out if r["ok"] and r["output_tokens"] == 1]
    assert ones and any(r["ttft_ms"] is None for r in out if r["ok"])  # both edge cases are in
    return out


def same(new: dict, old: dict) -> None:
    """Equal, float for float, with the same types and key order (orjson writes 1 and 1.0 apart)."""
    assert new == old
    assert orjson.dumps(new) == orjson.dumps(old)


SLOS = (None, {}, {"ttft_ms": 250.0}, {"tpot_ms": 12.0}, {"e2e_ms": 900.0}, {"ttft_ms": 300.0, "tpot_ms": 20.0, "e2e_ms": 1500.0})


@pytest.mark.parametrize("sort_run, window_min, n", [(64, 4, 1500), (SORT_RUN, summary.MERGE_WINDOW_MIN, 5000)])
def test_builder_equals_the_records_list_report(monkeypatch, sort_run, window_min, n):
    """With runs of 64 (merged 4 at a time) every distribution is sorted by merging; with the
    real runs, ITL (over SORT_RUN values) is and the rest are not."""
    monkeypatch.setattr(summary, "SORT_RUN", sort_run)
    monkeypatch.setattr(summary, "MERGE_WINDOW_MIN", window_min)
    records = records_of_every_kind(n, seed=sort_run)
    assert sum(len(r["itl_ms"] or ()) for r in records if r["ok"]) > sort_run
    cache = {"expected_cached_tokens": 10, "observed_cached_tokens": 9}
    for slo in SLOS:
        builder = ReportBuilder(slo)
        for r in records:
            builder.add(r)
        same(builder.report(cache), old_build_report(records, slo, cache))
        same(build_report(iter(records), slo), old_build_report(records, slo))
    same(summarize(records), old_summarize(records))
    assert failures(records) == old_failures(records)
    assert list(failures(records)[0]) == list(old_failures(records)[0])  # most common first, ties as seen


def test_edge_cases_equal_the_records_list_report():
    """No records, only unsent ones, one record; and the drift max among equal values of
    another kind (2 and 2.0, 0.0 and -0.0) is the last of them, as sorted(drifts)[-1] was."""
    rng = random.Random(9)
    unsent = [unsent_record(row(i), worker=None, api="a", scheduled_at=None, reason=RUN_STOPPED) for i in range(3)]
    one = ok_record(0, rng)
    same(build_report([], {"ttft_ms": 1.0}), old_build_report([], {"ttft_ms": 1.0}))
    cases = [unsent, [one], [one, *unsent]]
    for a, b in ((2, 2.0), (0.0, -0.0)):
        cases += [[dict(one, drift_ms=a), dict(one, drift_ms=b)], [dict(one, drift_ms=b), dict(one, drift_ms=a)]]
    for records in cases:
        same(build_report(records, {"e2e_ms": 1e9}), old_build_report(records, {"e2e_ms": 1e9}))


def test_report_again_after_more_records():
    """report() sorts the builder's arrays in place of the unsorted ones: adding more records
    and reporting again must still be the report of all of them."""
    records = records_of_every_kind(600, seed=4)
    builder = ReportBuilder({"ttft_ms": 200.0})
    for r in records[:300]:
        builder.add(r)
    same(builder.report(), old_build_report(records[:300], {"ttft_ms": 200.0}))
    same(builder.report(), old_build_report(records[:300], {"ttft_ms": 200.0}))
    for r in records[300:]:
        builder.add(r)
    same(builder.report(), old_build_report(records, {"ttft_ms": 200.0}))


def bits(values) -> bytes:
    """Bit for bit, so that 0.0 and -0.0 (equal, and both possible: a drift rounded to 3
    decimals) are told apart."""
    return array("d", values).tobytes()


@pytest.mark.parametrize("n", [0, 1, 5, 6, 23, 101, 1000])
@pytest.mark.parametrize("kind", ["random", "ties", "signed zeros", "sorted", "reversed", "one value"])
def test_sorted_array_is_sorted_bit_for_bit(monkeypatch, n, kind):
    """Runs of 5 and windows of 2: many runs and many merge rounds."""
    monkeypatch.setattr(summary, "SORT_RUN", 5)
    monkeypatch.setattr(summary, "MERGE_WINDOW_MIN", 2)
    rng = random.Random(n)
    make = {
        "random": lambda i: rng.uniform(-5, 5),
        "ties": lambda i: rng.choice((1.5, 2.25, 7.0, rng.uniform(0, 8))),
        "signed zeros": lambda i: rng.choice((0.0, -0.0, 1.0, -1.0)),
        "sorted": lambda i: i * 0.5,
        "reversed": lambda i: -i * 0.5,
        "one value": lambda i: 3.0,
    }[kind]
    values = array("d", (make(i) for i in range(n)))
    expected = sorted(values)
    assert bits(sorted_array(values)) == bits(expected)
    assert bits(sorted(values)) == bits(expected)  # `values` still holds the same values


# -- memory ------------------------------------------------------------------------------------

UNSENT_ROWS = 100_000
OK_ROWS = 50_000
ITL_PER_OK = 3
# Never-sent rows must cost counters only: after UNSENT_ROWS of them the builder holds < 50 KB,
# so even one byte kept per row (100 KB) fails, let alone an 8-byte value (800 KB).
# What the builder must keep for OK_ROWS ok rows: TTFT, TPOT, E2E, drift, the endpoint's TTFT and
# E2E, and ITL_PER_OK ITL values, 8 bytes each in array('d'): 50,000 x 9 x 8 = 3.6 MB. array
# over-allocates by ~1/16 as it grows, and report() holds the largest array (ITL, 1.2 MB) twice
# while it merges plus SORT_RUN values as Python floats (~2.6 MB): about 6.5 MB in all. The bound
# is 10 MB: keeping the values as Python floats (32 bytes each: 14.4 MB) breaks it, let alone the
# records (a dict is ~1 KB).
PEAK_BOUND = 10_000_000


def test_rows_never_sent_cost_counters_only():
    """Records are made one at a time (copies of one record of each kind: making each afresh
    would triple this test's time under tracemalloc) and dropped once added."""
    unsent = unsent_record(row(0), worker=None, api="openai-chat", scheduled_at=T0, reason=RUN_STOPPED)
    ok = ok_record(0, random.Random(1))
    tracemalloc.start()
    try:
        builder = ReportBuilder({"ttft_ms": 200.0})
        for rid in range(UNSENT_ROWS):
            record = unsent.copy()
            record["request_id"] = rid
            builder.add(record)
        after_unsent, _ = tracemalloc.get_traced_memory()
        for rid in range(OK_ROWS):
            record = ok.copy()
            record.update(request_id=UNSENT_ROWS + rid, endpoint=ENDPOINTS[rid % 3], ttft_ms=50.0 + rid % 997,
                          tpot_ms=10.0 + rid % 13, e2e_ms=900.0 + rid % 1009, drift_ms=0.001 * (rid % 17),
                          itl_ms=[12.5] * ITL_PER_OK)  # fmt: skip
            builder.add(record)
        report = builder.report()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert after_unsent < 50_000, f"{UNSENT_ROWS:,} rows never sent hold {after_unsent:,} bytes"
    assert peak < PEAK_BOUND, f"peak {peak:,} bytes"
    assert report["requests"] == UNSENT_ROWS + OK_ROWS and report["requests_unsent"] == UNSENT_ROWS
    assert report["itl_ms"]["p50"] == 12.5 and sum(e["requests"] for e in report["endpoints"].values()) == OK_ROWS
    print(f"builder peak {peak / 1e6:.1f} MB for {UNSENT_ROWS:,} rows never sent + {OK_ROWS:,} ok")

"""The child process that computes a run's cache section (replay/results/cache_section.py
starts it), so the process that asks never loads the tokenizer.

It streams: one pass over the records keeps a few numbers per request the server took in; one
pass over the trace, in file order, re-synthesizes those requests' prompts and writes their
server-block hashes to a spool file; then the requests are checked in send order, each one's
hashes read back from the spool, and, when the job names the servers' pool sizes, fed to the
model of each endpoint's finite cache (replay/results/cache_model.py), whose attribution of
every miss goes into the section under "misses". So memory holds arrays of numbers per
request, the infinite cache's distinct blocks, the pools (bounded by their sizes) and the
tokenizer, never a list of records or of trace rows.

    python -m replay.results.cache_child JOB.json RESULT.json [CHECKS.bin]

RESULT.json is {"section": {...}}, or {"error": "..."} for a bad input (a trace or records that
do not fit, a tokenizer that cannot load); CHECKS.bin, when named, the per-request checks
(CHECK_FORMAT each, in send order) for `replay report --html`.
"""

from __future__ import annotations

import logging
import math
import os
import struct
import sys
import tempfile
from array import array
from collections import Counter
from pathlib import Path

import orjson

from replay.protocol.table import prompt_format_problem, sends_token_ids
from replay.protocol.urls import shown
from replay.results.cache_model import CacheModel, ModelPrompt, ServerCache, attribution, model_checks, scheduled_at
from replay.results.fidelity import (
    CacheCheck,
    CacheTally,
    SentPrompt,
    ideal_trace_hits,
    method_text,
    missing_rows,
    scheduled,
    send_order_checks,
)
from replay.results.records import read_records
from replay.rules.prefix_cache import block_hashes
from replay.trace.fields import DEFAULT_BLOCK_SIZE
from replay.trace.prefix import IdealHits, hit_tokens
from replay.trace.reader import TraceStream

CHECK_FORMAT = struct.Struct("<qdqqqqqq")  # request_id, sent_at, prompt_tokens, reported, expected, observed, low, high
NONE = -1  # a number the record does not have
NAN = math.nan  # a time the record does not have
SPOOL_BUFFER = 1 << 20
# The child makes every sent prompt of the run in one process, so it meets every shared prefix the
# workers met between them: a block cache this size (about 585 bytes a block: some 37 MiB full)
# makes a trace's shared blocks once where a worker's (8192 blocks) would make them again and again.
CACHE_BLOCKS = 1 << 16


def write_check(out, c: CacheCheck) -> None:
    out.write(CHECK_FORMAT.pack(c.request_id, c.sent_at, c.prompt_tokens, _number(c.reported_prompt_tokens),
                                c.expected, _number(c.observed), c.low, c.high))


def read_checks(path: str | Path) -> list[CacheCheck]:
    """The checks a child wrote to `path`, in send order."""
    return [CacheCheck(rid, t, prompt, _none(reported), expected, _none(observed), low, high)
            for rid, t, prompt, reported, expected, observed, low, high in
            CHECK_FORMAT.iter_unpack(Path(path).read_bytes())]  # fmt: skip


def _number(value: int | None) -> int:
    return NONE if value is None else value


def _none(value: int) -> int | None:
    return None if value == NONE else value


class _Sent:
    """The requests the server took in: a few numbers each, and their send order; with `model`,
    what the cache model needs too (endpoint, end, output tokens, and the start estimated from
    the time to first token against the endpoint's least)."""

    def __init__(self, results: str, model: bool = False) -> None:
        self.request_id, self.sent_at = array("q"), array("d")
        self.reported, self.observed = array("q"), array("q")
        self.apis: Counter[str] = Counter()
        self.endpoints: list[str] = []  # index -> endpoint as shown
        self.endpoint, self.finished_at = array("q"), array("d")
        self.output_tokens, self.ttft_ms = array("q"), array("d")
        self.least_ttft: dict[int, float] = {}  # endpoint index -> its least ttft (a request that did not wait)
        index: dict[str | None, int] = {}
        for record in read_records(results):
            self.apis[record.get("api")] += 1
            if scheduled(record):
                self.request_id.append(record["request_id"])
                self.sent_at.append(record["sent_at"])
                self.reported.append(_number(record.get("prompt_tokens")))
                self.observed.append(_number(record.get("cached_tokens")))
                if model:
                    self._add_model(record, index)
        # by (sent_at, request_id): sorted by request_id (the file's own order, mostly), then stably by sent_at
        order = sorted(range(len(self.request_id)), key=self.request_id.__getitem__)
        order.sort(key=self.sent_at.__getitem__)
        self.order = array("q", order)
        del order
        self.position = array("q", [NONE]) * (max(self.request_id, default=-1) + 1)  # request_id -> index
        for k, rid in enumerate(self.request_id):
            self.position[rid] = k

    def _add_model(self, record: dict, index: dict[str | None, int]) -> None:
        name = record.get("endpoint")
        e = index.get(name)
        if e is None:
            e = index[name] = len(self.endpoints)
            self.endpoints.append(shown(name or ""))
        self.endpoint.append(e)
        finished, ttft, output = record.get("finished_at"), record.get("ttft_ms"), record.get("output_tokens")
        self.finished_at.append(NAN if finished is None else finished)
        self.output_tokens.append(output if output is not None else record.get("output_length") or 0)
        self.ttft_ms.append(NAN if ttft is None else ttft)
        if ttft is not None and ttft < self.least_ttft.get(e, math.inf):
            self.least_ttft[e] = ttft

    def model_fields(self, k: int) -> tuple:
        """ModelPrompt's fields after the SentPrompt's, but `ideal`: endpoint, finished_at, output_tokens."""
        finished = self.finished_at[k]
        return self.endpoints[self.endpoint[k]], None if finished != finished else finished, self.output_tokens[k]

    def started_at(self, k: int) -> float:
        ttft = self.ttft_ms[k]
        return scheduled_at(self.sent_at[k], None if ttft != ttft else ttft, self.least_ttft.get(self.endpoint[k]))


def compute(job: dict, checks_path: str | None = None) -> dict:
    """The cache section of `job` (CacheJob's fields); the per-request checks to `checks_path`."""
    from replay.synth.prompts import PromptSynthesizer  # the tokenizer: this process only
    from replay.synth.tokenizer import ServerTokenizer

    servers = job.get("servers")
    sent = _Sent(job["results"], model=servers is not None)
    api = job["api"] or (sent.apis.most_common(1)[0][0] if sent.apis else "openai-chat")
    if problem := prompt_format_problem(job["prompt_format"], api):
        raise ValueError(problem)
    token_ids = sends_token_ids(job["prompt_format"])
    server_block = job["server_block_size"]
    if server_block <= 0:
        raise ValueError(f"server block size must be positive, got {server_block}")
    tokenizer = ServerTokenizer.load(job["tokenizer"], job["chat_template"])
    n = len(sent.request_id)
    offset, blocks, length = array("q", [0]) * n, array("q", [0]) * n, array("q", [NONE]) * n
    ideal_tokens = array("q", [NONE]) * n if servers is not None else None  # the trace's own expectation
    stream = TraceStream(job["trace"], job["trace_format"], job["block_size"])
    synth = ideal = None
    position = sent.position
    with tempfile.TemporaryFile(prefix="tracereplay-cache-", buffering=SPOOL_BUFFER) as spool:
        written = 0
        for row in stream:
            if synth is None:  # the trace's block size is known from its first row on
                synth = PromptSynthesizer(tokenizer, api=api, block_size=stream.block_size or DEFAULT_BLOCK_SIZE,
                                          seed=job["seed"], token_ids=token_ids, cache_blocks=CACHE_BLOCKS)
                ideal = IdealHits() if stream.block_size else None
            hits = ideal.add(row, stream.block_size) if ideal is not None else 0
            k = position[row.request_id] if row.request_id < len(position) else NONE
            if k == NONE:
                continue
            if ideal_tokens is not None and ideal is not None:
                ideal_tokens[k] = hit_tokens(row, hits, stream.block_size)
            ids = synth.server_ids(row)
            hashes = array("q", block_hashes(ids, server_block))
            offset[k], blocks[k], length[k] = written, len(hashes), len(ids)
            spool.write(hashes)
            written += 8 * len(hashes)
        spool.flush()
        if synth is None and stream.block_size:  # a trace without rows
            ideal = IdealHits()
        missing = [sent.request_id[k] for k in sent.order if length[k] == NONE]
        if missing:
            raise missing_rows(len(missing), missing[0])
        fd = spool.fileno()

        def prompts():
            for k in sent.order:
                hashes = array("q")
                hashes.frombytes(os.pread(fd, 8 * blocks[k], offset[k]))
                if model is None:
                    yield SentPrompt(sent.request_id[k], sent.sent_at[k], _none(sent.reported[k]),
                                     _none(sent.observed[k]), hashes.tolist(), length[k])
                else:
                    yield ModelPrompt(sent.request_id[k], sent.sent_at[k], _none(sent.reported[k]),
                                      _none(sent.observed[k]), hashes.tolist(), length[k], *sent.model_fields(k),
                                      _none(ideal_tokens[k]), sent.started_at(k))

        model = None if servers is None else CacheModel(server_block, {
            endpoint: ServerCache(s["num_gpu_blocks"], s["served_before"]) for endpoint, s in servers.items()})
        tally = CacheTally()
        if model is None:
            checks = send_order_checks(prompts(), server_block, job["reorder_window_ms"])
        else:
            checks = (v.check for v in model_checks(prompts(), server_block, {}, model=model,
                                                    reorder_window_ms=job["reorder_window_ms"]))
        with open(checks_path or os.devnull, "wb", buffering=SPOOL_BUFFER) as out:
            for check in checks:
                tally.add(check)
                if checks_path:
                    write_check(out, check)
    method = method_text(api=api, token_ids=token_ids, tokenizer=job["tokenizer"], seed=job["seed"],
                         trace_block_size=stream.block_size, server_block_size=server_block,
                         reorder_window_ms=job["reorder_window_ms"])
    section = tally.section(method, ideal_trace_hits(ideal))
    if model is not None:
        section["misses"] = attribution(model)
    return section


def main(argv: list[str]) -> int:
    """The child: compute the section of the job in argv[0], write it (or the input's error) to argv[1]."""
    job_path, result_path, checks_path = (argv + [""])[:3]
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # The run already warned about rows too short for the template; the section counts them instead.
    logging.getLogger("replay.synth.prompts").setLevel(logging.ERROR)
    try:
        result = {"section": compute(orjson.loads(Path(job_path).read_bytes()), checks_path or None)}
    except (ValueError, OSError) as e:  # a bad input, said in one line (TraceError, PromptError are ValueErrors)
        result = {"error": str(e)}
    Path(result_path).write_bytes(orjson.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The child process that computes a run's cache section (replay/results/cache_section.py
starts it), so the process that asks never loads the tokenizer.

At the end (`compute`): one pass over the merged records keeps each request the server took
in as a few numbers (its id, send time and line); one pass over the trace, in file order,
re-synthesizes those requests' prompts and writes their server-block hashes to a spool file;
then the requests are checked in send order (each one's line and hashes read back), and, when
the job names the servers' pool sizes, fed to the model of each endpoint's finite cache
(replay/results/cache_model.py), whose attribution of every miss goes into the section under
"misses". So memory holds arrays of numbers per request, the infinite cache's distinct blocks,
the pools (bounded by their sizes) and the tokenizer, never a list of records or of trace rows.

While the run replays (`follow`, started at its go): the records the run appends are read as
they come (RecordTail), handed to the same checks in the same send order once no earlier send
can still come, each prompt made from a trace read only as far as the requests ask
(TraceCursor). At the end only the last requests are left to check, and the section is the one
`compute` would make; when the order cannot be kept (a record much later than the requests
sent after it), the child says so and the end computes the section as above.

    python -m replay.results.cache_child JOB.json RESULT.json [CHECKS.bin]
    python -m replay.results.cache_child --follow JOB.json RESULT.json END_MARKER

RESULT.json is {"section": {...}}, or {"error": "..."} for a bad input (a trace or records that
do not fit, a tokenizer that cannot load), or with --follow {"broken": "..."}; CHECKS.bin, when
named, the per-request checks (CHECK_FORMAT each, in send order) for `replay report --html`.
"""

from __future__ import annotations

import heapq
import logging
import math
import os
import shutil
import signal
import struct
import sys
import tempfile
import time
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

from replay.protocol.table import prompt_format_problem, sends_token_ids
from replay.protocol.urls import shown
from replay.results.cache_model import CacheModel, ModelPrompt, ServerCache, StartEstimates, attribution, model_checks
from replay.results.fidelity import (
    CacheCheck,
    CacheTally,
    FingerprintTally,
    SentPrompt,
    answered_at,
    ideal_trace_hits,
    method_text,
    missing_rows,
    scheduled,
    send_order_checks,
)
from replay.results.records import parse_record
from replay.rules.prefix_cache import block_hashes
from replay.rules.prompt_fingerprint import agreed_tokens
from replay.trace.fields import DEFAULT_BLOCK_SIZE
from replay.trace.prefix import IdealHits, hit_tokens
from replay.trace.reader import TraceStream

if TYPE_CHECKING:
    from replay.synth.prompts import PromptSynthesizer
    from replay.synth.tokenizer import ServerTokenizer

CHECK_FORMAT = struct.Struct("<qdqqqqqq")  # request_id, sent_at, prompt_tokens, reported, expected, observed, low, high
NONE = -1  # a number the record does not have
# The tail (--follow) hands a request to the checks once the run's file holds records sent this
# many seconds after it, or twice the longest a record came after a later-sent one, if longer.
HORIZON_S = 120.0
POLL_S = 0.5  # the tail's wait when the file has nothing new
END_SIGNAL = signal.SIGUSR1  # the run's word that the end marker is there: the tail reads on at once
TAIL_READ = 1 << 20
SPOOL_BUFFER = 1 << 20
# The child makes every sent prompt of the run in one process, so it meets every shared prefix the
# workers met between them: a block cache this size (its memory when full:
# docs/bench/2026-11-28-figures.md) makes a trace's shared blocks once where a worker's would make
# them again and again.
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
    """The requests the server took in, as the batch finds them in the merged file: each one's
    request id, send time and line (read again, in send order, when its prompt is checked), and
    their send order."""

    def __init__(self, results: str) -> None:
        self.request_id, self.sent_at = array("q"), array("d")
        self.offset, self.length = array("q"), array("q")
        self.apis: Counter[str] = Counter()
        self.fingerprinted = bytearray()  # 1: the record has a prompt_fingerprint
        offset = 0
        with open(results, "rb") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    record = parse_record(line, results, number)
                    self.apis[record.get("api")] += 1
                    if scheduled(record):
                        self.request_id.append(record["request_id"])
                        self.sent_at.append(record["sent_at"])
                        self.offset.append(offset)
                        self.length.append(len(line))
                        self.fingerprinted.append(record.get("prompt_fingerprint") is not None)
                offset += len(line)
        # by (sent_at, request_id): sorted by request_id (the file's own order, mostly), then stably by sent_at
        order = sorted(range(len(self.request_id)), key=self.request_id.__getitem__)
        order.sort(key=self.sent_at.__getitem__)
        self.order = array("q", order)
        del order
        self.position = array("q", [NONE]) * (max(self.request_id, default=-1) + 1)  # request_id -> index
        for k, rid in enumerate(self.request_id):
            self.position[rid] = k


def _sent_prompt(record: dict, hashes: list[int], prompt_tokens: int, ideal: int | None,
                 starts: StartEstimates | None, agreed: float | None = None) -> SentPrompt | ModelPrompt:
    """A request the server took in, from its record, as the checks take it: a ModelPrompt when
    there is a cache model (`starts`: its start estimates, asked in send order), else a SentPrompt.
    `agreed`: the tokens its fingerprint proves the trace's (replay.rules.prompt_fingerprint)."""
    rid, sent_at = record["request_id"], record["sent_at"]
    reported, observed = record.get("prompt_tokens"), record.get("cached_tokens")
    if starts is None:
        return SentPrompt(rid, sent_at, reported, observed, hashes, prompt_tokens, answered_at(record))
    endpoint = shown(record.get("endpoint") or "")
    output = record.get("output_tokens")
    return ModelPrompt(rid, sent_at, reported, observed, hashes, prompt_tokens, endpoint, record.get("finished_at"),
                       output if output is not None else record.get("output_length") or 0, ideal,
                       starts.started_at(endpoint, sent_at, record.get("ttft_ms")), answered_at(record), agreed)


def _agreed(record: dict, spec_fingerprint) -> float | None:
    """Up to where the prompt `record` says was sent is the one the run's spec makes of its row,
    whose fingerprint is `spec_fingerprint` (replay.rules.prompt_fingerprint.agreed_tokens);
    None: the record has no fingerprint."""
    sent = record.get("prompt_fingerprint")
    if sent is None:
        return None
    try:
        return agreed_tokens(sent, spec_fingerprint)
    except ValueError as e:
        raise ValueError(f"request_id {record['request_id']}: {e}") from None


def _settings(job: dict, api: str) -> tuple[bool, int]:
    """(token ids sent?, the server's block size) of `job`; raises ValueError for a bad one."""
    if problem := prompt_format_problem(job["prompt_format"], api):
        raise ValueError(problem)
    server_block = job["server_block_size"]
    if server_block <= 0:
        raise ValueError(f"server block size must be positive, got {server_block}")
    return sends_token_ids(job["prompt_format"]), server_block


def _tokenizer(job: dict):
    """The run's tokenizer (this process only: the one that asks never loads it), loaded on first
    use: the prompts' token ids come from the set-up (read from the set-up cache, which the run's
    preflight filled) and need the tokenizer itself only where a worker's would."""
    from replay.synth.tokenizer import ServerTokenizer

    return ServerTokenizer.load(job["tokenizer"], job["chat_template"], lazy=True)


def _synthesizer(tokenizer: Callable[[], ServerTokenizer], job: dict, api: str, token_ids: bool,
                 block_size: int | None, run_synth: PromptSynthesizer | None = None) -> PromptSynthesizer:
    """The run's PromptSynthesizer (the trace's block size is known from its first row on):
    `run_synth`'s blocks and set-up when it is the same job's (PromptSynthesizer.with_blocks_of:
    the run's end in the process whose worker made the prompts), else one of its own."""
    from replay.synth.prompts import PromptSynthesizer

    block_size = block_size or DEFAULT_BLOCK_SIZE
    if run_synth is not None and _same_synthesis(run_synth, job, api, token_ids, block_size):
        return run_synth.with_blocks_of(CACHE_BLOCKS)
    return PromptSynthesizer(tokenizer(), api=api, block_size=block_size, seed=job["seed"], token_ids=token_ids,
                             cache_blocks=CACHE_BLOCKS)


def _same_synthesis(synth: PromptSynthesizer, job: dict, api: str, token_ids: bool, block_size: int) -> bool:
    """Whether `synth` makes the prompts `job` says the run made (its settings and tokenizer)."""
    tokenizer = synth.tokenizer
    return (synth.api == api and synth.token_ids == token_ids and synth.seed == job["seed"]
            and synth.block_size == block_size and tokenizer.path is not None
            and str(tokenizer.path) == job["tokenizer"]
            and _same_path(tokenizer.chat_template_path, job["chat_template"]))


def _same_path(mine: str | Path | None, theirs: str | None) -> bool:
    return (mine is None) == (theirs is None) and (mine is None or str(mine) == str(theirs))


def _checked(prompts, job: dict, checks_path: str | None) -> tuple[CacheTally, CacheModel | None]:
    """`prompts` (in send order) through the infinite cache and, when the job names the
    servers' pools, the model of their finite caches; the checks to `checks_path`."""
    servers, server_block = job.get("servers"), job["server_block_size"]
    model = None if servers is None else CacheModel(server_block, {
        endpoint: ServerCache(s["num_gpu_blocks"], s["served_before"]) for endpoint, s in servers.items()})
    tally = CacheTally()
    if model is None:
        checks = send_order_checks(prompts, server_block, job["reorder_window_ms"])
    else:
        checks = (v.check for v in model_checks(prompts, server_block, {}, model=model,
                                                reorder_window_ms=job["reorder_window_ms"]))
    with open(checks_path or os.devnull, "wb", buffering=SPOOL_BUFFER) as out:
        for check in checks:
            tally.add(check)
            if checks_path:
                write_check(out, check)
    return tally, model


def _section(job: dict, api: str, token_ids: bool, tally: CacheTally, model: CacheModel | None,
             trace_block_size: int | None, ideal: IdealHits | None, fingerprints: FingerprintTally) -> dict:
    method = method_text(api=api, token_ids=token_ids, tokenizer=job["tokenizer"], seed=job["seed"],
                         trace_block_size=trace_block_size, server_block_size=job["server_block_size"],
                         reorder_window_ms=job["reorder_window_ms"])
    section = tally.section(method, ideal_trace_hits(ideal))
    section["fingerprints"] = fingerprints.section()
    if model is not None:
        section["misses"] = attribution(model)
    return section


def compute(job: dict, checks_path: str | None = None, run_synth: PromptSynthesizer | None = None) -> dict:
    """The cache section of `job` (CacheJob's fields) from its merged records file; the
    per-request checks to `checks_path`. `run_synth`: the PromptSynthesizer the run's worker
    made its prompts with, in this process (a single-process run's end): the spec's prompts
    are made again from its blocks (`_synthesizer`), never from what it sent."""
    sent = _Sent(job["results"])
    api = job["api"] or (sent.apis.most_common(1)[0][0] if sent.apis else "openai-chat")
    token_ids, server_block = _settings(job, api)
    model_on = job.get("servers") is not None
    n = len(sent.request_id)
    offset, blocks, length = array("q", [0]) * n, array("q", [0]) * n, array("q", [NONE]) * n
    ideal_tokens = array("q", [NONE]) * n if model_on else None  # the trace's own expectation
    agreed = array("d", [math.nan]) * n  # the tokens each fingerprint proves the trace's (nan: none)
    fingerprints = FingerprintTally(job.get("fingerprints_unchecked"))
    stream = TraceStream(job["trace"], job["trace_format"], job["block_size"], job.get("on_bad_line", "fail"))
    trace = TraceCursor(stream)
    synth = None
    position = sent.position
    with tempfile.TemporaryFile(prefix="tracereplay-cache-", buffering=SPOOL_BUFFER) as spool, \
            open(job["results"], "rb") as records:
        written = 0
        for row, row_ideal in trace.rows():
            if synth is None:  # the trace's block size is known from its first row on
                synth = _synthesizer(lambda: _tokenizer(job), job, api, token_ids, stream.block_size, run_synth)
            k = position[row.request_id] if row.request_id < len(position) else NONE
            if k == NONE:
                continue
            if ideal_tokens is not None and row_ideal is not None:
                ideal_tokens[k] = row_ideal
            if sent.fingerprinted[k] and fingerprints.compared:
                ids, fingerprint = synth.server_ids_and_fingerprint(row)
                record = orjson.loads(os.pread(records.fileno(), sent.length[k], sent.offset[k]))
                agreed[k] = _agreed(record, fingerprint)
            else:
                ids = synth.server_ids(row)
            fingerprints.add(row.request_id, None if math.isnan(agreed[k]) else agreed[k])
            hashes = array("q", block_hashes(ids, server_block))
            offset[k], blocks[k], length[k] = written, len(hashes), len(ids)
            spool.write(hashes)
            written += 8 * len(hashes)
        spool.flush()
        ideal = trace.finish()
        missing = [sent.request_id[k] for k in sent.order if length[k] == NONE]
        if missing:
            raise missing_rows(len(missing), missing[0])
        fd, records_fd = spool.fileno(), records.fileno()

        def prompts():
            starts = StartEstimates() if model_on else None
            for k in sent.order:
                hashes = array("q")
                hashes.frombytes(os.pread(fd, 8 * blocks[k], offset[k]))
                record = orjson.loads(os.pread(records_fd, sent.length[k], sent.offset[k]))
                yield _sent_prompt(record, hashes.tolist(), length[k],
                                   _none(ideal_tokens[k]) if ideal_tokens is not None else None, starts,
                                   None if math.isnan(agreed[k]) else agreed[k])

        tally, model = _checked(prompts(), job, checks_path)
    return _section(job, api, token_ids, tally, model, stream.block_size, ideal, fingerprints)


def wait_for_end_signal(timeout_s: float) -> None:
    """Sleep `timeout_s`, or until END_SIGNAL comes. The follower is started with it blocked
    (replay.child.start_module's `blocked`), so one sent before this wait is kept pending and
    ends the next wait at once; where it is not blocked (another caller), a plain sleep."""
    if END_SIGNAL in signal.pthread_sigmask(signal.SIG_BLOCK, []):
        signal.sigtimedwait([END_SIGNAL], timeout_s)
    else:
        time.sleep(timeout_s)


class StreamBroken(Exception):
    """The run's records cannot be checked while it runs (a record came after requests sent
    later than it were checked, or a line could not be read): the end computes the section."""


class ParentGone(Exception):
    """The run that started this child is gone: nobody will read its section."""


class RecordTail:
    """The records a running replay appends to its output (replay.results.store), handed out
    in send order as soon as no earlier send can still come: a record reaches the file when its
    request ends, so one is handed out once the file holds records sent `horizon` seconds after
    it. The horizon is the larger of HORIZON_S and twice the longest a record has come after a
    later-sent one so far; a record that still comes after later ones were handed out breaks the
    tail (StreamBroken): the order it gave would not be send order.

    The file ends when `end_marker` exists (the run writes it once every record is appended);
    until then an empty read waits `poll_s`, or less when END_SIGNAL comes (the run sends it
    with the marker, so the end waits for no poll), and a run gone (this process's parent is no
    longer `parent`, the run's process) raises ParentGone.

    `prepare` (record -> what is handed out in its place) runs as each record comes, not when
    the horizon lets it out: the work of each request (its prompt made again) is done while
    the run replays, and only the checks in send order wait."""

    def __init__(self, path: str, end_marker: Path, horizon_s: float = HORIZON_S, poll_s: float = POLL_S,
                 on_unscheduled=None, parent: int | None = None, prepare=None) -> None:
        self.path, self.end_marker = path, end_marker
        self.horizon_s, self.poll_s = horizon_s, poll_s
        self.on_unscheduled = on_unscheduled  # called with the request id of a record the server did not take in
        self.prepare = prepare
        self.parent = os.getppid() if parent is None else parent  # the run's process
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._offset = self._line = 0
        self._partial = b""
        self._heap: list[tuple[float, int, dict]] = []
        self._latest_sent = -math.inf
        self._lateness = 0.0
        self._last = (-math.inf, -1)  # the last handed out (sent_at, request_id)
        self.ended = False

    def close(self) -> None:
        os.close(self._fd)

    def _read(self) -> bool:
        """Take in what was appended since the last read; False when nothing was."""
        data = os.pread(self._fd, TAIL_READ, self._offset)
        if not data:
            return False
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            self._line += 1
            if line.strip():  # a blank line: a placeholder's, blanked when its row's record came
                self._take(line)
        return True

    def _take(self, line: bytes) -> None:
        try:
            record = parse_record(line, self.path, self._line)
        except ValueError as e:  # a line read while it was blanked, most likely
            raise StreamBroken(str(e)) from None
        if not scheduled(record):
            if self.on_unscheduled is not None:
                self.on_unscheduled(record["request_id"])
            return
        key = (record["sent_at"], record["request_id"])
        if key < self._last:
            raise StreamBroken(f"request {key[1]}'s record came {self._latest_sent - key[0]:.1f} s after a later "
                               f"send's, past the {self._horizon():.0f} s the tail waits")
        if key[0] > self._latest_sent:
            self._latest_sent = key[0]
        else:
            self._lateness = max(self._lateness, self._latest_sent - key[0])
        heapq.heappush(self._heap, (key[0], key[1], record if self.prepare is None else self.prepare(record)))

    def _horizon(self) -> float:
        return max(self.horizon_s, 2.0 * self._lateness)

    def __iter__(self):
        heap = self._heap
        while True:
            frontier = math.inf if self.ended else self._latest_sent - self._horizon()
            while heap and heap[0][0] < frontier:
                sent_at, rid, record = heapq.heappop(heap)
                self._last = (sent_at, rid)
                yield record
            if self.ended:
                return
            if self._read():
                continue
            if self.end_marker.exists():  # every record is in: read to the end
                while self._read():
                    pass
                if self._partial.strip():
                    raise StreamBroken(f"{self.path} ends inside a line")
                self.ended = True
            elif os.getppid() != self.parent:
                raise ParentGone()
            else:
                wait_for_end_signal(self.poll_s)


class TraceCursor:
    """The trace's rows, each with its hit tokens in the trace's own ideal (IdealHits: every row
    counts, in file order), read once: all of them in order (`rows`, the end's pass), or by
    request id only as far as a request asks (`take`, the follower's: a run sends them in about
    that order), the rows read past held until asked for, or dropped when their record says the
    server did not take them in. `finish` reads the rest and gives the ideal."""

    def __init__(self, stream: TraceStream, first: int = 0) -> None:
        """`first`: the run's lowest request id; rows before it (a window's start) are never held."""
        self.stream = stream
        self._first = first
        self._rows = iter(stream)
        self._held: dict[int, tuple] = {}
        self._unscheduled = bytearray()  # request_id -> 1: its record came, the server did not take it
        self.ideal: IdealHits | None = None
        self._started = False

    def drop(self, request_id: int) -> None:
        self._held.pop(request_id, None)
        if request_id >= len(self._unscheduled):
            self._unscheduled.extend(bytes(request_id + 1 - len(self._unscheduled) + 1024))
        self._unscheduled[request_id] = 1

    def _count(self, row) -> int | None:
        """`row`'s ideal hit tokens (None: the trace has no block size)."""
        block_size = self.stream.block_size
        if not self._started:
            self._started = True
            self.ideal = IdealHits() if block_size else None
        if self.ideal is None:
            return None
        return hit_tokens(row, self.ideal.add(row, block_size), block_size)

    def rows(self) -> Iterator[tuple]:
        """(row, its ideal hit tokens) of every row not read yet, in file order."""
        for row in self._rows:
            yield row, self._count(row)

    def take(self, request_id: int) -> tuple:
        """(the row, its ideal hit tokens) of `request_id`; raises ValueError when the trace has none."""
        held = self._held.pop(request_id, None)
        if held is not None:
            return held
        unscheduled = self._unscheduled
        if request_id < len(unscheduled) and unscheduled[request_id]:  # a placeholder (worker lost), then its record
            raise StreamBroken(f"request {request_id}'s record came after a record that said it was not taken in")
        for row in self._rows:
            found = row, self._count(row)
            rid = row.request_id
            if rid == request_id:
                return found
            if rid >= self._first and (rid >= len(unscheduled) or not unscheduled[rid]):
                self._held[rid] = found
        raise missing_rows(1, request_id)

    def finish(self) -> IdealHits | None:
        """Read the rows no request asked for (the trace's ideal counts them all): its IdealHits."""
        for row in self._rows:
            self._count(row)
        if not self._started and self.stream.block_size:  # a trace without rows
            self.ideal = IdealHits()
        return self.ideal


def follow(job: dict, end_marker: Path, horizon_s: float = HORIZON_S, poll_s: float = POLL_S,
           parent: int | None = None) -> dict:
    """The cache section of `job` (its `api` named), computed while the run (process `parent`)
    appends its records to job["results"]: the same section `compute` makes from the merged
    file at the end, when the tail is not broken (StreamBroken), the requests checked in the
    same send order."""
    api = job["api"]
    token_ids, server_block = _settings(job, api)
    synth = None  # the tokenizer is loaded when the first request is checked: not at the run's go, when it sends
    stream = TraceStream(job["trace"], job["trace_format"], job["block_size"], job.get("on_bad_line", "fail"))
    cursor = TraceCursor(stream, job.get("first_request_id", 0))
    tail = RecordTail(job["results"], end_marker, horizon_s, poll_s, on_unscheduled=cursor.drop, parent=parent)
    starts = StartEstimates() if job.get("servers") is not None else None
    fingerprints = FingerprintTally(job.get("fingerprints_unchecked"))

    def prepare(record: dict) -> tuple:
        """A request's own work, done as its record comes: its prompt made again, hashed."""
        nonlocal synth
        row, ideal = cursor.take(record["request_id"])
        if synth is None:
            synth = _synthesizer(lambda: _tokenizer(job), job, api, token_ids, stream.block_size)
        if fingerprints.compared and record.get("prompt_fingerprint") is not None:
            ids, fingerprint = synth.server_ids_and_fingerprint(row)
            agreed = _agreed(record, fingerprint)
        else:
            ids, agreed = synth.server_ids(row), None
        fingerprints.add(record["request_id"], agreed)
        return record, array("q", block_hashes(ids, server_block)), len(ids), ideal, agreed

    tail.prepare = prepare

    def prompts():
        for record, hashes, length, ideal, agreed in tail:
            yield _sent_prompt(record, hashes.tolist(), length, ideal, starts, agreed)

    try:
        tally, model = _checked(prompts(), job, None)
    finally:
        tail.close()
    ideal = cursor.finish()
    return _section(job, api, token_ids, tally, model, stream.block_size, ideal, fingerprints)


def main(argv: list[str]) -> int:
    """The child: compute the section of the job in argv[0], write it (or the input's error) to
    argv[1]. With `--follow` first: follow the run as it goes (`follow`); argv[2] is the end
    marker, and a broken tail writes {"broken": why} (the end then computes the section)."""
    following = argv[:1] == ["--follow"]
    if following:
        argv = argv[1:]
    job_path, result_path, third = (argv + [""])[:3]
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # The run already warned about rows too short for the template; the section counts them instead.
    logging.getLogger("replay.synth.prompts").setLevel(logging.ERROR)
    job = orjson.loads(Path(job_path).read_bytes())
    try:
        if following:
            result = {"section": follow(job, Path(third), job.get("horizon_s", HORIZON_S), parent=job.get("parent"))}
        else:
            result = {"section": compute(job, third or None)}
    except StreamBroken as e:
        result = {"broken": str(e)}
    except ParentGone:
        shutil.rmtree(Path(job_path).parent, ignore_errors=True)  # the run's folder for this child: nobody reads it
        return 0
    except (ValueError, OSError) as e:  # a bad input, said in one line (TraceError, PromptError are ValueErrors)
        result = {"error": str(e)}
    Path(result_path).write_bytes(orjson.dumps(result))
    if following and job.get("parent") is not None and os.getppid() != job["parent"]:
        shutil.rmtree(Path(job_path).parent, ignore_errors=True)  # the run died while its end waited for this
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

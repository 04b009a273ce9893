"""A run's cache fidelity section, from its files: what `replay report` prints and what the end
of a run puts in its summary (both call `cache_job` then `cache_section`: one way to compute
it). The server's block size and pool size come from the run's metadata (`server_cache`: what
each endpoint's /metrics said before the run, or the options), so neither needs a flag against
vLLM or `replay sim`; with the pool size the section holds the finite-cache model's miss
attribution under "misses" (replay/results/cache_model.py, read by the certificate's hook).

The work (re-synthesizing every sent prompt, which needs the tokenizer) runs in a child process
(replay/results/cache_child.py), so the process that asks, a run's master most of all, never
loads the tokenizer and its memory does not grow with the run; a single-process run's short end,
whose process holds the tokenizer's set-up already, computes it in that process instead
(`cache_section_here`). A child that fails or is killed
is one error here (CacheChildError); a bad input (a trace that does not fit the records) is the
ReportError the child names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import orjson

from replay.child import last_line, run_module, start_module, wait_module
from replay.results.cache_child import END_SIGNAL, compute
from replay.results.cache_model import server_caches, start_counters
from replay.results.fidelity import CacheCheck
from replay.results.metadata import file_sha256
from replay.results.report import ReportError
from replay.rules.run_files import metrics_path
from replay.synth.tokenizer_source import resolve_tokenizer

if TYPE_CHECKING:
    from replay.synth.prompts import PromptSynthesizer

CHILD_MODULE = "replay.results.cache_child"

log = logging.getLogger(__name__)


class CacheChildError(ValueError):
    """The child computing the section ended without one: how it ended, and its last words."""


@dataclass(frozen=True)
class CacheJob:
    """Everything the child needs, resolved: the run's settings with any flag applied."""

    results: str  # the run's records file
    trace: str
    trace_format: str | None
    block_size: int | None  # the trace's (None: its format's or the file's own)
    on_bad_line: str  # the run's --on-bad-line: rows it skipped are skipped again, so the ids line up
    tokenizer: str
    chat_template: str | None
    api: str | None  # None: the api most records name
    prompt_format: str
    seed: int
    server_block_size: int
    reorder_window_ms: float = 0.0
    # the cache model's servers: {endpoint as shown: {"num_gpu_blocks", "served_before"}}; None: no model
    servers: dict[str, dict] | None = None
    # why the records' prompt fingerprints are not compared (the prompts re-synthesized are not
    # provably the run's: a flag changed its spec, no metadata, the trace changed); None: compared
    fingerprints_unchecked: str | None = None


CAPACITY_SEARCH = "a capacity search's probes send prompts of their own, not the trace's rows: docs/capacity.md"


def cache_skipped(meta: dict | None) -> str | None:
    """Why the run has no cache section whatever the flags say (None: it may have one): a
    capacity search's records are of its probes' rows (request ids moved past the trace's, hash
    ids in each probe's own namespace, amplify's copies), not of the trace's."""
    return CAPACITY_SEARCH if ((meta or {}).get("options") or {}).get("capacity_search") else None


def _pick(flag, meta_value, default=None):
    return flag if flag is not None else (meta_value if meta_value is not None else default)


def cache_job(results: str | Path, meta: dict | None, *, server_block_size: int | None = None,
              server_cache_blocks: int | None = None, trace: str | None = None,
              trace_format: str | None = None, block_size: int | None = None, tokenizer: str | None = None,
              chat_template: str | None = None, api: str | None = None, prompt_format: str | None = None,
              seed: int | None = None, reorder_window_ms: float = 0.0, check_trace: bool = True,
              out: TextIO | None = sys.stderr) -> CacheJob | None:
    """The cache check of the run whose records are `results` and metadata `meta` (None: none
    beside them); the arguments win over the metadata (its `server_cache`: the block size and
    pool size each endpoint said). None when there is no cache check: no trace named, or (said
    on `out`, unless None) no server block size. Raises ReportError when the run's tokenizer is
    unknown, TokenizerNotFound (an OSError) when it is not on this host. `check_trace`: warn when
    the trace's sha256 differs from the metadata's (reads the whole trace)."""
    meta = meta or {}
    meta_trace = meta.get("trace") or {}
    trace_path = _pick(trace, meta_trace.get("path"))
    if trace_path is None:
        return None
    if (skipped := cache_skipped(meta)) is not None:
        if out is not None:
            print(f"cache fidelity: skipped ({skipped})", file=out)
        return None
    caches = meta.get("server_cache") or {}
    said = {c.get("block_size") for c in caches.values()} - {None}
    if server_block_size is None and len(said) == 1:
        server_block_size = said.pop()
    if server_block_size is None:
        if out is not None:
            why = "the endpoints said different block sizes" if said else "no server said its block size"
            print(f"cache fidelity: skipped ({why}: pass --server-block-size N, the server's KV block size)",
                  file=out)
        return None
    servers, note = _model_servers(results, caches, server_cache_blocks)
    if note and out is not None and caches:  # a run without server_cache (older, or no metadata): not news
        print(f"cache fidelity: {note}", file=out)
    elif note:
        log.info("cache fidelity: %s", note)
    tokenizer_path = _pick(tokenizer, meta.get("tokenizer"))
    if tokenizer_path is None:
        raise ReportError("cache fidelity needs the run's tokenizer: pass --tokenizer (no run metadata names it)")
    same_trace = trace is None
    unchecked = _not_the_runs_spec(meta, trace=trace, block_size=block_size, tokenizer=tokenizer,
                                   chat_template=chat_template, api=api, prompt_format=prompt_format, seed=seed)
    if check_trace and same_trace and meta_trace.get("sha256") and file_sha256(trace_path) != meta_trace["sha256"]:
        print(f"warning: {trace_path} changed since the run (sha256 differs from the run metadata)", file=out)
        unchecked = unchecked or "the trace changed since the run"
    return CacheJob(
        results=str(results),
        trace=str(trace_path),
        trace_format=_pick(trace_format, meta_trace.get("format") if same_trace else None),
        block_size=_pick(block_size, meta_trace.get("block_size") if same_trace else None),
        on_bad_line=(meta.get("options") or {}).get("on_bad_line") or "fail",
        tokenizer=str(resolve_tokenizer(tokenizer_path)),  # a Hugging Face id: its snapshot, for the child
        chat_template=_pick(chat_template, meta.get("chat_template")),
        api=api or meta.get("api"),
        prompt_format=_pick(prompt_format, (meta.get("options") or {}).get("prompt_format"), "text"),
        seed=_pick(seed, meta.get("seed"), 0),
        server_block_size=server_block_size,
        reorder_window_ms=reorder_window_ms,
        servers=servers,
        fingerprints_unchecked=unchecked,
    )


def _not_the_runs_spec(meta: dict, **flags) -> str | None:
    """Why prompts re-synthesized with `flags` (None: the metadata's) are not provably the run's,
    so its records' prompt fingerprints prove nothing against them: a flag that differs from
    the run's metadata, or no metadata at all. None: they are the run's."""
    if not meta:
        return "no run metadata says the run's spec"
    meta_trace = meta.get("trace") or {}
    said = {"trace": meta_trace.get("path"), "block_size": meta_trace.get("block_size"),
            "tokenizer": meta.get("tokenizer"), "chat_template": meta.get("chat_template"), "api": meta.get("api"),
            "prompt_format": (meta.get("options") or {}).get("prompt_format"), "seed": meta.get("seed")}
    for name, value in flags.items():
        if value is not None and str(value) != str(said[name]):
            return f"--{name.replace('_', '-')} {value} is not the run's ({said[name]})"
    return None


def _model_servers(results: str | Path, caches: dict, cache_blocks: int | None) -> tuple[dict | None, str]:
    """(the cache model's servers, why there is none) of a run whose meta's `server_cache` is `caches`:
    each endpoint's pool size (`cache_blocks` wins) and whether it had served prompts before
    the run (its prefix-cache counters in the first scrape; False after --reset-server-cache
    emptied it). No model (None) when an endpoint's pool size is unknown: its misses could not
    be told apart."""
    if cache_blocks is not None:
        caches = {endpoint: {**c, "num_gpu_blocks": cache_blocks} for endpoint, c in caches.items()}
    unknown = sorted(endpoint for endpoint, c in caches.items() if c.get("num_gpu_blocks") is None)
    if not caches or unknown:
        why = f"{', '.join(unknown)} said no pool size" if unknown else "the run's metadata names no server cache"
        return None, f"no cache model, so no miss has a cause: {why} (pass --server-cache-blocks N)"
    counters = start_counters(metrics_path(results)) if metrics_path(results).exists() else {}
    servers = {endpoint: {"num_gpu_blocks": server.num_gpu_blocks,
                          "served_before": server.served_before and not caches[endpoint].get("reset")}
               for endpoint, server in server_caches(caches, counters).items()}  # fmt: skip
    return servers, ""


def cache_section_here(job: CacheJob, run_synth: PromptSynthesizer | None = None) -> dict:
    """The cache section of `job` computed in this process, for a process that already holds the
    run's tokenizer and set-up (a single-process run's end: its worker made the same prompts
    here): a child would load them a second time, and its memory would add to this process's,
    alive at the same time. `run_synth`: the worker's PromptSynthesizer, whose blocks the
    spec's prompts are made again from (cache_child.compute). The section is `cache_section`'s
    (the same `compute`). Raises ReportError for a bad input, CacheChildError for any other
    failure (a child's crash)."""
    prompts_log = logging.getLogger("replay.synth.prompts")
    level = prompts_log.level
    prompts_log.setLevel(logging.ERROR)  # the run already warned about rows too short for the template
    started = time.thread_time()
    try:
        section = compute(dataclasses.asdict(job), None, run_synth)
    except (ValueError, OSError) as e:  # as the child says it (cache_child.main)
        raise ReportError(str(e)) from None
    except Exception as e:  # what would have ended a child ends only the section, as a child's end does
        raise CacheChildError(f"computing it failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                              "no cache section") from None
    finally:
        prompts_log.setLevel(level)
    log.info("cache fidelity computed in the run's own process in %.2f s of CPU", time.thread_time() - started)
    return section


def cache_section(job: CacheJob, *, checks: bool = False) -> tuple[dict, list[CacheCheck] | None]:
    """(the cache section, the per-request checks in send order when `checks`) of `job`,
    computed in a child process. Raises ReportError for a bad input, CacheChildError when the
    child ended without a result, OSError when its files could not be written."""
    from replay.results.cache_child import read_checks  # reads numbers only: no tokenizer here

    with tempfile.TemporaryDirectory(prefix="tracereplay-cache-") as folder:
        paths = {name: Path(folder) / name for name in ("job.json", "result.json", "checks.bin", "stderr")}
        paths["job.json"].write_bytes(orjson.dumps(dataclasses.asdict(job)))
        args = [str(paths["job.json"]), str(paths["result.json"]), str(paths["checks.bin"]) if checks else ""]
        started = time.perf_counter()
        status, peak_mib = run_module(CHILD_MODULE, args, paths["stderr"])
        result = _result(paths["result.json"])
        if status != 0 or result is None:
            how = f"ended with {status}" if status != 0 else "wrote no result"
            raise CacheChildError(f"the child process computing it {how} ({last_line(paths['stderr'])}); "
                                  "no cache section")
        if "error" in result:
            raise ReportError(result["error"])
        log.info("cache fidelity computed in a child process in %.1f s (its peak RSS %d MiB)",
                 time.perf_counter() - started, peak_mib)
        return result["section"], read_checks(paths["checks.bin"]) if checks else None


class CacheStream:
    """A run's cache section computed while the run replays: a child (cache_child --follow)
    reads the records as the run appends them and checks them in send order, so the end only
    waits for the last ones. It runs under SCHED_IDLE (where the system has it; nice 19
    otherwise): it gets a core only when nothing else wants it, and a send that falls due
    preempts it at once, so it takes the CPU the replay leaves; and where this process is
    pinned to some cores (taskset), on the others: its caches' churn is not the replay's.

    The section it makes is the end's only for the job it was started with: `section` takes a
    job made at the end and gives None (the end computes the section as before) when the two
    differ, when the child failed or was killed, or when its tail broke (a record much later
    than the requests sent after it). Nothing here is needed for the section."""

    def __init__(self) -> None:
        self.job: CacheJob | None = None
        self.pid: int | None = None
        self._folder: tempfile.TemporaryDirectory | None = None

    def start(self, job: CacheJob, horizon_s: float | None = None, first_request_id: int = 0) -> None:
        """Follow the run of `job` (its api named; its records file being appended), whose lowest
        request id is `first_request_id` (the trace rows before it are never held). A child that
        cannot start (no room for its job file) is a debug line: the end computes the section."""
        try:
            self._folder = tempfile.TemporaryDirectory(prefix="tracereplay-follow-")
            folder = Path(self._folder.name)
            fields = {**dataclasses.asdict(job), "parent": os.getpid(),  # the child ends when this process is gone
                      "first_request_id": first_request_id}
            if horizon_s is not None:
                fields["horizon_s"] = horizon_s
            (folder / "job.json").write_bytes(orjson.dumps(fields))
            self.pid = start_module(CHILD_MODULE, ["--follow", *(str(folder / name) for name in
                                                                 ("job.json", "result.json", "end"))],
                                    folder / "stderr", own_group=True,  # a Ctrl-C is the run's to handle
                                    blocked=(END_SIGNAL,))
            self.job = job
        except OSError as e:
            log.debug("the cache section is not computed while the run replays (%s)", e)
            self.stop()
            return
        _set_idle(self.pid, True)
        _off_my_cores(self.pid)

    def section(self, job: CacheJob) -> dict | None:
        """The section of `job` (the end's), once the child has checked the last records; None when
        the end must compute it. Blocks the calling thread until the child ends (run it off the loop)."""
        if self.pid is None or self._folder is None:
            return None
        if job != self.job:
            log.info("the cache section is computed at the end: the run's settings changed since its go")
            self.stop()
            return None
        folder = Path(self._folder.name)
        _set_idle(self.pid, False)  # the run is over and the end waits for it
        try:
            (folder / "end").touch()
        except OSError as e:
            log.info("the cache section is computed at the end (%s)", e)
            self.stop()
            return None
        with contextlib.suppress(OSError):  # ended already: nothing to wake
            os.kill(self.pid, END_SIGNAL)  # its tail reads on now, not at its next poll
        started = time.perf_counter()
        pid, self.pid = self.pid, None
        status, peak_mib = wait_module(pid)
        result = _result(folder / "result.json")
        self.stop()
        if status != 0 or result is None or "section" not in result:
            why = result and (result.get("broken") or result.get("error"))
            log.info("the cache section is computed at the end: the child that followed the run ended without it "
                     "(%s)", why or (f"ended with {status}" if status != 0 else "no result"))
            return None
        log.info("cache fidelity computed while the run replayed, its last records in %.1f s%s",
                 time.perf_counter() - started, f" (the child's peak RSS {peak_mib} MiB)" if peak_mib else "")
        return result["section"]

    def stop(self) -> None:
        """End the child if it runs; remove its folder."""
        if self.pid is not None:
            pid, self.pid = self.pid, None
            try:
                if os.wait4(pid, os.WNOHANG)[0] == 0:  # still running (not reaped: the pid is still its)
                    os.kill(pid, signal.SIGTERM)
                    wait_module(pid)
            except ChildProcessError:  # reaped by a SIGCHLD handler of gevent's
                pass
        if self._folder is not None:
            try:
                self._folder.cleanup()
            except OSError:
                pass
            self._folder = None


def _result(path: Path) -> dict | None:
    """What a child wrote to its result file; None when it wrote none (or not a JSON object)."""
    try:
        result = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    return result if isinstance(result, dict) else None


def _set_idle(pid: int, idle: bool) -> None:
    """Process `pid` to SCHED_IDLE (nice 19 where there is none), or back to this process's own
    scheduling where this process may raise it again (root); otherwise it stays as it was. Back
    to this process's, not to a default: a replay started under nice or SCHED_IDLE (a test
    suite's background pass, a batch job) keeps its end's work at the priority it was given."""
    try:
        if idle:
            os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
        else:
            os.sched_setscheduler(pid, os.sched_getscheduler(0), os.sched_getparam(0))
            os.setpriority(os.PRIO_PROCESS, pid, os.getpriority(os.PRIO_PROCESS, 0))
    except (AttributeError, OSError):  # no SCHED_IDLE here, or not allowed
        try:
            os.setpriority(os.PRIO_PROCESS, pid, 19 if idle else os.getpriority(os.PRIO_PROCESS, 0))
        except OSError:
            pass


def _off_my_cores(pid: int) -> None:
    """Process `pid` onto the cores this process is not pinned to, when it is pinned to some and
    others are there; else left as it is (a cpuset that forbids them included)."""
    try:
        mine = os.sched_getaffinity(0)
        others = set(range(os.cpu_count() or 1)) - mine
        if others:
            os.sched_setaffinity(pid, others)
    except (AttributeError, OSError):
        pass

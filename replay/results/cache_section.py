"""A run's cache fidelity section, from its files: what `replay report --server-block-size N`
prints and what the end of a run puts in its summary (both call `cache_job` then
`cache_section`: one way to compute it).

The work (re-synthesizing every sent prompt, which needs the tokenizer) runs in a child process
(replay/results/cache_child.py), so the process that asks, a run's master most of all, never
loads the tokenizer and its memory does not grow with the run. A child that fails or is killed
is one error here (CacheChildError); a bad input (a trace that does not fit the records) is the
ReportError the child names.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import orjson

from replay.child import last_line, run_module
from replay.results.fidelity import CacheCheck
from replay.results.metadata import file_sha256
from replay.results.report import ReportError
from replay.synth.tokenizer_source import resolve_tokenizer

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
    tokenizer: str
    chat_template: str | None
    api: str | None  # None: the api most records name
    prompt_format: str
    seed: int
    server_block_size: int
    reorder_window_ms: float = 0.0


def _pick(flag, meta_value, default=None):
    return flag if flag is not None else (meta_value if meta_value is not None else default)


def cache_job(results: str | Path, meta: dict | None, *, server_block_size: int | None, trace: str | None = None,
              trace_format: str | None = None, block_size: int | None = None, tokenizer: str | None = None,
              chat_template: str | None = None, api: str | None = None, prompt_format: str | None = None,
              seed: int | None = None, reorder_window_ms: float = 0.0, out: TextIO = sys.stderr) -> CacheJob | None:
    """The cache check of the run whose records are `results` and metadata `meta` (None: none
    beside them); the arguments win over the metadata. None when there is no cache check: no
    trace named, or (said on `out`) no server block size. Raises ReportError when the run's
    tokenizer is unknown, TokenizerNotFound (an OSError) when it is not on this host."""
    meta = meta or {}
    meta_trace = meta.get("trace") or {}
    trace_path = _pick(trace, meta_trace.get("path"))
    if trace_path is None:
        return None
    if server_block_size is None:
        print("cache fidelity: skipped (pass --server-block-size N, the server's KV block size)", file=out)
        return None
    tokenizer_path = _pick(tokenizer, meta.get("tokenizer"))
    if tokenizer_path is None:
        raise ReportError("cache fidelity needs the run's tokenizer: pass --tokenizer (no run metadata names it)")
    same_trace = trace is None
    if same_trace and meta_trace.get("sha256") and file_sha256(trace_path) != meta_trace["sha256"]:
        print(f"warning: {trace_path} changed since the run (sha256 differs from the run metadata)", file=out)
    return CacheJob(
        results=str(results),
        trace=str(trace_path),
        trace_format=_pick(trace_format, meta_trace.get("format") if same_trace else None),
        block_size=_pick(block_size, meta_trace.get("block_size") if same_trace else None),
        tokenizer=str(resolve_tokenizer(tokenizer_path)),  # a Hugging Face id: its snapshot, for the child
        chat_template=_pick(chat_template, meta.get("chat_template")),
        api=api or meta.get("api"),
        prompt_format=_pick(prompt_format, (meta.get("options") or {}).get("prompt_format"), "text"),
        seed=_pick(seed, meta.get("seed"), 0),
        server_block_size=server_block_size,
        reorder_window_ms=reorder_window_ms,
    )


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
        try:
            result = orjson.loads(paths["result.json"].read_bytes())
        except (OSError, orjson.JSONDecodeError):
            result = None
        if status != 0 or not isinstance(result, dict):
            how = f"ended with {status}" if status != 0 else "wrote no result"
            raise CacheChildError(f"the child process computing it {how} ({last_line(paths['stderr'])}); "
                                  "no cache section")
        if "error" in result:
            raise ReportError(result["error"])
        log.info("cache fidelity computed in a child process in %.1f s (its peak RSS %d MiB)",
                 time.perf_counter() - started, peak_mib)
        return result["section"], read_checks(paths["checks.bin"]) if checks else None

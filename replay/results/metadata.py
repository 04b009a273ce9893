"""Run metadata, written once beside the merged JSONL (OUTPUT + ".meta.json").

It holds what a report needs besides the records to be reproduced from files alone: which
trace (and window, scale), how prompts were made (tokenizer, template hash, api, seed, block
size), where they went (endpoints, model), who sent them (workers, clock offsets), and the
versions. `replay report RESULTS.jsonl` picks the file up by itself.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import platform
import sys
import time
from pathlib import Path

import orjson

from replay.errors import OutputError
from replay.output_claim import Input, Read
from replay.protocol.urls import redacted, shown
from replay.results.files import overwrite_in_place, write_atomically
from replay.rules.run_files import capacity_path, fidelity_path, meta_path, run_files, summary_path

META_VERSION = 1
MAX_SKIPPED_LISTED = 100


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def platform_name() -> str:
    """platform.platform()'s string without its `uname -p` child on Linux: that child is a fork
    of the whole replaying process (gevent's subprocess), whose memory the host holds twice
    while it lives, for a processor name that Linux's uname mostly reports as unknown. Here the
    system, release, machine and C library, as platform.platform() writes them."""
    if sys.platform != "linux":
        return platform.platform()
    name = os.uname()
    libc, libc_version = platform.libc_ver()
    return "-".join(part for part in (name.sysname, name.release, name.machine, "with", libc + libc_version) if part)


@functools.cache
def versions() -> dict[str, str | None]:
    """Once per process: where platform_name falls back to platform.platform(), that runs
    `uname -p` in a subprocess, which under gevent yields to the event loop
    (replay.run.preflight asks, not the run's start)."""
    return {
        "tracereplay": _version("tracereplay"),
        "locust": _version("locust"),
        "tokenizers": _version("tokenizers"),
        "python": platform.python_version(),
        "platform": platform_name(),
    }


def file_sha256(path: str | Path, limit: int = 1 << 30) -> str | None:
    """The trace's hash, so a report can tell a changed file (None past `limit` bytes or unreadable)."""
    try:
        p = Path(path)
        if p.stat().st_size > limit:
            return None
        h = hashlib.sha256()
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()
    except OSError:
        return None


def trace_notes(skipped: int, oversized: int, max_prompt_tokens: int | None, unwritten: int = 0) -> str:
    """The rows of the trace a run left out, or whose record the disk did not take, as lines:
    said under the summary by the run's end and by `replay report` (from the metadata), so no
    row is left out in silence."""
    notes = ""
    if skipped:
        notes += f"trace rows skipped as bad lines (--on-bad-line skip): {skipped}\n"
    if oversized:
        notes += f"trace rows over --max-prompt-tokens {max_prompt_tokens}, never sent: {oversized}\n"
    if unwritten:
        notes += f"rows whose record could not be written (not in the summary): {unwritten}\n"
    return notes


def template_sha256(tokenizer: str | None, chat_template: str | None) -> str | None:
    """ChatTemplate.sha256 of the template the run used, or None (no template, unreadable)."""
    from replay.synth.tokenizer import load_chat_template

    try:
        template = load_chat_template(tokenizer, chat_template, compiled=False)  # its bytes: no compile
    except (OSError, ValueError):
        return None
    return template.sha256 if template is not None else None


def run_metadata(
    options: dict,
    *,
    trace_path: str,
    trace_format: str,
    block_size: int | None,
    rows: int,
    origin: float,
    window_s: float,
    endpoints: list[str],
    workers: list[dict],
    epoch: float | None,
    started_at: float | None,
    run_id: str | None = None,
    trace_rows: int | None = None,
    skipped: list[str] | None = None,
    max_prompt_tokens: int | None = None,
    oversized: int = 0,
    server_check: dict | None = None,
    trace_sha256: str | None = None,
    incomplete: list[dict] | None = None,
    tokenizer_path: str | None = None,
    server_cache: dict | None = None,
    host_load: dict | None = None,
    tokenizer_fingerprint: str | None = None,
) -> dict:
    """The metadata document. `options` are the replay options (ReplayOptions.to_dict());
    `workers` are [{index, host, clock_offset_ms, rtt_ms, rows_assigned, lost}]; `skipped` the
    bad lines --on-bad-line skip dropped (all counted, the first MAX_SKIPPED_LISTED listed);
    `trace_sha256` the trace's hash when already known; `incomplete` the run's files that are
    not whole, [{file, error}] (see "The output" in README.md); `tokenizer_path` the --tokenizer
    as resolved (a Hugging Face id: its snapshot folder; None: the option is a path);
    `server_cache` each endpoint's KV cache, {endpoint: {"block_size", "num_gpu_blocks", "source"}},
    with "server_said" where an option contradicts the server (replay.protocol.server_cache);
    `host_load` the host while the run sent (replay.results.host_load)."""
    tokenizer = tokenizer_path or options.get("tokenizer")
    opts = redacted({k: v for k, v in options.items() if k != "header"})  # headers may carry credentials, and URLs
    opts["header_names"] = [h.split(":", 1)[0].strip() for h in options.get("header") or ()]
    return {
        "meta_version": META_VERSION,
        "written_at": time.time(),
        "run_id": run_id,  # requests carried X-Request-Id: <run_id>-<request_id>
        "complete": not incomplete,  # every file of the run whole (records sorted, summary written)
        "incomplete": list(incomplete or ()),
        "trace": {
            "path": str(Path(trace_path).resolve()),
            "sha256": trace_sha256 or file_sha256(trace_path),
            "format": trace_format,
            "block_size": block_size,
            "rows": rows,
            "rows_in_file": trace_rows,
            "rows_skipped": len(skipped or ()),
            "skipped": list(skipped or ())[:MAX_SKIPPED_LISTED],
            "max_prompt_tokens": max_prompt_tokens,
            "rows_over_max_prompt_tokens": oversized,
            "origin_s": origin,
            "start": options.get("start"),
            "duration": options.get("duration"),
            "max_requests": options.get("max_requests"),
            "window_s": window_s,
        },
        "scale": options.get("scale"),
        "tokenizer": str(Path(tokenizer).resolve()) if tokenizer else None,  # a path replay report can load
        "chat_template": str(Path(options["chat_template"]).resolve()) if options.get("chat_template") else None,
        "template_sha256": template_sha256(tokenizer, options.get("chat_template")),
        # what prompts are made of (replay.synth.tokenizer.tokenizer_fingerprint: the tokenizer.json
        # bytes, the template, its special tokens), wherever the files lie: what `replay compare` matches
        "tokenizer_fingerprint": tokenizer_fingerprint,
        "api": options.get("api"),
        "model": options.get("model"),
        "stream": options.get("stream"),
        "seed": options.get("seed"),
        "endpoints": [shown(url) for url in endpoints],
        "server_check": server_check,  # --verify-server: how each endpoint counted the sample
        "server_cache": server_cache,  # each endpoint's KV block size and pool size, as said or given
        "epoch": epoch,
        "started_at": started_at,
        "workers": workers,
        "host_load": host_load,  # how busy this host was while the run sent: the certificate's schedule line
        "options": opts,
        "versions": versions(),
    }


def write_run_metadata(output: str | Path, meta: dict, reserve: int = 0) -> Path:
    """Write OUTPUT.meta.json (atomically: a report never reads half a file). `reserve` bytes of
    spaces follow the document (JSON allows them): the room an end-of-run meta is written into
    in place when the disk has filled since, and a temporary copy no longer fits. Raises
    OutputError when neither way works."""
    path = meta_path(output)
    data = orjson.dumps(meta, option=orjson.OPT_INDENT_2)
    try:
        return write_atomically(path, data + b" " * reserve)
    except OutputError:
        if overwrite_in_place(path, data):
            return path
        raise


def write_summary(output: str | Path, report: dict) -> Path:
    """Write OUTPUT.summary.json, the end-of-run summary (atomically, as the metadata)."""
    return write_atomically(summary_path(output), orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")


def write_fidelity(output: str | Path, certificate: dict) -> Path:
    """Write OUTPUT.fidelity.json, the run's fidelity certificate (atomically, as the summary)."""
    return write_atomically(fidelity_path(output), orjson.dumps(certificate, option=orjson.OPT_INDENT_2) + b"\n")


def write_capacity(output: str | Path, report: dict) -> Path:
    """Write OUTPUT.capacity.json, a capacity search's probes and answer (atomically, as the summary)."""
    return write_atomically(capacity_path(output), orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")


def read_run_metadata(results: str | Path) -> dict | None:
    """The metadata beside a results file, or None when there is none."""
    path = meta_path(results)
    if not path.exists():
        return None
    try:
        return orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as e:
        raise ValueError(f"{path}: not a JSON document: {e}") from None


def run_inputs(results: str, label: str) -> list[Read]:
    """What a command reading a run's records reads, for the output claim (replay.output_claim):
    the records, every file beside them, and the trace, tokenizer and chat template its
    metadata names (`replay report` reads them when no flag names others)."""
    read = [Read(Path(results), f"{label} {results}")]
    read += [Read(p, f"{p} (beside {label} {results})") for p in run_files(results)[1:]]
    try:
        meta = read_run_metadata(results) or {}
    except (ValueError, OSError):  # the command says so itself, naming the file
        meta = {}
    named = {"trace": (meta.get("trace") or {}).get("path"), "tokenizer": meta.get("tokenizer"),
             "chat template": meta.get("chat_template")}
    read += [Read(Path(path), f"the {what} {path} ({label} {results}'s metadata names it)")
             for what, path in named.items() if isinstance(path, str) and path]
    return read


RUN = Input("run", expand=run_inputs)  # a run's merged records, as --output named them

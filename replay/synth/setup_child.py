"""A cold set-up built in a short child process, so the replay's own process never loads the
tokenizer.

Building the safe vocabulary and the frames needs the tokenizer itself in memory, and more
while the vocabulary is built, on top of what a worker or master already holds (Locust, gevent,
flask): docs/bench/2026-11-28-figures.md. Built here, that memory lives in a process that has
imported only what the set-up needs and exits when done, and the replay process reads the result as
it reads a set-up cache entry: same bytes, same checks (setup_cache's miss path, against the key
and tokenizer.json bytes it holds already).

The child (setup_child_main.py) is run by replay/child.py (the set-up runs in a gevent threadpool thread, off the
event loop, where it waits). Anything that goes wrong (no interpreter, an import error, a killed
child) logs why and returns None, and the caller builds in-process as before.
Small tokenizers (under CHILD_MIN_BYTES) and tokenizers this process has loaded already are
built in-process: the child would cost more than it saves.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

from replay.child import last_line, run_module
from replay.synth.tokenizer import ServerTokenizer, tokenizer_json

CHILD_MODULE = "replay.synth.setup_child_main"  # what the child runs: it builds and writes the entry
CHILD_MIN_BYTES = 1 << 20  # tokenizer.json sizes from which the child saves memory (llama2's is 1.4 MB)

log = logging.getLogger(__name__)


def run_child(tokenizer: ServerTokenizer, api: str) -> bytes | None:
    """`tokenizer`'s set-up for `api` as a cache entry's bytes, built in a child process (not yet
    checked); None when it is better built in this process, or the child did not deliver."""
    if tokenizer.path is None or tokenizer.loaded:
        return None
    if tokenizer_json(tokenizer.path).stat().st_size < CHILD_MIN_BYTES:
        return None
    template = tokenizer.chat_template_path
    with tempfile.TemporaryDirectory(prefix="tracereplay-setup-") as folder:
        entry, errors = Path(folder) / "entry", Path(folder) / "stderr"
        args = [str(tokenizer.path), "" if template is None else str(template), api, str(entry)]
        started = time.perf_counter()
        try:
            status, peak_mib = run_module(CHILD_MODULE, args, errors)
        except OSError as e:
            log.info("set-up of %s (%s): no child process (%s); building it here", tokenizer.name, api, e)
            return None
        if status != 0:
            log.info("set-up of %s (%s): the child process ended with %s (%s); building it here",
                     tokenizer.name, api, status, last_line(errors))
            return None
        try:
            raw = entry.read_bytes()
        except OSError as e:
            log.info("set-up of %s (%s): the child process wrote no result (%s); building it here",
                     tokenizer.name, api, e)
            return None
    log.info("set-up of %s (%s) built in a child process in %.1f s (its peak RSS %d MiB)",
             tokenizer.name, api, time.perf_counter() - started, peak_mib)
    return raw

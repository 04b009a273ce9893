"""A cold set-up built in a short child process, so the replay's own process never loads the
tokenizer.

Building the safe vocabulary and the frames needs the tokenizer itself in memory: 107-123 MiB
for qwen2 and 184 MiB for llama3, plus ~35 MiB while the vocabulary is built. A worker or master
already holds Locust, gevent and flask (~50 MiB), so a cold start built in-process peaked at
~230 MiB for qwen2. Built here, that memory lives in a process that has imported only what the
set-up needs and exits when done (qwen2: ~170 MiB), and the replay process reads the result as
it reads a set-up cache entry: same bytes, same checks (setup_cache's miss path, against the key
and tokenizer.json bytes it holds already).

The child is spawned and waited for with the C library's calls, not gevent's: the set-up runs
in a gevent threadpool thread (off the event loop), where gevent's cooperative subprocess cannot
be used. Anything that goes wrong (no interpreter, an import error, a killed child) logs why
and returns None, and the caller builds in-process as before.
Small tokenizers (under CHILD_MIN_BYTES) and tokenizers this process has loaded already are
built in-process: the child would cost more than it saves.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from pathlib import Path

from replay.synth.frames import measure
from replay.synth.tokenizer import ServerTokenizer, tokenizer_json
from replay.synth.vocab import build_safe_vocab

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
        argv = [sys.executable, "-m", __name__, str(tokenizer.path), "" if template is None else str(template),
                api, str(entry)]
        started = time.perf_counter()
        try:
            status, peak_mib = _run(argv, errors)
        except OSError as e:
            log.info("set-up of %s (%s): no child process (%s); building it here", tokenizer.name, api, e)
            return None
        if status != 0:
            last = errors.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            log.info("set-up of %s (%s): the child process ended with %s (%s); building it here",
                     tokenizer.name, api, status, last[0])
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


def _run(argv: list[str], errors: Path) -> tuple[int | str, int]:
    """Run `argv` to its end: (exit code, or the signal's name; the child's peak RSS in MiB).
    Its stdout and stderr go to `errors`, its stdin is /dev/null."""
    spawn = os.posix_spawn
    monkey = sys.modules.get("gevent.monkey")
    if monkey is not None and monkey.is_module_patched("os"):
        spawn = monkey.get_original("os", "posix_spawn")  # gevent's watches the child from the main loop only
    package_root = str(Path(__file__).resolve().parents[2])  # where `replay` is, wherever this process found it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
    actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
               (os.POSIX_SPAWN_OPEN, 1, str(errors), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
               (os.POSIX_SPAWN_DUP2, 1, 2)]
    pid = spawn(argv[0], argv, env, file_actions=actions)
    try:
        _, status, usage = os.wait4(pid, 0)  # wait4 is not gevent's: it blocks this thread only
    except ChildProcessError:  # reaped by a SIGCHLD handler of gevent's: ended; its entry is checked anyway
        return 0, 0
    peak_mib = usage.ru_maxrss // 1024
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}", peak_mib
    return os.waitstatus_to_exitcode(status), peak_mib


def main(argv: list[str]) -> int:
    """The child: build the set-up and write it as a cache entry to the given file."""
    from replay.synth import setup_cache  # here: setup_cache imports this module

    tokenizer_path, template, api, out = argv
    tokenizer = ServerTokenizer.load(tokenizer_path, template or None)
    measured = measure(tokenizer, api, build_safe_vocab(tokenizer.tokenizer, tokenizer.name))
    key = setup_cache.key_of(tokenizer, tokenizer_json(tokenizer_path).read_bytes(), api)
    Path(out).write_bytes(setup_cache.encode_entry(key, measured))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

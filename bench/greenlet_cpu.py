"""Where a locust process's CPU goes, greenlet by greenlet: which loop of the replay costs what.

A sampling profiler sees gevent's hub as always busy and a tracing one inflates every call;
this reads the main thread's CPU clock at each greenlet switch (greenlet.settrace) and charges
the slice to the greenlet that ran it, named by its function. "Hub.run" is the event loop
itself, with every I/O callback run inside it (a stream's reads: replay.protocol.client._BodyReader);
"main" is start-up and the end of the run. The process's other threads (gevent's threadpool:
the set-up, the server check's prompts, a single-process run's cache section) are one line,
the process's CPU less the main thread's. Costs one clock read per switch.

    .venv/bin/python bench/greenlet_cpu.py --headless --host URL --trace T ...

(the arguments are `replay run`'s: the user's command, with its own start-up), then at exit,
on stderr: seconds of CPU and switches per greenlet.
"""

from __future__ import annotations

import atexit
import sys
import time
import weakref
from collections import Counter
from pathlib import Path

import greenlet

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

cpu: Counter[str] = Counter()
switches: Counter[str] = Counter()
names: weakref.WeakKeyDictionary[greenlet.greenlet, str] = weakref.WeakKeyDictionary()
last = time.thread_time()


def name_of(g: greenlet.greenlet) -> str:
    """The greenlet's function (gevent drops a finished greenlet's, so it is noted on the way in)."""
    if type(g).__name__ == "Hub":
        return "Hub.run"
    if g.parent is None:
        return "main"
    run = getattr(g, "_run", None) or getattr(g, "run", None)
    return getattr(run, "__qualname__", None) or type(g).__name__


def on_switch(event: str, args) -> None:
    global last
    if event not in ("switch", "throw"):
        return
    origin, target = args
    if target not in names:
        try:
            names[target] = name_of(target)
        except TypeError:  # not weak-referenceable
            pass
    now = time.thread_time()
    who = names.get(origin) or name_of(origin)
    cpu[who] += now - last
    switches[who] += 1
    last = now


def report() -> None:
    on_switch("switch", (greenlet.getcurrent(), greenlet.getcurrent()))  # the last slice
    main_thread = sum(cpu.values())
    print(f"CPU by greenlet (main thread): {main_thread:.3f} s; the process's other threads "
          f"{max(time.process_time() - time.thread_time(), 0.0):.3f} s", file=sys.stderr)
    for who, seconds in cpu.most_common(25):
        print(f"  {seconds:7.3f} s {switches[who]:7d} switches  {who}", file=sys.stderr)


if __name__ == "__main__":
    greenlet.settrace(on_switch)
    atexit.register(report)
    from replay.cli import main

    sys.exit(main(["run", *sys.argv[1:]]))

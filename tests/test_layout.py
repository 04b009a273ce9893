"""The package's floor plan, checked from the sources (replay/source_graph.py reads the imports
from the syntax trees, importing nothing): no import cycles among replay modules, the command
line imported only by the command line, and no import-time side effects."""

import subprocess
import sys

from replay import source_graph

MODULES = source_graph.all_modules()
CLI = "replay.results.cli"


def command_line(module: str) -> bool:
    """The modules that parse a command line: replay.cli, replay.__main__ and each package's cli."""
    return module in ("replay.cli", "replay.__main__") or module.endswith(".cli")


def module_level_graph() -> dict[str, set[str]]:
    """Who imports whom when a module is imported: module-level imports only. `if TYPE_CHECKING:`
    blocks never run; imports inside functions run on a call, once every module is loaded, so
    they cannot leave a module half-initialized and are left out (the one such circle today:
    synth/setup_cache imports synth/setup_child, whose child-process main() imports setup_cache).
    A module's edge to its own packages is left out too: the package is mid-import already, its
    submodules still load."""
    return {m: {d for d in source_graph.imported_modules(m, in_functions=False) if not m.startswith(d + ".")}
            for m in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_among_replay_modules():
    assert len(MODULES) > 50, MODULES  # the package was found
    assert cycles(module_level_graph()) == []


def test_the_graph_sees_type_checking_and_function_imports_apart():
    # protocol/table.py imports Prompt only for type checking; setup_child imports setup_cache in main()
    assert "replay.protocol.prompt" not in source_graph.imported_modules("replay.protocol.table")
    assert "replay.synth.setup_cache" not in source_graph.imported_modules("replay.synth.setup_child",
                                                                           in_functions=False)
    assert "replay.synth.setup_cache" in source_graph.imported_modules("replay.synth.setup_child")


def importers_of_the_report_cli() -> set[str]:
    return {m for m in MODULES if not command_line(m) and CLI in source_graph.imported_modules(m)}


def test_only_the_command_line_imports_the_report_command_line():
    assert importers_of_the_report_cli() == set()


NO_SIDE_EFFECTS = """
import gc, sys
import gevent
before = gevent.config.track_greenlet_tree
import replay.locust
import replay.locust.plugin, replay.engine.dispatcher, replay.protocol.gevent_pool
from replay.locust import ReplayShape, ReplayUser
from replay.protocol import gevent_pool
assert gc.get_freeze_count() == 0, "gc.freeze() at import"
assert gevent.config.track_greenlet_tree == before, "gevent.config changed at import"
assert gevent_pool.require_once.cache_info().misses == 0, "geventhttpclient checked at import"
print("clean")
"""


def test_importing_changes_nothing_and_never_hangs():
    """Importing the Locust adapter first (before Locust itself) once hung on an import lock; and
    what start-up needs (gc.freeze, gevent's config, the geventhttpclient check) is done at start."""
    done = subprocess.run([sys.executable, "-c", NO_SIDE_EFFECTS], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "clean", done.stderr[-2000:]


def test_the_start_does_what_the_imports_no_longer_do():
    code = ("import gevent; from replay.engine.dispatcher import Dispatcher; from replay.engine.transport import "
            "LocalLink; Dispatcher(LocalLink(), local=True); assert not gevent.config.track_greenlet_tree; "
            "from replay.protocol import gevent_pool; from geventhttpclient import HTTPClient; "
            "gevent_pool.PoolInternals(HTTPClient('127.0.0.1', 9)); "
            "assert gevent_pool.require_once.cache_info().misses == 1; print('started')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "started", done.stderr[-2000:]

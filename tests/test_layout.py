"""The package's floor plan, checked from the sources (replay/source_graph.py reads the imports
from the syntax trees, importing nothing, and sees the imports inside functions too): the layers
declared once below (LAYERS), no import of a higher layer, no import circle, the command line
imported only by the command line, and no import-time side effects."""

import subprocess
import sys

from replay import source_graph

MODULES = source_graph.all_modules()
CLI = "replay.results.cli"


def command_line(module: str) -> bool:
    """The modules that parse a command line: replay.cli, replay.__main__ and each package's cli."""
    return module in ("replay.cli", "replay.__main__") or module.endswith(".cli")


# The floor plan, declared once: the layers from the top down. A module may import modules of
# its own package and of the layers below its own, never one above; the packages named in one
# layer are independent of each other. A module belongs to the most specific name that covers
# it (replay.run.options_doc, a script that renders the command line's options, is above the
# command line it renders). Imports inside functions count: they run on a call all the same.
LAYERS: list[tuple[str, ...]] = [
    ("replay.__main__", "replay.run.options_doc"),  # `python -m replay`; options_doc renders every command's options
    ("replay.cli", "replay.demo"),  # the command line
    ("replay.results.cli", "replay.synth.cli", "replay.sim.cli", "replay.record.cli"),  # each area's commands
    ("replay.trace.cli",),  # the trace's commands (the others share its --block-size)
    ("replay.locust",),  # the adapter: Locust's runner around the run
    ("replay.run",),  # preflight -> engine -> finish (run/driver.py)
    ("replay.engine", "replay.record"),  # the replay (master and workers, no Locust); the recording proxy
    ("replay.results", "replay.sim"),  # a run's files and figures; the reference server
    ("replay.synth",),  # exact prompts
    ("replay.protocol", "replay.trace"),  # talking to a server; reading traces
    ("replay.bounds", "replay.env_vars", "replay.output_claim", "replay.child", "replay.source_graph"),
    ("replay.errors", "replay.rules"),  # shared rules and errors, importing nothing
]


def layer_of(module: str) -> tuple[int, str] | None:
    """The layer (its index from the top) and the declared name that covers `module`, the
    longest; None: the package itself (replay/__init__.py)."""
    best = None
    for index, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > len(best[1])):
                best = (index, name)
    return best


def whole_graph() -> dict[str, set[str]]:
    """Who imports whom, imports inside functions included (they run on a call: a circle through
    one is a circle all the same), `if TYPE_CHECKING:` blocks left out (they never run). A
    module's edge to its own packages is left out: the package is mid-import already."""
    return {m: {d for d in source_graph.imported_modules(m) if not m.startswith(d + ".")} for m in MODULES}


def layer_breaches(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module in a layer above the importer's, or in a sibling package of its
    layer, as "importer -> imported"."""
    found = []
    for module, imported in sorted(graph.items()):
        mine = layer_of(module)
        for other in sorted(imported):
            theirs = layer_of(other)
            if mine is None or theirs is None or theirs[1] == mine[1]:
                continue
            if theirs[0] < mine[0] or (theirs[0] == mine[0]):
                found.append(f"{module} -> {other}")
    return found


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
    assert cycles(whole_graph()) == []


def test_every_module_has_a_layer():
    assert [m for m in MODULES if m != "replay" and layer_of(m) is None] == []


def test_no_import_runs_up_the_layers():
    assert layer_breaches(whole_graph()) == []


def test_the_layer_check_sees_an_import_up_and_one_in_a_function():
    assert layer_breaches({"replay.results.html": {"replay.engine.capacity"}}) == [
        "replay.results.html -> replay.engine.capacity"]
    assert layer_breaches({"replay.engine.plan": {"replay.trace.fields", "replay.rules.send_time"}}) == []
    assert layer_breaches({"replay.protocol.client": {"replay.trace.reader"}}) == [  # siblings are independent
        "replay.protocol.client -> replay.trace.reader"]
    assert layer_breaches({"replay.run.options_doc": {"replay.cli"}, "replay.run.finish": {"replay.cli"}}) == [
        "replay.run.finish -> replay.cli"]  # the most specific name decides


def test_the_graph_sees_type_checking_and_function_imports_apart():
    # protocol/table.py imports Prompt only for type checking; the dispatcher imports synth's bodies in a function
    assert "replay.protocol.prompt" not in source_graph.imported_modules("replay.protocol.table")
    assert "replay.synth.bodies" not in source_graph.imported_modules("replay.engine.dispatcher", in_functions=False)
    assert "replay.synth.bodies" in source_graph.imported_modules("replay.engine.dispatcher")


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

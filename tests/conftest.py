"""The pytest fixtures several test modules share; the plain helpers are in tests/support/.

Under pytest-xdist (`make test` runs the suite in parallel) a session-scoped fixture is set
up once per worker process, so the tests that share a real vLLM server run in one worker.
"""

from __future__ import annotations

# Locust monkey-patches the standard library with gevent when it is imported, and some test
# modules import it in-process. Patch first, before anything imports ssl (requests does),
# or ssl recurses forever (gevent issue 1016).
from gevent import monkey

monkey.patch_all()

import os  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import gevent  # noqa: E402
import pytest  # noqa: E402

from replay.sim.process import sim_process  # noqa: E402
from support.paths import shared_path  # noqa: E402
from support.traces import BLOCK  # noqa: E402
from support.vllm import REUSE_ENV, make_tiny_model, require_vllm, vllm_server  # noqa: E402

_KEEPALIVE = pytest.StashKey()


def pytest_configure(config: pytest.Config) -> None:
    """In a pytest-xdist worker, an hourly timer that does nothing keeps the gevent hub alive. The
    worker's main thread waits for its next test on a lock and an event that the monkey-patching
    above made gevent's, set by execnet's own (native) I/O thread; gevent wakes the main thread
    across threads, but a hub with nothing else to watch ends the wait at once (LoopExit)."""
    if hasattr(config, "workerinput"):  # set by pytest-xdist in its workers only
        timer = gevent.get_hub().loop.timer(3600.0, 3600.0)
        timer.start(lambda: None)
        config.stash[_KEEPALIVE] = timer


# Test modules whose tests must all run in one process, as one piece of work, when pytest-xdist
# runs the suite with `--dist loadgroup` (`make test`): the real vLLM servers they start are
# session or module fixtures, and each must start once. Those that share `vllm_qwen2` share a group.
SERIAL_GROUPS = {
    "tests/test_e2e_vllm.py": "vllm_qwen2",
    "tests/test_vllm_parity.py": "vllm_qwen2",
    "tests/test_record_vllm.py": "vllm_qwen2",
    "tests/test_server_time_vllm.py": "vllm_qwen2",
    "tests/test_verify_vllm.py": "vllm_llama3_class",
    "tests/test_cache_model_vllm.py": "vllm_small_cache",
    "tests/test_otlp_vllm.py": "vllm_otlp",
}


# Alone tests that run last among the alone tests: the capacity search calls a probe whose sends
# run 10 ms late (p99) client-limited, and 60 rows make its p99 one stall (it repeats such a
# probe once: two stalls, one in the probe and one in its repeat). `make test` runs the
# alone tests beside the parallel ones, whose starts (vLLM servers loading, a fresh checkout's
# files still being written out) are the busiest time of the run.
ALONE_LAST = ("tests/test_capacity_sim.py",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every `vllm` test belongs to a SERIAL_GROUPS module (a new one must be listed there), and
    they come first: they are the longest pieces of work, and end the run late if started late.
    ALONE_LAST's come last."""
    for item in items:
        if item.get_closest_marker("vllm") and item.nodeid.split("::")[0] not in SERIAL_GROUPS:
            raise pytest.UsageError(f"{item.nodeid}: a vllm test whose module is not in SERIAL_GROUPS "
                                    "(tests/conftest.py), so pytest-xdist could start its server in every worker")
    items.sort(key=lambda item: (item.get_closest_marker("vllm") is None,  # stable: otherwise in order
                                 item.nodeid.split("::")[0] in ALONE_LAST))


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: run in the controlling process
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadgroup` with the groups of SERIAL_GROUPS (each other test is a piece of work of
    its own). pytest-xdist's own grouping, by the xdist_group mark, has no effect from pytest 9.2
    on (pytest-xdist issue 1386): it renames node ids, which pytest no longer allows."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class SerialGroupScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return SERIAL_GROUPS.get(nodeid.split("::")[0]) or super()._split_scope(nodeid)

    return SerialGroupScheduling(config, log)


@pytest.fixture(scope="session", autouse=True)
def session_set_up_cache(tmp_path_factory) -> Path:
    """An empty set-up cache (replay/synth/setup_cache.py) for each test session, never the
    user's ~/.cache: a session's first set-up of each tokenizer is cold, so cold-start bugs are
    not hidden behind entries an earlier session wrote. Child processes (locust, replay sim)
    inherit it. Tests about the cache itself use a folder of their own. The pytest-xdist workers
    of one session share it (each worker's temporary folder is in the session's), as the
    replay's own workers on one host do: a real tokenizer's set-up is built once a session,
    not once a worker."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        path = tmp_path_factory.getbasetemp().parent / "setup-cache"
        path.mkdir(exist_ok=True)
    else:
        path = tmp_path_factory.mktemp("setup-cache")
    before = os.environ.get("TRACEREPLAY_CACHE_DIR")
    os.environ["TRACEREPLAY_CACHE_DIR"] = str(path)
    yield path
    if before is None:
        os.environ.pop("TRACEREPLAY_CACHE_DIR", None)
    else:
        os.environ["TRACEREPLAY_CACHE_DIR"] = before


@pytest.fixture(scope="session")
def toy_tokenizer_dir(tmp_path_factory) -> Path:
    """A tokenizer.json + tokenizer_config.json (ChatML) trained by the project itself."""
    from replay.synth.toy import build_toy_tokenizer

    return build_toy_tokenizer(tmp_path_factory.mktemp("toy-tokenizer"))


@pytest.fixture(params=["qwen2", "llama3", "llama2"])
def real_tokenizer_dir(request) -> Path:
    return shared_path("tokenizers", request.param)


@pytest.fixture
def fast_sim(toy_tokenizer_dir):
    """Answers in a few ms with no cap on concurrent requests: the replay, not the server, is on trial."""
    with sim_process(toy_tokenizer_dir, "--block-size", str(BLOCK), "--ttft-ms", "2", "--itl-ms", "0",
                     "--prefill-ms-per-1k", "0", "--max-num-seqs", "100000") as server:
        yield server


@pytest.fixture
def sim(toy_tokenizer_dir):
    with sim_process(toy_tokenizer_dir, "--block-size", str(BLOCK), "--ttft-ms", "30", "--itl-ms", "2",
                     "--prefill-ms-per-1k", "0") as server:
        yield server


@pytest.fixture(scope="session")
def vllm_qwen2(tmp_path_factory) -> Iterator[str]:
    """One vLLM serving the tiny model with the Qwen2 tokenizer, block size 32, for the session
    (under pytest-xdist, for the worker that runs SERIAL_GROUPS' "vllm_qwen2"); its users reset
    its prefix cache themselves.

    While developing, TRACEREPLAY_VLLM_URL=http://127.0.0.1:PORT reuses a server already started
    this way.
    """
    if os.environ.get(REUSE_ENV):
        yield os.environ[REUSE_ENV].rstrip("/")
        return
    require_vllm()
    model = make_tiny_model(shared_path("tokenizers", "qwen2"), tmp_path_factory.mktemp("tiny-qwen2"))
    # its answers carry vLLM's per-request timing: the records' server_* fields (tests/test_server_time_vllm.py)
    with vllm_server(model, block_size=32, kv_cache_gib=1, extra_args=("--enable-per-request-metrics",)) as url:
        yield url

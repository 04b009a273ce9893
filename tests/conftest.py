"""The pytest fixtures several test modules share; the plain helpers are in tests/support/.

Under pytest-xdist (`make test` runs the suite in parallel) a session-scoped fixture is set
up once per worker process; the tests marked `vllm` all run in one worker (one xdist group),
so real vLLM starts once.
"""

from __future__ import annotations

# Locust monkey-patches the standard library with gevent when it is imported, and some test
# modules import it in-process. Patch first, before anything imports ssl (requests does),
# or ssl recurses forever (gevent issue 1016).
from gevent import monkey

monkey.patch_all()

import os  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Iterator  # noqa: E402

import pytest  # noqa: E402

from replay.sim.process import sim_process  # noqa: E402
from support.paths import shared_path  # noqa: E402
from support.traces import BLOCK  # noqa: E402
from support.vllm import REUSE_ENV, make_tiny_model, require_vllm, vllm_server  # noqa: E402

VLLM_GROUP = "vllm"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every `vllm` test joins one xdist group, so one worker runs them all against one server
    (with `--dist loadgroup`), and they come first: the group is the longest piece of work,
    and it ends the run late if started late."""
    for item in items:
        if item.get_closest_marker("vllm"):
            item.add_marker(pytest.mark.xdist_group(VLLM_GROUP))
    items.sort(key=lambda item: item.get_closest_marker("vllm") is None)  # stable: otherwise in order


@pytest.fixture(scope="session", autouse=True)
def session_set_up_cache(tmp_path_factory) -> Path:
    """An empty set-up cache (replay/synth/setup_cache.py) for each test session, never the
    user's ~/.cache: a session's first set-up of each tokenizer is cold, so cold-start bugs are
    not hidden behind entries an earlier session wrote. Child processes (locust, replay sim)
    inherit it. Tests about the cache itself use a folder of their own. Each xdist worker has
    its own (tmp_path_factory's folders are per worker)."""
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
    (the `vllm` xdist group's worker); its users reset its prefix cache themselves.

    While developing, TRACEREPLAY_VLLM_URL=http://127.0.0.1:PORT reuses a server already started
    this way.
    """
    if os.environ.get(REUSE_ENV):
        yield os.environ[REUSE_ENV].rstrip("/")
        return
    require_vllm()
    model = make_tiny_model(shared_path("tokenizers", "qwen2"), tmp_path_factory.mktemp("tiny-qwen2"))
    with vllm_server(model, block_size=32, kv_cache_gib=1) as url:
        yield url

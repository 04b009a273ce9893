"""Shared fixtures: where ../shared is, and a small tokenizer of our own when it is absent."""

from __future__ import annotations

# Locust monkey-patches the standard library with gevent when it is imported, and some test
# modules import it in-process. Patch first, before anything imports ssl (requests does),
# or ssl recurses forever (gevent issue 1016).
from gevent import monkey

monkey.patch_all()

import os  # noqa: E402
import socket  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("TRACEREPLAY_SHARED", REPO.parent / "shared"))


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shared_path(*parts: str) -> Path:
    """A path under ../shared, or a skip that says why when it is not there."""
    p = SHARED.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"needs {p} (../shared beside the checkout is absent)")
    return p


@pytest.fixture(scope="session")
def toy_tokenizer_dir(tmp_path_factory) -> Path:
    """A tokenizer.json + tokenizer_config.json (ChatML) trained by the project itself."""
    from replay.synth.toy import build_toy_tokenizer

    return build_toy_tokenizer(tmp_path_factory.mktemp("toy-tokenizer"))


@pytest.fixture(params=["qwen2", "llama3", "llama2"])
def real_tokenizer_dir(request) -> Path:
    return shared_path("tokenizers", request.param)

"""Where the repository and ../shared (real tokenizers and traces) are."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("TRACEREPLAY_SHARED", REPO.parent / "shared"))


def shared_path(*parts: str) -> Path:
    """A path under ../shared, or a skip that says why when it is not there."""
    p = SHARED.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"needs {p}: the project's shared test data (real traces and tokenizers) is not at {SHARED}; "
                    "put it beside the checkout as ../shared, or set TRACEREPLAY_SHARED to its folder")
    return p


def char_device(path: Path) -> Path:
    """A character device (a /dev/null: 1, 3) at `path`, for the output claim's tests; needs
    root (CAP_MKNOD), a skip saying so otherwise."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("needs root to make a character device (CAP_MKNOD); run the tests as root (CI does) to cover it")
    return path

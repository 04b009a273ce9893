"""Where the repository and ../shared (real tokenizers and traces) are."""

from __future__ import annotations

import os
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

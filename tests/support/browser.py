"""Chromium and other optional tools (tests/test_html.py, test_browser_webui.py)."""

from __future__ import annotations

import os

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--enable-logging=stderr", "--v=0")  # fmt: skip


def need(what: str, hint: str) -> None:
    """A missing optional tool: fails in CI (CI=true), which must install it; skips elsewhere."""
    message = f"{what} is not installed ({hint})"
    if IN_CI:
        pytest.fail(message + "; CI must install it", pytrace=False)
    pytest.skip(message)

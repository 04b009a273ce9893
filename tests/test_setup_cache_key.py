"""The set-up cache key follows the code that decides a set-up, found from the imports, not
listed: an edit to any module the set-up runs (the special-token rule, the API table) is a new
key, so a stale entry is never read; an edit elsewhere keeps the key (entries stay warm)."""

import shutil
from pathlib import Path

import pytest

from replay import source_graph
from replay.synth import setup_cache


@pytest.fixture
def package_copy(tmp_path) -> Path:
    """A copy of the replay package, to edit: the root that holds it."""
    shutil.copytree(source_graph.ROOT / "replay", tmp_path / "replay",
                    ignore=shutil.ignore_patterns("__pycache__", "data", "static"))
    return tmp_path


def digest_after(root: Path, module: str, edit: str) -> str:
    path = root.joinpath(*module.split(".")).with_suffix(".py")
    path.write_text(path.read_text() + edit)
    return setup_cache.code_digest(root)


def test_the_copy_has_the_same_digest(package_copy):
    assert setup_cache.code_digest(package_copy) == setup_cache.code_digest()


@pytest.mark.parametrize("module, edit", [
    ("replay.rules.tokens", "\nCHAT_ADD_SPECIAL_TOKENS = True\n"),  # the special-token rule the encoding uses
    ("replay.protocol.table", "\nAPIS['openai-chat'] = APIS['openai-completions']\n"),  # the frames consult the table
    ("replay.protocol.openai", "\n# a body builder's edit\n"),
    ("replay.synth.vocab", "\n# the safe vocabulary's edit\n"),
])
def test_an_edit_to_what_decides_a_set_up_changes_the_key(package_copy, module, edit):
    assert module in source_graph.import_closure(setup_cache.SETUP_ENTRIES, package_copy)
    assert digest_after(package_copy, module, edit) != setup_cache.code_digest()


@pytest.mark.parametrize("module", ["replay.results.html", "replay.engine.coordinator", "replay.sim.server"])
def test_an_edit_elsewhere_keeps_the_key(package_copy, module):
    assert module not in source_graph.import_closure(setup_cache.SETUP_ENTRIES, package_copy)
    assert digest_after(package_copy, module, "\n# unrelated\n") == setup_cache.code_digest()


def test_the_key_carries_the_code_digest():
    assert setup_cache.cache_key("fingerprint", {}, "openai-chat")["code"] == setup_cache.code_digest()

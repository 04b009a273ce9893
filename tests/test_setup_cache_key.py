"""The set-up cache key follows the code that decides a set-up, found from the imports, not
listed: an edit to any module the set-up runs (the special-token rule, the API table) is a new
key, so a stale entry is never read; an edit elsewhere keeps the key (entries stay warm)."""

import shutil
from pathlib import Path

import orjson
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


# -- the import memo: each source's imports kept on this host, by the sha256 of its bytes -------


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv(setup_cache.ENV, str(path))
    return path


def digest(root: Path) -> str:
    """code_digest as a new process computes it (not this process's @cache of it)."""
    return setup_cache.code_digest.__wrapped__(root)


def parsed_digest(root: Path) -> str:
    """The digest with every source parsed, no memo."""
    return source_graph.source_digest(setup_cache.SETUP_ENTRIES, root)


def no_parsing(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a source was parsed although the memo holds its imports")
    monkeypatch.setattr(source_graph.ast, "parse", refuse)


def test_the_memo_keeps_the_closure_and_the_digest_and_spares_the_parse(package_copy, cache, monkeypatch):
    assert digest(package_copy) == parsed_digest(package_copy) == setup_cache.code_digest()
    memo = orjson.loads((cache / setup_cache.IMPORT_MEMO).read_bytes())
    assert len(memo) == len(source_graph.import_closure(setup_cache.SETUP_ENTRIES, package_copy))
    written = (cache / setup_cache.IMPORT_MEMO).stat().st_mtime_ns
    no_parsing(monkeypatch)
    assert digest(package_copy) == setup_cache.code_digest()
    assert (cache / setup_cache.IMPORT_MEMO).stat().st_mtime_ns == written  # nothing new: not rewritten


def test_an_edit_after_the_memo_is_read_from_the_source(package_copy, cache):
    """A module of the closure that now imports one more module: its bytes are new, so its
    imports are parsed again and the new module joins the closure (and the key)."""
    before = digest(package_copy)
    assert "replay.results.html" not in source_graph.import_closure(setup_cache.SETUP_ENTRIES, package_copy)
    after = digest_after(package_copy, "replay.rules.tokens", "\nimport replay.results.html  # noqa\n")
    edited = digest(package_copy)
    assert after == edited == parsed_digest(package_copy) != before
    memo = source_graph.ImportMemo(orjson.loads((cache / setup_cache.IMPORT_MEMO).read_bytes()))
    assert "replay.results.html" in source_graph.import_closure(setup_cache.SETUP_ENTRIES, package_copy, memo=memo)
    assert not memo.parsed  # the memo written after the edit holds the edited closure


def test_another_checkouts_runs_keep_this_ones_memo(package_copy, cache, monkeypatch, tmp_path):
    """Two checkouts on one host (a branch beside main, a benchmark's --against TREE) whose
    set-up sources differ take turns: each one's entries stay in the memo, so neither parses
    its sources again after the other's run (each did, when a memo held one checkout's only)."""
    other = tmp_path / "other"
    shutil.copytree(package_copy / "replay", other / "replay")
    tokens = other / "replay" / "rules" / "tokens.py"
    tokens.write_text(tokens.read_text() + "\n# another checkout's edit\n")
    mine, theirs = digest(package_copy), digest(other)
    assert mine != theirs
    no_parsing(monkeypatch)
    assert digest(package_copy) == mine and digest(other) == theirs


def test_the_memo_is_bounded(package_copy, cache, monkeypatch):
    monkeypatch.setattr(setup_cache, "IMPORT_MEMO_ENTRIES", 5)
    cache.mkdir()
    (cache / setup_cache.IMPORT_MEMO).write_bytes(orjson.dumps({f"old{k}": [] for k in range(10)}))
    digest(package_copy)
    memo = orjson.loads((cache / setup_cache.IMPORT_MEMO).read_bytes())
    assert len(memo) == 5 and not any(key.startswith("old") for key in memo)  # the used ones, the old dropped first


@pytest.mark.parametrize("content", [b"", b"{", b"[]", b"null", b'{"k": 1}', b'{"k": [1]}', b'{"k": "replay"}',
                                     b"\xff\xfe", b"{}" * 3])
def test_a_damaged_memo_is_ignored_and_replaced(package_copy, cache, content):
    cache.mkdir()
    (cache / setup_cache.IMPORT_MEMO).write_bytes(content)
    assert digest(package_copy) == parsed_digest(package_copy)
    memo = orjson.loads((cache / setup_cache.IMPORT_MEMO).read_bytes())
    assert len(memo) == len(source_graph.import_closure(setup_cache.SETUP_ENTRIES, package_copy))


def test_a_truncated_memo_is_ignored(package_copy, cache):
    digest(package_copy)
    path = cache / setup_cache.IMPORT_MEMO
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert digest(package_copy) == parsed_digest(package_copy)


@pytest.mark.parametrize("where", ["under a regular file", "a regular file"])
def test_a_cache_folder_that_cannot_be_written_costs_only_the_parse(package_copy, tmp_path, monkeypatch, where):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    monkeypatch.setenv(setup_cache.ENV, str(blocker / "cache" if where == "under a regular file" else blocker))
    assert digest(package_copy) == parsed_digest(package_copy)
    assert blocker.read_text() == "not a folder"

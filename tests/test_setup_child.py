"""A cold set-up of a real tokenizer is built in a child process (replay/synth/setup_child.py):
the replay's own process never loads the tokenizer, the result is the in-process build's byte
for byte, and a child that fails or delivers something off falls back to the in-process build."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
from test_setup_cache import BLOCK, assert_exact, bodies, entries

from replay.synth import setup_cache, setup_child
from replay.synth import tokenizer as tokenizer_module
from replay.synth.frames import PromptError
from replay.synth.prompts import PromptSynthesizer, set_up
from replay.synth.tokenizer import ServerTokenizer
from support.paths import REPO, shared_path

API = "openai-completions"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv(setup_cache.ENV, str(path))
    setup_cache.forget()
    return path


def fresh(tokenizer_dir, loaded: bool = False) -> PromptSynthesizer:
    setup_cache.forget()
    return PromptSynthesizer(ServerTokenizer.load(tokenizer_dir, lazy=not loaded), API, block_size=BLOCK, seed=5)


def child_logs(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == setup_child.__name__]


def test_a_cold_set_up_of_a_real_tokenizer_is_built_in_a_child(cache, caplog, monkeypatch):
    qwen2 = shared_path("tokenizers", "qwen2")
    monkeypatch.setattr(tokenizer_module, "_loaded", None)
    caplog.set_level(logging.INFO)
    child = fresh(qwen2)
    assert not child.tokenizer.loaded and tokenizer_module._loaded is None  # this process never loaded it
    assert any("built in a child process" in m for m in child_logs(caplog)), child_logs(caplog)
    assert len(entries(cache)) == 1  # saved for the next start, as an in-process build is
    # the same set-up as one built here (a loaded tokenizer is never sent to a child)
    for entry in entries(cache):
        entry.unlink()
    caplog.clear()
    here = fresh(qwen2, loaded=True)
    assert not child_logs(caplog) and here.set_up_from_cache is False
    assert bodies(child) == bodies(here)
    assert_exact(child)


def test_a_small_tokenizer_is_built_here(cache, caplog, toy_tokenizer_dir):
    caplog.set_level(logging.INFO)
    assert fresh(toy_tokenizer_dir).tokenizer.loaded
    assert not child_logs(caplog)


def test_a_child_that_fails_falls_back_to_building_here(cache, caplog, monkeypatch):
    qwen2 = shared_path("tokenizers", "qwen2")
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(sys, "executable", "/bin/false")
    s = fresh(qwen2)
    assert s.tokenizer.loaded and s.set_up_from_cache is False
    [line] = child_logs(caplog)
    assert "ended with 1" in line and "building it here" in line
    assert_exact(s)


def test_a_chat_set_up_without_a_template_starts_no_child(cache, caplog, tmp_path):
    """A tokenizer with no chat template cannot be set up for a chat api: the child used to be
    started anyway and die on the missing template (an AttributeError in the log) before the
    in-process build said so. The set-up refuses it first, with the message the user sees."""
    folder = tmp_path / "no-template"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((shared_path("tokenizers", "llama2") / "tokenizer.json").read_bytes())
    caplog.set_level(logging.INFO)
    with pytest.raises(PromptError, match="has no chat template; pass --chat-template"):
        set_up(ServerTokenizer.load(folder, lazy=True), "openai-chat")
    assert child_logs(caplog) == [] and "AttributeError" not in caplog.text


def test_a_child_result_that_fails_its_checks_is_not_used(cache, caplog, monkeypatch):
    """The child's entry is checked as a cache entry is: one of another key (here the set-up of
    another api) is refused, and the set-up built here."""
    qwen2 = shared_path("tokenizers", "qwen2")
    caplog.set_level(logging.INFO)
    real_run_child = setup_child.run_child
    monkeypatch.setattr(setup_child, "run_child", lambda tokenizer, api: real_run_child(tokenizer, "openai-chat"))
    s = fresh(qwen2)
    assert s.tokenizer.loaded
    warnings = [r.getMessage() for r in caplog.records if r.name == setup_cache.__name__]
    assert any("not usable (written for another" in m for m in warnings), warnings
    assert_exact(s)


SPAWN_UNDER_GEVENT = """
import gevent.monkey; gevent.monkey.patch_all()
import json, resource, sys, gevent
from replay.synth import tokenizer
from replay.synth.prompts import set_up
from replay.synth.tokenizer import ServerTokenizer
ticks = []
ticker = gevent.spawn(lambda: [ticks.append(gevent.sleep(0.05)) for _ in iter(int, 1)])
tok = ServerTokenizer.load(sys.argv[1], lazy=True)
where = sys.argv[2]
measured, cached = gevent.get_hub().threadpool.apply(set_up, (tok, "openai-chat")) if where == "thread" else set_up(tok, "openai-chat")
print(json.dumps({"cached": cached, "loaded": tokenizer._loaded is not None, "ticks": len(ticks),
                  "children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime > 0}))
"""


@pytest.mark.parametrize("where", ["thread", "event loop"])
def test_the_child_runs_in_a_gevent_process(cache, where):
    """A worker makes its set-up in a gevent threadpool thread, where gevent's own subprocess
    cannot run; the event loop keeps turning meanwhile (its heartbeats)."""
    qwen2 = shared_path("tokenizers", "qwen2")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", SPAWN_UNDER_GEVENT, str(qwen2), where], capture_output=True,
                         text=True, env=env, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["cached"] is False and result["loaded"] is False and result["children"]
    if where == "thread":
        assert result["ticks"] >= 5  # ~1 s of set-up in the child, the loop ticking every 50 ms

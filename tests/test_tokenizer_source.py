"""`--tokenizer ORG/NAME[@REVISION]` is read from this host's Hugging Face cache (never the
network): the cache is laid out here by hand as huggingface_hub writes it, blobs and symlinked
snapshots (tests/support/hf_cache.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import orjson
import pytest

from replay.engine.same_tokenizer import check_worker_tokenizer, master_tokenizer
from replay.errors import OptionError
from replay.results.records import read_records
from replay.rules.run_files import meta_path
from replay.sim.process import sim_process
from replay.synth.tokenizer import tokenizer_fingerprint
from replay.synth.tokenizer_source import TokenizerNotFound, hub_cache_dir, parse_hub_id, resolve_tokenizer
from support.hf_cache import cache_revision
from support.processes import replay_args, run_replay
from support.traces import BLOCK, mooncake_trace, trace_ids

MAIN = "a" * 40  # refs/main
V2 = "b1c2d3e4f5" + "0" * 30  # refs/v2: the same tokenizer.json blob, another bos_token
FETCH = "hf download org/toy --include 'tokenizer*' --include '*chat_template*'"


@pytest.fixture
def hub(tmp_path, toy_tokenizer_dir, monkeypatch) -> Path:
    """A cache holding org/toy at two revisions, found by HF_HUB_CACHE."""
    hub = tmp_path / "hub"
    cache_revision(hub, "org/toy", toy_tokenizer_dir, MAIN, refs=("main",))
    second = tmp_path / "second"
    shutil.copytree(toy_tokenizer_dir, second)
    config = json.loads((second / "tokenizer_config.json").read_text())
    config["bos_token"] = "<|im_end|>" if config.get("bos_token") == "<|im_start|>" else "<|im_start|>"
    (second / "tokenizer_config.json").write_text(json.dumps(config))
    cache_revision(hub, "org/toy", second, V2, refs=("v2",))
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.chdir(tmp_path)
    return hub


def snapshot(hub: Path, commit: str) -> Path:
    return hub / "models--org--toy" / "snapshots" / commit


def test_an_id_is_its_refs_main_snapshot_read_through_the_symlinks(hub, toy_tokenizer_dir):
    path = resolve_tokenizer("org/toy")
    assert path == snapshot(hub, MAIN) and (path / "tokenizer.json").is_symlink()
    # the same bytes give the same fingerprint, wherever they lie
    assert tokenizer_fingerprint(path) == tokenizer_fingerprint(toy_tokenizer_dir)


@pytest.mark.parametrize("revision", ["v2", V2, V2[:7]], ids=["ref", "full hash", "hash prefix"])
def test_a_revision_by_ref_name_or_commit_hash(hub, toy_tokenizer_dir, revision):
    path = resolve_tokenizer(f"org/toy@{revision}")
    assert path == snapshot(hub, V2)
    assert tokenizer_fingerprint(path) != tokenizer_fingerprint(toy_tokenizer_dir)  # its own tokenizer_config.json


def test_a_local_path_wins_over_an_id(hub, toy_tokenizer_dir):
    shutil.copytree(toy_tokenizer_dir, Path("org/toy"))
    assert resolve_tokenizer("org/toy") == Path("org/toy")


@pytest.mark.parametrize("value, looked", [
    ("org/none", "models--org--none/refs/main"),
    ("org/toy@v3", "models--org--toy/refs/v3"),
    ("org/toy@" + "c" * 40, "models--org--toy/refs/" + "c" * 40),
])
def test_an_absent_id_says_where_it_looked_and_how_to_fetch_it(hub, value, looked):
    with pytest.raises(TokenizerNotFound) as e:
        resolve_tokenizer(value)
    message = str(e.value)
    assert "\n" not in message and str(hub / looked) in message
    repo, revision = parse_hub_id(value)
    assert f"fetch it with: hf download {repo}" + (f" --revision {revision}" if revision else "") in message
    if repo == "org/toy":  # what it holds instead, to name
        assert f"it holds refs: main, v2; snapshots: {MAIN[:7]}, {V2[:7]})" in message


def test_a_snapshot_without_tokenizer_json_is_absent(hub):
    (snapshot(hub, MAIN) / "tokenizer.json").unlink()
    with pytest.raises(TokenizerNotFound) as e:
        resolve_tokenizer("org/toy")
    assert f"(looked for {snapshot(hub, MAIN) / 'tokenizer.json'}); fetch it with: {FETCH}" in str(e.value)


def test_what_is_an_id():
    assert parse_hub_id("Qwen/Qwen2.5-7B-Instruct") == ("Qwen/Qwen2.5-7B-Instruct", None)
    assert parse_hub_id("org/name@refs/pr/1") == ("org/name", "refs/pr/1")
    for path in ("tok", "./org/name", "/org/name", "a/b/c", "../a", "org/..", "org/name@../x", "~/x", "org/a--b"):
        assert parse_hub_id(path) is None, path
    with pytest.raises(TokenizerNotFound, match="^tokenizer not found: tok$"):  # a path, as before
        resolve_tokenizer("tok")


def test_hf_hub_cache_wins_over_hf_home(tmp_path, monkeypatch):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert hub_cache_dir() == tmp_path / "user/.cache/huggingface/hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache_dir() == tmp_path / "xdg/huggingface/hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home/hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert hub_cache_dir() == tmp_path / "cache"


def test_hf_home_layout_resolves(tmp_path, toy_tokenizer_dir, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    cache_revision(tmp_path / "home" / "hub", "org/toy", toy_tokenizer_dir, MAIN, refs=("main",))
    assert resolve_tokenizer("org/toy") == tmp_path / "home/hub/models--org--toy/snapshots" / MAIN
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))  # HF_HUB_CACHE wins, though it holds nothing
    with pytest.raises(TokenizerNotFound, match=str(tmp_path / "empty" / "models--org--toy")):
        resolve_tokenizer("org/toy")


def test_master_and_worker_resolve_an_id(hub, toy_tokenizer_dir):
    assert master_tokenizer("org/toy") == str(snapshot(hub, MAIN))
    expected = tokenizer_fingerprint(toy_tokenizer_dir)
    assert check_worker_tokenizer("org/toy", None, expected) == snapshot(hub, MAIN)
    with pytest.raises(OptionError, match=rf"^tokenizer mismatch: this worker's --tokenizer org/toy@v2 \({snapshot(hub, V2)}\)"):
        check_worker_tokenizer("org/toy@v2", None, expected)
    with pytest.raises(OptionError, match=r"^--tokenizer org/none: cannot load: tokenizer not found: .*hf download"):
        master_tokenizer("org/none")


def test_a_run_by_id_replays_and_records_the_snapshot(hub, tmp_path):
    """The sim and a replay both given the id; the meta names the snapshot, which replay report
    can load later, and keeps the id as given in its options."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=6, gap_ms=5)
    output = tmp_path / "run.jsonl"
    with sim_process("org/toy", "--block-size", str(BLOCK), "--ttft-ms", "2", "--itl-ms", "0") as sim:
        proc = run_replay(replay_args(trace, "org/toy", sim.url, output), tmp_path, 90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(r["request_id"] for r in read_records(output) if r["ok"]) == sorted(trace_ids(trace))
    meta = orjson.loads(meta_path(output).read_bytes())
    assert meta["tokenizer"] == str(snapshot(hub, MAIN).resolve()) and meta["options"]["tokenizer"] == "org/toy"


def test_a_run_by_an_absent_id_is_refused_in_one_line(hub, tmp_path):
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=3, gap_ms=10)
    proc = run_replay(replay_args(trace, "org/none", "http://127.0.0.1:9", tmp_path / "run.jsonl"), tmp_path, 60)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "replay: " in line]
    assert len(lines) == 1 and "--tokenizer org/none: cannot load: tokenizer not found" in lines[0]
    assert str(hub / "models--org--none" / "refs" / "main") in lines[0] and "hf download org/none" in lines[0]

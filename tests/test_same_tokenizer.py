"""Every host builds the same prompts: the master loads its tokenizer in its preflight and sends
its fingerprint; a worker whose tokenizer or template differs, or which lacks a header's
variable, fails its own rows (`worker failed: ...`, exit 1) and sends nothing.

Master and worker here run in folders of their own and are given `--tokenizer tok`, a relative
path: each resolves it in its own folder, as hosts resolve the same path on their own disks.
(The matching case is every distributed test: tests/test_distributed.py, test_locust.py.)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import requests

from replay.engine.dispatcher import BodyBuilder
from replay.engine.options import ReplayOptions
from replay.engine.same_tokenizer import check_worker_tokenizer, master_fingerprint, short
from replay.errors import OptionError
from replay.results.records import WORKER_FAILED, read_records
from replay.synth.chat_template import _compiled
from replay.synth.tokenizer import tokenizer_fingerprint
from replay.synth.toy import build_toy_tokenizer
from support.ports import free_port
from support.processes import finish, replay_args, run_replay, spawn_locust, spawn_worker
from support.traces import mooncake_trace, trace_ids


@pytest.fixture(scope="module")
def other_tokenizer_dir(tmp_path_factory) -> Path:
    """A tokenizer of another vocabulary (trained from other words), same ChatML template."""
    return build_toy_tokenizer(tmp_path_factory.mktemp("other-tokenizer"), vocab_size=2500, seed=1)


def copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_fingerprint_is_the_tokenizer_and_its_template(tmp_path, toy_tokenizer_dir, other_tokenizer_dir):
    mine = tokenizer_fingerprint(toy_tokenizer_dir)
    assert tokenizer_fingerprint(copy_of(toy_tokenizer_dir, tmp_path / "copy")) == mine  # the bytes, not the path
    assert tokenizer_fingerprint(toy_tokenizer_dir / "tokenizer.json") == mine  # the file or its folder
    assert tokenizer_fingerprint(other_tokenizer_dir) != mine

    retemplated = copy_of(toy_tokenizer_dir, tmp_path / "retemplated")
    config = json.loads((retemplated / "tokenizer_config.json").read_text())
    (tmp_path / "same.jinja").write_text(config["chat_template"])
    assert tokenizer_fingerprint(toy_tokenizer_dir, tmp_path / "same.jinja") == mine  # the same source
    config["chat_template"] = config["chat_template"].replace("'\\n'", "'\\n\\n'")
    (retemplated / "tokenizer_config.json").write_text(json.dumps(config))
    assert tokenizer_fingerprint(retemplated) != mine
    assert master_fingerprint(str(toy_tokenizer_dir)) == mine

    # the same files but for a special token the template sees (it may print bos_token)
    respecialled = copy_of(toy_tokenizer_dir, tmp_path / "respecialled")
    config = json.loads((respecialled / "tokenizer_config.json").read_text())
    config["bos_token"] = "<|im_start|>" if config.get("bos_token") != "<|im_start|>" else "<|im_end|>"
    (respecialled / "tokenizer_config.json").write_text(json.dumps(config))
    assert tokenizer_fingerprint(respecialled) != mine


def test_a_set_up_from_the_cache_compiles_no_template(tmp_path, toy_tokenizer_dir):
    """The master's check and a worker's set-up from the cache render no template, so they do
    not compile it (a compile costs as much as the rest of the set-up); a template that changed
    since its set-up was cached is compiled again (and refused when it does not compile)."""
    tok = copy_of(toy_tokenizer_dir, tmp_path / "tok")
    master_fingerprint(str(tok), None, "openai-chat")  # makes the set-up, if this session had not
    _compiled.cache_clear()
    fingerprint = master_fingerprint(str(tok), None, "openai-chat")
    builder = BodyBuilder(ReplayOptions(trace="unused", tokenizer=str(tok), api="openai-chat", model="m"), 16)
    assert builder.synth.set_up_from_cache and _compiled.cache_info().misses == 0
    assert fingerprint == tokenizer_fingerprint(tok)
    config = json.loads((tok / "tokenizer_config.json").read_text())
    config["chat_template"] += "{% if"  # other bytes: no cached set-up vouches for them
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(OptionError, match="cannot load the chat template"):
        master_fingerprint(str(tok), None, "openai-chat")


def test_worker_check(toy_tokenizer_dir, other_tokenizer_dir):
    expected = tokenizer_fingerprint(toy_tokenizer_dir)
    check_worker_tokenizer(str(toy_tokenizer_dir), None, expected)
    check_worker_tokenizer(str(other_tokenizer_dir), None, None)  # a master that sent none: no check
    with pytest.raises(OptionError) as e:
        check_worker_tokenizer(str(other_tokenizer_dir), None, expected)
    assert str(e.value) == (f"tokenizer mismatch: this worker's --tokenizer {other_tokenizer_dir} has fingerprint "
                            f"{short(tokenizer_fingerprint(other_tokenizer_dir))} but the master's is {short(expected)}")


@pytest.mark.parametrize("case", ["missing", "not json", "no tokenizer.json", "bad template", "no chat template",
                                  "config not json", "template raises", "template drops the content"])
@pytest.mark.parametrize("verify", ["auto", "off"])
def test_unloadable_tokenizer_is_refused_on_the_master(tmp_path, toy_tokenizer_dir, case, verify):
    """One line naming the option, exit 2, nothing written, whatever --verify-server says:
    before, the master ran and each worker failed in turn (a tokenizer without a chat template,
    or one whose template raises, for a chat api: refused only by the server check, and with
    `--verify-server off` every row `worker failed` after a traceback)."""
    tok = tmp_path / "tok"
    flags = ["--verify-server", verify]
    if case == "not json":
        tok.mkdir()
        (tok / "tokenizer.json").write_text("{not json")
        message = "--tokenizer tok: cannot load: "
    elif case == "no tokenizer.json":
        tok.mkdir()
        message = f"--tokenizer tok: cannot load: tokenizer not found: {Path('tok') / 'tokenizer.json'}"
    elif case == "bad template":
        copy_of(toy_tokenizer_dir, tok)
        (tmp_path / "bad.jinja").write_text("{% for m in messages %}{{ m['content'] }")
        flags += ["--chat-template", "bad.jinja"]
        message = "--chat-template bad.jinja: cannot load the chat template: "
    elif case == "no chat template":
        tok.mkdir()
        shutil.copy(toy_tokenizer_dir / "tokenizer.json", tok)
        message = "--tokenizer tok: has no chat template, which --api openai-chat needs; pass --chat-template"
    elif case == "config not json":
        copy_of(toy_tokenizer_dir, tok)
        (tok / "tokenizer_config.json").write_text('{"chat_template": ')
        message = f"--tokenizer tok: cannot load the chat template: {Path('tok') / 'tokenizer_config.json'}: not JSON: "
    elif case == "template drops the content":  # every prompt the template's length, whatever the row's
        copy_of(toy_tokenizer_dir, tok)
        (tok / "chat_template.jinja").write_text("{{ bos_token }}hello")
        message = "--tokenizer tok: the chat template renders none of the messages' content (tok (openai-chat, "
    elif case == "template raises":
        copy_of(toy_tokenizer_dir, tok)
        (tmp_path / "raises.jinja").write_text("{{ raise_exception('no system role') }}")
        flags += ["--chat-template", "raises.jinja"]
        message = "--chat-template raises.jinja: cannot render the chat template (template line 1): no system role"
    else:
        message = "--tokenizer tok: cannot load: tokenizer not found: tok"
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=3, gap_ms=10)
    args = replay_args(trace, Path("tok"), "http://127.0.0.1:9", tmp_path / "run.jsonl", *flags)
    proc = run_replay(args, tmp_path, 60)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "replay: " in line]
    assert len(lines) == 1 and f"replay: {message}" in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("run.jsonl")) == []


def run_one_worker(tmp_path: Path, master_tok: Path, worker_tok: Path, url: str, *flags: str,
                   master_env: dict | None = None, worker_env: dict | None = None):
    """A master (in tmp/master) and one worker (in tmp/worker), each with its own `tok`."""
    (tmp_path / "master").mkdir()
    (tmp_path / "worker").mkdir()
    os.symlink(master_tok, tmp_path / "master" / "tok")
    os.symlink(worker_tok, tmp_path / "worker" / "tok")
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=30, gap_ms=20)
    output = tmp_path / "run.jsonl"
    port = free_port()
    master = spawn_locust([*replay_args(trace, Path("tok"), url, output, *flags), "--master", "--expect-workers", "1",
                           "--master-bind-host", "127.0.0.1", "--master-bind-port", str(port)],
                          tmp_path / "master", tmp_path / "master.log", master_env)
    worker = spawn_worker(tmp_path / "worker", port, "worker0", worker_env)
    finish([master, worker])
    return master, trace, output


def assert_worker_failed(master, trace: Path, output: Path, log: Path, error: str, sim_url: str) -> None:
    assert master.returncode == 1, log.read_text()[-3000:]
    records = list(read_records(output))
    assert sorted(r["request_id"] for r in records) == sorted(trace_ids(trace))
    assert {r["error"] for r in records} == {f"{WORKER_FAILED}: {error}"}, log.read_text()[-3000:]
    assert not any(r["ok"] or r["sent_at"] for r in records)
    assert requests.get(f"{sim_url}/debug/requests", timeout=10).json()["total"] == 0  # nothing was sent
    assert f"worker 0 cannot replay: {error}" in log.read_text()


def test_worker_with_another_tokenizer_fails_its_rows(tmp_path, toy_tokenizer_dir, other_tokenizer_dir, sim):
    master, trace, output = run_one_worker(tmp_path, toy_tokenizer_dir, other_tokenizer_dir, sim.url)
    error = (f"tokenizer mismatch: this worker's --tokenizer {tmp_path / 'worker' / 'tok'} has fingerprint "
             f"{short(tokenizer_fingerprint(other_tokenizer_dir))} but the master's is "
             f"{short(tokenizer_fingerprint(toy_tokenizer_dir))}")
    assert_worker_failed(master, trace, output, tmp_path / "master.log", error, sim.url)


def test_worker_without_the_header_variable_fails_its_rows(tmp_path, toy_tokenizer_dir, sim):
    """The master has the variable (its preflight passes), the worker's host does not: the
    header is never sent with a literal `$REPLAY_TEST_SECRET`, the worker's rows fail."""
    master_env = {**os.environ, "REPLAY_TEST_SECRET": "s3cret"}
    worker_env = {k: v for k, v in os.environ.items() if k != "REPLAY_TEST_SECRET"}
    master, trace, output = run_one_worker(tmp_path, toy_tokenizer_dir, toy_tokenizer_dir, sim.url,
                                           "--header", "Authorization: Bearer $REPLAY_TEST_SECRET",
                                           master_env=master_env, worker_env=worker_env)
    error = "--header Authorization: $REPLAY_TEST_SECRET is not set on this host"
    assert_worker_failed(master, trace, output, tmp_path / "master.log", error, sim.url)

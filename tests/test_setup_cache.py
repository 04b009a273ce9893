"""The set-up cache (replay/synth/setup_cache.py): written on the first set-up, read on the
next, never trusted when anything is off, and prompts from it are the cold set-up's, byte for byte.

Each test points TRACEREPLAY_CACHE_DIR at a folder of its own (never the user's ~/.cache)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from replay.engine.dispatcher import BodyBuilder
from replay.engine.options import ReplayOptions
from replay.engine.same_tokenizer import master_fingerprint
from replay.synth import setup_cache
from replay.synth.bodies import build_body
from replay.synth.prompts import PromptSynthesizer, encode_prompt, server_count
from replay.synth.tokenizer import ServerTokenizer, load_chat_template, tokenizer_fingerprint
from replay.synth.toy import toy_words
from replay.trace.record import TraceRow
from support.paths import REPO, shared_path

BLOCK = 16
CASES = [("openai-chat", False), ("openai-completions", False), ("openai-completions", True), ("tgi", False)]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv(setup_cache.ENV, str(path))
    return path


def rows(count: int = 60) -> list[TraceRow]:
    """Rows of every kind: shared prefixes, private blocks, no hash ids, shorter than a template."""
    out = []
    for i in range(count):
        length = [1, 3, 17, 40, 95, 200][i % 6] + i
        hashes = tuple(range(i % 4)) + tuple(1000 * (i + 1) + k for k in range(length // BLOCK + 1))
        out.append(TraceRow(i, float(i), length, 10, None if i % 7 == 0 else hashes))
    return out


def synth(tokenizer_dir: Path, api: str = "openai-chat", token_ids: bool = False) -> PromptSynthesizer:
    """A fresh set-up, as a new process makes it (a new ServerTokenizer: no in-memory vocabulary,
    and none of this process's earlier set-ups)."""
    setup_cache.forget()
    return PromptSynthesizer(ServerTokenizer.load(tokenizer_dir, lazy=True), api, block_size=BLOCK, seed=5,
                             token_ids=token_ids)


def bodies(s: PromptSynthesizer) -> list[bytes]:
    return [build_body(s.api, s.prompt(r), model="m", output_length=r.output_length, stream=True) for r in rows()]


def assert_exact(s: PromptSynthesizer) -> None:
    """Every prompt re-encoded by the real tokenizer counts what the synthesizer said, and the
    row's input_length wherever the template leaves room for it."""
    for r in rows():
        prompt = s.prompt(r)
        counted = server_count(s.tokenizer, prompt)
        assert counted == prompt.expected_tokens, r
        if r.input_length > s.min_overhead_tokens:
            assert counted == r.input_length, r


def entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("setup-*.json"))


def cache_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == setup_cache.__name__ and r.levelno >= logging.WARNING]


def test_a_second_set_up_in_one_process_reads_nothing(cache, toy_tokenizer_dir):
    """A single process sets up twice (the master's server check, then its worker part): the
    second is the first's, even with the disk entry gone; other files or api are set up anew."""
    first = synth(toy_tokenizer_dir)
    for entry in entries(cache):
        entry.unlink()
    again = PromptSynthesizer(ServerTokenizer.load(toy_tokenizer_dir, lazy=True), "openai-chat", block_size=BLOCK, seed=9)
    assert again.set_up_from_cache and again.vocab is first.vocab and not entries(cache)
    other = PromptSynthesizer(ServerTokenizer.load(toy_tokenizer_dir, lazy=True), "openai-completions",
                              block_size=BLOCK, seed=9)
    assert not other.set_up_from_cache and other.vocab is not first.vocab


def test_written_on_the_first_set_up_and_read_on_the_second(cache, toy_tokenizer_dir):
    cold = synth(toy_tokenizer_dir)
    assert cold.set_up_from_cache is False
    assert len(entries(cache)) == 1 and not list(cache.glob("*.tmp"))
    warm = synth(toy_tokenizer_dir)
    assert warm.set_up_from_cache is True
    assert not warm.tokenizer.loaded  # prompts come from the vocabulary and frames alone
    assert warm.vocab == cold.vocab and warm.frame == cold.frame and warm.short_frame == cold.short_frame
    assert_exact(warm)


@pytest.mark.parametrize("api,token_ids", CASES)
def test_server_ids_come_from_the_set_up_alone(cache, toy_tokenizer_dir, api, token_ids):
    """A warm set-up gives every row's server token ids, rows shorter than the template
    included, without loading the tokenizer (the cache-fidelity child re-makes every sent
    prompt: one short row loading it cost that child 0.4 s of CPU and 100 MB with qwen2), and
    they are what the tokenizer encodes."""
    synth(toy_tokenizer_dir, api, token_ids)
    warm = synth(toy_tokenizer_dir, api, token_ids)
    assert warm.set_up_from_cache
    assert warm.api != "openai-chat" or any(r.input_length < warm.min_overhead_tokens for r in rows())
    ids = [warm.server_ids(r) for r in rows()]
    assert not warm.tokenizer.loaded
    if warm.verified:  # a template that touches the content: every prompt is encoded anyway
        return
    assert ids == [encode_prompt(warm.tokenizer, warm.prompt(r)) for r in rows()]


@pytest.mark.parametrize("api,token_ids", CASES)
def test_cached_prompts_are_the_cold_ones_byte_for_byte_toy(cache, toy_tokenizer_dir, api, token_ids):
    cold = synth(toy_tokenizer_dir, api, token_ids)
    warm = synth(toy_tokenizer_dir, api, token_ids)
    assert (cold.set_up_from_cache, warm.set_up_from_cache) == (False, True)
    assert bodies(warm) == bodies(cold)
    assert_exact(warm)


@pytest.mark.parametrize("api,token_ids", CASES)
def test_cached_prompts_are_the_cold_ones_byte_for_byte_qwen2(cache, api, token_ids):
    qwen2 = shared_path("tokenizers", "qwen2")
    cold = synth(qwen2, api, token_ids)
    warm = synth(qwen2, api, token_ids)
    assert (cold.set_up_from_cache, warm.set_up_from_cache) == (False, True)
    assert bodies(warm) == bodies(cold)
    assert_exact(warm)


def test_each_real_tokenizer_is_read_back_and_exact(cache, real_tokenizer_dir):
    """llama2's template touches the content: its 'no frame' verdict is cached too."""
    cold = synth(real_tokenizer_dir)
    warm = synth(real_tokenizer_dir)
    assert warm.set_up_from_cache and warm.verified == cold.verified
    assert bodies(warm) == bodies(cold)
    assert_exact(warm)


def _truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _flip_body_byte(data: bytes) -> bytes:
    at = len(data) - 10
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]


def _other_format(data: bytes) -> bytes:
    head, _, body = data.partition(b"\n")
    header = orjson.loads(head)
    header["format"] = setup_cache.FORMAT + 1
    return orjson.dumps(header) + b"\n" + body


def _resigned(data: bytes, change) -> bytes:
    """The body changed by `change`, with a header whose length and sha256 match it: only the
    checks of the content itself can catch it."""
    head, _, body = data.partition(b"\n")
    header, content = orjson.loads(head), orjson.loads(body)
    change(content)
    body = orjson.dumps(content)
    header["length"], header["sha256"] = len(body), __import__("hashlib").sha256(body).hexdigest()
    return orjson.dumps(header) + b"\n" + body


def _shifted_ids(content: dict) -> None:
    content["ids"] = [i + 1 for i in content["ids"]]


def _swapped_texts(content: dict) -> None:
    content["texts"] = content["texts"][1:] + content["texts"][:1]


def _not_a_word(content: dict) -> None:
    content["texts"][3] = " <|im_end|>"


CORRUPTIONS = {
    "empty": lambda data: b"",
    "truncated": _truncate,
    "header only": lambda data: data.partition(b"\n")[0],
    "a flipped body byte": _flip_body_byte,
    "garbage": lambda data: b"\x00\xff not json\n{}",
    "another format": _other_format,
    "ids shifted, re-signed": lambda data: _resigned(data, _shifted_ids),
    "texts rotated, re-signed": lambda data: _resigned(data, _swapped_texts),
    "a special token as a word, re-signed": lambda data: _resigned(data, _not_a_word),
}


@pytest.mark.parametrize("damage", list(CORRUPTIONS))
def test_a_damaged_entry_is_rebuilt_and_prompts_stay_exact(cache, toy_tokenizer_dir, caplog, damage):
    cold = synth(toy_tokenizer_dir, "openai-completions")
    [entry] = entries(cache)
    entry.write_bytes(CORRUPTIONS[damage](entry.read_bytes()))
    with caplog.at_level(logging.WARNING):
        again = synth(toy_tokenizer_dir, "openai-completions")
    assert again.set_up_from_cache is False
    [line] = cache_warnings(caplog)
    assert "not used" in line and str(entry) in line
    assert bodies(again) == bodies(cold)
    assert_exact(again)
    assert synth(toy_tokenizer_dir, "openai-completions").set_up_from_cache is True  # rewritten whole


@pytest.fixture
def other_template_dir(tmp_path, toy_tokenizer_dir) -> Path:
    """The toy tokenizer.json with another chat template (a system line before the messages)."""
    other = tmp_path / "other"
    shutil.copytree(toy_tokenizer_dir, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{- '<|im_start|>system\\nbe brief<|im_end|>\\n' }}" + config["chat_template"]
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    return other


def test_an_entry_of_another_fingerprint_is_never_used(cache, toy_tokenizer_dir, other_template_dir, caplog):
    assert tokenizer_fingerprint(other_template_dir) != tokenizer_fingerprint(toy_tokenizer_dir)
    synth(toy_tokenizer_dir)
    [toy_entry] = entries(cache)
    # its own name, the toy's content: the key inside must match, not only the file name
    other_entry = setup_cache.entry_path(_key(other_template_dir, "openai-chat"))
    shutil.copy(toy_entry, other_entry)
    with caplog.at_level(logging.WARNING):
        other = synth(other_template_dir)
    assert other.set_up_from_cache is False
    assert "another tokenizer" in cache_warnings(caplog)[0]
    assert other.frame != synth(toy_tokenizer_dir).frame  # the system line is in its frame
    assert_exact(other)


def test_special_tokens_of_the_template_are_part_of_the_key(cache, toy_tokenizer_dir, tmp_path):
    """A template sees tokenizer_config.json's bos_token etc.; they are not in the fingerprint
    (the template's source is), so the key carries them: a changed one is a new entry."""
    other = tmp_path / "bos"
    shutil.copytree(toy_tokenizer_dir, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{- bos_token }}" + config["chat_template"]
    config["bos_token"] = "<|endoftext|>"
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    first = synth(other)
    config["bos_token"] = "<|im_end|>"
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    second = synth(other)
    assert tokenizer_fingerprint(other) == _fingerprint_before(first)  # the fingerprint did not move
    assert second.set_up_from_cache is False and len(entries(cache)) == 2
    assert second.frame.before != first.frame.before
    assert_exact(second)


def _fingerprint_before(s: PromptSynthesizer) -> str:
    return tokenizer_fingerprint(s.tokenizer.path)


def _key(tokenizer_dir: Path, api: str) -> dict:
    template = load_chat_template(tokenizer_dir)
    return setup_cache.cache_key(tokenizer_fingerprint(tokenizer_dir), template.special_tokens, api)


@pytest.mark.parametrize("where", ["under a regular file", "a regular file"])
def test_an_unusable_cache_folder_still_sets_up(tmp_path, monkeypatch, toy_tokenizer_dir, caplog, where):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    monkeypatch.setenv(setup_cache.ENV, str(blocker / "cache" if where == "under a regular file" else blocker))
    with caplog.at_level(logging.WARNING):
        first = synth(toy_tokenizer_dir)
        second = synth(toy_tokenizer_dir)
    assert (first.set_up_from_cache, second.set_up_from_cache) == (False, False)
    lines = cache_warnings(caplog)
    assert len(lines) == 2 and all("cannot be written" in line for line in lines)  # one line per set-up
    assert blocker.read_text() == "not a folder"
    assert_exact(second)


def test_default_folder(monkeypatch, tmp_path):
    monkeypatch.delenv(setup_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert setup_cache.cache_dir() == tmp_path / "xdg" / "tracereplay"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert setup_cache.cache_dir() == tmp_path / "home" / ".cache" / "tracereplay"
    monkeypatch.setenv(setup_cache.ENV, str(tmp_path / "mine"))
    assert setup_cache.cache_dir() == tmp_path / "mine"


CHILD = """
import sys
from replay.synth.prompts import PromptSynthesizer
from replay.synth.tokenizer import ServerTokenizer
s = PromptSynthesizer(ServerTokenizer.load(sys.argv[1], lazy=True), "openai-chat", block_size=16)
print(s.set_up_from_cache)
"""


def test_workers_starting_together_share_one_entry(cache, toy_tokenizer_dir):
    """Four processes set up at once on an empty cache: every one works, and what is left is
    one whole entry (written to a temporary file and renamed), which the next process reads."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(toy_tokenizer_dir)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=REPO) for _ in range(4)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    assert len(entries(cache)) == 1 and not list(cache.glob("*.tmp"))
    assert synth(toy_tokenizer_dir).set_up_from_cache is True


def test_the_master_knows_a_tokenizer_that_loaded_before(cache, toy_tokenizer_dir):
    fingerprint = tokenizer_fingerprint(toy_tokenizer_dir)
    template = load_chat_template(toy_tokenizer_dir)
    assert not setup_cache.loaded_before(fingerprint, template.special_tokens, "openai-chat")
    synth(toy_tokenizer_dir)
    assert setup_cache.loaded_before(fingerprint, template.special_tokens, "openai-chat")
    assert not setup_cache.loaded_before(fingerprint, template.special_tokens, "openai-completions")
    assert master_fingerprint(str(toy_tokenizer_dir), None, "openai-chat") == fingerprint


def test_a_warm_worker_loads_its_tokenizer_only_for_rows_with_messages(cache, toy_tokenizer_dir):
    options = ReplayOptions(trace="unused", tokenizer=str(toy_tokenizer_dir), model="m")
    BodyBuilder(options, BLOCK)
    builder = BodyBuilder(options, BLOCK)
    tokenizer = builder.synth.tokenizer
    assert builder.synth.set_up_from_cache and not tokenizer.loaded
    builder.body(rows()[3])
    assert not tokenizer.loaded
    messages = [{"role": "user", "content": "hello there"}]
    body = orjson.loads(builder.body(TraceRow(99, 0.0, 0, 5, None, messages=messages)))
    assert tokenizer.loaded
    assert body["messages"] == messages


WARM_WORKER = """
import sys
import locust.main  # gevent patched first, as the locust command does
import locustfile  # all a single-process run imports, the plugin included
from replay.engine.dispatcher import BodyBuilder
from replay.engine.options import ReplayOptions
from replay.trace.record import TraceRow
builder = BodyBuilder(ReplayOptions(trace="unused", tokenizer=sys.argv[1], model="m"), 16)
builder.body(TraceRow(0, 0.0, 200, 10, (1, 2, 3)))
assert builder.synth.set_up_from_cache
print(sorted(name for name in sys.modules if name.split(".")[0] == "tokenizers"))
"""


def test_a_warm_worker_never_imports_the_tokenizers_library(cache, toy_tokenizer_dir):
    """A run whose set-up comes from the cache builds its prompts without the tokenizer, so it
    does not import the library either: its import is CPU before the first send and memory
    held for the whole run."""
    synth(toy_tokenizer_dir)  # the cache entry
    proc = subprocess.run([sys.executable, "-c", WARM_WORKER, str(toy_tokenizer_dir)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["[]"]


def test_a_unigram_tokenizers_entry_is_read_back(cache, tmp_path, caplog):
    """A Unigram model (T5, ALBERT, XLNet) keeps its vocabulary as [[piece, score], ...], the id
    the position: the spot check found no `"piece": id` there and rebuilt the set-up on every
    start, with a warning each time."""
    words = toy_words(800)
    corpus = [" ".join(words[(i * 7 + k) % len(words)] for k in range(30)) for i in range(600)]
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(corpus, trainers.UnigramTrainer(vocab_size=1200, special_tokens=["<unk>"],
                                                            unk_token="<unk>", show_progress=False))
    folder = tmp_path / "unigram"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    assert json.loads((folder / "tokenizer.json").read_text())["model"]["type"] == "Unigram"
    cold = synth(folder, "openai-completions")
    with caplog.at_level(logging.INFO, logger=setup_cache.__name__):
        warm = synth(folder, "openai-completions")
    assert not cold.set_up_from_cache and warm.set_up_from_cache, cache_warnings(caplog)
    assert cache_warnings(caplog) == [] and bodies(warm) == bodies(cold)
    assert_exact(warm)

"""Prompt synthesis: safe words, deterministic blocks, exact counts, shared prefixes, bodies."""

from __future__ import annotations

import hashlib
import random
import re
import subprocess
import sys
from dataclasses import replace

import orjson
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from replay.synth.bodies import build_body
from replay.synth.check import rescale_rows
from replay.synth.prompts import Prompt, PromptError, PromptSynthesizer, safe_vocab, server_count
from replay.synth.tokenizer import ServerTokenizer
from replay.synth.vocab import VocabularyError, build_safe_vocab
from replay.trace.reader import read_trace
from replay.trace.record import TraceRow
from support.paths import REPO, shared_path

_loaded: dict[str, ServerTokenizer] = {}


def load(path) -> ServerTokenizer:
    """One ServerTokenizer per path for the whole session (its safe vocabulary is cached on it)."""
    key = str(path)
    if key not in _loaded:
        _loaded[key] = ServerTokenizer.load(key)
    return _loaded[key]


@pytest.fixture(scope="module")
def toy(toy_tokenizer_dir) -> ServerTokenizer:
    return load(toy_tokenizer_dir)


def server_ids(synth: PromptSynthesizer, prompt: Prompt) -> list[int]:
    tok = synth.tokenizer
    if prompt.messages is not None:
        return tok.encode_chat(prompt.messages, prompt.tools)
    if prompt.token_ids is not None:
        return prompt.token_ids
    return tok.encode_text(prompt.text)


def content_of(synth: PromptSynthesizer, prompt: Prompt) -> list[int]:
    ids = server_ids(synth, prompt)
    before, after = len(synth.frame.before), len(synth.frame.after)
    return ids[before : len(ids) - after]


def row(request_id: int, length: int, hash_ids=None, **kw) -> TraceRow:
    return TraceRow(request_id, 0.0, length, 10, tuple(hash_ids) if hash_ids is not None else None, **kw)


def random_rows(count: int, block: int, seed: int, tiny: bool = True) -> list[TraceRow]:
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        length = rng.choice([0, 1, 2, 3, 7]) if tiny and i % 5 == 0 else rng.randint(1, 6 * block)
        blocks = -(-length // block)
        shared = rng.randint(0, blocks)
        hash_ids = list(range(shared)) + [1000 * (i + 1) + k for k in range(blocks - shared)]
        rows.append(row(i, length, None if i % 7 == 0 else hash_ids))
    return rows


# ---- the safe vocabulary ---------------------------------------------------------------------


def test_safe_vocab_is_plain_words_and_no_special_tokens(toy):
    vocab = safe_vocab(toy)
    added = set(toy.tokenizer.get_added_tokens_decoder())
    assert len(vocab) > 500 and 0 < vocab.lead_count <= len(vocab)
    assert not added & set(vocab.ids) and not added & set(vocab.lead_ids)
    assert all(re.fullmatch(r" [A-Za-z]+", text) for text in vocab.texts)


def test_safe_vocab_concatenations_reencode_exactly(real_tokenizer_dir):
    tok = load(real_tokenizer_dir)
    vocab = safe_vocab(tok)
    rng = random.Random(7)
    texts, expected = [], []
    for _ in range(40):
        first = rng.randrange(vocab.lead_count)
        rest = [rng.randrange(len(vocab)) for _ in range(rng.randint(0, 300))]
        texts.append(vocab.texts[first][1:] + "".join(vocab.texts[i] for i in rest))
        expected.append([vocab.lead_ids[first]] + [vocab.ids[i] for i in rest])
    encoded = [e.ids for e in tok.tokenizer.encode_batch(texts, add_special_tokens=False)]
    assert encoded == expected


# ---- blocks: determinism and prefixes --------------------------------------------------------

CHILD = """
import hashlib, sys
from replay.synth.tokenizer import ServerTokenizer
from replay.synth.prompts import PromptSynthesizer
from replay.trace.record import TraceRow
s = PromptSynthesizer(ServerTokenizer.load(sys.argv[1]), "openai-completions", block_size=64, seed=3)
for hash_ids in ([5, 6, 7], [5, 8], [123456789]):
    text = s.prompt(TraceRow(0, 0.0, 64 * len(hash_ids) - 9, 1, tuple(hash_ids))).text
    print(hashlib.sha256(text.encode()).hexdigest())
"""


def test_same_hash_ids_give_identical_text_in_separate_processes(toy, toy_tokenizer_dir):
    runs = [
        subprocess.run([sys.executable, "-c", CHILD, str(toy_tokenizer_dir)], capture_output=True, text=True, cwd=REPO)
        for _ in range(2)
    ]
    for run in runs:
        assert run.returncode == 0, run.stderr
    first, second = (run.stdout.split() for run in runs)
    synth = PromptSynthesizer(toy, "openai-completions", block_size=64, seed=3)
    here = [
        hashlib.sha256(synth.prompt(row(0, 64 * len(h) - 9, h)).text.encode()).hexdigest()
        for h in ([5, 6, 7], [5, 8], [123456789])
    ]
    assert first == second == here
    assert len(set(here)) == 3


@pytest.mark.parametrize("api", ["openai-chat", "openai-completions"])
def test_rows_sharing_k_hash_ids_share_exactly_k_blocks(toy, api):
    block = 16
    synth = PromptSynthesizer(toy, api, block_size=block)
    lead = synth.template_overhead_tokens
    base = [11, 12, 13, 14, 15]
    prompts = {
        k: synth.prompt(row(k, lead + 5 * block, base[:k] + [900 + 10 * k + j for j in range(5 - k)])) for k in range(5)
    }
    reference = server_ids(synth, synth.prompt(row(99, lead + 5 * block, base)))
    start = len(synth.frame.before)
    for k, prompt in prompts.items():
        ids = server_ids(synth, prompt)
        assert ids[: start + k * block] == reference[: start + k * block]
        # the very next token differs, and so does the rest of the next block
        assert ids[start + k * block] != reference[start + k * block]
        next_block = slice(start + k * block, start + (k + 1) * block)
        assert ids[next_block] != reference[next_block]


def test_shared_prefix_on_real_tokenizer_server_ids(real_tokenizer_dir):
    synth = PromptSynthesizer(load(real_tokenizer_dir), "openai-chat", block_size=32)
    n = synth.template_overhead_tokens + 3 * 32
    a = server_ids(synth, synth.prompt(row(0, n, [1, 2, 3])))
    b = server_ids(synth, synth.prompt(row(1, n + 20, [1, 2, 4, 5])))
    cut = len(synth.frame.before) + 2 * 32
    assert a[:cut] == b[:cut] and a[cut] != b[cut]


def test_rows_without_hash_ids_share_no_block(toy):
    block = 16
    synth = PromptSynthesizer(toy, "openai-completions", block_size=block)
    contents = [content_of(synth, synth.prompt(row(i, 4 * block))) for i in range(20)]
    # and a row whose hash ids run out before its length does not borrow anyone's blocks either
    contents.append(content_of(synth, synth.prompt(row(20, 4 * block, [1]))))
    seen: set[tuple[int, ...]] = set()
    for content in contents[:-1]:
        for k in range(4):
            chunk = tuple(content[k * block : (k + 1) * block])
            assert chunk not in seen
            seen.add(chunk)
    for k in range(1, 4):
        assert tuple(contents[-1][k * block : (k + 1) * block]) not in seen
    firsts = [tuple(c[:3]) for c in contents]
    assert len(set(firsts)) == len(firsts)


def test_partial_last_block_is_a_prefix_of_the_whole_block(toy):
    block = 32
    synth = PromptSynthesizer(toy, "openai-completions", block_size=block)
    whole = synth.prompt(row(0, 2 * block, [70, 71]))
    for cut in (1, 2, 5, block - 1):
        part = synth.prompt(row(1, block + cut, [70, 71]))
        assert whole.text.startswith(part.text)
        assert content_of(synth, whole)[: block + cut] == content_of(synth, part)


# ---- exact counts ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "api,token_ids",
    [("openai-chat", False), ("openai-completions", False), ("openai-completions", True), ("tgi", False)],
)
def test_toy_counts_are_exact_for_random_lengths(toy, api, token_ids):
    synth = PromptSynthesizer(toy, api, block_size=16, token_ids=token_ids)
    short = 0
    for r in random_rows(200, 16, seed=len(api) * 2 + token_ids):
        prompt = synth.prompt(r)
        counted = server_count(toy, prompt)
        assert counted == prompt.expected_tokens, r
        if r.input_length > synth.min_overhead_tokens:
            assert counted == r.input_length, r
        else:
            short += counted != r.input_length
    assert synth.warnings == short


def test_rows_shorter_than_the_template_warn(toy, caplog):
    synth = PromptSynthesizer(toy, "openai-chat", block_size=16)
    with caplog.at_level("WARNING"):
        prompts = [synth.prompt(row(i, 2)) for i in range(3)]
    assert synth.warnings == 3
    assert [p.expected_tokens for p in prompts] == [synth.frame.empty_tokens] * 3
    assert len([r for r in caplog.records if "below" in r.getMessage()]) == 1


def _mooncake_rows(limit: int = 300) -> tuple[list[TraceRow], int]:
    trace = read_trace(shared_path("traces", "mooncake_synthetic_trace.jsonl"))
    return rescale_rows(trace.rows[:limit], trace.block_size, 32), 32


@pytest.mark.parametrize("api", ["openai-chat", "openai-completions"])
def test_real_tokenizers_are_exact_on_mooncake_rows(real_tokenizer_dir, api):
    rows, block = _mooncake_rows()
    rows += random_rows(100, block, seed=1)
    tok = load(real_tokenizer_dir)
    synth = PromptSynthesizer(tok, api, block_size=block)
    exact = checked = 0
    for r in rows:
        prompt = synth.prompt(r)
        counted = server_count(tok, prompt)
        assert counted == prompt.expected_tokens, r
        if r.input_length > synth.min_overhead_tokens:
            checked += 1
            exact += counted == r.input_length
    assert exact == checked > 250


def test_no_special_tokens_inside_content(real_tokenizer_dir):
    tok = load(real_tokenizer_dir)
    synth = PromptSynthesizer(tok, "openai-chat", block_size=64)
    specials = set(tok.tokenizer.get_added_tokens_decoder())
    content = synth.prompt(row(0, 2000, [1, 2, 3]))
    text = content.messages[-1]["content"]
    assert re.fullmatch(r"[A-Za-z]+( [A-Za-z]+)*", text)
    assert not specials & set(content_of(synth, content))


def test_rows_with_messages_are_sent_as_they_are(toy):
    messages = [{"role": "user", "content": "Hello there, how are you?"}]
    chat = PromptSynthesizer(toy, "openai-chat").prompt(row(0, 0, messages=messages, tools=[{"type": "function"}]))
    assert chat.messages is messages and chat.tools == [{"type": "function"}]
    assert chat.expected_tokens == toy.count_chat(messages, chat.tools)
    text = PromptSynthesizer(toy, "openai-completions").prompt(row(0, 0, messages=messages))
    assert text.expected_tokens == toy.count_text(text.text) and "Hello there" in text.text


def test_token_id_prompts_carry_the_bos(real_tokenizer_dir):
    tok = load(real_tokenizer_dir)
    synth = PromptSynthesizer(tok, "openai-completions", block_size=32, token_ids=True)
    text_synth = PromptSynthesizer(tok, "openai-completions", block_size=32)
    r = row(0, 100, [1, 2, 3, 4])
    ids = synth.prompt(r).token_ids
    assert len(ids) == 100 and ids == tok.encode_text(text_synth.prompt(r).text)


def test_bad_configurations_are_refused(toy):
    with pytest.raises(PromptError, match="unknown api"):
        PromptSynthesizer(toy, "grpc")
    with pytest.raises(PromptError, match="token-id"):
        PromptSynthesizer(toy, "openai-chat", token_ids=True)
    bare = ServerTokenizer(toy.tokenizer, None, "no-template")
    with pytest.raises(PromptError, match="chat template"):
        PromptSynthesizer(bare, "openai-chat")


# ---- bodies ----------------------------------------------------------------------------------


def test_chat_body_fields(toy):
    prompt = PromptSynthesizer(toy, "openai-chat", block_size=16).prompt(row(0, 40, [1, 2, 3]))
    body = orjson.loads(build_body("openai-chat", prompt, model="m1", output_length=7, stream=True))
    assert body["model"] == "m1" and body["messages"] == prompt.messages
    assert body["max_tokens"] == 7 and body["min_tokens"] == 7 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert "tools" not in body
    plain = build_body("openai-chat", prompt, model="m1", output_length=0, stream=False, ignore_eos=False)
    plain = orjson.loads(plain)
    assert plain["max_tokens"] == 1 and plain["stream"] is False
    assert not {"stream_options", "ignore_eos", "min_tokens"} & set(plain)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    with_tools = replace(prompt, tools=tools)
    body = orjson.loads(build_body("openai-chat", with_tools, model="m", output_length=1, stream=False))
    assert body["tools"] == tools


def test_completions_and_tgi_bodies(toy):
    r = row(0, 40, [1, 2, 3])
    text = PromptSynthesizer(toy, "openai-completions", block_size=16).prompt(r)
    ids = PromptSynthesizer(toy, "openai-completions", block_size=16, token_ids=True).prompt(r)
    body = orjson.loads(build_body("openai-completions", text, model="m", output_length=3, stream=False))
    assert body["prompt"] == text.text and body["max_tokens"] == 3 and "messages" not in body
    body = orjson.loads(build_body("openai-completions", ids, model="m", output_length=3, stream=False))
    assert body["prompt"] == ids.token_ids
    tgi_prompt = PromptSynthesizer(toy, "tgi", block_size=16).prompt(r)
    tgi = orjson.loads(build_body("tgi", tgi_prompt, model="m", output_length=0, stream=True))
    parameters = {"max_new_tokens": 1, "details": True, "decoder_input_details": False}
    assert tgi == {"inputs": text.text, "parameters": parameters}
    with pytest.raises(ValueError, match="messages"):
        build_body("openai-chat", text, model="m", output_length=1, stream=False)


def test_templates_that_merge_with_the_content_fall_back_to_fixing_up(toy_tokenizer_dir, tmp_path):
    template = tmp_path / "merging.jinja"
    template.write_text("{% for m in messages %}ka{{ m['content'] }}zu{% endfor %}")
    tok = ServerTokenizer.load(toy_tokenizer_dir, template)
    synth = PromptSynthesizer(tok, "openai-chat", block_size=16)
    assert synth.verified
    rows = [r for r in random_rows(60, 16, seed=5) if r.input_length > 4]
    exact = 0
    for r in rows:
        prompt = synth.prompt(r)
        assert server_count(tok, prompt) == prompt.expected_tokens  # the claim is always honest
        assert abs(prompt.expected_tokens - r.input_length) <= 2
        exact += prompt.expected_tokens == r.input_length
    # this toy template glues words to the content's ends, so some lengths cannot be hit at all
    assert exact == len(rows) - synth.warnings and exact >= 0.6 * len(rows)


def test_block_cache_evicts_least_recently_used_and_regenerates_the_same(toy):
    synth = PromptSynthesizer(toy, "openai-completions", block_size=8, cache_blocks=2)
    blocks = synth.blocks
    first = blocks.hashed(1).text
    blocks.hashed(2)
    blocks.hashed(1)  # 1 is now the most recent: adding 3 evicts 2
    blocks.hashed(3)
    assert blocks.misses == 3 and blocks.hits == 1
    blocks.hashed(1)
    assert blocks.hits == 2
    blocks.hashed(2)
    assert blocks.misses == 4
    blocks.clear()
    assert blocks.hashed(1).text == first


def test_a_blocks_draws_are_shake_of_its_material_with_the_prefix_hashed_once(toy, monkeypatch):
    """A block's draws are SHAKE-256 of b"tracereplay-block-v1|seed|namespace|key|block_size"
    (what every machine derives alike), and making a block hashes only its own key: the constant
    part before it is hashed once per source, not again for every block of a run."""
    from array import array

    from replay.synth import blocks as blocks_module

    source = PromptSynthesizer(toy, "openai-completions", block_size=16, seed=3).blocks
    made = {(namespace, key): source.make(namespace, key).draws
            for namespace, key in ((blocks_module.HASHED, b"5"), (blocks_module.HASHED, b"123456789"),
                                   (blocks_module.UNIQUE, b"7.2"))}
    for (namespace, key), draws in made.items():
        material = b"tracereplay-block-v1|3|%s|%s|16" % (namespace, key)
        expected = array("H", hashlib.shake_256(material).digest(32))
        if sys.byteorder == "big":
            expected.byteswap()
        assert draws == expected, (namespace, key)
    started, shake_256 = [], hashlib.shake_256
    monkeypatch.setattr(blocks_module.hashlib, "shake_256", lambda *a: started.append(a) or shake_256(*a))
    source.make(blocks_module.HASHED, b"6")
    source.unique(9, 0)
    assert started == []


@pytest.mark.parametrize(
    "api,token_ids",
    [("openai-chat", False), ("openai-completions", False), ("openai-completions", True), ("tgi", False)],
)
def test_server_ids_and_fingerprint_are_one_walk_of_the_same_prompt(toy, api, token_ids):
    """What the cache section takes of each sent prompt, made in one walk over its blocks: the
    same server ids and fingerprint as `server_ids` and `prompt` make apart, for rows that share
    prefixes, rows shorter than the template, rows without hash ids and rows of their own messages."""
    synth = PromptSynthesizer(toy, api, block_size=16, token_ids=token_ids)
    rows = random_rows(120, 16, seed=3) + [row(500, 0, messages=[{"role": "user", "content": "Hello there"}])]
    for r in rows:
        assert synth.server_ids_and_fingerprint(r) == (synth.server_ids(r), synth.prompt(r).fingerprint), r


def test_a_synthesizer_with_the_blocks_of_another_makes_the_spec_prompts(toy):
    """The run's end makes the spec's prompts again with the blocks the worker's synthesizer made
    (`with_blocks_of`): none made a second time, none of the worker's test hook (a broken block is
    the worker's bug the check must see), and its own cache from then on."""
    worker = PromptSynthesizer(toy, "openai-chat", block_size=16)
    rows = random_rows(60, 16, seed=5, tiny=False)
    spec = [worker.prompt(r).fingerprint for r in rows]
    worker.break_block(2)
    broken = [worker.prompt(r).fingerprint for r in rows]
    assert broken != spec
    end = worker.with_blocks_of(cache_blocks=1 << 16)
    misses = end.blocks.misses
    assert [end.prompt(r).fingerprint for r in rows] == spec and end.blocks.misses == misses
    assert [worker.prompt(r).fingerprint for r in rows] == broken  # the worker's own stays as it was
    end.blocks.hashed(99_999)
    assert 99_999 in end.blocks._cache and 99_999 not in worker.blocks._cache


def test_a_wordpiece_tokenizer_is_refused_naming_its_model():
    """WordPiece (BERT) has no space marker on whole words: no prompt can be made of its
    words as the synthesis makes them, and the error says which model this is."""
    vocab = {"[UNK]": 0, "the": 1, "cat": 2, "##s": 3}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    with pytest.raises(VocabularyError, match="vocabulary of this WordPiece model: prompts are synthesized for"):
        build_safe_vocab(tokenizer, "bert")

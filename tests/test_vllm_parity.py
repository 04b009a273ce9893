"""`replay sim` against real vLLM: same prompts in, same prompt_tokens and cached_tokens out.

The sim is only worth testing against if it counts like vLLM. Both servers get the same
prompts, one at a time and in the same order, from a cold prefix cache: prompts that share
1..k leading blocks of different sizes, lengths on both sides of block boundaries, repeats
(a hit never covers the last token), unrelated prompts and ~2000-token ones. Chat runs
through the chat template, completions does not (vLLM's notes: a template's leading tokens
can hide a prompt a few tokens short), so both are checked, half the prompts streamed.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import orjson
import pytest
import requests

from replay.sim.process import sim_process
from replay.synth.tokenizer import ServerTokenizer
from replay.synth.vocab import SafeVocab, build_safe_vocab
from support.paths import shared_path
from support.vllm import KV_BYTES_PER_TOKEN, metric_total, reset_prefix_cache

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(400)]

BLOCK = 32
KV_CACHE_GIB = 1  # vllm_qwen2's
MAX_TOKENS = 2
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
ENDPOINTS = {"openai-chat": "/v1/chat/completions", "openai-completions": "/v1/completions"}


@dataclass
class Case:
    name: str
    words: list[str]  # ' word' texts; the first loses its space in the prompt

    @property
    def text(self) -> str:
        return "".join(self.words)[1:]


@dataclass
class Usage:
    prompt_tokens: int | None
    cached_tokens: int | None


@pytest.fixture(scope="module")
def tokenizer_dir():
    return shared_path("tokenizers", "qwen2")


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir) -> ServerTokenizer:
    return ServerTokenizer.load(tokenizer_dir)


@pytest.fixture(scope="module")
def sim_url(vllm_qwen2, tokenizer_dir):
    # Same cache capacity as vLLM's KV space, so neither evicts what the other keeps.
    cache_blocks = int(KV_CACHE_GIB * 2**30) // (KV_BYTES_PER_TOKEN * BLOCK)
    args = ["--block-size", BLOCK, "--model", "tiny", "--port", 0, "--cache-blocks", cache_blocks,
            "--ttft-ms", 0, "--itl-ms", 0, "--prefill-ms-per-1k", 0]  # fmt: skip
    with sim_process(tokenizer_dir, *map(str, args)) as sim:
        yield sim.url


class Words:
    """Deterministic word streams from the tokenizer's round-tripping vocabulary."""

    def __init__(self, vocab: SafeVocab, seed: int = 7):
        self.vocab = vocab
        self.rng = random.Random(seed)

    def stream(self, n: int) -> list[str]:
        """n words starting with one that also encodes alone as one token (it may open a prompt)."""
        v, rng = self.vocab, self.rng
        return [v.texts[rng.randrange(v.lead_count)]] + [v.texts[rng.randrange(len(v))] for _ in range(n - 1)]


def _fit(count, words: list[str], target: int) -> list[str] | None:
    """The prefix of `words` whose prompt counts `target` tokens, or None when none does."""
    k = target - (count(words[:8]) - 8)  # safe words are one token each; the rest is the frame
    if k < 1 or count(words[:k]) != target:
        return None
    return words[:k]


def build_cases(vocab: SafeVocab, count) -> list[Case]:
    """The prompt list, in sending order; `count(words)` is the server-side token count for the api."""
    w = Words(vocab)
    spine = w.stream(2400)  # many prompts are prefixes of it
    root = spine[:100]
    branches = [w.stream(200) for _ in range(8)]
    cases: list[Case] = []

    def add(name: str, words: list[str]) -> None:
        cases.append(Case(name, words))

    # Lengths on both sides of one, two and three blocks, each a prefix of the previous ones.
    for target in (31, 32, 33, 63, 64, 65, 95, 96, 97):
        fitted = _fit(count, spine, target)
        if fitted is not None:  # chat: the template alone may already be longer
            add(f"spine={target}t", fitted)
    for target in (64, 65, 33):
        fitted = _fit(count, spine, target)
        if fitted is not None:
            add(f"again spine={target}t", fitted)
    # A tree: one root, branches of assorted lengths, then sub-branches.
    add("root", root)
    for i, n in enumerate((1, 5, 31, 32, 40, 64, 77, 150)):
        add(f"root+b{i}[:{n}]", root + branches[i][:n])
    for i, (n, m) in enumerate(((31, 33), (64, 1), (77, 96), (150, 13))):
        b = (2, 5, 6, 7)[i]
        add(f"root+b{b}[:{n}]+leaf{i}", root + branches[b][:n] + w.stream(m))
    # The same prompt three times in a row.
    same = root + branches[4][:40] + w.stream(20)
    for k in range(3):
        add(f"identical#{k}", same)
    # Prompts that share nothing with anything (chat: only the template).
    for n in (1, 3, 17, 45, 130, 257, 500):
        add(f"unrelated[{n}]", w.stream(n))
    # Long ones: a cold ~2000, a longer one over it, repeats, a shorter prefix, a fork.
    add("spine[:1978]", spine[:1978])
    add("spine[:1978] again", spine[:1978])
    add("spine[:2000]", spine[:2000])
    add("spine[:2000] again", spine[:2000])
    add("spine[:500]", spine[:500])
    add("spine[:1000]+fork", spine[:1000] + w.stream(1000))
    add("root+long", root + w.stream(1900))
    # Back to earlier prefixes, after the long ones went by.
    for i, n in enumerate((1, 31, 64, 150)):
        add(f"revisit root+b{(0, 2, 5, 7)[i]}[:{n}]+", root + branches[(0, 2, 5, 7)[i]][:n] + w.stream(7 + i))
    add("revisit root", root)
    add("root[:99]", root[:99])
    add("root[:65]", root[:65])
    for n in (33, 64, 96, 127, 128, 129):
        add(f"spine[:{n}]", spine[:n])
    add("unrelated again", cases[[c.name for c in cases].index("unrelated[257]")].words)
    return cases


def _usage(usage: dict | None) -> Usage:
    if not usage:
        return Usage(None, None)
    details = usage.get("prompt_tokens_details") or {}
    return Usage(usage.get("prompt_tokens"), details.get("cached_tokens"))


def send(session: requests.Session, url: str, api: str, text: str, stream: bool) -> Usage:
    body: dict = {"model": "tiny", "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
    if api == "openai-chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    resp = session.post(url + ENDPOINTS[api], data=orjson.dumps(body), stream=stream, timeout=60,
                        headers={"Content-Type": "application/json"})  # fmt: skip
    assert resp.status_code == 200, f"{url} {api}: {resp.status_code} {resp.text[:500]}"
    if not stream:
        return _usage(resp.json().get("usage"))
    usage = None
    for line in resp.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            usage = orjson.loads(line[6:]).get("usage") or usage
    return _usage(usage)


def counters(url: str) -> tuple[float | None, float | None]:
    text = requests.get(url + "/metrics", timeout=10).text
    return metric_total(text, HITS), metric_total(text, QUERIES)


def settled_counters(url: str, queries_expected: float, timeout_s: float = 10.0) -> tuple[float, float]:
    """vLLM records stats just after answering; wait until the queries counter caught up."""
    deadline = time.monotonic() + timeout_s
    while True:
        hits, queries = counters(url)
        if queries is not None and queries >= queries_expected or time.monotonic() > deadline:
            return hits, queries
        time.sleep(0.1)


def test_both_export_prefix_cache_counters(vllm_qwen2, sim_url):
    for name, url in (("vllm", vllm_qwen2), ("sim", sim_url)):
        hits, queries = counters(url)
        assert hits is not None and queries is not None, f"{name} /metrics lacks {HITS} or {QUERIES}"


@pytest.mark.parametrize("api", ["openai-chat", "openai-completions"])
def test_prompt_and_cached_tokens_match_vllm(api, vllm_qwen2, sim_url, tokenizer):
    vocab = build_safe_vocab(tokenizer.tokenizer, tokenizer.name)
    if api == "openai-chat":
        count = lambda words: tokenizer.count_chat([{"role": "user", "content": "".join(words)[1:]}])  # noqa: E731
    else:
        count = lambda words: tokenizer.count_text("".join(words)[1:])  # noqa: E731
    cases = build_cases(vocab, count)
    assert len(cases) >= 50
    servers = {"vllm": vllm_qwen2, "sim": sim_url}
    for url in servers.values():
        reset_prefix_cache(url)
    before = {name: counters(url) for name, url in servers.items()}

    rows = []
    with requests.Session() as vs, requests.Session() as ss:
        for i, case in enumerate(cases):
            stream = i % 2 == 1
            v = send(vs, vllm_qwen2, api, case.text, stream)
            s = send(ss, sim_url, api, case.text, stream)
            rows.append((i, case, count(case.words), stream, v, s))

    prompt_total = sum(v.prompt_tokens or 0 for *_, v, _ in rows)
    after = {name: settled_counters(url, before[name][1] + prompt_total) for name, url in servers.items()}
    mismatches = [r for r in rows if (r[4].prompt_tokens, r[4].cached_tokens) != (r[5].prompt_tokens, r[5].cached_tokens)]
    table = "\n".join(
        f"{i:3d} {case.name:32.32s} local={local:5d} stream={int(stream)} "
        f"vllm={v.prompt_tokens}/{v.cached_tokens} sim={s.prompt_tokens}/{s.cached_tokens}"
        for i, case, local, stream, v, s in mismatches
    )
    assert not mismatches, (
        f"{api}: {len(mismatches)} of {len(rows)} prompts differ (prompt_tokens/cached_tokens):\n{table}"
    )

    # The prompt list must really exercise the cache: full hits, partial hits and misses.
    cached = [v.cached_tokens for *_, v, _ in rows]
    assert all(c is not None for c in cached), f"{api}: vLLM reported no cached_tokens (--enable-prompt-tokens-details?)"
    assert any(c == 0 for c in cached) and any(c > 0 for c in cached)
    assert any(0 < v.cached_tokens < v.prompt_tokens - BLOCK for *_, v, _ in rows), "no partial prefix hit"

    hits = {name: after[name][0] - before[name][0] for name in servers}
    queries = {name: after[name][1] - before[name][1] for name in servers}
    assert hits["vllm"] == hits["sim"] == sum(cached), f"{api}: {HITS} deltas {hits}, reported {sum(cached)}"
    assert queries["vllm"] == queries["sim"] == prompt_total, f"{api}: {QUERIES} deltas {queries}, prompts {prompt_total}"

"""The model of the server's finite prefix cache (replay/rules/block_pool.py, vLLM's block pool)
and the cause it gives each cached-token count that differs from the infinite-cache expectation
(replay/results/cache_model.py): hand-made sequences first, then real runs against `replay sim`."""

from __future__ import annotations

import math

import pytest

from replay.protocol.prometheus import cache_config
from replay.results.cache_model import ModelPrompt, ServerCache, model_checks, server_caches
from replay.rules.block_pool import BlockPool
from replay.rules.prefix_cache import block_hashes
from support.cache_model import SIM_BLOCK, reuse_trace, turns_trace

B = 2  # block size of the hand-made sequences


def request(pool: BlockPool, tokens: list[int], output: int = 0) -> tuple[int, list[int]]:
    return pool.allocate(block_hashes(tokens, pool.block_size), len(tokens), output)


def blocks(*ids: int) -> list[int]:
    """A prompt of whole blocks, block i being [ids[i], ids[i]], and one more token."""
    return [t for i in ids for t in (i, i)] + [99]


# -- the pool ---------------------------------------------------------------------------------------
def test_running_requests_blocks_are_pinned():
    pool = BlockPool(B, num_gpu_blocks=5)  # 4 blocks hold KV
    a = blocks(1, 2)  # 2 full blocks + 1 token: 3 blocks
    _, held_a = request(pool, a)
    _, held_b = request(pool, blocks(3))  # 2 blocks: only 1 free, the pool does not evict a running request's
    assert pool.hit_blocks(block_hashes(a, B), len(a)) == 2 and pool.overflow == 1 and pool.evictions == 0
    pool.free(held_b)
    pool.free(held_a)
    assert pool.used == 0
    request(pool, blocks(4, 5, 6))  # 4 blocks: now a's are free and evicted, its tail (block 2) before its head
    assert pool.hit_blocks(block_hashes(a, B), len(a)) == 0 and pool.evictions >= 2


def test_freed_in_reverse_order_tail_evicted_first():
    """A request's cached blocks go to the free queue's tail last block first (LRU, a prefix's
    tail before its head); a block caching nothing (its partial last block) to its head, to be
    taken first (vLLM 0.32's free_blocks)."""
    pool = BlockPool(B, num_gpu_blocks=5)
    a = blocks(1, 2, 3)  # 4 blocks: the whole pool
    pool.free(request(pool, a)[1])  # queue: a's partial | a's 3rd, 2nd, 1st
    pool.free(request(pool, blocks(7))[1])  # 2 blocks: a's partial block, then its 3rd
    assert pool.hit_blocks(block_hashes(a, B), len(a)) == 2
    pool.free(request(pool, [8])[1])  # 1 block: the last request's partial one, at the head: nothing evicted
    assert pool.hit_blocks(block_hashes(a, B), len(a)) == 2 and pool.evictions == 1
    pool.free(request(pool, blocks(9))[1])  # 2: that partial one again, then a's 2nd (older than [7, 7]'s)
    assert pool.hit_blocks(block_hashes(a, B), len(a)) == 1 and pool.hit_blocks(block_hashes([7, 7, 99], B), 3) == 1


def test_a_hit_on_a_free_block_takes_it_out_of_the_queue():
    """Reuse after free: the request's own hit blocks are touched before it takes new ones, so it
    never evicts the prefix it is about to use, and they go back to the queue's tail at its end."""
    pool = BlockPool(B, num_gpu_blocks=5)
    a = blocks(1, 2, 3)
    pool.free(request(pool, a)[1])  # queue: a's partial, 3rd, 2nd, 1st block
    hit, held = request(pool, blocks(1, 2, 3) + [5, 5, 5])  # hits 3, then takes 2: the partial one and one more
    assert hit == 3 and pool.overflow == 1  # the 4 blocks are all its own: nothing to evict but nothing left
    pool.free(held)
    assert pool.hit_blocks(block_hashes(a, B), len(a)) == 3


def test_a_block_cached_twice_still_hits_when_one_copy_goes():
    """A prompt of whole blocks sent again cannot hit its last block (the last token is computed):
    vLLM caches that block a second time, in another block; a lookup finds either."""
    pool = BlockPool(B, num_gpu_blocks=20)
    whole = [1, 1, 2, 2]
    pool.free(request(pool, whole)[1])
    hit, held = request(pool, whole)
    assert hit == 1 and len(pool) == 2 and pool._copies  # block 2 cached in two blocks
    pool.free(held)
    longer = whole + [3]
    assert pool.hit_blocks(block_hashes(longer, B), len(longer)) == 2


def test_reset_only_when_no_block_is_held():
    pool = BlockPool(B, num_gpu_blocks=10)
    _, held = request(pool, blocks(1, 2))
    assert not pool.reset() and len(pool) == 2
    pool.free(held)
    assert pool.reset() and len(pool) == 0
    assert request(pool, blocks(1, 2))[0] == 0


def test_cache_config_info_is_read_from_vllms_labels():
    text = ('# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size="16",cache_dtype="auto",'
            'engine="0",num_gpu_blocks="661",swap_space="4"} 1.0\nvllm:num_requests_running{engine="0"} 0.0\n')
    assert cache_config(text) == {"block_size": 16, "num_gpu_blocks": 661}
    assert cache_config(text.replace('"661"', '"None"')) == {"block_size": 16, "num_gpu_blocks": None}
    assert cache_config("vllm:num_requests_running 0\n") is None


# -- the model's causes -----------------------------------------------------------------------------
def prompt(rid: int, t: float, tokens: list[int], observed: int | None, *, end: float | None = None,
           endpoint: str = "a", reported: int | None = None, output: int = 0, ideal: int | None = None,
           answered: float | None = None, agreed: float | None = math.inf) -> ModelPrompt:
    """`agreed`: the tokens its fingerprint proves the trace's (math.inf: all; None: no fingerprint)."""
    return ModelPrompt(rid, t, reported, observed, block_hashes(tokens, B), len(tokens), endpoint,
                       end if end is not None else t + 0.001, output, ideal, answered_at=answered, agreed=agreed)


def verdicts(prompts: list[ModelPrompt], servers: dict | None = None, window_ms: float = 0.0, **default):
    servers = servers or {"a": ServerCache(**(default or {"num_gpu_blocks": 100}))}
    return {v.request_id: v for v in model_checks(prompts, B, servers, reorder_window_ms=window_ms)}


def test_eviction_is_predicted_and_named():
    a, c = blocks(1, 2, 3), blocks(5, 6, 7)
    seq = [prompt(0, 0.0, a, 0), prompt(1, 1.0, c, 0), prompt(2, 2.0, a, 0)]  # a evicted by c in a 5-block pool
    v = verdicts(seq, num_gpu_blocks=5)
    assert v[2].expected == 6 and v[2].predicted == 0 and v[2].exact and v[2].cause == "evicted"
    roomy = verdicts([s._replace(observed=6 if s.request_id == 2 else 0) for s in seq], num_gpu_blocks=100)
    assert roomy[2].predicted == 6 and roomy[2].cause is None


def test_a_prefix_on_another_endpoint_is_routed_elsewhere():
    a = blocks(1, 2)
    servers = {"a": ServerCache(100), "b": ServerCache(100)}
    v = verdicts([prompt(0, 0.0, a, 0, endpoint="a"), prompt(1, 1.0, a, 0, endpoint="b")], servers)
    assert v[1].expected == 4 and v[1].predicted == 0 and v[1].cause == "routed-elsewhere"


def test_only_a_fingerprint_that_differs_blames_the_prompt():
    """A missing block the pool must hold, or a length the server counted otherwise: the
    prompt's fingerprint decides. Differing before the expected hits' end: prompt-differs;
    proven the trace's through them: the server's doing (server-missed); no fingerprint (an
    older run's record): nobody is blamed (no-fingerprint)."""
    a = blocks(1, 2)
    seq = [prompt(0, 0.0, a, 0), prompt(1, 1.0, a, 2), prompt(2, 2.0, a, 0, reported=len(a) + 1)]
    v = verdicts(seq)
    assert v[1].predicted == 4 and v[1].cause == "server-missed"  # no eviction ever: the server had it
    assert v[2].cause == "server-missed"  # the server counted another length of the trace's prompt
    differs = verdicts([seq[0], seq[1]._replace(agreed=2), seq[2]._replace(agreed=0)])
    assert differs[1].cause == "prompt-differs" and differs[2].cause == "prompt-differs"
    after = verdicts([seq[0], seq[1]._replace(agreed=4)])  # differs only past the 4 tokens it should hit
    assert after[1].cause == "server-missed"
    unknown = verdicts([seq[0], seq[1]._replace(agreed=None), seq[2]._replace(agreed=None)])
    assert unknown[1].cause == "no-fingerprint" and unknown[2].cause == "no-fingerprint"
    evicted = verdicts([prompt(0, 0.0, a, 0), prompt(1, 1.0, blocks(5, 6, 7), 0), prompt(2, 2.0, a, 0, agreed=0)],
                       num_gpu_blocks=5)
    assert evicted[2].cause == "prompt-differs"  # direct evidence comes before the pool's word


def test_a_miss_of_a_block_cached_by_a_prompt_that_differed_is_prompt_differs():
    """The request that cached the prefix sent other words in its second block (its fingerprint
    agrees through 2 tokens only); a later request whose own prompt is the trace's misses that
    block: the replay's doing (the first's prompt), not the server's. Once a request with the
    trace's words has cached it again, a miss of it is the server's again."""
    a = blocks(1, 2)
    v = verdicts([prompt(0, 0.0, a, 0, agreed=2), prompt(1, 1.0, a, 2)])
    assert v[1].expected == 4 and v[1].cause == "prompt-differs"
    healed = verdicts([prompt(0, 0.0, a, 0, agreed=2), prompt(1, 1.0, a, 2), prompt(2, 2.0, a, 2)])
    assert healed[2].cause == "server-missed"  # request 1 sent the trace's words: the server held them


def test_a_request_sent_within_the_reorder_window_is_in_flight():
    a = blocks(1, 2)
    v = verdicts([prompt(0, 0.0, a, 0, end=1.0), prompt(1, 0.002, a, 0)], window_ms=5)
    assert v[1].expected == 4 and v[1].cause == "in-flight"
    v = verdicts([prompt(0, 0.0, a, 4), prompt(1, 0.002, a, 0)], window_ms=5)  # the second reached it first
    assert v[0].expected == 0 and v[0].cause == "in-flight"


def test_requests_in_flight_together_are_the_servers_order_not_a_prompt_that_differs():
    """Rows sent at one instant that the server scheduled in the other order: the later-sent one
    cached the prefix first. Until a request's first token came back the server may not have
    scheduled it, so neither count blames the prompt; once it had answered, a later send that
    misses what it cached is evidence that the prompt differs."""
    a = blocks(1, 2)
    together = [prompt(0, 0.0, a, 4, answered=0.02), prompt(1, 0.0, a, 0, answered=0.02)]
    v = verdicts(together)
    assert (v[0].expected, v[1].expected) == (0, 4)
    assert v[0].cause == "in-flight" and v[1].cause == "in-flight"
    # the first answered (0.02) before the second was sent (0.03): the server held its blocks
    answered_first = [prompt(0, 0.0, a, 0, answered=0.02), prompt(1, 0.03, a, 0, answered=0.05, agreed=0)]
    assert verdicts(answered_first)[1].cause == "prompt-differs"
    # sent before the first's answer: it may have reached the scheduler first
    assert verdicts([answered_first[0], prompt(1, 0.01, a, 0, answered=0.05)])[1].cause == "in-flight"


def test_a_shared_prefix_ending_inside_a_block_is_partial_block():
    a = blocks(1, 2)
    v = verdicts([prompt(0, 0.0, a, 0), prompt(1, 1.0, a, 4, ideal=5)])
    assert v[1].expected == 5 and v[1].cause == "partial-block" and v[1].exact


def test_hits_beyond_the_run_are_warm_at_start_only_on_a_server_that_served_before():
    a = blocks(1, 2)
    assert verdicts([prompt(0, 0.0, a, 4)], num_gpu_blocks=100, served_before=True)[0].cause == "warm-at-start"
    assert verdicts([prompt(0, 0.0, a, 4)], num_gpu_blocks=100)[0].cause == "unexplained"
    assert verdicts([prompt(0, 0.0, a, 0), prompt(1, 1.0, a, 3)])[1].cause == "unexplained"  # not whole blocks


def test_the_section_counts_causes_per_endpoint():
    from replay.results.cache_model import CacheModel

    a, c = blocks(1, 2, 3), blocks(5, 6, 7)
    model = CacheModel(B, {"a": ServerCache(5)})
    seq = [prompt(0, 0.0, a, 0), prompt(1, 1.0, c, 0), prompt(2, 2.0, a, 0), prompt(3, 3.0, a, 6)]
    list(model_checks(seq, B, {}, model=model))
    section = model.tally.section(model)
    assert section["requests_compared"] == 4 and section["requests_exact"] == 4 and section["exact_share"] == 1
    assert section["misses"] == 1 and section["misses_attributed_share"] == 1.0  # the 4th found the 3rd's blocks
    assert section["miss_causes"] == {"evicted": {"requests": 1, "tokens": 6, "examples": [2]}}
    assert section["endpoints"]["a"]["evictions"] > 0 and section["endpoints"]["a"]["num_gpu_blocks"] == 5


def test_server_caches_from_the_meta_and_the_counters_at_the_start():
    meta = {"http://a": {"block_size": 16, "num_gpu_blocks": 50, "source": "server"},
            "http://b": {"block_size": 16, "num_gpu_blocks": None, "source": "server"}}
    caches = server_caches(meta, {"http://a": {"queries": 120.0, "hits": 0.0}})
    assert caches == {"http://a": ServerCache(50, served_before=True)}


@pytest.mark.parametrize("window_ms", [0.0, 5.0])
def test_memory_is_the_pools_and_the_running(window_ms):
    """A long stream of distinct prompts through a small pool: the pool never grows past its size."""
    model_prompts = (prompt(i, i * 0.01, blocks(3 * i, 3 * i + 1), 0) for i in range(5000))
    from replay.results.cache_model import CacheModel

    model = CacheModel(B, {"a": ServerCache(64)})
    for _ in model_checks(model_prompts, B, {}, reorder_window_ms=window_ms, model=model):
        pass
    pool = model.endpoints["a"].pool
    assert len(pool._ref) <= 63 and len(pool) <= 63 and not model.endpoints["a"].running


# -- real runs against `replay sim` -------------------------------------------------------------------
FAST_SIM = ("--block-size", str(SIM_BLOCK), "--ttft-ms", "3", "--itl-ms", "1", "--prefill-ms-per-1k", "0",
            "--eos-prob", "0")


def replay(trace, tokenizer_dir, url, output, tmp_path, *extra, exit_code: int | None = 0):
    from support.processes import replay_args, run_locust

    return run_locust(replay_args(trace, tokenizer_dir, url, output, "--overwrite", *extra), tmp_path,
                      exit_code=exit_code)


def certificate(output) -> dict:
    """The run's certificate as its end wrote it (OUTPUT.fidelity.json): no option asked for the
    cache section, the sim's /metrics said its block size and pool size."""
    import json

    from replay.rules.run_files import fidelity_path

    return json.loads(fidelity_path(output).read_text())


def causes(cert: dict) -> dict[str, int]:
    """The causes the certificate names: {cause: requests}, those with none left out."""
    return {cause: c["requests"] for cause, c in cert["cache"]["misses"]["causes"].items() if c["requests"]}


@pytest.mark.alone  # the model's start times come from the run's timing: another test's load skews them
def test_a_small_sim_cache_evicts_and_the_model_predicts_it(tmp_path, toy_tokenizer_dir):
    """Done means: `replay sim --cache-blocks` small enough to evict, heavy prefix reuse: the model
    predicts the observed cached tokens exactly for >= 99% of requests, every miss has a cause
    other than `unexplained`, and `evicted` is one of them: through the run's own end (the cache
    child), with no option; the block size and pool size come from the sim's /metrics."""
    from replay.sim.process import sim_process

    trace = reuse_trace(tmp_path / "trace.jsonl")
    output = tmp_path / "run.jsonl"
    with sim_process(toy_tokenizer_dir, *FAST_SIM, "--cache-blocks", "30") as sim:
        proc = replay(trace, toy_tokenizer_dir, sim.url, output, tmp_path)
    misses = certificate(output)["cache"]["misses"]
    model = misses["model"]
    assert misses["block_size"] == SIM_BLOCK and misses["capacity_blocks"] == 30
    assert model["requests_compared"] == 160
    assert misses["predicted_exact_share"] >= 0.99, model
    assert model["misses"] > 0 and model["misses_attributed_share"] == 1.0, model["miss_causes"]
    assert causes(certificate(output))["evicted"] > 0 and "unexplained" not in causes(certificate(output))
    assert "cache evicted:" in proc.stdout  # the summary's certificate says it


@pytest.mark.alone  # the model's start times come from the run's timing: another test's load skews them
def test_a_fleet_routed_round_robin_scatters_sessions_session_routing_keeps_them(tmp_path, toy_tokenizer_dir):
    from replay.sim.process import sim_process
    from support.traces import bailian_trace

    trace = bailian_trace(tmp_path / "trace.jsonl", sessions=7, turns=3, gap_s=0.05)  # odd: turns alternate
    certs = {}
    with sim_process(toy_tokenizer_dir, *FAST_SIM, "--cache-blocks", "1000") as one, \
            sim_process(toy_tokenizer_dir, *FAST_SIM, "--cache-blocks", "1000") as two:  # fmt: skip
        for routing in ("round-robin", "session"):
            output = tmp_path / f"{routing}.jsonl"
            replay(trace, toy_tokenizer_dir, one.url, output, tmp_path, "--endpoints", f"{one.url},{two.url}",
                   "--routing", routing, "--reset-server-cache")
            certs[routing] = certificate(output)
    scattered = certs["round-robin"]["cache"]["misses"]
    assert set(causes(certs["round-robin"])) == {"routed-elsewhere"}, scattered
    assert len(scattered["endpoints"]) == 2 and any(e["routed-elsewhere"]["requests"]
                                                    for e in scattered["endpoints"].values())
    assert "--routing session" in " ".join(scattered["notes"])
    # what is left is the trace's own: a session's shared prefix ends inside a server block
    assert set(causes(certs["session"])) <= {"partial-block"}, certs["session"]["cache"]["misses"]
    assert not any(line.startswith("cache") for line in certs["session"]["failing"])


@pytest.mark.alone  # the model's start times come from the run's timing: another test's load skews them
def test_a_second_run_on_a_warm_sim_names_warm_at_start_until_reset(tmp_path, toy_tokenizer_dir):
    """The same trace twice against one sim: the second run's certificate names warm-at-start, its
    verdict is warm-cache (its hits came from the first run: not the trace's cache behaviour), so
    --require-faithful exits 1, and its summary gives the remedy; --reset-server-cache makes a
    third faithful again."""
    from replay.results.certificate import REMEDIES, WARM_CACHE
    from replay.sim.process import sim_process

    trace = reuse_trace(tmp_path / "trace.jsonl", rows=40)
    with sim_process(toy_tokenizer_dir, *FAST_SIM, "--cache-blocks", "1000") as sim:
        runs = {}
        for name, extra, code in (("first", (), 0), ("second", ("--require-faithful",), 1),
                                  ("after-reset", ("--reset-server-cache",), 0)):
            output = tmp_path / f"{name}.jsonl"
            runs[name] = (replay(trace, toy_tokenizer_dir, sim.url, output, tmp_path, *extra, exit_code=code).stdout,
                          certificate(output))
    # partial-block is the trace's own (a shared prefix ending inside a server block), in-flight the
    # sim's order of requests a loaded host kept in flight together: no failure
    fine = {"partial-block", "in-flight"}
    assert set(causes(runs["first"][1])) <= fine, runs["first"][1]["cache"]
    stdout, second = runs["second"]
    assert "warm-at-start" in causes(second) and set(causes(second)) <= {"warm-at-start", *fine}, \
        second["cache"]["misses"]
    assert "--reset-server-cache" in stdout and "another --seed" in stdout
    assert REMEDIES[WARM_CACHE] in second["remedies"] and "a freshly started server" in stdout
    # the verdict is the warm cache's, unless this host made the sends late too (a schedule line first)
    assert second["verdict"] == WARM_CACHE or second["failing"][0].startswith("schedule"), second["failing"]
    stdout, after_reset = runs["after-reset"]
    assert set(causes(after_reset)) <= fine, after_reset["cache"]
    assert not any(line.startswith("cache") for line in after_reset["failing"])
    assert "--reset-server-cache" not in stdout


@pytest.mark.alone  # the sends' timing is on trial: another test's load would make the run late
def test_rows_sent_together_that_the_server_schedules_in_another_order_are_in_flight(tmp_path, toy_tokenizer_dir):
    """8 rows due at one instant (4 conversations' two turns) against a sim that schedules the
    requests that came together the last first (--reorder-ms): the hits the trace puts on the
    second turns land on the first ones. That is the server's order of requests in flight
    together, not a replay bug: `in-flight`, no cache line fails. The same rows 300 ms apart
    hit as the trace says."""
    from replay.sim.process import sim_process

    certs = {}
    with sim_process(toy_tokenizer_dir, *FAST_SIM, "--reorder-ms", "100") as sim:
        for gap_ms in (0, 300):
            trace = turns_trace(tmp_path / f"turns-{gap_ms}.jsonl", gap_ms)
            output = tmp_path / f"turns-{gap_ms}.jsonl.out"
            proc = replay(trace, toy_tokenizer_dir, sim.url, output, tmp_path, "--reset-server-cache")
            certs[gap_ms] = certificate(output), proc.stdout
    together, stdout = certs[0]
    assert causes(together).get("in-flight", 0) >= 4 and set(causes(together)) <= {"in-flight", "partial-block"}, \
        together["cache"]["misses"]
    assert together["cache"]["infinite"]["observed_cached_tokens"] > 0  # the server did hit, in its own order
    # the prompts as sent are the trace's: their fingerprints say so, whatever order the server took them in
    assert together["cache"]["infinite"]["fingerprints"] == {"checked": 8, "differ": 0, "without": 0, "examples": []}
    assert not any(line.startswith("cache") for line in together["failing"]) and "a replay bug" not in stdout
    apart, _ = certs[300]
    assert set(causes(apart)) <= {"partial-block"}, apart["cache"]["misses"]


def test_a_server_whose_usage_says_no_hits_is_judged_by_its_counters(tmp_path, toy_tokenizer_dir):
    """`replay sim --false-usage '{"cached_tokens": 0}'`: every answer says nothing was cached
    while the sim's /metrics count the hits the prompts give. The usage is not evidence: no
    request is called a replay bug, the cache line is judged from the counters, and passes."""
    from replay.sim.process import sim_process

    trace = reuse_trace(tmp_path / "trace.jsonl", rows=40)
    output = tmp_path / "run.jsonl"
    with sim_process(toy_tokenizer_dir, *FAST_SIM, "--false-usage", '{"cached_tokens": 0}') as sim:
        proc = replay(trace, toy_tokenizer_dir, sim.url, output, tmp_path, "--reset-server-cache")
    cert = certificate(output)
    cached = cert["usage"]["cached_tokens"]
    assert cached["status"] == "disagrees" and cached["usage"] == 0 and cached["counters"] > 0, cert["usage"]
    assert cert["cache"]["judged_from"] == "counters"
    counters = cert["cache"]["counters"]
    assert counters["low"] <= counters["prefix_cache_hits"] <= counters["high"], counters
    assert not any(line.startswith("cache") for line in cert["failing"]) and "a replay bug" not in proc.stdout
    assert "judged from /metrics" in proc.stdout


@pytest.mark.alone  # which misses are in flight together comes from the run's timing
def test_a_cache_smaller_than_declared_is_not_a_replay_bug(tmp_path, toy_tokenizer_dir):
    """A 30-block sim taken for a 100,000-block one (--server-cache-blocks 100000, as a server
    that says more than it has): the model never evicts, so every block the sim evicted looks
    like one it must hold, which would blame the prompts. The sim's own KV-cache usage (scraped)
    peaks far above what such a pool could reach: those misses are not judged, and the line
    says to pass the real size."""
    from replay.sim.process import sim_process

    trace = reuse_trace(tmp_path / "trace.jsonl")
    output = tmp_path / "run.jsonl"
    with sim_process(toy_tokenizer_dir, *FAST_SIM, "--cache-blocks", "30") as sim:
        proc = replay(trace, toy_tokenizer_dir, sim.url, output, tmp_path, "--reset-server-cache",
                      "--server-cache-blocks", "100000", "--server-metrics-interval", "0.1")
    cert = certificate(output)
    (smaller,) = cert["cache"]["smaller_than_declared"]
    assert smaller["num_gpu_blocks"] == 100_000 and smaller["server_peak_usage"] > 0.1, smaller
    # what the model would have blamed on the prompts: their fingerprints prove them the trace's
    assert "prompt-differs" not in causes(cert) and causes(cert)["server-missed"] == smaller["prompt_differs_held"] > 0
    assert not any(line.startswith("cache") for line in cert["failing"]), cert["failing"]
    assert any("its cache is smaller than that" in line and "--server-cache-blocks" in line
               for line in cert["unchecked"])
    assert "a replay bug" not in proc.stdout


def test_a_server_that_cannot_reset_its_cache_is_refused(tmp_path, toy_tokenizer_dir):
    """--reset-server-cache against a server without POST /reset_prefix_cache (vLLM outside dev
    mode: `replay sim --no-reset-endpoint`): refused before the first send, exit 2, one line
    naming the endpoint; every row recorded as refused."""
    from replay.sim.process import sim_process
    from support.traces import mooncake_trace

    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=3, gap_ms=10)
    output = tmp_path / "run.jsonl"
    with sim_process(toy_tokenizer_dir, *FAST_SIM, "--no-reset-endpoint") as sim:
        proc = replay(trace, toy_tokenizer_dir, sim.url, output, tmp_path, "--reset-server-cache", exit_code=2)
    assert f"--reset-server-cache: {sim.url}: it has no POST /reset_prefix_cache" in proc.stderr, proc.stderr[-2000:]


def test_the_preflight_reads_the_servers_cache_and_options_override_it(sim, caplog):
    """replay sim says its block size and pool size in vllm:cache_config_info as vLLM does; the
    options win, with a warning naming both values where the server said otherwise (and the
    server's figures kept in the meta as `server_said`); a server that says nothing leaves them
    to the options."""
    from replay.protocol.server_cache import server_caches as ask

    (said,) = ask([sim.url], block_size=None, cache_blocks=None).values()
    assert said == {"block_size": SIM_BLOCK, "num_gpu_blocks": 100_000, "source": "server"}
    (agreed,) = ask([sim.url], block_size=SIM_BLOCK, cache_blocks=100_000).values()
    assert agreed == {"block_size": SIM_BLOCK, "num_gpu_blocks": 100_000, "source": "options"}
    assert not caplog.records
    (mixed,) = ask([sim.url], block_size=32, cache_blocks=None).values()
    assert mixed == {"block_size": 32, "num_gpu_blocks": 100_000, "source": "options+server",
                     "server_said": {"block_size": SIM_BLOCK}}
    (given,) = ask([sim.url], block_size=32, cache_blocks=64).values()
    assert given == {"block_size": 32, "num_gpu_blocks": 64, "source": "options",
                     "server_said": {"block_size": SIM_BLOCK, "num_gpu_blocks": 100_000}}
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings[-2:] == [
        f"--server-block-size 32: {sim.url} says its block size is {SIM_BLOCK} (GET /metrics, "
        f"vllm:cache_config_info); the cache model uses 32",
        f"--server-cache-blocks 64: {sim.url} says its pool is 100000 blocks (GET /metrics, "
        f"vllm:cache_config_info); the cache model uses 64"], warnings
    (silent,) = ask(["http://127.0.0.1:9"], block_size=None, cache_blocks=None).values()
    assert silent == {"block_size": None, "num_gpu_blocks": None, "source": None}

"""The servers' KV caches, asked once before a run sends anything (`GET /metrics`, vLLM's
`vllm:cache_config_info`): each endpoint's block size and pool size, for the model of the
server's prefix cache the run's end checks the cached tokens with
(replay/results/cache_model.py), so it needs no option against vLLM or `replay sim`.

--server-block-size and --server-cache-blocks override what a server says, or supply what it
does not (a server without /metrics, or not vLLM). The answer goes into the run's metadata as
`server_cache`: {endpoint: {"block_size", "num_gpu_blocks", "source"}}, null values where
neither the server nor an option said. An option that contradicts the server is warned of,
naming both values, and the server's figures are kept beside it (`server_said`), but it is not
refused: the options exist to override (a server's figure may be the one that is wrong, e.g. a
router's /metrics), and they change only the end-of-run cache analysis, never what is sent.

--reset-server-cache empties each endpoint's prefix cache before the first send
(`reset_prefix_caches`: vLLM's `POST /reset_prefix_cache`, served with VLLM_SERVER_DEV_MODE=1,
and `replay sim`'s), so a second replay of the same trace starts as cold as the first; the
meta's `server_cache` then says `"reset": true` for each, and the certificate does not call a
hit beyond the run's own "warm-at-start" there.
"""

from __future__ import annotations

import logging

import orjson

from replay.protocol.ask import Unanswered, ask
from replay.protocol.prometheus import cache_config
from replay.protocol.urls import shown

CACHE_TIMEOUT_S = 5.0  # /metrics answers at once, however busy the server
OPTIONS = {"block_size": ("--server-block-size", "block size is {}"),
           "num_gpu_blocks": ("--server-cache-blocks", "pool is {} blocks")}  # each figure's option, and how it reads

logger = logging.getLogger(__name__)


def ask_cache_config(url: str, headers: dict[str, str] | None = None,
                     timeout: float = CACHE_TIMEOUT_S) -> dict[str, int | None] | None:
    """What `url`'s /metrics says of its KV cache (prometheus.cache_config), or None: no
    /metrics, no such line, or no answer."""
    try:
        status, data = ask(url.rstrip("/") + "/metrics", headers=headers, timeout=timeout)
    except Unanswered:
        return None
    if status != 200:
        return None
    return cache_config(data.decode("utf-8", "replace"))


def server_caches(urls: list[str], *, block_size: int | None, cache_blocks: int | None,
                  headers: dict[str, str] | None = None, ask_server: bool = True) -> dict[str, dict]:
    """{endpoint as shown: {"block_size", "num_gpu_blocks", "source"}} for every endpoint: the
    options (`block_size`: --server-block-size, `cache_blocks`: --server-cache-blocks) where
    given, else what the server says (`ask_server`: ask it, also when both options are given,
    to warn of a contradiction). `source` names where the values came from: "options",
    "server", "options+server" or None (neither said anything); `server_said`, only where an
    option contradicts the server, the server's own figures."""
    caches: dict[str, dict] = {}
    for url in urls:
        said = (ask_cache_config(url, headers) if ask_server else None) or {}
        values: dict[str, int | None] = {}
        sources: set[str] = set()
        contradicted: dict[str, int | None] = {}
        for key, option in (("block_size", block_size), ("num_gpu_blocks", cache_blocks)):
            values[key] = option if option is not None else said.get(key)
            if values[key] is not None:
                sources.add("options" if option is not None else "server")
            if option is not None and said.get(key) not in (None, option):
                contradicted[key] = said[key]
                flag, what = OPTIONS[key]
                logger.warning("%s %d: %s says its %s (GET /metrics, vllm:cache_config_info); the cache model uses %d",
                               flag, option, shown(url), what.format(said[key]), option)
        caches[shown(url)] = {**values, "source": "+".join(sorted(sources)) or None}
        if contradicted:
            caches[shown(url)]["server_said"] = contradicted
    return caches


class CacheNotReset(ValueError):
    """An endpoint did not empty its prefix cache when asked (--reset-server-cache)."""


def reset_prefix_caches(urls: list[str], headers: dict[str, str] | None = None,
                        timeout: float = CACHE_TIMEOUT_S) -> None:
    """`POST /reset_prefix_cache` to every endpoint of `urls`. Raises CacheNotReset naming the
    first that refused: no such route (vLLM serves it only with VLLM_SERVER_DEV_MODE=1), an
    error status, `{"success": false}` (a request held blocks: another client is using the
    server), or no answer."""
    for url in urls:
        try:
            status, data = ask(url.rstrip("/") + "/reset_prefix_cache", body={}, headers=headers, timeout=timeout)
        except Unanswered as e:
            raise CacheNotReset(f"--reset-server-cache: {e}") from None
        try:
            answer = orjson.loads(data) if data.strip() else None
        except orjson.JSONDecodeError:
            answer = None
        if status in (404, 405):
            why = "it has no POST /reset_prefix_cache (vLLM serves it with VLLM_SERVER_DEV_MODE=1)"
        elif status != 200:
            why = f"POST /reset_prefix_cache answered HTTP {status}"
        elif isinstance(answer, dict) and answer.get("success") is False:
            why = "it could not empty its cache (a request held blocks: is another client using it?)"
        else:
            continue
        raise CacheNotReset(f"--reset-server-cache: {shown(url)}: {why}; drop the option to replay against its "
                            "cache as it is")

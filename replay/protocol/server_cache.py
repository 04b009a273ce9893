"""The servers' KV caches, asked once before a run sends anything (`GET /metrics`, vLLM's
`vllm:cache_config_info`): each endpoint's block size and pool size, for the model of the
server's prefix cache the run's end checks the cached tokens with
(replay/results/cache_model.py), so it needs no option against vLLM or `replay sim`.

--server-block-size and --server-cache-blocks override what a server says, or supply what it
does not (a server without /metrics, or not vLLM). The answer goes into the run's metadata as
`server_cache`: {endpoint: {"block_size", "num_gpu_blocks", "source"}}, null values where
neither the server nor an option said.
"""

from __future__ import annotations

from replay.protocol.ask import Unanswered, ask
from replay.protocol.urls import shown
from replay.results.server_metrics import cache_config

CACHE_TIMEOUT_S = 5.0  # /metrics answers at once, however busy the server


def ask_cache_config(url: str, headers: dict[str, str] | None = None,
                     timeout: float = CACHE_TIMEOUT_S) -> dict[str, int | None] | None:
    """What `url`'s /metrics says of its KV cache (server_metrics.cache_config), or None: no
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
    given, else what the server says (`ask_server`: ask it). `source` names where the values
    came from: "options", "server", "options+server" or None (neither said anything)."""
    caches = {}
    for url in urls:
        said = (ask_cache_config(url, headers) if ask_server and (block_size is None or cache_blocks is None)
                else None) or {}  # fmt: skip
        values, sources = {}, set()
        for key, option in (("block_size", block_size), ("num_gpu_blocks", cache_blocks)):
            values[key] = option if option is not None else said.get(key)
            if values[key] is not None:
                sources.add("options" if option is not None else "server")
        caches[shown(url)] = {**values, "source": "+".join(sorted(sources)) or None}
    return caches

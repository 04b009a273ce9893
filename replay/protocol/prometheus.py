"""The Prometheus text format as a server's /metrics page writes it: a sample line's name and
value, every series of a page, and vLLM's `vllm:cache_config_info` labels. Protocol, no
results: the scraper, the KV cache's question (server_cache.py) and the server section
(replay.results.server_metrics) all read pages by these rules.
"""

from __future__ import annotations

import math
import re

SAMPLE_LINE = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?[ \t]+(\S+)(?:[ \t]+-?[0-9]+)?[ \t]*')


def parse_series(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text exposition (an exporter's page, kept raw), keyed by its
    series as written, `name{labels}` (NaN values dropped). Raises ValueError on text that is not the format."""
    series: dict[str, float] = {}
    for line in text.splitlines():
        if not line.strip() or line[0] == "#":
            continue
        _, value = sample(line)
        match = SAMPLE_LINE.fullmatch(line)
        if match is not None and not math.isnan(value):  # it matches: sample() read it
            series[line[: match.start(2)].rstrip()] = value
    return series


def sample(line: str) -> tuple[str, float]:
    """A sample line's name and value: `name{labels} value [timestamp]`."""
    match = SAMPLE_LINE.fullmatch(line)
    try:
        if match is None:
            raise ValueError
        return match[1], float(match[2])
    except ValueError:
        raise ValueError(f"not the Prometheus text format: {line[:80]!r}") from None


CACHE_CONFIG = "vllm:cache_config_info"
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def cache_config(text: str) -> dict[str, int | None] | None:
    """vLLM's KV cache as its `vllm:cache_config_info` labels say it: {"block_size",
    "num_gpu_blocks"} (an int, or None where the label says "None"), of its first engine; None
    when the page has no such line (not vLLM, or a version without it)."""
    for line in text.splitlines():
        if not line.startswith(CACHE_CONFIG + "{"):
            continue
        labels = dict(LABEL.findall(line[len(CACHE_CONFIG) + 1 : line.rfind("}")]))
        return {name: _count(labels.get(name)) for name in ("block_size", "num_gpu_blocks")}
    return None


def _count(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None

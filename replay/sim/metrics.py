"""/metrics in Prometheus text format, with vLLM's names and labels.

vLLM (vllm/v1/metrics/loggers.py) exports prometheus_client counters, which gain the
`_total` suffix, labelled `{engine="0",model_name="..."}`. vllm:prefix_cache_queries counts
prompt tokens looked up and vllm:prefix_cache_hits the tokens found (PrefixCacheStats.record
is called with request.num_tokens and the hit tokens). Counters vLLM does not have are
prefixed `sim:`.

The gauges are the engine's own state at the moment of the scrape: requests running (holding
one of --max-num-seqs) and waiting, and the share of the --cache-blocks pool the running
requests hold (Engine.kv_cache_usage). The sim never preempts, so vllm:num_preemptions_total
stays 0. With --no-metrics there is no /metrics (404), as from a server that serves none.

`vllm:cache_config_info` is vLLM's info gauge (value 1) whose labels are its CacheConfig
(vllm/v1/metrics/loggers.py log_metrics_info: CacheConfig.metrics_info() and `engine`): the
block size and the pool's num_gpu_blocks (null block included) are what a replay's cache model
reads; the other labels are vLLM's defaults, as a plain `vllm serve` shows them.
"""

from __future__ import annotations

from replay.sim.engine import Engine


def render(engine: Engine) -> bytes:
    c = engine.counters
    labels = f'engine="0",model_name="{engine.options.model}"'
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for extra, value in samples:
            lab = labels + ("," + extra if extra else "")
            lines.append(f"{name}{{{lab}}} {float(value)}")

    opts = engine.options
    config = {"block_size": opts.block_size, "cache_dtype": "auto", "enable_prefix_caching": True,
              "gpu_memory_utilization": 0.9, "num_cpu_blocks": None, "num_gpu_blocks": opts.cache_blocks,
              "num_gpu_blocks_override": None, "prefix_caching_hash_algo": "builtin", "engine": 0}
    lines.append("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig")
    lines.append("# TYPE vllm:cache_config_info gauge")
    labels_text = ",".join(f'{k}="{v}"' for k, v in config.items())
    lines.append(f"vllm:cache_config_info{{{labels_text}}} 1.0")
    metric("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
           [("", engine.running)])
    metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
           [("", engine.waiting)])
    metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
           [("", engine.kv_cache_usage)])
    metric("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens.",
           [("", c.cache_queries)])
    metric("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.",
           [("", c.cache_hits)])
    metric("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", [("", c.prompt_tokens)])
    metric("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
           [("", c.generation_tokens)])
    metric("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.",
           [("", c.preemptions)])
    metric("vllm:request_success_total", "counter", "Count of successfully processed requests.",
           [(f'finished_reason="{r}"', n) for r, n in sorted(c.success.items())])
    metric("sim:request_errors_total", "counter", "Requests answered with an HTTP error, by status.",
           [(f'status="{s}"', n) for s, n in sorted(c.errors.items())])
    metric("sim:streams_dropped_total", "counter", "Streams cut mid-way by --drop-rate.", [("", c.dropped)])
    ledger = engine.ledger
    metric("sim:connections_accepted_total", "counter", "TCP connections accepted.",
           [("", ledger.connections_accepted)])
    metric("sim:connections_open", "gauge", "TCP connections open now.", [("", ledger.connections_open)])
    return ("\n".join(lines) + "\n").encode()

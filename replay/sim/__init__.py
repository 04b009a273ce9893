"""Reference LLM server: vLLM/TGI-compatible answers, a block-hash prefix cache, a latency model, faults."""

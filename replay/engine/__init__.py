"""The replay engine: the coordinator (master side), the dispatcher (worker side), the
messages between them (`messages`: every message and its payload) and their transport
(`Window`, `Link`, `LocalLink`), clock sync, timing, the schedule, routing, live figures, the
/metrics scraper, the tokenizer check, and the run's options (`options`, with their
`--replay-config` file, `config`).

Nothing here imports Locust: what the engine needs of a runner (the target host, whether a
worker is gone, the exit code, Locust's per-request stats) is handed in by the adapter,
replay.locust.plugin, as plain values and callbacks.
"""

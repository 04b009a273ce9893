"""Talking to an LLM server, in one package: the API table (`table.py`: each API's paths,
request and /tokenize bodies, and reply readers, in `openai.py`, `tgi.py`, `reading.py`), the
`Prompt` they are built from (`prompt.py`), and the dispatch side (`client.py`: the HTTP
client; `sse.py`, `headers.py`, `urls.py`, `gevent_pool.py`) and the master's own questions
(`ask.py`, `models.py`).

The table's modules are pure functions (no gevent, no HTTP client, no tokenizer): synth
imports them without pulling in the dispatch side. This file imports nothing, for that reason.
"""

"""The APIs a replay can speak, by name: the one list the options, synth and the adapters check.

Only the names live here: the request body of each API is synth's (`synth/bodies.py`, built
ahead of send time) and its path and response reading are the adapters' (`api/adapters.py`);
synth runs before dispatch, so it must not import the dispatch side to learn the names.
"""

from __future__ import annotations

API_NAMES = ("openai-chat", "openai-completions", "tgi")

"""What the served model allows, asked of the server before a run (`GET /v1/models`).

vLLM and `replay sim` report `max_model_len` per model: a prompt longer than it can never be
answered, so the replay does not synthesize or send such rows. Servers that do not say (or do not
answer) leave the limit to the caller's default.
"""

from __future__ import annotations

import logging

from replay.protocol.ask import ask_json
from replay.protocol.urls import shown

logger = logging.getLogger(__name__)

MODELS_TIMEOUT_S = 5.0


def served_max_model_len(urls: list[str], model: str | None = None,
                         headers: dict[str, str] | None = None) -> int | None:
    """The smallest `max_model_len` the endpoints report for `model` (or their first model),
    None when none reports one. `headers`: the run's own (a server behind a key wants it)."""
    limits = []
    for url in urls:
        try:
            status, answer = ask_json(url.rstrip("/") + "/v1/models", headers=headers, timeout=MODELS_TIMEOUT_S)
            if status != 200 or not isinstance(answer, dict):
                raise ValueError(f"HTTP {status}")
            models = answer.get("data") or []
        except (OSError, ValueError) as e:
            logger.info("%s/v1/models: no model information (%s)", shown(url), e)
            continue
        chosen = [m for m in models if isinstance(m, dict) and (model is None or m.get("id") == model)] or models[:1]
        for m in chosen:
            value = m.get("max_model_len") if isinstance(m, dict) else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                limits.append(value)
    return min(limits) if limits else None

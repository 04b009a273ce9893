"""What the served model allows, asked of the server before a run (`GET /v1/models`).

vLLM and `replay sim` report `max_model_len` per model: a prompt longer than it can never be
answered, so the replay does not synthesize or send such rows. Servers that do not say (or do not
answer) leave the limit to the caller's default.
"""

from __future__ import annotations

import http.client
import logging
from urllib.parse import urlsplit

import orjson

from replay.api.client import close_with_reset

logger = logging.getLogger(__name__)

MODELS_TIMEOUT_S = 5.0


def served_max_model_len(urls: list[str], model: str | None = None) -> int | None:
    """The smallest `max_model_len` the endpoints report for `model` (or their first model),
    None when none reports one."""
    limits = []
    for url in urls:
        try:
            models = _get_json(url.rstrip("/") + "/v1/models").get("data") or []
        except (OSError, http.client.HTTPException, ValueError, AttributeError) as e:
            logger.info("%s/v1/models: no model information (%s)", url, e)
            continue
        chosen = [m for m in models if isinstance(m, dict) and (model is None or m.get("id") == model)] or models[:1]
        for m in chosen:
            value = m.get("max_model_len") if isinstance(m, dict) else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                limits.append(value)
    return min(limits) if limits else None


def _get_json(url: str) -> dict:
    """One GET on a connection of its own, closed by reset: the run's servers are not left a
    connection in TIME_WAIT by a question asked before the run."""
    parts = urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = kind(parts.hostname, parts.port, timeout=MODELS_TIMEOUT_S)
    try:
        connection.request("GET", parts.path or "/")
        answer = connection.getresponse()
        body = answer.read()
    finally:
        if connection.sock is not None:
            close_with_reset(connection.sock)
        connection.close()
    if answer.status != 200:
        raise ValueError(f"HTTP {answer.status}")
    return orjson.loads(body)

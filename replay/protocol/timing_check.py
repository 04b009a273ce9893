"""Whether each server tells its own per-request timing, asked once before a run sends anything.

vLLM adds a `metrics` object (queue, prefill, decode times) to every answer when it was started
with `--enable-per-request-metrics`; nothing in a request asks for it, so the only way to know
before the run is to see one answer. The preflight (replay.run.preflight) sends each endpoint
one request of the run's own form for one output token, not streamed, and says what came back.
A server without it is never a refused run: its records keep null server fields
(replay/rules/server_timing.py), and the run's meta file and log say why.
"""

from __future__ import annotations

from replay.protocol.ask import Unanswered, ask_json
from replay.protocol.readiness import one_token_request
from replay.protocol.table import get_api
from replay.protocol.urls import shown
from replay.rules.server_timing import answer_fields, has_server_timing

SENT = "sent"  # its answer carried the timing object, with at least one duration
NOT_SENT = "not sent"  # it answered without one
QUESTION_TEXT = "Say hi."  # short: a block's worth of tokens or less, so it caches nothing a run's prompts share


def timing_question(api_name: str, model: str | None) -> tuple[str, dict] | None:
    """(path, body) of the question for `api_name`, or None when its answers never carry timing."""
    if get_api(api_name).read_metrics({"metrics": {}}) is None:  # the API's table entry reads no timing object (TGI)
        return None
    return one_token_request(api_name, model, QUESTION_TEXT)


def ask_server_timing(urls: list[str], api_name: str, model: str | None,
                      headers: dict[str, str] | None = None) -> dict[str, str]:
    """{endpoint as shown: what it said}: SENT, NOT_SENT, or why it could not be told (no answer,
    an HTTP error, an API without timing). Never raises for a server that fails."""
    question = timing_question(api_name, model)
    said = {}
    for url in urls:
        if question is None:
            said[shown(url)] = f"not asked: --api {api_name} answers carry no timing"
            continue
        path, body = question
        try:
            status, answer = ask_json(url.rstrip("/") + path, body, headers)
        except Unanswered as e:
            said[shown(url)] = f"no answer to POST {path} ({e.reason})"
            continue
        if status != 200 or not isinstance(answer, dict):
            said[shown(url)] = f"POST {path} answered HTTP {status}"
            continue
        fields, problems = answer_fields(get_api(api_name).read_metrics(answer))
        if problems:
            said[shown(url)] = f"{SENT}, with figures that are not durations: {'; '.join(problems)}"
        else:
            said[shown(url)] = SENT if has_server_timing(fields) else NOT_SENT
    return said

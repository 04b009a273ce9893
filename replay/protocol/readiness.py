"""Whether a server answers a request of the run's kind: the one question that tells a server
back from an outage. Its model list says nothing of that: a server that sheds load answers
`GET /v1/models` 200 while it answers every generation 503, and a search that took the list for
readiness repeated its probe into the same errors (replay.engine.probes, --on-outage retry).

The request is the run's own API's (its path and body, replay.protocol.table), not streamed, for
one output token of a prompt of a few tokens, on a connection of its own (replay.protocol.ask),
bounded in time; only a 200 counts.
"""

from __future__ import annotations

from replay.protocol.ask import Unanswered, ask
from replay.protocol.prompt import Prompt
from replay.protocol.table import get_api
from replay.protocol.urls import shown

READY_TIMEOUT_S = 10.0  # one output token of a tiny prompt, from a server with nothing else to do
READY_TEXT = "Hello"


def one_token_request(api_name: str, model: str | None, text: str) -> tuple[str, dict]:
    """(path, body) of a request of `api_name`'s own form (replay.protocol.table) for one output
    token of `text` as the user's message or the prompt, not streamed: a question put to a server
    before or between a run's sends (readiness here, its timing in replay.protocol.timing_check)."""
    api = get_api(api_name)
    prompt = Prompt(messages=[{"role": "user", "content": text}], text=text, token_ids=None, expected_tokens=0)
    return api.body_path, api.body(prompt, model=model, max_tokens=1, stream=False, ignore_eos=False)


def ready_problem(url: str, api: str, model: str | None, headers: dict[str, str] | None = None,
                  timeout: float = READY_TIMEOUT_S) -> str | None:
    """None when `url` answers a one-token `api` request 200; else why not, in one line
    naming the server ('http://host:8000: POST /v1/chat/completions answered HTTP 503')."""
    path, body = one_token_request(api, model, READY_TEXT)
    asked = f"POST {path}"
    try:
        status, _ = ask(url.rstrip("/") + path, body, headers, timeout)
    except Unanswered as e:
        return f"{shown(url)}: {asked} got no answer ({e.reason})"
    return None if status == 200 else f"{shown(url)}: {asked} answered HTTP {status}"

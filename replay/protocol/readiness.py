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


def ready_problem(url: str, api: str, model: str | None, headers: dict[str, str] | None = None,
                  timeout: float = READY_TIMEOUT_S) -> str | None:
    """None when `url` answers a one-token `api` request 200; else why not, in one line
    naming the server ('http://host:8000: POST /v1/chat/completions answered HTTP 503')."""
    spec = get_api(api)
    prompt = Prompt(messages=[{"role": "user", "content": READY_TEXT}], text=READY_TEXT, token_ids=None,
                    expected_tokens=0)
    body = spec.body(prompt, model=model, max_tokens=1, stream=False, ignore_eos=False)
    asked = f"POST {spec.body_path}"
    try:
        status, _ = ask(url.rstrip("/") + spec.body_path, body, headers, timeout)
    except Unanswered as e:
        return f"{shown(url)}: {asked} got no answer ({e.reason})"
    return None if status == 200 else f"{shown(url)}: {asked} answered HTTP {status}"

"""What the servers serve, asked once before a run sends anything (`GET /v1/models`; TGI's
`GET /info`: the API table's `models_path`).

Every endpoint must answer and serve the run's model: a dead server, or a wrong or missing
--model, would otherwise be found only once the whole trace had been sent, every row failing.
The preflight (replay.run.preflight) asks (`ask_served`), takes the model from the answers
when --model is not given (`only_model`) and the prompt limit (`prompt_limit`: vLLM and
`replay sim` say max_model_len, TGI max_input_tokens; a longer prompt can never be answered,
so such rows are recorded, never sent), and refuses the run for what `refusal` says once the
Coordinator can record every row.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from replay.protocol.ask import Unanswered, ask_json
from replay.protocol.reading import Models
from replay.protocol.table import get_api
from replay.protocol.urls import shown

logger = logging.getLogger(__name__)

MODELS_TIMEOUT_S = 5.0  # a live server answers its model list at once, however busy


@dataclass(frozen=True)
class Served:
    """One endpoint's answer: the models it serves, or why it gave none (`problem`)."""

    endpoint: str  # as shown: no credentials
    models: Models = field(default_factory=dict)  # id -> prompt limit in tokens (None: not said)
    problem: str | None = None

    def describe(self) -> str:
        """For the one-line refusal: 'URL serves a, b', or 'URL did not answer ...'."""
        if self.problem is not None:
            return f"{self.endpoint} {self.problem}"
        return f"{self.endpoint} serves {', '.join(self.models) or 'no model'}"


def ask_served(urls: list[str], api: str, headers: dict[str, str] | None = None,
               timeout: float = MODELS_TIMEOUT_S) -> tuple[Served, ...]:
    """Each endpoint asked what it serves, by `api`'s question; `headers`: the run's own (a
    server behind a key wants it). Never raises for a server that fails: its `problem` says how."""
    spec = get_api(api)
    question = f"GET {spec.models_path}"
    answers = []
    for url in urls:
        try:
            status, answer = ask_json(url.rstrip("/") + spec.models_path, headers=headers, timeout=timeout)
        except Unanswered as e:
            answers.append(Served(shown(url), problem=f"did not answer {question} ({e.reason})"))
            continue
        models = spec.read_models(answer) if status == 200 else None
        if models is None:
            said = f"HTTP {status}" if status != 200 else "no model list"
            answers.append(Served(shown(url), problem=f"answered {question} with {said}"))
        else:
            answers.append(Served(shown(url), models))
    return tuple(answers)


def only_model(served: tuple[Served, ...]) -> str | None:
    """The model every endpoint serves when each serves exactly that one, else None."""
    kinds = {tuple(s.models) for s in served if s.problem is None}
    if len(kinds) != 1 or any(s.problem is not None for s in served):
        return None
    (models,) = kinds
    return models[0] if len(models) == 1 else None


def prompt_limit(served: tuple[Served, ...], model: str | None) -> int | None:
    """The smallest prompt limit the endpoints state for `model` (or for their first model
    where they do not serve it), None when none states one."""
    limits = []
    for s in served:
        chosen = [s.models[model]] if model in s.models else list(s.models.values())[:1]
        limits += [limit for limit in chosen if limit is not None]
    return min(limits) if limits else None


def refusal(served: tuple[Served, ...], model: str | None) -> str | None:
    """Why the run cannot be sent to these endpoints (one line naming each endpoint at fault and
    what it serves), or None: every endpoint answered and serves `model`; without a model, when
    they do not all serve one and the same."""
    silent = [s for s in served if s.problem is not None]
    if silent:
        return "; ".join(s.describe() for s in silent)
    if model is None:
        if served and only_model(served) is None:
            return (f"no --model, and the endpoints do not serve one and the same model: "
                    f"{'; '.join(s.describe() for s in served)}; pass --model NAME")
        return None
    wrong = [s for s in served if model not in s.models]
    return f"--model {model}: {'; '.join(s.describe() for s in wrong)}" if wrong else None

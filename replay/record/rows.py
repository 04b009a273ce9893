"""One recorded exchange (the request's and the answer's bytes, and when) made into a trace row.

The row is a `jsonl` trace row (replay/trace/formats.py: `timestamp` in ms, `input_length`,
`output_length`, `hash_ids`, `block_size`, `session_id`), read by `replay trace validate`,
`stats` and `run` with no option, plus what the replay ignores and a reader of the trace
wants: `turn`, `gap_ms` (from the previous turn's answer end to this arrival), `api`, `model`,
`max_tokens`, `ignore_eos`, `stream`, `status` and, for a request that did not end well, `error`.
No text of a prompt or an answer is in a row unless the recording keeps it (`--keep-text`).
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from replay.protocol.ask import Unanswered, ask_json
from replay.protocol.openai import chat_tokenize_body, completions_tokenize_body
from replay.protocol.prompt import Prompt
from replay.protocol.sse import DONE, sse_data
from replay.protocol.table import get_api
from replay.record.hashing import BlockHasher
from replay.record.sessions import Sessions, Turn
from replay.rules.tokens import are_token_ids
from replay.synth.server_check import _tokenize_ids
from replay.synth.tokenizer import ServerTokenizer

CHAT, COMPLETIONS = "openai-chat", "openai-completions"
NOT_OFFERED = (404, 405, 501)  # a server without POST /tokenize


def api_of(path: str) -> str | None:
    """The API a request path is (None: not a generation request; forwarded, not recorded)."""
    path = path.split("?", 1)[0].rstrip("/")
    if path.endswith("/chat/completions"):
        return CHAT
    if path.endswith("/completions"):
        return COMPLETIONS
    return None


@dataclass
class Exchange:
    """What the proxy saw of one generation request (its header on the pipe to the recorder)."""

    seq: int  # arrival order among generation requests
    path: str
    arrival: float  # unix s, when the request's head arrived
    origin: float  # arrival of the recording's first generation request: the trace's time 0
    end: float  # when the answer's last byte went to the client (or the exchange broke off)
    status: int  # the status the client got (502: the proxy's own, the upstream unreachable)
    error: str | None  # why the exchange did not end well (the proxy's words), or None
    session_name: str | None  # the client's session header or `user` value, when the recording takes it
    client_id: str | None  # the client's request id header (--id-header), to pair rows with the client's logs
    request: bytes = b""
    response: bytes = b""


class PromptTokens:
    """The prompt's token ids as the server counts them: the server's own POST /tokenize while it
    has one, else the served model's tokenizer and chat template (as the replay's preflight)."""

    def __init__(self, upstream: str | None, tokenizer: ServerTokenizer | None, ask_server: bool = True):
        self.upstream = (upstream or "").rstrip("/")
        self.tokenizer = tokenizer
        self.ask_server = ask_server
        self.method: str | None = None  # "server /tokenize" or "tokenizer", once known

    def ids(self, api: str, body: dict) -> tuple[list[int] | None, str | None]:
        """(ids, None), or (None, why not)."""
        model = body.get("model")
        if api == COMPLETIONS:
            prompt = body.get("prompt")
            if are_token_ids(prompt) and prompt:
                return prompt, None
            if not isinstance(prompt, str):
                return None, "prompt is not one text or one list of token ids"
            ask_body = completions_tokenize_body(Prompt(None, prompt, None, 0), model)
        else:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                return None, "no messages"
            ask_body = chat_tokenize_body(Prompt(messages, None, None, 0, body.get("tools")), model)
            for key in ("chat_template_kwargs", "add_generation_prompt", "continue_final_message"):
                if key in body:
                    ask_body[key] = body[key]
        if self.ask_server and self.upstream:
            try:
                status, answer = ask_json(self.upstream + "/tokenize", ask_body)
            except Unanswered as e:
                return None, f"POST /tokenize: {e.reason}"
            ids, _ = _tokenize_ids(answer) if status == 200 else (None, None)
            if ids is not None:
                self.method = "server /tokenize"
                return ids, None
            if status not in NOT_OFFERED:
                return None, f"POST /tokenize answered HTTP {status}"
            self.ask_server = False  # the server has none: the tokenizer from now on
        if self.tokenizer is None:
            return None, "no POST /tokenize to ask and no --tokenizer"
        self.method = "tokenizer"
        try:
            if api == COMPLETIONS:
                return self.tokenizer.encode_text(ask_body["prompt"]), None
            return self.tokenizer.encode_chat(body["messages"], body.get("tools"), body.get("chat_template_kwargs")), None
        except Exception as e:  # a template that fails on these messages: the row says so
            return None, f"the chat template failed: {e}"


@dataclass
class Answer:
    output_tokens: int | None
    prompt_tokens: int | None
    counted: str  # "usage" or "events" (no usage: content events counted)
    message: dict | None  # chat: the answer as a message (for the next turn to find)
    text: str  # completions: the answer's text
    error: str | None


def read_answer(api: str, response: bytes, streamed: bool) -> Answer:
    """The answer's usage (or its content events counted), and its first choice's content."""
    spec = get_api(api)
    objects = []
    broken = None  # the stream's last data line, when it did not parse
    if streamed:
        for line in response.split(b"\n"):
            data = sse_data(line.rstrip(b"\r"))
            if data is None or data == DONE:
                continue
            try:
                objects.append(orjson.loads(data))
                broken = None
            except orjson.JSONDecodeError:
                broken = data
    elif response:
        try:
            objects.append(orjson.loads(response))
        except orjson.JSONDecodeError:
            return Answer(None, None, "usage", None, "", "the answer is not JSON")
    events = 0
    usage = None
    error = None
    content: list[str] = []
    calls: list[dict] = []
    for obj in objects:
        if not isinstance(obj, dict):
            continue
        count, said, err = (spec.read_event if streamed else spec.read_body)(obj)
        events += count
        usage = said or usage
        error = err or error
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            part = choice.get("delta") if streamed else choice.get("message")
            if api == COMPLETIONS:
                content.append(str(choice.get("text") or ""))
            elif isinstance(part, dict):
                content.append(str(part.get("content") or ""))
                calls.extend(part.get("tool_calls") or ())
    if broken is not None and not response.endswith(b"\n"):  # an event cut off where the answer ended
        error = error or f"the answer's stream ended mid-event: {broken[:80].decode(errors='replace')}"
    text = "".join(content)
    message: dict[str, str | list[dict]] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    if usage and isinstance(usage.get("output_tokens"), int):
        return Answer(usage["output_tokens"], usage.get("prompt_tokens"), "usage", message, text, error)
    return Answer(events, (usage or {}).get("prompt_tokens"), "events", message, text, error)


class RowMaker:
    def __init__(self, tokens: PromptTokens, hasher: BlockHasher, session_from: str | None, keep_text: bool,
                 session_user: bool = False):
        self.tokens = tokens
        self.hasher = hasher
        self.sessions = Sessions(hasher)
        self.session_from = session_from  # "header" / "user": the client's names win; None: continuation only
        self.keep_text = keep_text
        self.session_user = session_user  # the body's OpenAI `user` names the session where no header did

    def row(self, x: Exchange) -> dict:
        """The row of an exchange the proxy saw (its bytes)."""
        try:
            body = orjson.loads(x.request)
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict):
            return self.row_of(x, None, None)
        api = api_of(x.path) or CHAT
        return self.row_of(x, body, read_answer(api, x.response, body.get("stream") is True))

    def row_of(self, x: Exchange, body: dict | None, answer: Answer | None) -> dict:
        """The row of a request `body` (None: not a JSON object) and its `answer`, read already."""
        api = api_of(x.path) or CHAT
        row: dict = {"timestamp": round((x.arrival - x.origin) * 1000.0, 3), "input_length": 0, "output_length": 0}
        if body is None or answer is None:
            row.update(api=api, status=x.status, error=x.error or "malformed JSON request (forwarded as it came)")
            if x.client_id is not None:
                row["client_request_id"] = x.client_id
            return row
        streamed = body.get("stream") is True
        ids, why = self.tokens.ids(api, body)
        prompt_tokens = answer.prompt_tokens if isinstance(answer.prompt_tokens, int) else None
        row["input_length"] = prompt_tokens if prompt_tokens is not None else len(ids or ())
        row["output_length"] = answer.output_tokens or 0
        if ids is not None and len(ids) == row["input_length"]:
            row["hash_ids"] = self.hasher.hash_ids(ids)
            row["block_size"] = self.hasher.block_size
        elif ids is not None:
            row["tokenized_length"] = len(ids)  # the server said otherwise: no hash ids can be trusted
        turn, answered = self._session(api, body, x)
        row["session_id"] = turn.session
        row["turn"] = turn.turn
        if turn.previous_end is not None:
            row["gap_ms"] = round((x.arrival - turn.previous_end) * 1000.0, 3)
        ok = x.error is None and 200 <= x.status < 300 and answer.error is None
        if ok:
            answered(answer, x.end)
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
        row.update(api=api, model=body.get("model"), max_tokens=max_tokens, ignore_eos=body.get("ignore_eos") is True,
                   stream=streamed, status=x.status)
        if answer.counted != "usage":
            row["output_counted"] = "events"
        problems = [p for p in (x.error, answer.error if not ok else None, why if ids is None else None,
                                None if "hash_ids" in row or ids is None else "the server counted the prompt otherwise")
                    if p]
        if problems:
            row["error"] = "; ".join(problems)
        if x.client_id is not None:
            row["client_request_id"] = x.client_id
        if self.keep_text:
            if api == CHAT:
                row["messages"] = body.get("messages")
            else:
                row["text_input"] = body.get("prompt")
        return row

    def _session(self, api: str, body: dict, x: Exchange):
        sessions = self.sessions
        name = x.session_name
        if not name and self.session_user and isinstance(body.get("user"), str):
            name = body["user"]
        if self.session_from is not None and name:
            turn, key = sessions.by_name(name, x.arrival)
            return turn, lambda answer, end: sessions.named_answered(key, end)
        if api == CHAT and isinstance(body.get("messages"), list):
            turn, digest = sessions.chat(body["messages"])
            return turn, lambda answer, end: sessions.chat_answered(digest, turn, answer.message, end)
        if api == COMPLETIONS and isinstance(body.get("prompt"), str):
            turn, prompt = sessions.completions(body["prompt"])
            return turn, lambda answer, end: sessions.completions_answered(prompt, turn, answer.text, end)
        return Turn(sessions._new(), 0, None), lambda answer, end: None

"""The master and every worker synthesize prompts from the same tokenizer and chat template.

Each worker makes its prompts from the tokenizer at `--tokenizer` on its own host. One whose
file differs (another model's, another revision, another template) sends prompts of the wrong
lengths and with the wrong shared prefixes, and nothing in the records would say so. So the
master loads its tokenizer in its preflight (an unloadable one is refused there, before any
worker starts) and sends its fingerprint (replay.synth.tokenizer.tokenizer_fingerprint) in the
plan; a worker whose own differs refuses its part, which is then recorded as
`worker failed: tokenizer mismatch: ...` and makes the run's exit code 1.
"""

from __future__ import annotations

from pathlib import Path

from replay.errors import OptionError
from replay.protocol.table import APIS
from replay.synth import setup_cache
from replay.synth.prompts import PromptError, set_up
from replay.synth.tokenizer import (
    ChatTemplate,
    ChatTemplateError,
    ServerTokenizer,
    fingerprint_with_template,
    load_tokenizer,
    tokenizer_fingerprint,
)
from replay.synth.tokenizer_source import parse_hub_id, resolve_tokenizer

SHORT = 12  # hex digits of a fingerprint shown in messages


def short(fingerprint: str) -> str:
    return fingerprint[:SHORT]


def master_tokenizer(tokenizer: str) -> str:
    """The master's `--tokenizer` resolved on its host (replay.synth.tokenizer_source), the path
    every later step of its preflight uses. Raises OptionError naming the option."""
    try:
        return str(resolve_tokenizer(tokenizer))
    except FileNotFoundError as e:
        raise OptionError(f"--tokenizer {tokenizer}: cannot load: {_first_line(e)}") from None


def master_fingerprint(tokenizer: str, chat_template: str | None = None, api: str | None = None) -> str:
    """Load the tokenizer (a path: master_tokenizer's) and its chat template as a worker will,
    and return their fingerprint.

    The load is proved by making the set-up a worker will need (_prove_loadable), which this
    host's workers and the server check then read from the cache; it is skipped when this
    host's set-up cache holds an entry for these exact bytes, this `tokenizers` version and
    `api`: it loaded here before, and so did the template compile. Raises OptionError naming the option, also for a chat `api`
    with no template or with one that raises on the set-up's messages: the workers would fail
    every row on them, whatever --verify-server says.
    """
    try:
        fingerprint, template = fingerprint_with_template(tokenizer, chat_template, compiled=False)
        failure = None
    except Exception as e:  # reported below, after a load error (which says more) if there is one
        fingerprint, template, failure = None, None, e
    loaded_before = fingerprint is not None and api is not None and setup_cache.loaded_before(
        fingerprint, template.special_tokens if template else {}, api)
    if not loaded_before:
        try:  # these bytes compiled before when they loaded before: then no one here renders them
            if template is not None:
                template.compile()
        except Exception as e:
            fingerprint, template, failure = None, None, e
        _prove_loadable(tokenizer, chat_template, None if failure is not None else api)
    if failure is None and api is not None:
        _refuse_template_for(tokenizer, template, api)
    if failure is not None:  # the template: unreadable, bad JSON, a jinja syntax error
        raise OptionError(f"{_template_option(tokenizer, chat_template)}: cannot load the chat template: "
                          f"{_first_line(failure)}") from None
    assert fingerprint is not None  # set whenever there was no failure
    return fingerprint


def _is_chat(api: str) -> bool:
    return getattr(APIS.get(api), "chat", False)


def _template_option(tokenizer: str, chat_template: str | None) -> str:
    """The option the chat template comes from, as its messages name it."""
    return f"--chat-template {chat_template}" if chat_template else f"--tokenizer {tokenizer}"


def _refuse_template_for(tokenizer: str, template: ChatTemplate | None, api: str) -> None:
    """A chat api needs a template; without one every worker would fail each of its rows (and a
    server check would only catch it when it is on), so the preflight refuses it itself."""
    if template is None and _is_chat(api):
        raise OptionError(f"--tokenizer {tokenizer}: has no chat template, which --api {api} needs; "
                          f"pass --chat-template")


def _prove_loadable(tokenizer: str, chat_template: str | None, api: str | None) -> None:
    """Raise OptionError unless `tokenizer` loads. With an `api`, by making the set-up the
    workers will need: in a child process for a real tokenizer (replay/synth/setup_child.py), so
    this process never holds the tokenizer, and this host's workers then read the set-up from
    the cache. A set-up that fails for another reason than the load is reported where the
    set-up is made again (the server check, the workers), so then only the load is tried here;
    but a template that raises on the set-up's messages, or cannot frame a prompt, is refused
    here, as the workers would fail on it whatever the server check says."""
    if api is not None:
        try:
            loaded = ServerTokenizer.load(tokenizer, chat_template, lazy=True, compiled=_is_chat(api))
            if loaded.chat_template is not None or not _is_chat(api):  # else: master_fingerprint refuses it
                set_up(loaded, api)
                return
        except ChatTemplateError as e:
            at = f" (template line {e.line})" if e.line is not None else ""
            raise OptionError(f"{_template_option(tokenizer, chat_template)}: cannot render the chat template"
                              f"{at}: {_first_line(ValueError(e.reason))}") from None
        except PromptError as e:  # the template cannot frame a prompt (one that drops the content)
            raise OptionError(f"{_template_option(tokenizer, chat_template)}: {_first_line(e)}") from None
        except Exception:
            pass
    try:
        load_tokenizer(tokenizer)
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
        raise OptionError(f"--tokenizer {tokenizer}: cannot load: {_first_line(e)}") from None


def check_worker_tokenizer(tokenizer: str, chat_template: str | None, expected: str | None) -> Path:
    """This host's `--tokenizer` resolved (replay.synth.tokenizer_source), the path its set-up
    uses. Raises OptionError ("tokenizer mismatch: ...") when it and the template differ from
    the master's `expected` fingerprint (None: the master sent none, no check), or when it
    cannot be read."""
    try:
        path = resolve_tokenizer(tokenizer)
    except FileNotFoundError as e:
        raise OptionError(f"this worker's {_where(tokenizer, None, chat_template)} cannot be read: "
                          f"{_first_line(e)}") from None
    where = _where(tokenizer, path, chat_template)
    if expected is None:
        return path
    try:
        mine = tokenizer_fingerprint(path, chat_template)
    except Exception as e:
        raise OptionError(f"this worker's {where} cannot be read: {_first_line(e)}") from None
    if mine != expected:
        raise OptionError(f"tokenizer mismatch: this worker's {where} has fingerprint {short(mine)} "
                          f"but the master's is {short(expected)}")
    return path


def _where(tokenizer: str, path: Path | None, chat_template: str | None) -> str:
    """The worker's tokenizer in its messages: a path as given, made absolute in this worker's
    folder; a Hugging Face id with the snapshot it resolved to."""
    where = f"--tokenizer {Path(tokenizer).absolute()}"
    if path is not None and path != Path(tokenizer).expanduser():
        where = f"--tokenizer {tokenizer} ({path})"
    elif path is None and parse_hub_id(tokenizer) is not None:
        where = f"--tokenizer {tokenizer}"
    if chat_template:
        where += f" --chat-template {Path(chat_template).absolute()}"
    return where


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]

"""Chat templates rendered as transformers' apply_chat_template renders them (what vLLM calls).

A prompt's token count is only exact if the text the replay counts is the text the server
renders, byte for byte, so this module reproduces transformers' jinja setup rather than
jinja's defaults:

- an ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks;
- the `{% generation %}...{% endgeneration %}` tag (transformers' AssistantTracker, which
  marks assistant text for training masks; a server rendering a request gets its body) and
  `jinja2.ext.loopcontrols` (`{% break %}`, `{% continue %}`);
- globals `raise_exception(message)` and `strftime_now(format)`, and a `tojson` filter that
  does not HTML-escape and takes `ensure_ascii`, `indent`, `separators`, `sort_keys`;
- the variables `messages`, `tools` (a list or None), `documents`, `add_generation_prompt`,
  the tokenizer's special tokens that are set (`bos_token`, ...; unset ones are left
  undefined, not None), and any chat_template_kwargs, which win over the special tokens;
- a tokenizer may carry several named templates: "tool_use" when tools are passed (even an
  empty list), else "default".

Errors a template raises (its own raise_exception, or a bad expression on unexpected
messages) become ChatTemplateError: one line naming the template and its line, no traceback.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from functools import lru_cache
from types import TracebackType
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

DEFAULT = "default"
TOOL_USE = "tool_use"
# The filename jinja gives template code in a rewritten traceback (templates made from strings).
TEMPLATE_FRAME = "<template>"


class ChatTemplateError(ValueError):
    """A chat template that cannot be compiled, or that failed on these messages.

    `reason` is what the template (or jinja) said, as vLLM would return it to a client;
    str() adds which template and which of its lines, for logs and the CLI.
    """

    def __init__(self, reason: str, where: str, line: int | None = None, context: str = ""):
        self.reason = reason
        self.where = where
        self.line = line
        self.context = context
        at = f", template line {line}" if line is not None else ""
        super().__init__(f"{context + ': ' if context else ''}chat template {where}{at}: {reason}")

    def about(self, context: str) -> ChatTemplateError:
        """The same error, saying what was being rendered (e.g. which trace row)."""
        return ChatTemplateError(self.reason, self.where, self.line, context)


class GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, as transformers registers it.

    transformers uses the tag to find the assistant's text for return_assistant_tokens_mask;
    a server rendering a request never asks for the mask, so the tag renders its body and
    nothing else. Without the extension such a template does not even compile.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller) -> str:
        return caller()


def raise_exception(message: str):
    """The template's own refusal (e.g. roles that do not alternate), as transformers raises it."""
    raise jinja2.exceptions.TemplateError(message)


def tojson(x: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    """transformers' tojson: jinja's own sorts keys and HTML-escapes `<>&'`, which would change
    the rendered tools; the arguments are json.dumps's, in transformers' order."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(fmt: str) -> str:
    """Today's date in the template (Llama 3.1+ system prompts): local time, as transformers."""
    return datetime.now().strftime(fmt)


def make_environment() -> ImmutableSandboxedEnvironment:
    """A jinja environment set up as transformers' _compile_jinja_template sets up its own."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


@lru_cache(maxsize=16)
def _compiled(text: str) -> jinja2.Template:
    """One compile per template text and process: the master's check, the server check and the
    worker's set-up each load the template, and a compile is slow (docs/bench/2026-11-28-figures.md). A compiled template is only
    rendered, never changed, so one object serves them all; a syntax error is not cached."""
    return make_environment().from_string(text)


def template_line(tb: TracebackType | None) -> int | None:
    """The template line a render error came from: jinja rewrites tracebacks so that template
    code shows as frames of the file "<template>"; the innermost one is where it failed."""
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == TEMPLATE_FRAME:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _reason(exc: Exception) -> str:
    """The error as one line: a template's own message as is, anything else with its type."""
    if isinstance(exc, jinja2.TemplateError):
        return str(exc.message if isinstance(exc, jinja2.TemplateSyntaxError) else exc)
    return f"{type(exc).__name__}: {exc}"


class ChatTemplate:
    """One chat template, or several named ones, rendered the way apply_chat_template renders.

    `source` is a template string, or {name: template} (tokenizer_config.json's list form).
    All are compiled here, so a template that does not compile fails at load, not mid-run; with
    `compiled=False`, when first rendered (or by `compile()`): a caller whose prompts come from
    the set-up cache renders none, and a compile costs as much as the rest of its set-up.
    """

    def __init__(self, source: str | dict[str, str], special_tokens: dict[str, Any] | None = None, origin: str = "",
                 compiled: bool = True):
        self.source = source
        self.origin = origin
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v}
        self._texts = {DEFAULT: source} if isinstance(source, str) else dict(source)
        self._templates: dict[str, jinja2.Template] = {}
        if compiled:
            self.compile()

    def compile(self) -> None:
        """Compile every template now; ChatTemplateError for one that does not compile."""
        for name, text in self._texts.items():
            if name not in self._templates:
                self._templates[name] = self._compile(name, text)

    @property
    def names(self) -> list[str]:
        """The template names (["default"] for a single template)."""
        return list(self._texts)

    @property
    def sha256(self) -> str:
        """What identifies the template(s): of the string itself for one (as before named
        templates were supported), of the canonical JSON of {name: template} for several."""
        if isinstance(self.source, str):
            text = self.source
        else:
            text = json.dumps(self.source, sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()

    def _where(self, name: str) -> str:
        where = self.origin or "(inline)"
        return where if isinstance(self.source, str) else f"{where} (template {name!r})"

    def _compile(self, name: str, text: str) -> jinja2.Template:
        if not isinstance(text, str):
            raise ChatTemplateError(f"expected a template string, got {type(text).__name__}", self._where(name))
        try:
            return _compiled(text)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(_reason(exc), self._where(name), exc.lineno) from None

    def pick(self, tools: list | None) -> str:
        """transformers' get_chat_template: "tool_use" when tools are passed and it exists,
        else "default"; several templates and neither is an error."""
        if tools is not None and TOOL_USE in self._texts:
            return TOOL_USE
        if DEFAULT in self._texts:
            return DEFAULT
        raise ChatTemplateError(
            f"several chat templates and none named 'default' ({', '.join(sorted(self._texts))})",
            self.origin or "(inline)",
        )

    def render(
        self,
        messages: list[dict],
        tools: list | None = None,
        documents: list | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The prompt text. `kwargs` are chat_template_kwargs: extra variables, which replace
        special tokens of the same name (transformers' rule)."""
        name = self.pick(tools)
        if name not in self._templates:
            self._templates[name] = self._compile(name, self._texts[name])
        variables = {**self.special_tokens, **kwargs}
        try:
            return self._templates[name].render(
                messages=messages,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except Exception as exc:  # whatever the template does on these messages is its error
            raise ChatTemplateError(_reason(exc), self._where(name), template_line(exc.__traceback__)) from None

"""Count and encode prompts exactly as vLLM does.

vLLM renders a chat request with the model's chat template (add_generation_prompt=True,
HuggingFace's jinja settings) and encodes the text *without* adding special tokens; a
completions request with a text prompt is encoded *with* the tokenizer's own special tokens
(Llama's BOS). Both the synthesizer and the reference server use this module, so that the
two can never disagree about what a prompt's length is.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from functools import cached_property
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # HuggingFace's tojson: unlike jinja's own, it does not HTML-escape.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A chat template rendered the way transformers' apply_chat_template renders it."""

    def __init__(self, source: str, special_tokens: dict[str, str | None] | None = None, origin: str = ""):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self.source = source
        self.origin = origin
        self.special_tokens = dict(special_tokens or {})
        self._template = env.from_string(source)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()

    def render(self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = True) -> str:
        return self._template.render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **self.special_tokens
        )


def _config_path(path: Path) -> Path | None:
    if path.is_dir():
        cfg = path / "tokenizer_config.json"
        return cfg if cfg.exists() else None
    sibling = path.parent / "tokenizer_config.json"
    return sibling if sibling.exists() else None


def _special_tokens(config: dict) -> dict[str, str | None]:
    tokens = {key: _token_text(config.get(key)) for key in SPECIAL_TOKEN_KEYS}
    extra = config.get("additional_special_tokens") or []
    tokens["additional_special_tokens"] = [_token_text(t) for t in extra]
    return tokens


def _template_from_config(config: dict) -> str | None:
    tmpl = config.get("chat_template")
    if isinstance(tmpl, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in tmpl}
        tmpl = named.get("default") or next(iter(named.values()), None)
    return tmpl


def load_chat_template(tokenizer_path: str | Path | None, chat_template_path: str | Path | None = None) -> ChatTemplate | None:
    """The chat template: an explicit --chat-template (tokenizer_config.json or .jinja) wins
    over the tokenizer folder's own tokenizer_config.json / chat_template.jinja."""
    config: dict = {}
    if tokenizer_path is not None:
        cfg = _config_path(Path(tokenizer_path))
        if cfg is not None:
            config = json.loads(cfg.read_text())
    special = _special_tokens(config)
    if chat_template_path is not None:
        p = Path(chat_template_path)
        if not p.exists():
            raise FileNotFoundError(f"chat template not found: {p}")
        if p.suffix == ".json":
            tmpl_config = json.loads(p.read_text())
            source = _template_from_config(tmpl_config)
            if source is None:
                raise ValueError(f"{p}: no 'chat_template' field")
            special = {**special, **{k: v for k, v in _special_tokens(tmpl_config).items() if v}}
        else:
            source = p.read_text()
        return ChatTemplate(source, special, origin=str(p))
    source = _template_from_config(config)
    if source is None and tokenizer_path is not None:
        jinja_file = Path(tokenizer_path) / "chat_template.jinja" if Path(tokenizer_path).is_dir() else None
        if jinja_file is not None and jinja_file.exists():
            source = jinja_file.read_text()
    if source is None:
        return None
    return ChatTemplate(source, special, origin=str(tokenizer_path))


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A HuggingFace tokenizer from tokenizer.json or a folder holding one."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.exists():
        raise FileNotFoundError(f"tokenizer not found: {p}")
    return Tokenizer.from_file(str(p))


class ServerTokenizer:
    """A tokenizer plus chat template, counting tokens as the server will."""

    def __init__(self, tokenizer: Tokenizer, chat_template: ChatTemplate | None, name: str = ""):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.name = name

    @classmethod
    def load(cls, tokenizer_path: str | Path, chat_template_path: str | Path | None = None) -> "ServerTokenizer":
        return cls(load_tokenizer(tokenizer_path), load_chat_template(tokenizer_path, chat_template_path), str(tokenizer_path))

    @cached_property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def render_chat(self, messages: list[dict], tools: list | None = None) -> str:
        if self.chat_template is None:
            raise ValueError(f"tokenizer {self.name} has no chat template; pass --chat-template")
        return self.chat_template.render(messages, tools=tools, add_generation_prompt=True)

    def encode_chat(self, messages: list[dict], tools: list | None = None) -> list[int]:
        return self.tokenizer.encode(self.render_chat(messages, tools), add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        """A completions prompt: the tokenizer adds its own special tokens (BOS), as vLLM does."""
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def count_chat(self, messages: list[dict], tools: list | None = None) -> int:
        return len(self.encode_chat(messages, tools))

    def count_text(self, text: str) -> int:
        return len(self.encode_text(text))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

"""Count and encode prompts exactly as vLLM does.

vLLM renders a chat request with the model's chat template (add_generation_prompt=True,
transformers' jinja setup, reproduced in replay/synth/chat_template.py) and encodes the
text *without* adding special tokens; a completions request with a text prompt is encoded
*with* the tokenizer's own special tokens (Llama's BOS). Both the synthesizer and the
reference server use this module, so that the two can never disagree about what a
prompt's length is.
"""

from __future__ import annotations

import hashlib
import json
import threading
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from replay.rules.tokens import CHAT_ADD_SPECIAL_TOKENS, TEXT_ADD_SPECIAL_TOKENS
from replay.synth.chat_template import DEFAULT, ChatTemplate, ChatTemplateError

if TYPE_CHECKING:  # the library is imported where a tokenizer is loaded: a set-up from the cache needs none
    from tokenizers import Tokenizer

__all__ = ["ChatTemplate", "ChatTemplateError", "ServerTokenizer", "load_chat_template", "load_tokenizer"]

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# transformers' files for templates kept outside tokenizer_config.json (they win over it)
TEMPLATE_FILE = "chat_template.jinja"
MORE_TEMPLATES_DIR = "additional_chat_templates"


def _token_text(value) -> str | None:
    """A special token's text: tokenizer_config.json writes it as a string or as an AddedToken
    dict ({"content": "<s>", "lstrip": false, ...})."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _folder(path: Path) -> Path:
    """The folder whose tokenizer_config.json / chat_template.jinja go with a tokenizer path."""
    return path if path.is_dir() else path.parent


def _config_path(path: Path) -> Path | None:
    cfg = _folder(path) / "tokenizer_config.json"
    return cfg if cfg.exists() else None


def _special_tokens(config: dict) -> dict[str, str | list[str]]:
    """The special tokens transformers hands a template: its special_tokens_map, which leaves
    out unset (null or empty) ones, so a template sees them undefined, never as None."""
    tokens: dict[str, str | list[str]] = {}
    for key in SPECIAL_TOKEN_KEYS:
        text = _token_text(config.get(key))
        if text:
            tokens[key] = str(text)
    extra = [str(_token_text(t)) for t in config.get("additional_special_tokens") or []]
    if extra:
        tokens["additional_special_tokens"] = extra
    return tokens


def _template_from_config(config: dict, where: Path) -> str | dict[str, str] | None:
    """tokenizer_config.json's chat_template: a string, or a list of named templates
    ([{"name": "default", "template": ...}, {"name": "tool_use", ...}]) read as {name: template}."""
    tmpl = config.get("chat_template")
    if isinstance(tmpl, list):
        if not all(isinstance(t, dict) and "name" in t and "template" in t for t in tmpl):
            raise ChatTemplateError("chat_template list entries must be {\"name\": ..., \"template\": ...}", str(where))
        tmpl = {t["name"]: t["template"] for t in tmpl}
    if isinstance(tmpl, dict):  # named templates (also as this module hands them on)
        if bad := next((name for name, t in tmpl.items() if not isinstance(t, str)), None):
            raise ChatTemplateError(f"chat_template {bad!r}: expected a template string, got "
                                    f"{type(tmpl[bad]).__name__}", str(where))
    elif tmpl is not None and not isinstance(tmpl, str):
        raise ChatTemplateError(f"chat_template: expected a template string or a list of named ones, got "
                                f"{type(tmpl).__name__}", str(where))
    return tmpl


def _folder_templates(folder: Path) -> tuple[str | dict[str, str], str] | None:
    """Templates kept as files (transformers >= 4.50 saves them so): chat_template.jinja is
    "default", additional_chat_templates/NAME.jinja the others. (templates, origin) or None."""
    templates: dict[str, str] = {}
    main = folder / TEMPLATE_FILE
    if main.is_file():
        templates[DEFAULT] = main.read_text()
    more = folder / MORE_TEMPLATES_DIR
    if more.is_dir():
        for f in sorted(more.glob("*.jinja")):
            templates[f.name.removesuffix(".jinja")] = f.read_text()
    if not templates:
        return None
    if list(templates) == [DEFAULT]:
        return templates[DEFAULT], str(main)
    return templates, str(folder)


def _read_config(path: Path) -> dict:
    """A tokenizer_config.json, or ValueError naming the file: json's own message names none."""
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    return config


def _explicit_template(p: Path, special: dict, compiled: bool = True) -> ChatTemplate:
    """--chat-template: a .jinja file (as vLLM's --chat-template), or a tokenizer_config.json,
    whose set special tokens win over the tokenizer folder's."""
    if not p.exists():
        raise FileNotFoundError(f"chat template not found: {p}")
    if p.suffix != ".json":
        return ChatTemplate(p.read_text(), special, origin=str(p), compiled=compiled)
    config = _read_config(p)
    source = _template_from_config(config, p)
    if source is None:
        raise ValueError(f"{p}: no 'chat_template' field")
    return ChatTemplate(source, {**special, **_special_tokens(config)}, origin=str(p), compiled=compiled)


def load_chat_template(
    tokenizer_path: str | Path | None, chat_template_path: str | Path | None = None, compiled: bool = True
) -> ChatTemplate | None:
    """The chat template: an explicit --chat-template (tokenizer_config.json or .jinja) wins
    over the tokenizer folder's own; in the folder, as transformers loads it,
    chat_template.jinja (+ additional_chat_templates/) wins over tokenizer_config.json's
    chat_template. Special tokens come from tokenizer_config.json. `compiled=False`: compiled
    when first rendered (ChatTemplate)."""
    config: dict = {}
    cfg = _config_path(Path(tokenizer_path)) if tokenizer_path is not None else None
    if cfg is not None:
        config = _read_config(cfg)
    special = _special_tokens(config)
    if chat_template_path is not None:
        return _explicit_template(Path(chat_template_path), special, compiled)
    if tokenizer_path is None:
        return None
    files = _folder_templates(_folder(Path(tokenizer_path)))
    if files is not None:
        return ChatTemplate(files[0], special, origin=files[1], compiled=compiled)
    source = _template_from_config(config, cfg) if cfg is not None else None
    if source is None:
        return None
    return ChatTemplate(source, special, origin=str(cfg), compiled=compiled)


def tokenizer_json(path: str | Path) -> Path:
    """The tokenizer.json that `path` (the file, or a folder holding it) names."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.exists():
        raise FileNotFoundError(f"tokenizer not found: {p}")
    return p


_loaded: tuple[tuple, Tokenizer] | None = None  # the last tokenizer this process loaded, by file identity


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A HuggingFace tokenizer from tokenizer.json or a folder holding one.

    The last one loaded is kept and handed out again while its file is unchanged (same path,
    size and mtime): a real tokenizer costs 100-180 MB and 0.1-0.35 s to load, and on a cold
    start one process asks for it twice (the master's preflight, then the set-up that builds
    the safe vocabulary); two loads held together were a third of a cold run's peak RSS. A
    Tokenizer is only read (encode/decode), and safe to share between threads."""
    global _loaded
    named = tokenizer_json(path)
    file = named.resolve()
    stat = file.stat()
    identity = (str(file), stat.st_size, stat.st_mtime_ns)
    if _loaded is not None and _loaded[0] == identity:
        return _loaded[1]
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
        reason = (str(e).strip() or type(e).__name__).splitlines()[0]
        raise ValueError(f"{named}: not a tokenizer.json the tokenizers library reads: {reason}") from None
    _loaded = (identity, tokenizer)
    return tokenizer


def tokenizer_fingerprint(tokenizer_path: str | Path, chat_template_path: str | Path | None = None) -> str:
    """What two hosts must share to synthesize the same prompts: the sha256 of (the sha256 of
    the tokenizer.json bytes, the template's ChatTemplate.sha256 or "no chat template", and the
    special tokens tokenizer_config.json hands the template: a `bos_token` the template prints
    changes every chat prompt).

    The bytes, not the loaded tokenizer: hashing the file is a small fraction of loading it
    (docs/bench/2026-11-28-figures.md). The template is the one ServerTokenizer.load would use (--chat-template, else
    the folder's own), so a worker whose tokenizer_config.json differs is told apart too.
    """
    return fingerprint_with_template(tokenizer_path, chat_template_path)[0]


def fingerprint_with_template(tokenizer_path: str | Path, chat_template_path: str | Path | None = None,
                              compiled: bool = True) -> tuple[str, ChatTemplate | None]:
    """(tokenizer_fingerprint, the template it covers), for a caller that needs the template too
    (its special tokens): the files are read once. `compiled`: as load_chat_template's."""
    template = load_chat_template(tokenizer_path, chat_template_path, compiled)
    return fingerprint_of(tokenizer_json(tokenizer_path).read_bytes(), template), template


def fingerprint_of(tokenizer_bytes: bytes, template: ChatTemplate | None) -> str:
    """tokenizer_fingerprint of a tokenizer.json already read and a template already loaded: the
    one computation of a fingerprint (the set-up cache's key uses it with the bytes it holds)."""
    digest = hashlib.sha256(tokenizer_bytes).hexdigest()
    parts = f"tokenizer.json sha256 {digest}\nchat template sha256 {template.sha256 if template else 'no chat template'}"
    if template is not None and template.special_tokens:
        parts += f"\nspecial tokens {json.dumps(template.special_tokens, sort_keys=True)}"
    return hashlib.sha256(parts.encode()).hexdigest()


class ServerTokenizer:
    """A tokenizer plus chat template, counting tokens as the server will.

    With `load(..., lazy=True)` the tokenizer itself is loaded when first used: a worker whose
    set-up comes from the disk cache (replay/synth/setup_cache.py) builds its prompts from the
    safe vocabulary and the frames alone, and never pays a real tokenizer's load, in CPU and
    memory (docs/bench/2026-11-28-figures.md).
    """

    def __init__(self, tokenizer: Tokenizer | None, chat_template: ChatTemplate | None, name: str = "",
                 path: str | Path | None = None, chat_template_path: str | Path | None = None):
        if tokenizer is None and path is None:
            raise ValueError("ServerTokenizer needs a tokenizer or the path to load it from")
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self.chat_template = chat_template
        self.name = name
        self.path = Path(path) if path is not None else None  # where `load` found it (the cache's key needs it)
        # load's --chat-template (None: the folder's own), for another process to load the same
        self.chat_template_path = chat_template_path

    @classmethod
    def load(cls, tokenizer_path: str | Path, chat_template_path: str | Path | None = None,
             lazy: bool = False, compiled: bool = True) -> ServerTokenizer:
        """`lazy`: the tokenizer loaded when first used; `compiled=False`: the template compiled
        when first rendered (ChatTemplate), for a caller whose set-up may come from the cache."""
        tokenizer_json(tokenizer_path)  # a missing file fails here, also when lazy
        tokenizer = None if lazy else load_tokenizer(tokenizer_path)
        return cls(tokenizer, load_chat_template(tokenizer_path, chat_template_path, compiled), str(tokenizer_path),
                   tokenizer_path, chat_template_path)

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            with self._lock:  # the builder's thread and the event loop may both ask first
                if self._tokenizer is None:
                    self._tokenizer = load_tokenizer(self.path)
        return self._tokenizer

    @property
    def loaded(self) -> bool:
        """Whether the tokenizer itself is in memory (using it would not load it)."""
        return self._tokenizer is not None

    @cached_property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def render_chat(
        self, messages: list[dict], tools: list | None = None, chat_template_kwargs: dict | None = None
    ) -> str:
        """The text vLLM renders for a chat request: tools as sent (None when absent),
        documents None, add_generation_prompt True, then the request's chat_template_kwargs,
        which vLLM lets replace any of those and add variables of their own."""
        if self.chat_template is None:
            raise ValueError(f"tokenizer {self.name} has no chat template; pass --chat-template")
        options = {"tools": tools, "documents": None, "add_generation_prompt": True, **(chat_template_kwargs or {})}
        return self.chat_template.render(messages, **options)

    def encode_chat(
        self, messages: list[dict], tools: list | None = None, chat_template_kwargs: dict | None = None
    ) -> list[int]:
        text = self.render_chat(messages, tools, chat_template_kwargs)
        return self.tokenizer.encode(text, add_special_tokens=CHAT_ADD_SPECIAL_TOKENS).ids

    def encode_text(self, text: str) -> list[int]:
        """A completions prompt: the tokenizer adds its own special tokens (BOS), as vLLM does."""
        return self.tokenizer.encode(text, add_special_tokens=TEXT_ADD_SPECIAL_TOKENS).ids

    def count_chat(
        self, messages: list[dict], tools: list | None = None, chat_template_kwargs: dict | None = None
    ) -> int:
        return len(self.encode_chat(messages, tools, chat_template_kwargs))

    def count_text(self, text: str) -> int:
        return len(self.encode_text(text))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

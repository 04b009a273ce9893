"""A tokenizer's set-up (safe vocabulary + frames) kept on disk, so that a process's second
start costs milliseconds, not the CPU the build takes (a second or more for a real tokenizer,
long enough on a loaded machine for a worker to miss Locust heartbeats).

The set-up is a pure function of its inputs, and the key names all of them: the tokenizer
and template fingerprint (sha256 of tokenizer.json's bytes and of the template source), the
special tokens the template is rendered with, the api, the versions of `tokenizers`, jinja2
and Python, and a digest of the source of every replay module that computes it (so changing how
the vocabulary or the frames are built, how a prompt is encoded or what an API's frame is never
reads an older result). Those modules are found, not listed: the imports of the set-up's entry
points (SETUP_ENTRIES), followed through every replay module they import, read from the sources
(replay/source_graph.py). FORMAT is the file layout.

A file is one header line (JSON: format, key, the body's length and sha256) and the body
(JSON of `Measured`). Nothing read is trusted blindly; before use:

- the header's key must equal this process's key (not only its file name);
- the body must have the header's length and sha256 (a truncated or damaged file fails);
- the vocabulary must be well formed (as many texts as ids, distinct ids, each text a space
  + ASCII letters, lead ids for the first lead_count words, frames of ints);
- a spot check against this host's tokenizer.json: SPOT_CHECKS words spread over the
  vocabulary must be in its vocab under the cached ids (the marker + word for a word, and
  the bare or marked word for its lead id).

On a miss, a real tokenizer's set-up is built in a child process (setup_child.py), whose
result is checked as an entry read from disk is. Anything off, or a cache folder that cannot
be read or written, logs one line and the set-up is built as without a cache: a run never
fails, and prompts are never inexact, because of it.
Writes go to a temporary file in the folder, renamed over the entry (atomic on POSIX), so
workers starting together on one host never read half a file.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import platform
import re
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path

import jinja2
import orjson

from replay import source_graph
from replay.rules.tokens import are_token_ids
from replay.synth import setup_child
from replay.synth.frames import Frame, Measured
from replay.synth.tokenizer import ServerTokenizer, fingerprint_of, tokenizer_json
from replay.synth.vocab import SPACE_MARKERS, SafeVocab

FORMAT = 2
ENV = "TRACEREPLAY_CACHE_DIR"
SPOT_CHECKS = 8  # each a look through tokenizer.json's bytes
TEXTS = re.compile(r" [A-Za-z]+(?:\0 [A-Za-z]+)*")  # the vocabulary's texts joined by NULs: each a space + ASCII letters
# Where the cached value is computed: the safe vocabulary (vocab), the frames (frames), the child
# that builds and writes them (setup_child_main). Every replay module they
# import, however far down, is in the key's code digest.
SETUP_ENTRIES = ("replay.synth.vocab", "replay.synth.frames", "replay.synth.setup_child_main")
IMPORT_MEMO = "source-imports.json"  # code_digest's memo of each source's imports (source_graph.ImportMemo)
IMPORT_MEMO_ENTRIES = 4096  # at most (a checkout's set-up closure is some 30 sources; each checkout keeps its own)

log = logging.getLogger(__name__)
_in_process: dict[tuple, Measured] = {}  # this process's set-ups (cached(): a second one of the same files is free)


class CacheError(ValueError):
    """A cache entry that must not be used (the reason is logged, the set-up rebuilt)."""


def cache_dir() -> Path:
    """$TRACEREPLAY_CACHE_DIR, else $XDG_CACHE_HOME/tracereplay, else ~/.cache/tracereplay."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "tracereplay"
    return Path.home() / ".cache" / "tracereplay"


@cache
def code_digest(root: Path = source_graph.ROOT) -> str:
    """The digest of the source of every module that decides a set-up (the package under `root`;
    its source does not change while this process runs). The modules' imports come from this
    host's memo (IMPORT_MEMO in the cache folder) where their bytes are unchanged: the digest
    reads each source but parses only those edited since."""
    memo = source_graph.ImportMemo(_read_import_memo())
    digest = source_graph.source_digest(SETUP_ENTRIES, root, memo)
    if memo.parsed:
        _write_import_memo(memo.kept(IMPORT_MEMO_ENTRIES))
    return digest


def _read_import_memo() -> dict[str, list[str]]:
    """The memo's entries, or none where it is missing, unreadable or not entirely well formed
    (then every source is parsed: a slower start, never a wrong digest)."""
    try:
        memo = orjson.loads((cache_dir() / IMPORT_MEMO).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return {}
    if not isinstance(memo, dict) or not all(
            isinstance(v, list) and all(isinstance(m, str) for m in v) for v in memo.values()):
        return {}
    return memo


def _write_import_memo(entries: dict[str, list[str]]) -> None:
    """Replace the memo (atomically); a folder that cannot be written only costs the next
    process its parse."""
    try:
        _write_atomically(cache_dir() / IMPORT_MEMO, orjson.dumps(entries))
    except OSError as e:
        log.debug("set-up cache: the import memo cannot be written (%s)", e)


@cache
def _tokenizers_version() -> str:
    """The tokenizers library's version, from its metadata: importing it (to read __version__)
    costs a run whose set-up comes from this cache its time and memory, for nothing else."""
    return importlib.metadata.version("tokenizers")


def cache_key(fingerprint: str, template_specials: dict, api: str) -> dict:
    """Everything the cached set-up depends on."""
    specials = orjson.dumps(template_specials, option=orjson.OPT_SORT_KEYS)
    return {
        "format": FORMAT,
        "fingerprint": fingerprint,
        "template_special_tokens": hashlib.sha256(specials).hexdigest(),
        "api": api,
        "tokenizers": _tokenizers_version(),
        "jinja2": jinja2.__version__,
        "python": ".".join(platform.python_version_tuple()[:2]),
        "code": code_digest(),
    }


def entry_path(key: dict) -> Path:
    name = hashlib.sha256(orjson.dumps(key, option=orjson.OPT_SORT_KEYS)).hexdigest()[:32]
    return cache_dir() / f"setup-v{FORMAT}-{name}.json"


def key_of(tokenizer: ServerTokenizer, data: bytes, api: str) -> dict:
    template = tokenizer.chat_template
    return cache_key(fingerprint_of(data, template), template.special_tokens if template else {}, api)


def cached(tokenizer: ServerTokenizer, api: str, build: Callable[[], Measured]) -> tuple[Measured, bool]:
    """(the set-up, True) from a verified cache entry, else (build(), False), saved for next time.
    Kept in memory too, for this process's next set-up of the same files.

    A tokenizer made without a path (not by ServerTokenizer.load) has no file to key on and
    is always built."""
    if tokenizer.path is None:
        return build(), False
    file = tokenizer_json(tokenizer.path)
    stat = file.stat()
    template = tokenizer.chat_template
    here = (str(cache_dir()), str(file.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns, api,
            template.sha256 if template else None, repr(sorted(template.special_tokens.items())) if template else None)
    if here in _in_process:  # a second set-up in this process (a single process's master check, then its worker)
        return _in_process[here], True
    measured, from_cache = _cached(tokenizer, file.read_bytes(), api, build)
    _in_process[here] = measured
    return measured, from_cache


def forget() -> None:
    """Drop this process's set-ups, so the next one reads the disk cache (tests of that cache)."""
    _in_process.clear()


def _cached(tokenizer: ServerTokenizer, data: bytes, api: str, build: Callable[[], Measured]) -> tuple[Measured, bool]:
    key = key_of(tokenizer, data, api)
    path = entry_path(key)
    problem = None  # why the entry was not used (None: there was none), for the one log line
    try:
        measured = read_entry(path, key, data)
        log.debug("set-up of %s (%s) read from %s", tokenizer.name, api, path)
        return measured, True
    except (FileNotFoundError, NotADirectoryError):
        pass
    except (OSError, CacheError) as e:
        problem = f"not used ({e})"
    measured = _built_in_child(tokenizer, api, key, data) or build()
    try:
        write_entry(path, key, measured)
    except OSError as e:
        problem = f"{problem + ', and ' if problem else ''}cannot be written ({e})"
    if problem:
        log.warning("set-up cache %s %s; the set-up was built instead", path, problem)
    else:
        log.info("set-up of %s (%s) saved to %s", tokenizer.name, api, path)
    return measured, False


def _built_in_child(tokenizer: ServerTokenizer, api: str, key: dict, data: bytes) -> Measured | None:
    """The set-up a child process built (setup_child.py), checked as an entry read from disk is,
    against this key and these tokenizer.json bytes; None to build it here."""
    raw = setup_child.run_child(tokenizer, api)
    if raw is None:
        return None
    try:
        return decode_entry(raw, key, data)
    except CacheError as e:
        log.warning("set-up of %s (%s): the child process's result is not usable (%s); building it here",
                    tokenizer.name, api, e)
        return None


def loaded_before(fingerprint: str, template_specials: dict, api: str) -> bool:
    """Whether this host has a cache entry's header for this key: the tokenizer loaded here
    with this `tokenizers` version, so a master's preflight need not load it again to know."""
    key = cache_key(fingerprint, template_specials, api)
    try:
        with open(entry_path(key), "rb") as f:
            return orjson.loads(f.readline()).get("key") == key
    except (OSError, ValueError, AttributeError):
        return False


# -- the file ---------------------------------------------------------------------------------


def _frame_json(frame: Frame | None) -> list | None:
    return None if frame is None else [list(frame.before), list(frame.after), list(frame.empty_ids)]


def encode_entry(key: dict, measured: Measured) -> bytes:
    vocab = measured.vocab
    body = orjson.dumps({
        "ids": list(vocab.ids), "texts": list(vocab.texts), "lead_ids": list(vocab.lead_ids),
        "lead_count": vocab.lead_count, "frame": _frame_json(measured.frame),
        "short_frame": _frame_json(measured.short_frame), "frame_error": measured.frame_error,
        "empty_text_ids": list(measured.empty_text_ids),
    })
    header = {"format": FORMAT, "key": key, "length": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    return orjson.dumps(header) + b"\n" + body


def write_entry(path: Path, key: dict, measured: Measured) -> None:
    _write_atomically(path, encode_entry(key, measured))


def _write_atomically(path: Path, data: bytes) -> None:
    """A temporary file in the same folder, renamed over `path`: a reader never sees half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_entry(path: Path, key: dict, tokenizer_bytes: bytes) -> Measured:
    """The entry at `path`, verified (see the module's docstring); CacheError says what is off."""
    return decode_entry(path.read_bytes(), key, tokenizer_bytes)


def decode_entry(raw: bytes, key: dict, tokenizer_bytes: bytes) -> Measured:
    """An entry's bytes (a file's, or what a set-up child wrote), verified as read_entry does."""
    head, sep, body = raw.partition(b"\n")
    try:
        header = orjson.loads(head)
    except orjson.JSONDecodeError:
        raise CacheError("unreadable header") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CacheError(f"format {header.get('format') if isinstance(header, dict) else '?'}, expected {FORMAT}")
    if header.get("key") != key:
        raise CacheError("written for another tokenizer, template, api or version")
    if not sep or len(body) != header.get("length") or hashlib.sha256(body).hexdigest() != header.get("sha256"):
        raise CacheError("damaged or truncated (length or sha256 differs from its header)")
    try:
        measured = _measured(orjson.loads(body))
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise CacheError(f"malformed: {e}") from None
    spot_check(measured.vocab, tokenizer_bytes)
    return measured


def _ints(value, what: str) -> tuple[int, ...]:
    if not are_token_ids(value):
        raise ValueError(f"{what} is not a list of token ids")
    return tuple(value)


def _frame(value, what: str) -> Frame | None:
    if value is None:
        return None
    before, after, empty = value
    return Frame(_ints(before, what), _ints(after, what), _ints(empty, what))


def _measured(body: dict) -> Measured:
    ids, lead_ids = _ints(body["ids"], "ids"), _ints(body["lead_ids"], "lead_ids")
    texts, lead_count = body["texts"], body["lead_count"]
    if not isinstance(texts, list) or len(texts) != len(ids) or len(set(ids)) != len(ids):
        raise ValueError("ids and texts do not pair up")
    try:
        joined = "\0".join(texts)  # a text that is not a str fails here
    except TypeError:
        joined = ""
    if not TEXTS.fullmatch(joined):
        raise ValueError("a text is not a space + ASCII letters")
    if type(lead_count) is not int or not 0 < lead_count <= len(ids) or len(lead_ids) != lead_count:
        raise ValueError("bad lead ids")
    frame = _frame(body["frame"], "frame")
    if frame is None:
        raise ValueError("no frame")
    error = body["frame_error"]
    if error is not None and not isinstance(error, str):
        raise ValueError("bad frame_error")
    vocab = SafeVocab(ids=ids, texts=tuple(texts), lead_ids=lead_ids, lead_count=lead_count)
    return Measured(vocab, frame, _frame(body["short_frame"], "short_frame"), error,
                    _ints(body["empty_text_ids"], "empty_text_ids"))


def _in_vocab(data: bytes, tokens: list[str], token_id: int) -> bool:
    """Whether tokenizer.json's vocab maps one of `tokens` to `token_id`: `"token": id` with
    or without a space, the id not followed by another digit (words are ASCII letters, the
    markers are written unescaped, as `tokenizers` writes them)."""
    digits = str(token_id).encode()
    for token in tokens:
        for sep in (b'":', b'": '):
            needle = b'"' + token.encode() + sep + digits
            at = data.find(needle)
            if at >= 0 and not data[at + len(needle): at + len(needle) + 1].isdigit():
                return True
    return False


def _unigram_pieces(data: bytes) -> list | None:
    """A Unigram model's vocabulary, [[piece, score], ...] whose position is the id (T5, ALBERT,
    XLNet write it so, with no `"piece": id` for _in_vocab to find); None for another model."""
    if b'"Unigram"' not in data:
        return None
    try:
        model = orjson.loads(data).get("model") or {}
    except (orjson.JSONDecodeError, AttributeError):
        return None
    vocab = model.get("vocab") if model.get("type") == "Unigram" else None
    return vocab if isinstance(vocab, list) else None


def spot_check(vocab: SafeVocab, tokenizer_bytes: bytes) -> None:
    """SPOT_CHECKS words spread over the cached vocabulary are this tokenizer.json's tokens
    under the cached ids (a look at the file, much cheaper than loading the tokenizer)."""
    count = len(vocab)
    pieces = _unigram_pieces(tokenizer_bytes)
    if pieces is not None:
        def has(tokens: list[str], token_id: int) -> bool:
            entry = pieces[token_id] if 0 <= token_id < len(pieces) else None
            return isinstance(entry, list) and bool(entry) and entry[0] in tokens
    else:
        def has(tokens: list[str], token_id: int) -> bool:
            return _in_vocab(tokenizer_bytes, tokens, token_id)
    for k in range(SPOT_CHECKS):
        i = k * (count - 1) // max(1, SPOT_CHECKS - 1)
        word = vocab.texts[i][1:]
        if not has([m + word for m in SPACE_MARKERS], vocab.ids[i]):
            raise CacheError(f"spot check: {vocab.texts[i]!r} is not token {vocab.ids[i]} of this tokenizer.json")
        if i < vocab.lead_count and not has([word, *(m + word for m in SPACE_MARKERS)], vocab.lead_ids[i]):
            raise CacheError(f"spot check: {word!r} is not token {vocab.lead_ids[i]} of this tokenizer.json")

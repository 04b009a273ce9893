"""What `--tokenizer` names, resolved to a path on this host: a local path, else a Hugging Face id.

Users name tokenizers as they name models, `ORG/NAME` (`Qwen/Qwen2.5-7B-Instruct`), and the
host that serves the model already holds its tokenizer in the Hugging Face cache. So a value
that is not a path on this host and reads as `ORG/NAME[@REVISION]` is looked up in that cache,
laid out as huggingface_hub writes it:

    $HF_HUB_CACHE, else $HF_HOME/hub, else ${XDG_CACHE_HOME:-~/.cache}/huggingface/hub
      models--ORG--NAME/refs/<ref>                a file holding a commit hash (`main` by default)
      models--ORG--NAME/snapshots/<commit>/...    the files, usually symlinks into blobs/

The lookup reads files only, never the network: a run must not wait on, nor change with, the
hub. Where the tokenizer is absent, the one-line error says where it looked and the command
that fetches it. The snapshot's files are read through their symlinks, so the fingerprint of a
cached tokenizer is the same as of a copy of the same bytes anywhere else.

Each process resolves `--tokenizer` once where it starts using it (the master's preflight, a
worker's set-up, `replay report`, `replay synth check`, `replay sim`) and hands the path on; the
run's options keep the value as given, so each worker resolves an id in its own host's cache.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["TOKENIZER_HELP", "TokenizerNotFound", "hub_cache_dir", "parse_hub_id", "resolve_tokenizer"]

TOKENIZER_HELP = ("tokenizer.json or a folder holding it (and tokenizer_config.json), or a Hugging Face id "
                  "ORG/NAME[@REVISION] read from this host's Hugging Face cache (never downloaded)")
DEFAULT_REF = "main"
MIN_HASH_PREFIX = 7  # hex digits of a commit named by its prefix, as git and the hub's pages show it
# huggingface_hub's repo id rule: letters, digits, '-', '_', '.', no leading '-' or '.'
_NAME = r"[A-Za-z0-9_][A-Za-z0-9_.-]*"
_HUB_ID = re.compile(rf"^(?P<org>{_NAME})/(?P<name>{_NAME})(?:@(?P<revision>[A-Za-z0-9_./-]+))?$")
_HEX = re.compile(r"^[0-9a-f]+$")


class TokenizerNotFound(FileNotFoundError):
    """--tokenizer names nothing on this host; the message is one line saying where it looked."""


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache folder, by huggingface_hub's own rule (its `constants`):
    HF_HUB_CACHE (or the older HUGGINGFACE_HUB_CACHE), else HF_HOME/hub, else
    XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    home = os.environ.get("HF_HOME")
    if not home:
        home = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                            "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def parse_hub_id(value: str) -> tuple[str, str | None] | None:
    """(repo id `ORG/NAME`, revision or None) when `value` reads as a Hugging Face model id,
    else None. A bare NAME is never an id here (it is a path: write the org, e.g.
    openai-community/gpt2), nor is anything with '..' in a part."""
    m = _HUB_ID.match(value)
    if m is None or ".." in value or "--" in m["org"] + m["name"]:
        return None
    revision = m["revision"]
    if revision is not None and any(part in ("", ".") for part in revision.split("/")):
        return None
    return f"{m['org']}/{m['name']}", revision


def resolve_tokenizer(value: str | os.PathLike) -> Path:
    """The path `--tokenizer value` means on this host: the path itself when it exists (a local
    path wins over an id), else the snapshot folder of a Hugging Face id in this host's cache.
    Raises TokenizerNotFound (one line) when it is neither."""
    text = str(value)
    path = Path(text).expanduser()
    if path.exists():
        return path
    hub = parse_hub_id(text)
    if hub is None:
        raise TokenizerNotFound(f"tokenizer not found: {text}")
    return _snapshot(text, *hub)


def _snapshot(value: str, repo_id: str, revision: str | None) -> Path:
    cache = hub_cache_dir()
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    ref = revision or DEFAULT_REF
    commit, looked = _commit(repo, ref)
    held = ""
    if commit is None:
        held = _held(repo)
    else:
        folder = repo / "snapshots" / commit
        if (folder / "tokenizer.json").is_file():
            return folder
        looked = folder / "tokenizer.json"
    fetch = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "") + \
        " --include 'tokenizer*' --include '*chat_template*'"
    raise TokenizerNotFound(f"tokenizer not found: {value} is not a path here nor in the Hugging Face cache "
                            f"(looked for {looked}{held}); fetch it with: {fetch}")


def _commit(repo: Path, ref: str) -> tuple[str | None, Path]:
    """(the commit `ref` names in `repo`, or None; the path looked at last): refs/REF's hash
    (a branch or tag), else a snapshot folder named REF (a full hash), else the one snapshot
    whose name starts with REF (a hash prefix of MIN_HASH_PREFIX digits or more)."""
    ref_file = repo / "refs" / ref
    if ref_file.is_file():
        return ref_file.read_text().strip(), ref_file
    snapshots = repo / "snapshots"
    if (snapshots / ref).is_dir():
        return ref, snapshots / ref
    if len(ref) >= MIN_HASH_PREFIX and _HEX.match(ref) and snapshots.is_dir():
        matches = [p.name for p in snapshots.iterdir() if p.name.startswith(ref)]
        if len(matches) == 1:
            return matches[0], snapshots / matches[0]
    return None, ref_file


def _held(repo: Path) -> str:
    """What the cache holds of the repo when not the revision asked for: a hint to name one."""
    snapshots = repo / "snapshots"
    held = sorted(p.name[:MIN_HASH_PREFIX] for p in snapshots.iterdir()) if snapshots.is_dir() else []
    if not held:
        return ""
    refs = repo / "refs"
    names = sorted(str(p.relative_to(refs)) for p in refs.rglob("*") if p.is_file()) if refs.is_dir() else []
    return f"; it holds refs: {', '.join(names) or 'none'}; snapshots: {', '.join(held)}"

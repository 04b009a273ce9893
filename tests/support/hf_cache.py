"""A Hugging Face hub cache laid out by hand, as huggingface_hub writes it: each file once in
blobs/ (named by its hash), each revision a snapshots/<commit>/ folder of symlinks into blobs/,
and refs/<name> files holding a commit hash."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_revision(hub: Path, repo_id: str, files: Path, commit: str, refs: tuple[str, ...] = ()) -> Path:
    """Put the files of folder `files` in `hub` as revision `commit` of model `repo_id`, named
    also by each of `refs`; returns the snapshot folder."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in sorted(files.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot

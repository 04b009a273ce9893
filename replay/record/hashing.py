"""Hash ids of a prompt's token blocks, as a server's prefix cache sees them, keyed with a salt.

A block's digest chains the previous block's, so two prompts share hash id k only if their
token ids agree up to the end of block k (the last block may be partial: it then shares its id
only with a prompt that ends at the same token). The digests are keyed with a secret salt, so
a recorded trace cannot be matched against prompts guessed by someone without it, and
renumbered to small integers in order of first use, as Bailian's published traces are: the
ids reveal which requests shared which prefix, nothing about the tokens.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from array import array
from pathlib import Path

SALT_BYTES = 32
DIGEST_BYTES = 16  # 128 bits: no two blocks of a recording meet by chance


def read_salt(path: str | Path | None) -> bytes:
    """The salt: the file's bytes (at least 16, at most 64: blake2b's key), or a fresh random one."""
    if path is None:
        return secrets.token_bytes(SALT_BYTES)
    try:
        salt = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"--salt-file {path}: {e.strerror or e}") from None
    if not 16 <= len(salt) <= 64:
        raise ValueError(f"--salt-file {path}: holds {len(salt)} bytes; give 16 to 64 (e.g. head -c 32 /dev/urandom)")
    return salt


def write_salt(path: str | Path) -> None:
    """A new salt file, readable by its owner only (`replay record --salt-file` reuses it)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(SALT_BYTES))


class BlockHasher:
    """Salted chained block digests, renumbered in order of first use. The table of digests grows
    with the distinct blocks seen (16 bytes and one int each)."""

    def __init__(self, salt: bytes, block_size: int):
        self.salt = salt
        self.block_size = block_size
        self.ids: dict[bytes, int] = {}

    def hash_ids(self, token_ids: list[int]) -> list[int]:
        out = []
        previous = b""
        size = self.block_size
        for start in range(0, len(token_ids), size):
            block = array("q", token_ids[start:start + size]).tobytes()
            previous = hashlib.blake2b(previous + block, key=self.salt, digest_size=DIGEST_BYTES).digest()
            out.append(self.ids.setdefault(previous, len(self.ids)))
        return out

    def digest(self, data: bytes) -> bytes:
        """A salted digest of anything (a session key, a conversation so far): no text kept."""
        return hashlib.blake2b(data, key=self.salt, digest_size=DIGEST_BYTES).digest()

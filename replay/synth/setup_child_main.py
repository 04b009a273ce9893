"""The child process of a cold set-up (setup_child.py starts it): load the tokenizer, build the
safe vocabulary and the frames, and write them as a set-up cache entry (setup_cache's format,
under the key this process computes from what it loaded) to the file it is given. It imports
only what the set-up needs, so the tokenizer's memory lives and dies here.
"""

from __future__ import annotations

import sys
from pathlib import Path

from replay.protocol.table import get_api
from replay.synth import setup_cache
from replay.synth.frames import measure
from replay.synth.tokenizer import ServerTokenizer, tokenizer_json
from replay.synth.vocab import build_safe_vocab


def main(argv: list[str]) -> int:
    """Build the set-up of TOKENIZER (with TEMPLATE, "" for its own) for API and write it to OUT."""
    tokenizer_path, template, api, out = argv
    tokenizer = ServerTokenizer.load(tokenizer_path, template or None, compiled=get_api(api).chat)
    measured = measure(tokenizer, api, build_safe_vocab(tokenizer.tokenizer, tokenizer.name))
    key = setup_cache.key_of(tokenizer, tokenizer_json(tokenizer_path).read_bytes(), api)
    Path(out).write_bytes(setup_cache.encode_entry(key, measured))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

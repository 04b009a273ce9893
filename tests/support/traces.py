"""Trace files and rows built by hand, damaged gzip files, and slices of ../shared's trace."""

from __future__ import annotations

import gzip
import json
import math
import random
import subprocess
import sys
import zlib
from pathlib import Path

from support.paths import shared_path

BLOCK = 16  # the block size of the hand-built traces and of the tests' sims


def mooncake_trace(path: Path, rows: int, gap_ms: float, output_length=(4, 12), seed: int = 0) -> Path:
    """Mooncake rows whose hash ids share prefixes (two families of common prefixes)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(rows):
            shared = [0, 1, 2] if i % 2 == 0 else [7, 8]
            hashes = shared + [1000 + 10 * i + k for k in range(rng.randint(0, 2))]
            input_length = len(hashes) * BLOCK - rng.randint(0, BLOCK - 1)
            row = {"timestamp": round(i * gap_ms, 3), "input_length": input_length,
                   "output_length": rng.randint(*output_length), "hash_ids": hashes}
            f.write(json.dumps(row) + "\n")
    return path


def mooncake_slice(out_dir: Path, rows: int, block: int, time_scale: float, max_output: int | None = None) -> Path:
    """The first `rows` rows of ../shared's Mooncake trace, rescaled to `block`-token blocks and
    sped up `time_scale` times (`replay trace convert`), for runs against real vLLM. `max_output`
    caps output lengths: vLLM on CPU spends a run's time decoding, and an exact output count is
    as exact at 32 tokens as at 700."""
    source = shared_path("traces", "mooncake_synthetic_trace.jsonl")
    out = out_dir / f"mooncake-{rows}-b{block}.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "replay", "trace", "convert", str(source), str(out), "--max-rows", str(rows),
         "--block-size-to", str(block), "--time-scale", str(time_scale)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    if max_output is not None:
        rows_out = [json.loads(line) for line in out.read_text().splitlines()]
        write_jsonl(out, [{**r, "output_length": min(r["output_length"], max_output)} for r in rows_out])
    return out


def trace_ids(trace: Path) -> set[int]:
    """The request ids of a trace's rows (0, 1, ... in file order)."""
    return set(range(sum(1 for line in open(trace) if line.strip())))


def bailian_trace(path: Path, sessions: int = 8, turns: int = 3, gap_s: float = 0.1, blocks_per_turn: int = 2) -> Path:
    """Bailian rows: follow-up turns reference their parent chat and extend its hash ids by
    `blocks_per_turn` blocks."""
    rows = []
    chat = 0
    for s in range(sessions):
        parent, hashes = -1, []
        for turn in range(1, turns + 1):
            hashes = hashes + [10_000 * (s + 1) + 100 * turn + k for k in range(blocks_per_turn)]
            rows.append({"chat_id": chat, "parent_chat_id": parent, "timestamp": round((s + turn * sessions) * gap_s, 3),
                         "input_length": len(hashes) * 16 - 3, "output_length": 4, "type": "text", "turn": turn,
                         "hash_ids": hashes})
            parent, chat = chat, chat + 1
    rows.sort(key=lambda r: r["timestamp"])
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def write_jsonl(path: Path, records: list, gz: bool = False) -> Path:
    """Rows (dicts, or lines as they are) one a line, gzipped when `gz`."""
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def mooncake_rows(n=5, block=512):
    rows = []
    for i in range(n):
        length = 700 + 300 * i
        rows.append(
            {
                "timestamp": 250 * i,
                "input_length": length,
                "output_length": 10 + i,
                "hash_ids": [0] + [100 * i + k for k in range(1, math.ceil(length / block))],
            }
        )
    return rows


def bailian_rows():
    """Two conversations, one three turns deep, parents before children, interleaved."""
    def row(chat, parent, t, length, turn):
        return {
            "chat_id": chat, "parent_chat_id": parent, "timestamp": t, "input_length": length,
            "output_length": 7, "type": "text", "turn": turn,
            "hash_ids": list(range(chat * 1000, chat * 1000 + math.ceil(length / 16))),
        }
    return [
        row(10, -1, 0.0, 40, 1),
        row(20, -1, 0.5, 16, 1),
        row(11, 10, 1.25, 90, 2),
        row(21, 20, 2.0, 33, 2),
        row(12, 11, 3.5, 170, 3),
    ]


GZIP_DAMAGES = ["truncated", "crc", "magic-then-garbage", "header-then-garbage", "magic-only"]


def gzipped_rows(rows: int = 2000) -> bytes:
    """A gzipped mooncake trace, long enough that a cut lands far into the file."""
    text = "".join(json.dumps({"timestamp": i, "input_length": 10, "output_length": 1}) + "\n" for i in range(rows))
    return gzip.compress(text.encode())


def damaged_gzip(tmp_path, damage, data=None, name="damaged.jsonl.gz"):
    """(path, line, message): a gzip file with this damage, and what read_trace must say about it.

    The line is worked out with zlib, not with the gzip module the reader uses: one past the
    last whole line that can be decompressed at all.
    """
    data = data if data is not None else gzipped_rows()
    if damage == "truncated":
        body = data[: len(data) // 2]
        whole = zlib.decompressobj(wbits=31).decompress(body).count(b"\n")
        line, message = whole + 1, f"truncated gzip file: ended after line {whole}"
    elif damage == "crc":
        body = bytearray(data)
        body[-8] ^= 0xFF  # the CRC-32 is the 8 bytes before the last 4 (the length)
        line, message = gzip.decompress(data).count(b"\n") + 1, "corrupt gzip data: CRC check failed"
    elif damage == "magic-then-garbage":
        body, line, message = b"\x1f\x8bthis is not gzip\n" * 3, 1, "corrupt gzip data: Unknown compression method"
    elif damage == "header-then-garbage":  # 0xff starts a deflate block of the reserved type 3
        body, line, message = data[:10] + b"\xff" * 64, 1, "corrupt gzip data: Error -3 while decompressing data"
    else:
        body, line, message = b"\x1f\x8b", 1, "truncated gzip file: ended before the first line"
    path = tmp_path / f"{damage}-{name}"
    path.write_bytes(bytes(body))
    return path, line, message


AZURE_HEADER = b"TIMESTAMP,ContextTokens,GeneratedTokens\n"
HUGE = 1_000_000_000


def huge_prompt_trace(tmp_path, fmt):
    """(path, line): a four-row trace of this format whose row on `line` asks for 10^9 prompt
    tokens (bailian without hash ids: with them, 10^9 tokens need 62.5 million ids)."""
    lengths = [10, 20, HUGE, 30]
    if fmt == "azure":
        text = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
            f"2023-11-16 18:15:4{i},{n},1\n" for i, n in enumerate(lengths))
    elif fmt == "burstgpt":
        text = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n" + "".join(
            f"{i},GPT-4,{n},1,{n + 1},API log\n" for i, n in enumerate(lengths))
    else:
        make = {
            "mooncake": lambda i, n: {"timestamp": 100 * i, "input_length": n, "output_length": 1},
            "jsonl": lambda i, n: {"session_id": "s", "delay": 100, "input_length": n, "output_length": 1},
            "bailian": lambda i, n: {"chat_id": i + 1, "parent_chat_id": i or -1, "timestamp": float(i),
                                     "input_length": n, "output_length": 1, "type": "text"},
        }[fmt]
        text = "".join(json.dumps(make(i, n)) + "\n" for i, n in enumerate(lengths))
    path = tmp_path / f"huge-{fmt}.txt"
    path.write_text(text)
    line = lengths.index(HUGE) + (2 if fmt in ("azure", "burstgpt") else 1)
    return path, line


def conversation_trace(path: Path, conversations: int = 12, turns: tuple[int, int] = (1, 4), system_blocks: int = 2,
                       seed: int = 0) -> Path:
    """Mooncake rows of multi-turn conversations, as Mooncake's traces have them: no session
    field; a later turn's hash ids repeat the earlier turn's but its last (partial) block, then
    add 2-3 of its own; every row starts with the same `system_blocks` ids (a shared system
    prompt, ids 0, 1, ...). Rows in time order; conversations overlap."""
    rng = random.Random(seed)
    rows, next_id = [], 100
    for _ in range(conversations):
        time_ms = rng.uniform(0, 2000.0 * conversations)
        carried = list(range(system_blocks))
        for _ in range(rng.randint(*turns)):
            added = list(range(next_id, next_id + rng.randint(2, 3)))
            next_id += len(added)
            ids = carried + added
            rows.append({"timestamp": round(time_ms, 3), "input_length": len(ids) * BLOCK - rng.randint(0, BLOCK - 1),
                         "output_length": rng.randint(1, 20), "hash_ids": ids})
            carried = ids[:-1]
            time_ms += rng.uniform(1000, 5000)
    rows.sort(key=lambda r: r["timestamp"])
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def leading_common(a: list, b: list) -> int:
    """How many leading items two lists share (two prompts' tokens, two rows' hash ids)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def expected_shared(ti, tj, before: int, overhead: int, server_block: int = BLOCK, block: int = BLOCK) -> int:
    """How many leading blocks of `server_block` tokens the server's prompts of trace rows `ti` and
    `tj` (of `block`-token hash ids) share when a template frame moves block boundaries: the
    server's prompts are `before` frame tokens, the rows' contents (their blocks, cut to
    input_length - overhead) and the frame's end; they agree on `before` + the shared content, and
    share the whole blocks of that (all of them when the prompts are the same)."""
    if list(ti.hash_ids) == list(tj.hash_ids) and ti.input_length == tj.input_length:
        return -(-ti.input_length // server_block)
    content = min(leading_common(ti.hash_ids, tj.hash_ids) * block, ti.input_length - overhead,
                  tj.input_length - overhead)
    return (before + content) // server_block

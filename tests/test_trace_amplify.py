"""`replay trace amplify` and `replay trace stats IN OUT`, in-process."""

from __future__ import annotations

import gzip
import json
import random
from collections import Counter, defaultdict
from pathlib import Path

import orjson
import pytest

from replay.cli import main
from replay.trace import amplify, file_array, sessions_on_disk, sorted_spool
from replay.trace.amplify import Clones, amplify_trace
from replay.trace.convert import to_record
from replay.trace.reader import TraceStream
from replay.trace.sessions import find_sessions
from replay.trace.sorted_spool import DEFAULT_CHUNK_ROWS
from replay.trace.stats import inferred_sessions, length_stats, trace_stats
from support.paths import shared_path
from support.traces import BLOCK, bailian_trace, conversation_trace, write_jsonl

SAME = ("input_length", "output_length", "turns_per_session")


def stream_of(path: Path, block: int | None = BLOCK, fmt: str | None = None):
    return lambda: TraceStream(path, fmt, block)


def rows_of(path: Path) -> list[dict]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f]


def stats_of(path: Path, block: int | None = None, min_rows: int = 12) -> dict:
    stats = trace_stats(TraceStream(path, None, block))
    if stats["sessions"] is None:
        stats.update(inferred_sessions(lambda: TraceStream(path, None, block), min_rows))
    return stats


def sessions_trace(path: Path, sessions: int = 10, turns: int = 3) -> Path:
    """jsonl rows with their own session_id; each session's turns extend its ids; id 0 shared by all."""
    rows = []
    for s in range(sessions):
        ids = [0]
        for turn in range(turns):
            ids = ids + [1000 * (s + 1) + 10 * turn, 1000 * (s + 1) + 10 * turn + 1]
            rows.append({"session_id": f"c{s}", "timestamp": 100 * s + 1000 * turn, "input_length": len(ids) * BLOCK,
                         "output_length": 5 + s, "hash_ids": ids, "block_size": BLOCK})
    rows.sort(key=lambda r: r["timestamp"])
    return write_jsonl(path, rows)


@pytest.fixture
def conversations(tmp_path) -> Path:
    return conversation_trace(tmp_path / "conv.jsonl", conversations=40)


def test_integer_factor_keeps_lengths_turns_and_rate_exactly(tmp_path, conversations):
    out = tmp_path / "out.jsonl"
    done = amplify_trace(stream_of(conversations), out, 3)
    before, after = stats_of(conversations, BLOCK), stats_of(out)
    assert after["requests"] == 3 * before["requests"] == done.rows_out
    assert after["sessions"] == 3 * before["sessions"] == 3 * 40
    for key in SAME:
        assert after[key] == before[key], key
    assert after["duration_s"] == pytest.approx(before["duration_s"])  # clones end within IN's span
    assert after["mean_rps"] == pytest.approx(3 * before["mean_rps"])
    assert abs(after["ideal_prefix_hit_ratio"] - before["ideal_prefix_hit_ratio"]) <= 0.02
    times = [r["timestamp"] for r in rows_of(out)]
    assert times == sorted(times)


def test_sessions_inferred_from_hash_ids(conversations):
    """Conversations are found as sessions; the shared system prompt (ids 0, 1) is global.
    With --global-min-rows 2 every id two rows share is global: no row is linked."""
    found = find_sessions(stream_of(conversations), 12)
    assert len(found) == 40 and found.inferred
    assert {0, 1} <= found.global_ids and not found.global_ids - {0, 1}
    rows = sum(1 for _ in open(conversations))
    assert len(find_sessions(stream_of(conversations), 2)) == rows


def test_global_ids_kept_and_clone_ids_disjoint(tmp_path, conversations):
    out = tmp_path / "out.jsonl"
    amplify_trace(stream_of(conversations), out, 3, seed=5)
    source_ids = {h for r in rows_of(conversations) for h in r["hash_ids"]}
    by_clone: dict[str, set] = defaultdict(set)
    for row in rows_of(out):
        name = row["session_id"]
        assert row["hash_ids"][:2] == [0, 1]  # the system prompt, shared by every copy
        by_clone[name].update(row["hash_ids"][2:])
    for name, ids in by_clone.items():
        if "#" in name:
            assert not ids & source_ids, name
        else:
            assert ids <= source_ids, name
    clones = [ids for name, ids in by_clone.items() if "#" in name]
    assert sum(map(len, clones)) == len(set().union(*clones))  # no two clones share a private id


def test_declared_sessions_and_their_global_ids(tmp_path):
    """Bailian chains are sessions; an id two sessions carry is global, the rest are remapped."""
    trace = bailian_trace(tmp_path / "b.jsonl", sessions=6, turns=3)
    found = find_sessions(stream_of(trace, None), 12)
    assert len(found) == 6 and not found.inferred and found.global_ids == set()
    trace = sessions_trace(tmp_path / "s.jsonl")
    found = find_sessions(stream_of(trace, None), 12)
    assert len(found) == 10 and found.global_ids == {0}
    out = tmp_path / "out.jsonl"
    amplify_trace(stream_of(trace, None), out, 2)
    before, after = stats_of(trace), stats_of(out)
    for key in SAME:
        assert after[key] == before[key], key
    assert after["ideal_prefix_hit_ratio"] == pytest.approx(before["ideal_prefix_hit_ratio"], abs=0.02)


def test_fractional_factor_counts(tmp_path):
    trace = sessions_trace(tmp_path / "s.jsonl", sessions=10)
    out = tmp_path / "out.jsonl"
    done = amplify_trace(stream_of(trace, None), out, 1.5, seed=3)
    names = Counter(r["session_id"] for r in rows_of(out))
    assert done.sessions_out == len(names) == 15 and done.rows_out == 45
    assert {f"c{s}" for s in range(10)} <= set(names)  # every session once
    assert sum(1 for n in names if n.endswith("#1")) == 5  # half of them twice
    assert all(turns == 3 for turns in names.values())


def test_factor_below_one_is_a_sample_of_whole_sessions(tmp_path):
    trace = sessions_trace(tmp_path / "s.jsonl", sessions=10)
    out = tmp_path / "out.jsonl"
    amplify_trace(stream_of(trace, None), out, 0.5, seed=1)
    source = {(r["session_id"], r["timestamp"], tuple(r["hash_ids"])) for r in rows_of(trace)}
    written = rows_of(out)
    assert len(written) == 15 and len({r["session_id"] for r in written}) == 5
    assert {(r["session_id"], r["timestamp"], tuple(r["hash_ids"])) for r in written} <= source
    with pytest.raises(ValueError, match="keeps none of the trace's 10 sessions"):
        amplify_trace(stream_of(trace, None), tmp_path / "none.jsonl", 0.01)


def test_same_seed_same_file_and_a_small_sort_chunk_changes_nothing(tmp_path, conversations, monkeypatch):
    first, again, other, chunked = (tmp_path / f"{n}.jsonl" for n in ("first", "again", "other", "chunked"))
    amplify_trace(stream_of(conversations), first, 2.5, seed=7)
    amplify_trace(stream_of(conversations), again, 2.5, seed=7)
    amplify_trace(stream_of(conversations), other, 2.5, seed=8)
    monkeypatch.setattr(sorted_spool, "MAX_OPEN", 3)  # chunks merged in groups first
    amplify_trace(stream_of(conversations), chunked, 2.5, seed=7, chunk_rows=7)
    assert first.read_bytes() == again.read_bytes() == chunked.read_bytes()
    assert first.read_bytes() != other.read_bytes()
    assert not list(tmp_path.glob(".spool-*")) and not list(tmp_path.glob("*.tmp"))


def test_cli_gz_output_and_stats_side_by_side(tmp_path, conversations, capsys):
    out = tmp_path / "out.jsonl.gz"
    assert main(["trace", "amplify", str(conversations), str(out), "--factor", "2", "--block-size", str(BLOCK)]) == 0
    said = capsys.readouterr().out
    assert said.startswith(f"wrote {2 * len(rows_of(conversations))} rows, 80 sessions to {out}"), said
    assert out.read_bytes()[:2] == b"\x1f\x8b"
    assert main(["trace", "stats", str(conversations), str(out), "--block-size", str(BLOCK)]) == 0
    table = capsys.readouterr().out
    assert "40 (inferred)" in table and "x2.000" in table
    for label in ("input len p99", "output len max", "turns/session p50"):
        assert any(line.startswith(label) and line.endswith("same") for line in table.splitlines()), label
    assert main(["trace", "stats", "--json", str(conversations), str(out), "--block-size", str(BLOCK)]) == 0
    both = json.loads(capsys.readouterr().out)
    assert both["second"]["requests"] == 2 * both["first"]["requests"]
    assert both["first"]["sessions_inferred"] and both["second"]["sessions"] == 80


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e9", "abc"])
def test_bad_factor_is_one_line_naming_the_option(tmp_path, conversations, capsys, value):
    with pytest.raises(SystemExit) as exit_:
        main(["trace", "amplify", str(conversations), str(tmp_path / "o.jsonl"), "--factor", value])
    assert exit_.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and "argument --factor" in errors[0], errors
    assert not (tmp_path / "o.jsonl").exists()


def test_a_trace_of_no_rows_is_one_line_naming_it(tmp_path, capsys):
    header_only = tmp_path / "azure.csv"
    header_only.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    assert main(["trace", "amplify", str(header_only), str(tmp_path / "o.jsonl"), "--factor", "2"]) == 1
    assert capsys.readouterr().err.strip() == f"error: {header_only}: no rows to amplify"
    assert not (tmp_path / "o.jsonl").exists()


def test_out_that_is_in_is_refused(tmp_path, conversations, capsys):
    before = conversations.read_bytes()
    assert main(["trace", "amplify", str(conversations), str(conversations), "--factor", "2"]) == 2
    assert capsys.readouterr().err.strip() == (f"replay trace amplify: OUT {conversations}: is IN {conversations}, "
                                               f"which this command reads: choose another OUT")
    assert conversations.read_bytes() == before


@pytest.mark.parametrize("name, fmt, factor", [("mooncake_synthetic_trace.jsonl", None, 3),
                                               ("azure_conv_2023.csv", None, 2)])
def test_shared_traces(tmp_path, name, fmt, factor):
    """The issue's targets on ../shared's real traces: lengths and turns the same, the rate K
    times, the ideal hit ratio within 2 points."""
    trace = shared_path("traces", name)
    out = tmp_path / "out.jsonl"
    amplify_trace(lambda: TraceStream(trace, fmt), out, factor)
    before, after = stats_of(trace), stats_of(out)
    for key in SAME:
        assert after[key] == before[key], key
    assert after["requests"] == factor * before["requests"]
    assert after["mean_rps"] == pytest.approx(factor * before["mean_rps"], rel=0.01)
    if before["ideal_prefix_hit_ratio"] is not None:
        assert abs(after["ideal_prefix_hit_ratio"] - before["ideal_prefix_hit_ratio"]) <= 0.02


def in_memory_amplify(stream_of, factor: float, seed: int, min_rows: int) -> bytes:
    """OUT as amplify wrote it before it found sessions on disk: find_sessions and Clones in
    memory, every copy sorted in memory by (timestamp, copy x rows + row)."""
    sessions = find_sessions(stream_of, min_rows)
    clones = Clones(sessions, factor, seed)
    rows, lines = len(sessions.row_session), []
    stream = stream_of()
    for position, row in enumerate(stream):
        ids, start = row.hash_ids, row.timestamp_s
        for copy in range(clones.count(position)):
            row.session_id, row.hash_ids, shift = clones.copy(position, copy, ids)
            record = to_record(row, start + shift, row.input_length, stream.block_size)
            lines.append((record["timestamp"], copy * rows + position, orjson.dumps(record) + b"\n"))
    lines.sort()
    return b"".join(line for _, _, line in lines)


def mixed_trace(path: Path, rows: int, seed: int = 0) -> Path:
    """jsonl rows out of time order, some with a session_id and some without, carrying ids shared
    by 1 to 30 rows (within and across sessions, named and not), some ids at and above 2^63."""
    rng = random.Random(seed)
    base = (1 << 63) - rows // 2
    records = []
    for i in range(rows):
        ids = [base + rng.choice((0, 1, 2))] if rng.random() < 0.3 else []
        ids += [base + 3 + rng.randrange(rows // (1 + rng.choice((0, 1, 4, 15)))) for _ in range(rng.randint(0, 4))]
        ids.append(base + rows + i)  # an id of its own
        record = {"timestamp": round(rng.uniform(0, 600_000), 3), "input_length": len(ids) * BLOCK,
                  "output_length": rng.randint(1, 50), "hash_ids": ids, "block_size": BLOCK}
        if rng.random() < 0.2:
            record["session_id"] = f"u{rng.randrange(rows // 10)}"
        records.append(record)
    return write_jsonl(path, records)


def rerooted_bailian(path: Path) -> Path:
    """Bailian rows whose chains are read before their roots: TraceStream.sessions re-roots them."""
    rows = []
    for s in range(30):
        chain = [1000 * s + k for k in range(4)]  # chain[k]'s parent is chain[k + 1], the last is the root
        for k, chat in enumerate(chain):
            parent = chain[k + 1] if k + 1 < len(chain) else -1
            rows.append({"chat_id": chat, "parent_chat_id": parent, "timestamp": s + k, "input_length": 3 * 16,
                         "output_length": 4, "hash_ids": [7, 100 * s + k, 100 * s + k + 1]})
    return write_jsonl(path, rows)


@pytest.mark.parametrize("trace, factor, seed, min_rows", [
    ("mooncake", 3, 0, 12), ("mooncake", 2.5, 4, 4), ("azure", 1.5, 1, 12), ("conversations", 0.5, 2, 2),
    ("mixed", 2.5, 3, 12), ("mixed", 3, 5, 3), ("bailian", 2, 0, 12), ("rerooted", 2.5, 6, 12)])
def test_same_bytes_as_sessions_found_in_memory(tmp_path, conversations, monkeypatch, trace, factor, seed, min_rows):
    """Sessions found on disk give OUT byte for byte what find_sessions in memory gave; the
    mixed trace with every chunk, buffer and trim interval far smaller than it, so that each
    spills, merges in groups and wraps (the sort of starts included: its rows are out of order)."""
    paths = {"mooncake": shared_path("traces", "mooncake_synthetic_trace.jsonl"),
             "azure": shared_path("traces", "azure_conv_2023.csv"), "conversations": conversations,
             "bailian": bailian_trace(tmp_path / "b.jsonl", sessions=20, turns=4),
             "rerooted": rerooted_bailian(tmp_path / "r.jsonl")}
    chunk_rows = DEFAULT_CHUNK_ROWS
    if trace == "mixed":
        paths["mixed"] = mixed_trace(tmp_path / "mixed.jsonl", 3000, seed)
        chunk_rows = 97
        monkeypatch.setattr(sorted_spool, "MAX_OPEN", 4)
        monkeypatch.setattr(file_array, "_FLUSH_ITEMS", 13)
        monkeypatch.setattr(sessions_on_disk, "TRIM_EVERY", 64)
        monkeypatch.setattr(amplify, "TRIM_EVERY", 64)
    stream = stream_of(paths[trace], BLOCK if trace == "conversations" else None)
    out = tmp_path / "out.jsonl"
    amplify_trace(stream, out, factor, seed, min_rows, chunk_rows=chunk_rows)
    assert out.read_bytes() == in_memory_amplify(stream, factor, seed, min_rows)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    if trace == "rerooted":  # the case it is there for: a second reading, knowing the re-rooted rows
        read = stream()
        assert list(read) and read.sessions


def test_stats_turns_found_on_disk_are_find_sessions_turns(tmp_path):
    trace = mixed_trace(tmp_path / "mixed.jsonl", 1500)
    stream = stream_of(trace, None)
    for min_rows in (2, 12):
        found = find_sessions(stream, min_rows)
        assert inferred_sessions(stream, min_rows) == {
            "sessions": len(found), "turns_per_session": length_stats(found.turns()), "sessions_inferred": True}


def test_interrupted_or_failed_amplify_leaves_nothing(tmp_path, conversations, monkeypatch):
    """^C while the copies are written, or IN that cannot be read: no OUT, no OUT.tmp, no
    temporary folder; IN's own error is raised as it is (not as a failure to write OUT)."""
    calls = 0

    def interrupted(*args):
        nonlocal calls
        calls += 1
        if calls > 50:
            raise KeyboardInterrupt
        return to_record(*args)

    monkeypatch.setattr(amplify, "to_record", interrupted)
    out = tmp_path / "out" / "o.jsonl"
    out.parent.mkdir()
    with pytest.raises(KeyboardInterrupt):
        amplify_trace(stream_of(conversations), out, 3)
    assert list(out.parent.iterdir()) == []
    with pytest.raises(FileNotFoundError):
        amplify_trace(stream_of(tmp_path / "absent.jsonl"), out, 3)
    assert list(out.parent.iterdir()) == []

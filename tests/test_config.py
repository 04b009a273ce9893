"""`--replay-config FILE.yaml`: keys, types, errors that name the key, flags winning, and the
shipped configs/ (each loads, its trace validates, one runs end to end against `replay sim`).

The configs name paths under data/ (what docker-compose mounts). The tests run in a scratch
directory whose data/ holds the real traces of ../shared (linked) and a generated bailian
trace, so the files are checked exactly as shipped, with no rewriting.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from replay.engine.options import LOCAL_OPTION_NAMES, ReplayOptions, add_arguments
from replay.run.config import ConfigError, apply_config, config_keys, load_config, replay_options
from replay.sim.process import sim_process
from support.paths import shared_path
from support.processes import run_replay
from support.records import check_records
from support.traces import bailian_trace

REPO = Path(__file__).resolve().parent.parent
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
BLOCK = 16


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parsed = parser.parse_args(argv)
    apply_config(parsed, argv)
    return parsed


def test_every_option_is_a_key():
    keys = config_keys()
    shipped = set(ReplayOptions.__dataclass_fields__)
    assert not shipped & set(LOCAL_OPTION_NAMES)  # the web UI's password stays on the master
    assert set(keys) == {name.replace("_", "-") for name in shipped | set(LOCAL_OPTION_NAMES)}
    assert keys["web-user"].kind == "str"
    assert keys["no-ignore-eos"].kind == "bool" and keys["stream"].kind == "bool"
    assert keys["header"].kind == "list" and keys["scale"].kind == "float" and keys["routing"].choices


def test_values_become_what_the_flags_would_give(tmp_path):
    path = write(tmp_path, "trace: t.jsonl\nblock_size: 16\nscale: 2\nstream: false\nno-ignore-eos: true\n"
                           "endpoints: [http://a:8000, http://b:8000]\nheader: 'Authorization: Bearer $K'\n"
                           "routing: session\nweb-user: admin:$WEB_PW\n")
    assert load_config(path) == {
        "trace": "t.jsonl", "block_size": 16, "scale": 2.0, "stream": False, "no_ignore_eos": True,
        "endpoints": "http://a:8000,http://b:8000", "header": ["Authorization: Bearer $K"], "routing": "session",
        "web_user": "admin:$WEB_PW",  # expanded only where it is checked (replay.locust.webauth)
    }
    assert load_config(write(tmp_path, "", "empty.yaml")) == {}


@pytest.mark.parametrize("text, expected", [
    ("trace: t\nblocksize: 16\n", r"run.yaml:2: unknown key 'blocksize'; valid keys: api, block-size, "),
    ("scale: fast\n", r"run.yaml:1: key 'scale': expected a number, got 'fast' (str)"),
    ("block-size: 1.5\n", r"run.yaml:1: key 'block-size': expected an integer, got 1.5 (float)"),
    ("max-requests: true\n", r"key 'max-requests': expected an integer, got True (bool)"),
    ("stream: 'no'\n", r"key 'stream': expected true or false, got 'no' (str)"),
    ("model: 7\n", r"key 'model': expected a string, got 7 (int)"),
    ("routing: random\n", r"key 'routing': 'random' is not one of round-robin, least-inflight, session, prefix"),
    ("block-size: 16\nblock_size: 32\n", r"run.yaml:2: key 'block_size' given twice (also as 'block-size')"),
    ("replay-config: other.yaml\n", r"unknown key 'replay-config' (a config cannot name another)"),
    ("- trace\n", r"run.yaml:1: expected a mapping of option names to values"),
    ("trace: [unclosed\n", r"run.yaml: not valid YAML"),
])  # fmt: skip
def test_bad_files_name_the_key(tmp_path, text, expected):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    assert expected in str(e.value)


def test_unknown_key_lists_every_valid_one(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "tokeniser: x\n"))
    assert str(e.value).endswith("valid keys: " + ", ".join(sorted(config_keys())))


def test_flags_win_even_when_they_repeat_the_default(tmp_path):
    path = write(tmp_path, "trace: file.jsonl\nrouting: session\nscale: 4\nseed: 3\nheader: ['A: 1']\n")
    parsed = parse(["--replay-config", str(path), "--routing", "round-robin", "--scale=2", "--header", "B: 2"])
    assert (parsed.trace, parsed.routing, parsed.scale, parsed.seed, parsed.header) == \
        ("file.jsonl", "round-robin", 2.0, 3, ["B: 2"])
    options = replay_options(parsed)  # the plugin's path: applying twice changes nothing
    assert (options.trace, options.routing, options.scale) == ("file.jsonl", "round-robin", 2.0)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="--replay-config .*nope.yaml: cannot read"):
        parse(["--replay-config", str(tmp_path / "nope.yaml")])


def test_a_file_that_is_not_utf8_is_named_with_its_line(tmp_path):
    """It used to fail with the codec's own words, naming no file."""
    path = tmp_path / "run.yaml"
    path.write_bytes(b"trace: t.jsonl\nmodel: caf\xe9\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == f"{path}:2: not UTF-8: byte 0xe9"


# -- the shipped configs ------------------------------------------------------------------------

SHARED_TRACES = {"mooncake_synthetic_trace.jsonl", "azure_conv_2023.csv"}


@pytest.fixture
def data_dir(tmp_path, toy_tokenizer_dir) -> Path:
    """A working directory laid out as docker-compose mounts it: data/traces, data/tokenizers."""
    (tmp_path / "data" / "traces").mkdir(parents=True)
    bailian_trace(tmp_path / "data" / "traces" / "bailian.jsonl", sessions=6, turns=3, gap_s=0.05)
    (tmp_path / "data" / "tokenizers").mkdir()
    return tmp_path


def _link_trace(cwd: Path, trace: str) -> None:
    name = Path(trace).name
    if name in SHARED_TRACES:
        (cwd / trace).symlink_to(shared_path("traces", name))


def test_configs_exist():
    assert {p.name for p in CONFIGS} >= {"demo.yaml", "mooncake-vllm.yaml", "bailian-sessions.yaml",
                                          "azure-tgi.yaml", "fleet-vllm.yaml"}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_loads_and_its_trace_validates(config, data_dir):
    values = load_config(config)
    assert {"trace", "tokenizer", "api", "model", "endpoints"} <= set(values)
    trace = values["trace"]
    if trace.startswith("data/"):
        _link_trace(data_dir, trace)
        cwd = data_dir
    else:  # shipped with the package (the demo's sample)
        cwd = REPO
    assert (cwd / trace).exists(), f"{config.name}: trace {trace} not found under {cwd}"
    cmd = [sys.executable, "-m", "replay", "trace", "validate", trace]
    if values.get("trace_format"):
        cmd += ["--format", values["trace_format"]]
    if values.get("block_size"):
        cmd += ["--block-size", str(values["block_size"])]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("OK: ")
    tokenizer = values["tokenizer"]
    if tokenizer.startswith("data/tokenizers/"):  # names a tokenizer of the test data
        shared_path("tokenizers", Path(tokenizer).name)


def test_bailian_config_end_to_end(data_dir, toy_tokenizer_dir):
    """configs/bailian-sessions.yaml as shipped; flags point it at two sims and the sims' model
    (flags win) and at the toy tokenizer the sims serve with. Session routing and partition
    come from the file."""
    (data_dir / "data" / "tokenizers" / "qwen2").symlink_to(toy_tokenizer_dir)
    config = REPO / "configs" / "bailian-sessions.yaml"
    with sim_process(toy_tokenizer_dir, "--block-size", str(BLOCK), "--ttft-ms", "10", "--itl-ms", "1") as a, \
            sim_process(toy_tokenizer_dir, "--block-size", str(BLOCK), "--ttft-ms", "10", "--itl-ms", "1") as b:
        proc = run_replay(["--headless", "--replay-config", str(config), "--model", "sim",
                          "--endpoints", f"{a.url},{b.url}", "--loglevel", "INFO"], data_dir, 90)
    assert proc.returncode == 0, proc.stderr[-4000:]
    output = data_dir / "data" / "results" / "bailian-sessions.jsonl"  # the file's `output`
    trace = data_dir / "data" / "traces" / "bailian.jsonl"
    records = check_records(output, trace)
    sessions = defaultdict(set)
    for r in records:
        sessions[r["session_id"]].add(r["endpoint"])
    assert all(len(endpoints) == 1 for endpoints in sessions.values()), sessions
    assert set.union(*sessions.values()) == {a.url, b.url}
    rows = [json.loads(line) for line in open(trace)]
    assert all(r["cached_tokens"] > 0 for r in records if rows[r["request_id"]]["turn"] > 1)


def test_locust_rejects_a_bad_config(tmp_path):
    bad = write(tmp_path, "trace: t.jsonl\nroutng: session\n")
    proc = run_replay(["--headless", "--host", "http://127.0.0.1:9", "--replay-config", str(bad)], tmp_path, 60)
    assert proc.returncode == 2
    assert f"{bad}:2: unknown key 'routng'; valid keys: " in proc.stderr

"""Shared fixtures: where ../shared is, and a small tokenizer of our own when it is absent."""

from __future__ import annotations

# Locust monkey-patches the standard library with gevent when it is imported, and some test
# modules import it in-process. Patch first, before anything imports ssl (requests does),
# or ssl recurses forever (gevent issue 1016).
from gevent import monkey

monkey.patch_all()

import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from replay.results.records import RECORD_FIELDS, read_records  # noqa: E402
from replay.sim.process import sim_process  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("TRACEREPLAY_SHARED", REPO.parent / "shared"))


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shared_path(*parts: str) -> Path:
    """A path under ../shared, or a skip that says why when it is not there."""
    p = SHARED.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"needs {p} (../shared beside the checkout is absent)")
    return p


@pytest.fixture(scope="session", autouse=True)
def session_set_up_cache(tmp_path_factory) -> Path:
    """An empty set-up cache (replay/synth/setup_cache.py) for each test session, never the
    user's ~/.cache: a session's first set-up of each tokenizer is cold, so cold-start bugs are
    not hidden behind entries an earlier session wrote. Child processes (locust, replay sim)
    inherit it. Tests about the cache itself use a folder of their own."""
    path = tmp_path_factory.mktemp("setup-cache")
    before = os.environ.get("TRACEREPLAY_CACHE_DIR")
    os.environ["TRACEREPLAY_CACHE_DIR"] = str(path)
    yield path
    if before is None:
        os.environ.pop("TRACEREPLAY_CACHE_DIR", None)
    else:
        os.environ["TRACEREPLAY_CACHE_DIR"] = before


@pytest.fixture(scope="session")
def toy_tokenizer_dir(tmp_path_factory) -> Path:
    """A tokenizer.json + tokenizer_config.json (ChatML) trained by the project itself."""
    from replay.synth.toy import build_toy_tokenizer

    return build_toy_tokenizer(tmp_path_factory.mktemp("toy-tokenizer"))


@pytest.fixture(params=["qwen2", "llama3", "llama2"])
def real_tokenizer_dir(request) -> Path:
    return shared_path("tokenizers", request.param)


# -- replays with real locust processes (tests/test_locust.py, tests/test_distributed.py) --------

LOCUST = [sys.executable, "-m", "locust", "-f", str(REPO / "locustfile.py")]
BLOCK = 16


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


def mooncake_slice(out_dir: Path, rows: int, block: int, time_scale: float) -> Path:
    """The first `rows` rows of ../shared's Mooncake trace, rescaled to `block`-token blocks and
    sped up `time_scale` times (`replay trace convert`), for runs against real vLLM."""
    source = shared_path("traces", "mooncake_synthetic_trace.jsonl")
    out = out_dir / f"mooncake-{rows}-b{block}.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "replay", "trace", "convert", str(source), str(out), "--max-rows", str(rows),
         "--block-size-to", str(block), "--time-scale", str(time_scale)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return out


def replay_args(trace: Path, tokenizer: Path, url: str, output: Path, *extra: str) -> list[str]:
    return ["--headless", "--host", url, "--trace", str(trace), "--block-size", str(BLOCK), "--tokenizer",
            str(tokenizer), "--model", "sim", "--output", str(output), "--loglevel", "INFO", *extra]


def run_locust(args: list[str], cwd: Path, timeout: float = 90, exit_code: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run([*LOCUST, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == exit_code, f"locust exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def trace_ids(trace: Path) -> set[int]:
    return set(range(sum(1 for line in open(trace) if line.strip())))


def check_records(output: Path, trace: Path, exact_prompt: bool = True) -> list[dict]:
    records = list(read_records(output))
    ids = [r["request_id"] for r in records]
    assert len(ids) == len(set(ids)), "a row has two records"
    assert set(ids) == trace_ids(trace)
    for r in records:
        assert tuple(r) == RECORD_FIELDS
        assert r["ok"], r
        assert r["status"] == 200
        assert r["output_tokens"] == r["output_length"]
        if exact_prompt:
            assert r["prompt_tokens"] == r["input_length"], r
        assert r["sent_at"] >= r["scheduled_at"] - 0.005
        assert r["finished_at"] >= r["sent_at"]
    return records


def spawn_locust(args: list[str], cwd: Path, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`env`: the process's whole environment (default: this one's)."""
    return subprocess.Popen([*LOCUST, *args], cwd=cwd, stdout=open(log, "w"), stderr=subprocess.STDOUT, text=True,
                            env=env)


def spawn_worker(tmp_path: Path, port: int, name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A worker running in `tmp_path` (relative paths in the plan resolve there), log `tmp_path/name.log`."""
    return spawn_locust(["--worker", "--master-host", "127.0.0.1", "--master-port", str(port)], tmp_path,
                        tmp_path / f"{name}.log", env)


def master_and_workers(tmp_path: Path, master_args: list[str], workers: int = 2, port: int | None = None):
    """A `locust --master` (log: master.log) and `workers` workers (worker0.log, ...)."""
    port = port or free_port()
    master = spawn_locust([*master_args, "--master", "--expect-workers", str(workers), "--master-bind-host",
                           "127.0.0.1", "--master-bind-port", str(port)], tmp_path, tmp_path / "master.log")
    return master, [spawn_worker(tmp_path, port, f"worker{i}") for i in range(workers)]


def finish(procs: list[subprocess.Popen], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def bailian_trace(path: Path, sessions: int = 8, turns: int = 3, gap_s: float = 0.1) -> Path:
    """Bailian rows: follow-up turns reference their parent chat and extend its hash ids."""
    rows = []
    chat = 0
    for s in range(sessions):
        parent, hashes = -1, []
        for turn in range(1, turns + 1):
            hashes = hashes + [10_000 * (s + 1) + 100 * turn + k for k in range(2)]
            rows.append({"chat_id": chat, "parent_chat_id": parent, "timestamp": round((s + turn * sessions) * gap_s, 3),
                         "input_length": len(hashes) * 16 - 3, "output_length": 4, "type": "text", "turn": turn,
                         "hash_ids": hashes})
            parent, chat = chat, chat + 1
    rows.sort(key=lambda r: r["timestamp"])
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


@pytest.fixture
def sim(toy_tokenizer_dir):
    with sim_process(toy_tokenizer_dir, "--block-size", str(BLOCK), "--ttft-ms", "30", "--itl-ms", "2",
                     "--prefill-ms-per-1k", "0") as server:
        yield server


# -- the server's side of a run (OUTPUT.server-metrics.jsonl) -------------------------------------


def server_samples(output: Path) -> list[dict]:
    """Every line of a run's server-metrics file, each parsed (a line that does not parse fails)."""
    path = Path(f"{output}.server-metrics.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def counter_change(samples: list[dict], endpoint: str, name: str) -> float:
    """Last minus first value of a counter at `endpoint` (the tests' servers never restart)."""
    values = [s["metrics"][name] for s in samples if s["endpoint"] == endpoint and s["ok"]]
    assert len(values) >= 2, f"{endpoint}: {len(values)} samples of {name}"
    return values[-1] - values[0]

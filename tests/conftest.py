"""What several test modules share (no test module imports from another): where ../shared is,
a small tokenizer of our own when it is absent, traces and records built by hand, real Locust
processes and the sim, waiting by polling (`wait_for`), and the web UI's and Chromium's set-up."""

from __future__ import annotations

# Locust monkey-patches the standard library with gevent when it is imported, and some test
# modules import it in-process. Patch first, before anything imports ssl (requests does),
# or ssl recurses forever (gevent issue 1016).
from gevent import monkey

monkey.patch_all()

import gzip  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Iterator  # noqa: E402

import pytest  # noqa: E402
import requests  # noqa: E402

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
            assert r["usage_mismatch"] is None, r  # an honest server's usage (replay.rules.usage)
        assert r["sent_at"] >= r["scheduled_at"] - 0.005
        assert r["finished_at"] >= r["sent_at"]
    return records


def spawn_locust(args: list[str], cwd: Path, log: Path, env: dict[str, str] | None = None,
                 new_session: bool = False, locustfile: list[str] | None = None) -> subprocess.Popen:
    """`env`: the process's whole environment (default: this one's). `new_session`: in a process
    group of its own, as a process started from another terminal or host is (by default it shares
    pytest's, and the master's). `locustfile`: the command before `args` (default LOCUST)."""
    return subprocess.Popen([*(locustfile or LOCUST), *args], cwd=cwd, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=new_session)


def spawn_worker(tmp_path: Path, port: int, name: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    """A worker running in `tmp_path` (relative paths in the plan resolve there), log `tmp_path/name.log`;
    `kwargs` as spawn_locust's."""
    return spawn_locust(["--worker", "--master-host", "127.0.0.1", "--master-port", str(port)], tmp_path,
                        tmp_path / f"{name}.log", env, **kwargs)


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
def fast_sim(toy_tokenizer_dir):
    """Answers in a few ms with no cap on concurrent requests: the replay, not the server, is on trial."""
    with sim_process(toy_tokenizer_dir, "--block-size", str(BLOCK), "--ttft-ms", "2", "--itl-ms", "0",
                     "--prefill-ms-per-1k", "0", "--max-num-seqs", "100000") as server:
        yield server


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


# -- waiting for something to happen: poll with a deadline, never sleep and hope ----------------


def wait_for(check: Callable[[], Any], what: str, timeout: float = 60.0, every: float = 0.1) -> Any:
    """Call `check` every `every` s until it returns something true, and return that; fail
    saying `what` did not happen within `timeout` s. A connection error (a server not up yet)
    counts as not yet."""
    deadline = time.monotonic() + timeout
    last_error = ""
    while True:
        try:
            value = check()
        except requests.ConnectionError as e:
            value, last_error = None, f" (last: {e})"
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}{last_error}"
        time.sleep(every)


def wait_for_text(log: Path, text: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    """Wait for `text` in `proc`'s log; fail at once if `proc` exits first."""

    def seen() -> bool:
        content = log.read_text()
        assert proc.poll() is None or text in content, f"exited {proc.returncode} before {text!r}:\n{content[-3000:]}"
        return text in content

    wait_for(seen, f"{text!r} in {log}", timeout)


# -- the web UI (tests/test_webui.py, test_webauth.py, test_browser_webui.py) --------------------


def web_args(trace: Path, tokenizer: Path, url: str, output: Path, port: int) -> list[str]:
    args = [a for a in replay_args(trace, tokenizer, url, output) if a != "--headless"]
    return [*args, "--web-host", "127.0.0.1", "--web-port", str(port)]


def start_web_locust(tmp_path: Path, args: list[str], workers: int) -> list:
    """workers=0: one local process (logs to master.log); else a master and its workers."""
    if workers == 0:
        return [spawn_locust(args, tmp_path, tmp_path / "master.log")]
    master, procs = master_and_workers(tmp_path, args, workers)
    return [master, *procs]


# -- Chromium and other optional tools (tests/test_html.py, test_browser_webui.py) ---------------

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--enable-logging=stderr", "--v=0")  # fmt: skip


def need(what: str, hint: str) -> None:
    """A missing optional tool: fails in CI (CI=true), which must install it; skips elsewhere."""
    message = f"{what} is not installed ({hint})"
    if IN_CI:
        pytest.fail(message + "; CI must install it", pytrace=False)
    pytest.skip(message)


# -- records built by hand (tests/test_report.py, test_html.py) ---------------------------------

T0 = 1_700_000_000.0


def record(rid: int, **fields) -> dict:
    r = {k: None for k in RECORD_FIELDS}
    r.update(request_id=rid, worker=0, endpoint="http://127.0.0.1:1", api="openai-chat", status=200, ok=True,
             input_length=100, output_length=10)  # fmt: skip
    r.update(fields)
    return r


def ok_record(rid: int, rng: random.Random) -> dict:
    scheduled = T0 + rid * 0.1
    drift = rng.uniform(0.05, 3.0)
    sent = scheduled + drift / 1000
    out = rng.randint(1, 40)
    ttft = rng.uniform(20, 400)
    itl = [rng.uniform(5, 30) for _ in range(out - 1)]
    e2e = ttft + sum(itl) + rng.uniform(0, 2)
    tpot = (e2e - ttft) / (out - 1) if out > 1 else None
    inp = rng.randint(10, 3000)
    return record(
        rid, scheduled_at=scheduled, sent_at=sent, finished_at=sent + e2e / 1000, drift_ms=drift, ttft_ms=ttft,
        tpot_ms=tpot, e2e_ms=e2e, itl_ms=itl, input_length=inp, output_length=out, prompt_tokens=inp,
        output_tokens=out, cached_tokens=0,
    )  # fmt: skip


# -- trace files built by hand (tests/test_trace_read.py, test_trace_cli.py) ---------------------


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


# -- real vLLM on CPU (helpers in tests/vllm_server.py) -------------------------------------------


@pytest.fixture(scope="module")
def vllm_qwen2(tmp_path_factory) -> Iterator[str]:
    """One vLLM serving the tiny model with the Qwen2 tokenizer, block size 32, per test module.

    Start-up takes about 40-60 s, so a module starts it once and resets its prefix cache itself.
    While developing, TRACEREPLAY_VLLM_URL=http://127.0.0.1:PORT reuses a server already started
    this way.
    """
    # imported here: vllm_server imports this module
    from vllm_server import REUSE_ENV, make_tiny_model, require_vllm, vllm_server

    if os.environ.get(REUSE_ENV):
        yield os.environ[REUSE_ENV].rstrip("/")
        return
    require_vllm()
    model = make_tiny_model(shared_path("tokenizers", "qwen2"), tmp_path_factory.mktemp("tiny-qwen2"))
    with vllm_server(model, block_size=32, kv_cache_gib=1) as url:
        yield url

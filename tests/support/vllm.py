"""Real vLLM on CPU for tests: a tiny model folder around a real tokenizer, and a server process.

Token counts and prefix-cache behaviour depend on the tokenizer, the chat template and the
block size, never on the weights, so a 2-layer Llama with random weights (`--load-format
dummy`) stands in for any model. vLLM lives in its own venv (`make vllm`, .ci/install-vllm)
because it pins its own torch and transformers; the tests only talk to it over HTTP.
The shared server fixture (`vllm_qwen2`) is in conftest.py, built from the helpers here;
conftest.py's SERIAL_GROUPS keeps each server's tests in one pytest-xdist worker, so each
server starts once.

Policy when vLLM is not installed: with ../shared present (CI, or a full checkout) the test
FAILS and says `make vllm`, because a silent skip would hide the only check against a real
server; TRACEREPLAY_SKIP_VLLM=1 turns that into a skip on purpose. Without ../shared there
is no real tokenizer to serve, so the test skips.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from support.paths import REPO, SHARED
from support.ports import free_port

VLLM_VENV = Path(os.environ.get("TRACEREPLAY_VLLM_VENV", REPO / ".venv-vllm"))
SKIP_ENV = "TRACEREPLAY_SKIP_VLLM"
REUSE_ENV = "TRACEREPLAY_VLLM_URL"
# A file in which a server started ahead (tests/support/serve_vllm.py, `make test`) writes its
# URL once healthy, or "-" when it started none.
SMALL_CACHE_ENV = "TRACEREPLAY_VLLM_SMALL_CACHE_FILE"
SERVED_MODEL = "tiny"
STARTUP_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0
KV_BYTES_PER_TOKEN = 2 * 2 * 64 * 2  # layers x (K, V) x hidden x bf16 bytes, for make_tiny_model's config


def vllm_python() -> Path | None:
    """The python of the vLLM venv, or None when `make vllm` has not been run."""
    python = VLLM_VENV / "bin" / "python"
    return python if python.exists() else None


def require_vllm() -> Path:
    """The vLLM python, or the skip / fail the module docstring describes."""
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1: tests against real vLLM are skipped on request")
    if not SHARED.exists():
        pytest.skip(f"real vLLM tests serve a real tokenizer from the project's shared test data, which is not "
                    f"at {SHARED}: put it beside the checkout as ../shared, or set TRACEREPLAY_SHARED to its folder")
    python = vllm_python()
    if python is None:
        pytest.fail(
            f"real vLLM is not installed in {VLLM_VENV}: run `make vllm` (about 2 minutes, 3.4 GB), "
            f"or set {SKIP_ENV}=1 to skip these tests on purpose",
            pytrace=False,
        )
    return python


def _token_id(tokenizer: dict, config: dict, key: str) -> int | None:
    token = config.get(key)
    if isinstance(token, dict):
        token = token.get("content")
    if not token:
        return None
    for added in tokenizer.get("added_tokens", []):
        if added["content"] == token:
            return added["id"]
    return tokenizer.get("model", {}).get("vocab", {}).get(token)


def _vocab_size(tokenizer: dict) -> int:
    ids = list(tokenizer.get("model", {}).get("vocab", {}).values())
    ids += [t["id"] for t in tokenizer.get("added_tokens", [])]
    return max(ids) + 1


def make_tiny_model(tokenizer_dir: str | Path, out_dir: str | Path, max_model_len: int = 32768) -> Path:
    """A model folder vLLM serves with --load-format dummy: the tokenizer plus a 2-layer Llama config.

    The vocabulary is rounded up to a multiple of 128 (vLLM pads embeddings anyway); bos/eos
    come from the tokenizer so that generation stops where the real model's would.
    """
    src, out = Path(tokenizer_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src / "tokenizer.json", out / "tokenizer.json")
    tokenizer = json.loads((src / "tokenizer.json").read_text())
    tok_config = json.loads((src / "tokenizer_config.json").read_text())
    tok_config["model_max_length"] = max_model_len
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1))
    eos = _token_id(tokenizer, tok_config, "eos_token")
    bos = _token_id(tokenizer, tok_config, "bos_token")
    if bos is None:  # Qwen has no BOS; its model config names <|endoftext|>, the pad token
        bos = _token_id(tokenizer, tok_config, "pad_token")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "dtype": "bfloat16",
        "vocab_size": math.ceil(_vocab_size(tokenizer) / 128) * 128,
        "max_position_embeddings": max_model_len,
        "bos_token_id": bos,
        "eos_token_id": eos,
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


class VllmStartError(RuntimeError):
    """vLLM died or never became healthy; the message carries its log tail."""


def _log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (API server + engine core), SIGKILL if it lingers."""
    for sig, wait_s in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    # The engine core may outlive the API server by a moment; make sure the group is gone.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise VllmStartError(f"vLLM exited with {proc.returncode} before it was healthy; log {log}:\n{_log_tail(log)}")
        with contextlib.suppress(requests.RequestException):
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise VllmStartError(f"vLLM not healthy after {timeout_s:.0f} s; log {log}:\n{_log_tail(log)}")


@contextlib.contextmanager
def vllm_server(
    model_dir: str | Path,
    block_size: int = 32,
    kv_cache_gib: float = 2,
    max_model_len: int = 32768,
    port: int | None = None,
    python: str | Path | None = None,
    extra_args: tuple[str, ...] = (),
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
) -> Iterator[str]:
    """Serve `model_dir` as model "tiny" on 127.0.0.1 and yield its base URL (no /v1).

    The prefix cache can be emptied with reset_prefix_cache(url) (VLLM_SERVER_DEV_MODE=1).
    The server's log is kept (and its path printed) only when start-up fails.
    """
    python = Path(python) if python else vllm_python()
    if python is None:
        raise VllmStartError(f"vLLM is not installed in {VLLM_VENV}: run `make vllm`")
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
        "VLLM_SERVER_DEV_MODE": "1",
        # The model runs in the engine core process, as vLLM runs a one-GPU model: on CPU it
        # would otherwise start a worker process of its own (the mp executor, for OpenMP thread
        # binding, which a 2-layer model does not need), a third process importing torch and
        # vLLM. On one OpenMP thread, as that worker was: a second one spins on the other core
        # between steps, beside tests that time their sends.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "OMP_NUM_THREADS": "1",
        # Nothing leaves the machine: no hub look-ups, no usage reports.
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    cmd = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", SERVED_MODEL,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--max-model-len", str(max_model_len),
        "--enable-prompt-tokens-details",
        "--block-size", str(block_size),
        "--enforce-eager",
        "--load-format", "dummy",
        *extra_args,
    ]  # fmt: skip
    fd, log_name = tempfile.mkstemp(prefix="vllm-server-", suffix=".log")
    log = Path(log_name)
    with os.fdopen(fd, "wb") as log_file:
        # A process group of its own (stopped as one), in this session: a new session would be a
        # scheduling group of its own where the kernel groups by session (autogroup), weighted
        # as a normal process however idle its scheduling (make test's SCHED_IDLE pass).
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, env=env, process_group=0
        )
    failed = True
    try:
        _wait_healthy(proc, url, log, startup_timeout_s)
        failed = False
        yield url
    finally:
        _stop(proc)
        if not failed:
            log.unlink(missing_ok=True)


SMALL_CACHE_BLOCKS = 40
SMALL_CACHE_BLOCK = 32


@contextlib.contextmanager
def small_cache_vllm(work_dir: str | Path, startup_timeout_s: float = STARTUP_TIMEOUT_S) -> Iterator[str]:
    """vLLM serving the tiny model with the Qwen2 tokenizer and a pool of SMALL_CACHE_BLOCKS blocks
    of SMALL_CACHE_BLOCK tokens, small enough to evict (tests/test_cache_model_vllm.py):
    VLLM_CPU_KVCACHE_SPACE is whole GiB (1 GiB holds 131072 blocks of this model), so
    `--num-gpu-blocks-override` makes it small; vLLM's CPU attention takes blocks of a multiple of 32."""
    model = make_tiny_model(SHARED / "tokenizers" / "qwen2", Path(work_dir), max_model_len=1024)
    with vllm_server(model, block_size=SMALL_CACHE_BLOCK, kv_cache_gib=1, max_model_len=1024,
                     extra_args=("--num-gpu-blocks-override", str(SMALL_CACHE_BLOCKS), "--max-num-seqs", "16"),
                     startup_timeout_s=startup_timeout_s) as url:
        yield url


def started_ahead(env: str, timeout_s: float = STARTUP_TIMEOUT_S) -> str | None:
    """The URL of the server started ahead into the file `env` names, waiting while it starts;
    None when `env` is not set, or no server came (the caller starts its own)."""
    name = os.environ.get(env)
    if not name:
        return None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            text = Path(name).read_text().strip()
        except OSError:
            return None
        if text:
            return None if text == "-" else text
        time.sleep(0.5)
    return None


def reset_prefix_cache(url: str) -> None:
    """Empty the server's prefix cache (vLLM: dev-mode endpoint)."""
    requests.post(f"{url}/reset_prefix_cache", timeout=30).raise_for_status()


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def metric_total(metrics_text: str, name: str) -> float | None:
    """Sum of a Prometheus metric's samples over all label sets, or None when absent."""
    total, seen = 0.0, False
    for line in metrics_text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) == name:
            total += float(m.group(3))
            seen = True
    return total if seen else None

"""Deployment files checked without a Docker engine: docker-compose.yml and the Dockerfile refer
to files that exist and to options our parsers accept, and the ports and names line up. Then
fleet routing end to end: prefix routing over two real sims, and the report's per-endpoint
breakdown of that run.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import yaml

from replay.results.records import read_records
from replay.results.summary import percentile
from replay.run.config import load_config
from replay.sim.process import sim_process
from support.deploy import (
    APP,
    COMPOSE,
    DOCKERFILE,
    REPO,
    dockerfile,
    in_repo,
    instruction,
    locust_command,
    parse_locust,
)
from support.processes import replay_args, run_locust
from support.records import check_records

BLOCK = 16


def interpolate(text: str) -> str:
    """Compose's ${VAR:-default} / ${VAR-default} / ${VAR} with no variable set, and $$."""
    text = re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: m.group(2) or "", text)
    return text.replace("$$", "$")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(interpolate(COMPOSE.read_text()))["services"]


# -- docker-compose.yml -------------------------------------------------------------------------

def test_compose_services(compose):
    assert {"master", "worker", "sim", "vllm-0", "vllm-1", "vllm-2", "vllm-3", "tgi"} <= set(compose)
    for name in ("master", "worker", "sim"):
        s = compose[name]
        assert s["build"] == "." and s["image"] == "tracereplay:latest" and "profiles" not in s
        assert "./data:/app/data" in s["volumes"]
    devices = []
    for i in range(4):
        s = compose[f"vllm-{i}"]
        assert s["profiles"] == ["fleet"] and s["image"].startswith("vllm/vllm-openai:")
        (device,) = s["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"
        devices.append(tuple(device["device_ids"]))
        args = shlex.split(s["command"])
        assert args[args.index("--port") + 1] == "8000" and "--enable-prefix-caching" in args
    assert len(set(devices)) == 4, "each vLLM gets its own GPU"
    assert compose["tgi"]["profiles"] == ["tgi"]
    assert compose["dcgm-exporter"]["profiles"] == ["fleet"]


def test_master_and_worker_commands(compose):
    master = parse_locust(locust_command(compose["master"]))
    assert master.master and not master.headless
    assert f"{master.web_port}:{master.web_port}" in compose["master"]["ports"]
    assert f"{master.master_bind_port}:{master.master_bind_port}" in compose["master"]["ports"]
    assert (master.web_port, master.master_bind_port) == (8089, 5557)
    assert load_config(in_repo(master.replay_config))  # the default config, which must load
    worker = parse_locust(locust_command(compose["worker"]))
    assert worker.worker and worker.master_host == "master" and worker.master_port == master.master_bind_port
    assert compose["worker"]["depends_on"] == {"master": {"condition": "service_started"},
                                               "sim": {"condition": "service_healthy"}}
    assert "/health" in " ".join(compose["sim"]["healthcheck"]["test"])


def test_sim_serves_what_the_demo_config_sends(compose):
    from replay.cli import build_parser

    s = compose["sim"]
    args, unknown = build_parser().parse_known_args([*s["entrypoint"][1:], *shlex.split(s["command"])])
    assert s["entrypoint"] == ["replay"] and args.command == "sim" and not unknown, unknown
    demo = load_config(REPO / "configs" / "demo.yaml")
    assert demo["endpoints"] == f"http://sim:{args.port}"
    assert (demo["tokenizer"], demo["model"], demo["block_size"]) == (args.tokenizer, args.model, args.block_size)
    assert in_repo(demo["trace"]).is_file()
    toy = re.search(r"build_toy_tokenizer\('([^']+)'\)", " ".join(instruction("RUN")))
    assert toy and toy.group(1) == args.tokenizer, "the sim's tokenizer is the one the image builds"


def test_configs_address_the_compose_services(compose):
    for name in ("fleet-vllm", "mooncake-vllm", "bailian-sessions"):
        for url in load_config(REPO / "configs" / f"{name}.yaml")["endpoints"].split(","):
            host, port = re.fullmatch(r"http://([\w-]+):(\d+)", url).groups()
            assert host in compose and port == "8000", url
    fleet = load_config(REPO / "configs" / "fleet-vllm.yaml")
    assert fleet["endpoints"].count(",") == 3
    for url in fleet["metrics_endpoint"]:  # the GPUs' exporter, a compose service too
        host, port = re.fullmatch(r"http://([\w-]+):(\d+)/metrics", url).groups()
        assert host in compose and port == "9400", url
    azure = load_config(REPO / "configs" / "azure-tgi.yaml")
    assert azure["api"] == "tgi" and azure["endpoints"] == "http://tgi:80"
    assert "--port 80" in compose["tgi"]["command"]


def test_commands_in_comments_name_real_files():
    text = COMPOSE.read_text() + DOCKERFILE.read_text()
    named = set(re.findall(r"\b(configs/[\w.-]+\.yaml)", text))
    assert named and all((REPO / p).is_file() for p in named), named
    for line in re.findall(r"#\s+(?:\S+=\S+ )*(?:docker compose|docker run)[^\n]*", text):
        assert "--profile" not in line or re.search(r"--profile (fleet|tgi)\b", line), line


def docker_compose() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return None


def test_docker_compose_config():
    tool = docker_compose()
    if tool is None:
        if os.environ.get("CI") == "true":
            pytest.fail("docker-compose is not installed (Debian package docker-compose; needs no engine)")
        pytest.skip("needs docker-compose (Debian package docker-compose) to validate docker-compose.yml")
    env = {k: v for k, v in os.environ.items() if k not in ("REPLAY_CONFIG", "REPLAY_MASTER_ARGS")}

    def run(*args):
        return subprocess.run([*tool, "-f", str(COMPOSE), *args], cwd=REPO, capture_output=True, text=True,
                              timeout=60, env=env)

    checked = run("config", "-q")
    assert checked.returncode == 0, checked.stderr
    services = run("--profile", "fleet", "config", "--services")
    assert services.returncode == 0, services.stderr
    assert {"master", "worker", "sim", "vllm-0", "vllm-3"} <= set(services.stdout.split())
    resolved = yaml.safe_load(run("config").stdout)["services"]
    assert "--replay-config configs/demo.yaml" in resolved["master"]["command"]


# -- Dockerfile ---------------------------------------------------------------------------------

def test_dockerfile():
    words = [w for w, _ in dockerfile()]
    assert instruction("FROM") == ["python:3.11-slim"]
    assert instruction("WORKDIR") == [APP]
    user = instruction("USER")
    assert user and user[-1] not in ("root", "0") and words.index("USER") > max(
        i for i, w in enumerate(words) if w == "RUN"), "runs as a non-root user"
    assert set(" ".join(instruction("EXPOSE")).split()) == {"8089", "5557"}
    ignored = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    for args in instruction("COPY"):
        *sources, _ = args.split()
        for src in sources:
            assert (REPO / src).exists(), f"COPY {src}: not in the checkout"
            assert src not in ignored and src.split("/")[0] not in ignored, f"COPY {src}: excluded by .dockerignore"
    run = " ".join(instruction("RUN"))
    assert "pip install ." in run  # not editable: `replay run` imports the package from site-packages
    assert json.loads(instruction("ENTRYPOINT")[-1]) == ["replay", "run"]


def test_dockerfile_python_steps_run(tmp_path):
    """The RUN step's `python -c` code, executed here with its output directory moved to tmp."""
    for code in re.findall(r'python -c "([^"]+)"', " ".join(instruction("RUN"))):
        code = code.replace("/opt/tracereplay", str(tmp_path))
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "toy-tokenizer" / "tokenizer.json").is_file()
    assert (tmp_path / "toy-tokenizer" / "tokenizer_config.json").is_file()


# -- fleet routing ------------------------------------------------------------------------------

def prefix_trace(path: Path, families: int = 5, rows: int = 30, gap_ms: float = 25) -> Path:
    """Rows whose prompts start with one of `families` shared blocks, then blocks of their own."""
    with open(path, "w") as f:
        for i in range(rows):
            hashes = [1000 * (i % families), 1000 * (i % families) + 1, 50_000 + i]
            f.write(json.dumps({"timestamp": i * gap_ms, "input_length": 3 * BLOCK - 2, "output_length": 4,
                                "hash_ids": hashes}) + "\n")
    return path


def test_prefix_routing_and_per_endpoint_report(tmp_path, toy_tokenizer_dir):
    trace = prefix_trace(tmp_path / "trace.jsonl")
    output = tmp_path / "run.jsonl"
    sim = ("--block-size", str(BLOCK), "--ttft-ms", "10", "--itl-ms", "1", "--prefill-ms-per-1k", "0")
    with sim_process(toy_tokenizer_dir, *sim) as a, sim_process(toy_tokenizer_dir, *sim, "--ttft-ms", "60") as b:
        run_locust(replay_args(trace, toy_tokenizer_dir, a.url, output, "--endpoints", f"{a.url},{b.url}",
                               "--routing", "prefix"), tmp_path)
    records = check_records(output, trace)
    rows = [json.loads(line) for line in open(trace)]
    by_prefix = defaultdict(set)
    for r in records:
        by_prefix[rows[r["request_id"]]["hash_ids"][0]].add(r["endpoint"])
    assert len(by_prefix) == 5 and all(len(e) == 1 for e in by_prefix.values()), by_prefix
    assert set.union(*by_prefix.values()) == {a.url, b.url}
    # every request sent once its family's first had its first token (its blocks were cached by
    # then) finds the shared blocks in that server's cache; on a busy host, late sends can go out
    # together, and a family's second then reaches the server with its first
    first = {}
    for r in sorted(records, key=lambda r: r["sent_at"]):
        first.setdefault(rows[r["request_id"]]["hash_ids"][0], r)
    later = [r for r in records if r["sent_at"] >= (f := first[rows[r["request_id"]]["hash_ids"][0]])["sent_at"]
             + f["ttft_ms"] / 1000 and r is not f]
    assert len(later) >= len(records) // 2 and all(r["cached_tokens"] >= BLOCK for r in later), later

    report_json = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "replay", "report", str(output), "--json", str(report_json)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    endpoints = json.loads(report_json.read_text())["endpoints"]
    assert list(endpoints) == sorted([a.url, b.url])
    for url, entry in endpoints.items():
        mine = [r for r in read_records(output) if r["endpoint"] == url]
        assert entry["requests"] == entry["requests_ok"] == len(mine) and entry["requests_failed"] == 0
        assert entry["ttft_ms"]["p50"] == pytest.approx(percentile(sorted(r["ttft_ms"] for r in mine), 50))
        assert entry["e2e_ms"]["p99"] == pytest.approx(percentile(sorted(r["e2e_ms"] for r in mine), 99))
    assert endpoints[b.url]["ttft_ms"]["p50"] > endpoints[a.url]["ttft_ms"]["p50"] + 30  # the slow one shows
    assert "Per Endpoint" in proc.stdout
    for url, entry in endpoints.items():
        assert re.search(rf"{re.escape(url)}\s+{entry['requests']}\s+0\s", proc.stdout), proc.stdout

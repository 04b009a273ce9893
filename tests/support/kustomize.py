"""`kubectl kustomize`, the build `kubectl apply -k` applies, and the YAML it prints. The real
build, never a stand-in: a layout the real kustomize refuses (a cycle between a base and an
overlay inside it) must fail here as it fails on a cluster.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path

import yaml

from support.browser import need

MIN_KUSTOMIZE = 5  # the major version deploy/k8s is built with; Debian's kubectl 1.20 (kustomize 2) lacks `patches`
KUBECTL_HINT = f"kubectl 1.27 or later, whose `kubectl kustomize` is kustomize {MIN_KUSTOMIZE} or later"


def documents(path: Path) -> list[dict]:
    """The YAML documents of a manifest file, empty ones dropped."""
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def kubectl() -> str:
    """The kubectl to build with; skips (fails in CI) without one new enough."""
    path = shutil.which("kubectl")
    if path is None:
        need("kubectl", KUBECTL_HINT)
    if (major := _kustomize_major(path)) is None or major < MIN_KUSTOMIZE:
        need(f"kubectl with kustomize {MIN_KUSTOMIZE}+ (this one's: {major or 'unknown'})", KUBECTL_HINT)
    return path


@functools.cache
def _kustomize_major(kubectl_path: str) -> int | None:
    out = subprocess.run([kubectl_path, "version", "--client"], capture_output=True, text=True, timeout=60).stdout
    found = re.search(r"Kustomize Version: v(\d+)", out)
    return int(found.group(1)) if found else None


@functools.cache
def _build_text(folder: Path) -> str:
    done = subprocess.run([kubectl(), "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise AssertionError(f"kubectl kustomize {folder}: exit {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def build(folder: str | Path) -> list[dict]:
    """The resources `kubectl kustomize folder` prints (a fresh copy each call)."""
    return [d for d in yaml.safe_load_all(_build_text(Path(folder).resolve())) if d]


def pod_spec(resource: dict) -> dict | None:
    """The pod spec of a Pod, or of a workload's pod template."""
    if resource["kind"] == "Pod":
        return resource["spec"]
    return resource.get("spec", {}).get("template", {}).get("spec")


def containers(resource: dict) -> list[dict]:
    spec = pod_spec(resource)
    return spec["containers"] if spec else []

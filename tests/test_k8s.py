"""deploy/k8s without a cluster: every manifest and each kustomization's output, as `kubectl
kustomize` builds it (what `kubectl apply -k` applies), validate against the Kubernetes JSON
schemas of a current release (kubernetes-validate ships them); the master's,
the Job's and the workers' commands, ports, names and config agree with each other, with
docker-compose.yml and with docs/deployment.md; and the sim overlay runs to completion as
processes on this machine, with the commands and config its manifests give, master and workers
ending with the run.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from replay.run.config import load_config
from replay.sim.process import SimProcess
from support.browser import need
from support.deploy import COMPOSE, REPO, locust_command, parse_locust
from support.kustomize import build, containers, documents, pod_spec
from support.ports import free_port
from support.processes import finish, spawn_locust
from support.records import check_records

K8S = REPO / "deploy" / "k8s"
BASE = K8S / "base"  # the shared resources, and the web UI's setup
OVERLAYS = tuple(sorted(p.parent for p in K8S.rglob("kustomization.yaml")))  # base, headless, sim
IMAGE = "tracereplay:latest"  # docker-compose.yml's image, built from the Dockerfile


def by_kind(resources: list[dict], kind: str, name: str) -> dict:
    (found,) = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    return found


def args_of(resource: dict, container: str) -> list[str]:
    (c,) = [c for c in containers(resource) if c["name"] == container]
    return [str(a) for a in c["args"]]


def config_of(resources: list[dict], tmp_path: Path) -> tuple[Path, dict]:
    """The run config the master mounts, written to a file, and as load_config reads it."""
    path = tmp_path / "replay.yaml"
    path.write_text(by_kind(resources, "ConfigMap", "tracereplay-config")["data"]["replay.yaml"])
    return path, load_config(path)


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


def test_manifests_and_kustomizations_validate():
    try:
        import kubernetes_validate as kv
    except ImportError:
        need("kubernetes-validate", "pip install 'tracereplay[test]'; it has the Kubernetes JSON schemas")
    version = kv.latest_version()
    rendered = [(f"{folder.relative_to(REPO)} (kustomize build)", r) for folder in OVERLAYS for r in build(folder)]
    files = [(str(p.relative_to(REPO)), d) for p in manifest_files() for d in documents(p)]
    for where, resource in files + rendered:
        try:
            kv.validate(resource, version, strict=True)
        except kv.ValidationError as e:
            pytest.fail(f"{where}: {resource['kind']}/{resource['metadata']['name']}: {e.message}")


@pytest.mark.parametrize("folder", OVERLAYS, ids=lambda p: str(p.relative_to(K8S)))
def test_conventions(folder):
    for r in build(folder):
        labels = r["metadata"].get("labels", {})
        assert labels.get("app.kubernetes.io/name") == "tracereplay", r["metadata"]
        assert labels.get("app.kubernetes.io/part-of") == "tracereplay", r["metadata"]
        assert re.fullmatch(r"tracereplay(-[a-z0-9]+)*", r["metadata"]["name"]), r["metadata"]["name"]
        spec = pod_spec(r)
        if spec is None:
            continue
        template = r["spec"]["template"]["metadata"]["labels"]
        assert r["spec"].get("selector", {}).get("matchLabels", {}).items() <= template.items()
        assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] != 0
        for c in containers(r):
            assert c["image"] == IMAGE, c["image"]  # the one image: compose's
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["resources"]["requests"] and c["resources"]["limits"]
            if r["metadata"]["name"] != "tracereplay-sim":
                assert "command" not in c, "the image's entry point, `replay run`, as in compose"


def test_master_workers_and_job_agree(tmp_path):
    base, headless = build(BASE), build(K8S / "headless")
    service = by_kind(base, "Service", "tracereplay-master")
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    deployment = by_kind(base, "Deployment", "tracereplay-master")
    master = parse_locust(locust_command({"command": shlex.join(args_of(deployment, "master"))}))
    assert master.master and not master.headless
    (container,) = containers(deployment)
    exposed = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert exposed == {"web": master.web_port, "master": master.master_bind_port}
    assert ports["web"]["targetPort"] == "web" and ports["master"]["targetPort"] == "master"
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["tcpSocket"]["port"] == "web"
    mount = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert master.replay_config == f"{mount['config']}/replay.yaml"
    assert mount["data"] == "/app/data"
    _, config = config_of(base, tmp_path)
    assert config["output"].startswith("data/results/")

    worker_deployment = by_kind(base, "Deployment", "tracereplay-worker")
    worker = parse_locust(locust_command({"command": shlex.join(args_of(worker_deployment, "worker"))}))
    assert worker.worker and worker.master_host == service["metadata"]["name"]
    assert worker.master_port == ports["master"]["port"] == master.master_bind_port
    (wc,) = containers(worker_deployment)
    assert wc["resources"]["limits"]["cpu"] == "1", "one worker process per core"

    assert not [r for r in headless if r["kind"] == "Deployment" and r["metadata"]["name"] == "tracereplay-master"]
    job = by_kind(headless, "Job", "tracereplay-run")
    run = parse_locust(locust_command({"command": shlex.join(args_of(job, "master"))}))
    assert run.master and run.headless and run.replay_config == master.replay_config
    assert run.master_bind_port == master.master_bind_port
    workers_job = by_kind(headless, "Job", "tracereplay-workers")
    assert not [r for r in headless if r["kind"] == "Deployment"], "headless: every pod ends with the run"
    assert run.expect_workers == workers_job["spec"]["parallelism"] == workers_job["spec"]["completions"]
    # the workers Job's pods are the Deployment's, bar what makes them end
    job_template = yaml.safe_load(yaml.safe_dump(workers_job["spec"]["template"]))
    assert job_template["spec"].pop("restartPolicy") == "OnFailure"  # a worker that found no master yet retries
    assert job_template == worker_deployment["spec"]["template"]
    assert job["spec"]["backoffLimit"] == 0 and pod_spec(job)["restartPolicy"] == "Never"
    assert job["spec"]["template"]["metadata"]["labels"].items() >= service["spec"]["selector"].items()

    # docker-compose.yml's master gives the same options, bar the config's path
    compose = yaml.safe_load(COMPOSE.read_text())["services"]
    flags = [a for a in shlex.split(compose["master"]["command"]) if a.startswith("--")]
    assert flags == [a for a in args_of(deployment, "master") if a.startswith("--")]
    assert compose["master"]["image"] == IMAGE


def test_docs_name_what_the_manifests_define():
    comments = "".join(p.read_text() for p in K8S.rglob("*.yaml"))
    docs = (REPO / "docs" / "deployment.md").read_text() + (REPO / "README.md").read_text() + comments
    assert "kubectl apply -k deploy/k8s/sim" in docs
    names = {f"{r['kind'].lower()}/{r['metadata']['name']}" for folder in OVERLAYS for r in build(folder)}
    for kind, name in re.findall(r"\b(job|deployment|statefulset|pod|svc)/(tracereplay[\w-]*)", docs):
        kind = {"svc": "service"}.get(kind, kind)
        assert f"{kind}/{name}" in names or (kind == "pod" and name == "tracereplay-data"), f"{kind}/{name}"
    for path in re.findall(r"\b(deploy/k8s[\w/.-]*)", docs):
        assert (REPO / path.rstrip(".")).exists(), path
    for path in re.findall(r"kubectl (?:apply|delete) -k (deploy/k8s[\w/.-]*)", docs):  # a folder kubectl can build
        assert (REPO / path.rstrip(".")).resolve() in OVERLAYS, path


@pytest.mark.parametrize("overlay", ["headless", "sim"])
def test_an_image_set_in_an_overlay_covers_its_bases(tmp_path, overlay):
    """What the kustomizations' comment promises: `kustomize edit set image` in the folder
    applied renames the image of every container, the base's included (an entry whose name
    matched no container would leave them pulling `tracereplay:latest`, without a word)."""
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    kustomization = copy / overlay / "kustomization.yaml"
    spec = yaml.safe_load(kustomization.read_text())
    assert spec["images"] == [{"name": "tracereplay", "newTag": "latest"}]
    spec["images"] = [{"name": "tracereplay", "newName": "registry.example.com/tracereplay", "newTag": "1.0"}]
    kustomization.write_text(yaml.safe_dump(spec))
    images = {c["image"] for r in build(copy / overlay) for c in containers(r)}
    assert images == {"registry.example.com/tracereplay:1.0"}


def test_sim_overlay_runs_to_completion(tmp_path, toy_tokenizer_dir):
    """The sim overlay's fleet, headless master (the Job) and workers, as processes here. Only
    what ties them to a cluster changes: the sims' and the master's listening ports (free ones
    here), the services' host names (127.0.0.1), the toy tokenizer's path in the image (the
    test's own, built the same way), the config's mount path. The working directory stands for
    the image's /app: the bundled trace is at replay/data there, results go to data/results/."""
    resources = build(K8S / "sim")
    sims = by_kind(resources, "StatefulSet", "tracereplay-sim")
    in_image = "/opt/tracereplay/toy-tokenizer"
    sim_args = [str(toy_tokenizer_dir) if a == in_image else a for a in args_of(sims, "sim")]
    assert sim_args[:1] == ["sim"] and containers(sims)[0]["command"] == ["replay"]
    sim_args[sim_args.index("--port") + 1] = "0"
    sim_args[sim_args.index("--host") + 1] = "127.0.0.1"
    config_path, config = config_of(resources, tmp_path)
    text = config_path.read_text().replace(in_image, str(toy_tokenizer_dir))
    (tmp_path / "replay").mkdir()
    (tmp_path / "replay" / "data").symlink_to(REPO / "replay" / "data")
    workers = by_kind(resources, "Job", "tracereplay-workers")
    job = by_kind(resources, "Job", "tracereplay-run")
    port = free_port()
    fleet = [SimProcess(toy_tokenizer_dir, sim_args[1:]) for _ in range(sims["spec"]["replicas"])]
    procs: list[subprocess.Popen] = []
    try:
        for i, sim in enumerate(fleet):
            text = text.replace(f"http://tracereplay-sim-{i}.tracereplay-sim:8000", sim.url)
        assert "tracereplay-sim" not in text, "every endpoint is one of the StatefulSet's pods"
        config_path.write_text(text)
        master_args = args_of(job, "master")
        master_args[master_args.index("--replay-config") + 1] = str(config_path)
        master_args[master_args.index("--master-bind-host") + 1] = "127.0.0.1"
        master_args[master_args.index("--master-bind-port") + 1] = str(port)
        procs.append(spawn_locust(master_args, tmp_path, tmp_path / "master.log"))
        worker_args = args_of(workers, "worker")
        worker_args[worker_args.index("--master-host") + 1] = "127.0.0.1"
        worker_args[worker_args.index("--master-port") + 1] = str(port)
        procs += [spawn_locust(worker_args, tmp_path, tmp_path / f"worker{i}.log")
                  for i in range(workers["spec"]["completions"])]
        finish(procs, timeout=120)
    finally:
        for sim in fleet:
            sim.stop()
    assert procs[0].returncode == 0, (tmp_path / "master.log").read_text()[-4000:]
    for i, worker in enumerate(procs[1:]):  # the workers' pods complete with the run: nothing outlives it
        assert worker.returncode == 0, (tmp_path / f"worker{i}.log").read_text()[-4000:]
    output = tmp_path / config["output"]
    records = check_records(output, REPO / config["trace"])
    assert {r["endpoint"] for r in records} == {s.url for s in fleet}

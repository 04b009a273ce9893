"""`kustomize build` for the few features deploy/k8s uses, for machines without the binary
(kubectl's `-k` is kustomize): `resources` (files of YAML documents, and directories with a
kustomization.yaml of their own), `patches` (strategic merge, inline or from a file, including
`$patch: delete`), `images` and `replicas`. Any other key fails, so that a manifest using a
feature the loader lacks is not rendered wrong in silence.
"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

SUPPORTED = {"apiVersion", "kind", "resources", "patches", "images", "replicas"}


def documents(path: Path) -> list[dict]:
    """The YAML documents of a manifest file, empty ones dropped."""
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def key(resource: dict) -> tuple[str, str]:
    return resource["kind"], resource["metadata"]["name"]


def merge(base, patch):
    """A strategic merge patch as kubectl applies it to what deploy/k8s patches: maps merge,
    lists of maps with a `name` merge by name, other lists and scalars are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = merge(base[k], v) if k in base else copy.deepcopy(v)
        return out
    if (isinstance(base, list) and isinstance(patch, list) and patch
            and all(isinstance(x, dict) and "name" in x for x in base + patch)):
        out = [dict(x) for x in base]
        names = [x["name"] for x in out]
        for item in patch:
            if item["name"] in names:
                i = names.index(item["name"])
                out[i] = merge(out[i], item)
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)


def build(folder: str | Path) -> list[dict]:
    """The resources `kustomize build folder` prints, in order."""
    folder = Path(folder)
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(spec) - SUPPORTED
    assert not unknown, f"{folder}/kustomization.yaml: {sorted(unknown)}: not supported by this loader"
    resources: list[dict] = []
    for entry in spec.get("resources", []):
        path = (folder / entry).resolve()
        resources.extend(build(path) if path.is_dir() else documents(path))
    keys = [key(r) for r in resources]
    assert len(set(keys)) == len(keys), f"{folder}: a resource is listed twice: {keys}"
    for entry in spec.get("patches", []):
        assert set(entry) <= {"patch", "path"}, f"{folder}: patch {entry}: only inline or file patches"
        patch = yaml.safe_load(entry["patch"]) if "patch" in entry else yaml.safe_load((folder / entry["path"]).read_text())
        (i,) = [i for i, r in enumerate(resources) if key(r) == key(patch)] or [None]
        assert i is not None, f"{folder}: a patch for {key(patch)}, which is not among the resources"
        if patch.get("$patch") == "delete":
            del resources[i]
        else:
            resources[i] = merge(resources[i], patch)
    for image in spec.get("images", []):
        for r in resources:
            for c in containers(r):
                if c["image"].split(":")[0] == image["name"]:
                    c["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    for entry in spec.get("replicas", []):
        (r,) = [r for r in resources if r["metadata"]["name"] == entry["name"] and "replicas" in r.get("spec", {})]
        r["spec"]["replicas"] = entry["count"]
    return resources


def pod_spec(resource: dict) -> dict | None:
    """The pod spec of a Pod, or of a workload's pod template."""
    if resource["kind"] == "Pod":
        return resource["spec"]
    return resource.get("spec", {}).get("template", {}).get("spec")


def containers(resource: dict) -> list[dict]:
    spec = pod_spec(resource)
    return spec["containers"] if spec else []

"""The project as a user gets it: its wheel, built from a copy of the sources, installed into a
fresh virtual environment outside the checkout.

The fresh environment gets its dependencies without a download: a folder of links to the
distributions the wheel requires, and what they require in turn (markers and extras
evaluated), as installed in the environment running the tests (`make` installs them), is put on
its path by a .pth file. So pip installs the wheel alone, offline, in seconds, and an import of
a package the wheel does not declare fails there as it would for a user. Building the wheel
needs the build backend pyproject.toml names (pip fetches it from the index, or its cache).
"""

from __future__ import annotations

import email.parser
import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from support.paths import REPO

SOURCES = ("pyproject.toml", "README.md", "replay")  # what the wheel is built from


class BuildError(RuntimeError):
    """The wheel could not be built; the message is pip's last lines."""


def build_wheel(out: Path) -> Path:
    """The project's wheel, built from a copy of SOURCES (the build writes build/ and
    *.egg-info beside its sources, never into the checkout)."""
    src = out / "src"
    for name in SOURCES:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            src.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, src / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--disable-pip-version-check",
                           "-w", str(out / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise BuildError((done.stdout + done.stderr)[-2000:])
    (wheel,) = (out / "dist").glob("tracereplay-*.whl")
    return wheel


def requirement_closure(requirements: list[str]) -> dict[str, importlib.metadata.Distribution]:
    """The installed distributions `requirements` name, and those they require in turn."""
    found: dict[str, importlib.metadata.Distribution] = {}
    done: set[tuple[str, str]] = set()
    todo = [(r, "") for r in requirements]
    while todo:
        text, extra = todo.pop()
        req = Requirement(text)
        if req.marker and not req.marker.evaluate({"extra": extra}):
            continue
        try:
            dist = importlib.metadata.distribution(req.name)
        except importlib.metadata.PackageNotFoundError:
            raise AssertionError(f"{text}: required by the wheel, not installed here (`make install` installs it)") from None
        name = canonicalize_name(dist.metadata["Name"])
        found[name] = dist
        for wanted in ("", *sorted(req.extras)):
            if (name, wanted) not in done:
                done.add((name, wanted))
                todo += [(r, wanted) for r in dist.requires or []]
    return found


def link_distributions(dists: dict[str, importlib.metadata.Distribution], folder: Path) -> Path:
    """`folder` with a link to each top-level file and folder of `dists` (their RECORDs)."""
    folder.mkdir(parents=True)
    for name, dist in dists.items():
        assert dist.files is not None, f"{name}: installed without a RECORD, its files unknown"
        for top in {f.parts[0] for f in dist.files} - {"..", "__pycache__"}:
            if not (folder / top).exists():
                (folder / top).symlink_to(dist.locate_file(top))
    return folder


def wheel_requirements(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist lines (its extras' too: their markers leave them out of a closure)."""
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = email.parser.BytesParser().parsebytes(z.read(name))
    return metadata.get_all("Requires-Dist") or []


class Venv:
    """A fresh virtual environment, without pip: the tests' pip installs into it (--python)."""

    def __init__(self, path: Path, deps: Path):
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
        self.path = path
        self.bin = path / "bin"
        self.python = self.bin / "python"
        self.site_packages = Path(subprocess.run(
            [self.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True, timeout=60).stdout.strip())
        (self.site_packages / "tracereplay-test-deps.pth").write_text(f"{deps}\n")

    def pip(self, *args: str) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-m", "pip", "--python", str(self.python), "--disable-pip-version-check",
                               *args], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"pip {' '.join(args)}: exit {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
        return done

    def files(self) -> set[str]:
        """Every file and link in the environment, relative to it (folders left out)."""
        return {str(p.relative_to(self.path)) for p in self.path.rglob("*")
                if not p.is_dir() or p.is_symlink()} - {""}

    def env(self, tmp: Path) -> dict[str, str]:
        """An environment for its commands: its bin first, no PYTHONPATH (nothing of the
        checkout), TMPDIR `tmp` (what they leave in a temporary folder shows there)."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        env.update(PATH=f"{self.bin}{os.pathsep}{env.get('PATH', '')}", TMPDIR=str(tmp))
        return env

"""The deployment files as the tests read them: the Dockerfile's instructions, paths as a
container sees them, and Locust's parser (with the replay's options) for the commands that
docker-compose.yml and deploy/k8s give `replay run`."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from replay.locust.cli import LOCUSTFILE, locust_argv

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
APP = "/app"  # the image's WORKDIR, where the checkout's files are copied


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        if raw.strip().startswith("#") or not raw.strip():
            continue
        current += raw.rstrip("\\").strip() + " "
        if not raw.rstrip().endswith("\\"):
            word, _, rest = current.strip().partition(" ")
            lines.append((word.upper(), rest.strip()))
            current = ""
    return lines


def instruction(name: str) -> list[str]:
    return [args for word, args in dockerfile() if word == name]


def in_repo(path: str) -> Path:
    """A path as the container sees it (absolute under /app, or relative to it) in the checkout."""
    return REPO / Path(path).relative_to(APP) if path.startswith(APP + "/") else REPO / path


def locust_parser():
    from locust.argument_parser import get_parser

    import replay.locust.plugin  # noqa: F401  (registers the replay options with Locust's parser)

    return get_parser()


def locust_command(service: dict) -> list[str]:
    """The arguments Locust gets from the image's `replay run` entry point and the service's command."""
    assert json.loads(instruction("ENTRYPOINT")[-1]) == ["replay", "run"]
    return locust_argv(shlex.split(service["command"]))


def parse_locust(args: list[str]):
    parsed, unknown = locust_parser().parse_known_args(args)
    assert not unknown and not parsed.user_classes, f"options Locust + replay do not know: {unknown or parsed.user_classes}"
    assert Path(parsed.locustfile) == LOCUSTFILE, parsed.locustfile  # the package's, wherever it is installed
    return parsed

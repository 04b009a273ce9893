"""The files of a `replay run` that are Locust's options, claimed with the run's --output
(replay.output_claim): Locust's `--html` and `--json-file` reports, written at the run's end,
so a refusal before the run saves what they would have replaced (the trace, the run's own
records), and `--replay-config`, read. Locust opens `--csv`'s files and `--logfile` itself
before any of the package's code runs: a refusal could save nothing, and they are not claimed
(docs/records.md#every-commands-outputs)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from replay.engine.options import CONFIG_FLAG
from replay.output_claim import Read, Written
from replay.run.config import CONFIG_DEST

# dest: (flag, the files Locust writes for the value); Locust makes their folders
CLAIMED: dict[str, tuple[str, Callable[[str], list[Path]]]] = {
    "html_file": ("--html", lambda value: [Path(value)]),
    "json_file": ("--json-file", lambda value: [Path(f"{value}.json")]),  # locust.stats.save_stats_json
}
NOT_CLAIMED = {"csv_prefix": "--csv", "logfile": "--logfile"}  # open before the package's code runs


def locust_outputs(parsed: argparse.Namespace) -> list[Written]:
    return [Written(flag, value, tuple(files(value)), makes_folder=True)
            for dest, (flag, files) in CLAIMED.items() if (value := getattr(parsed, dest, None))]


def config_input(parsed: argparse.Namespace) -> list[Read]:
    path = getattr(parsed, CONFIG_DEST, None)
    return [Read(Path(path), f"{CONFIG_FLAG} {path}")] if path else []

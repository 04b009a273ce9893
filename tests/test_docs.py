"""The documentation stays true to the repository: the option reference is the one the options
generate, the README stays a front page, and every file or link the docs cite exists.

Docs drift silently (a renamed module, a moved test, a new option nobody wrote up); these
checks make the drift a failing test that names the file and what to do.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

from replay.engine.options import CONFIG_FLAG, LOCAL_OPTION_NAMES, OPTION_NAMES
from replay.run.options_doc import REGENERATE, render

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
OPTIONS_DOC = REPO / "docs" / "options.md"
README_MAX_LINES = 200


# A repository path as the docs cite it: one of the repository's top-level folders, then a
# path; not part of a longer path (/app/replay/...) nor a dotted module name.
REPO_PATH = re.compile(r"(?<![\w./-])((?:replay|bench|tests|docs|configs|\.ci)/[\w./-]*)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^(```|~~~)")
# Documents outside the repository that the docs once cited: a reader cannot open them.
OUTSIDE_DOCS = re.compile(r"design\.md|shared/notes|\.\./shared/[\w./-]*\.md")


def doc_files() -> list[Path]:
    return [README, *sorted((REPO / "docs").rglob("*.md"))]


def _relative(path: Path) -> str:
    return str(path.relative_to(REPO))


def test_options_doc_is_current():
    assert OPTIONS_DOC.exists(), f"docs/options.md is missing: run `{REGENERATE}`"
    assert OPTIONS_DOC.read_text(encoding="utf-8") == render(), (
        f"docs/options.md is not what the options generate: run `{REGENERATE}`")


def test_options_doc_lists_every_option():
    text = OPTIONS_DOC.read_text(encoding="utf-8")
    flags = [CONFIG_FLAG, *("--" + name.replace("_", "-") for name in (*OPTION_NAMES, *LOCAL_OPTION_NAMES))]
    missing = [flag for flag in flags if f"`{flag}`" not in text]
    assert not missing, f"docs/options.md does not list {', '.join(missing)}: run `{REGENERATE}`"


def test_render_lists_an_option_added_to_the_dataclass(monkeypatch):
    """The page is derived from the parser, so a new field shows up without editing a list."""
    import argparse

    import replay.run.options_doc as options_doc

    real = options_doc.add_arguments

    def with_extra(parser: argparse.ArgumentParser) -> None:
        real(parser)
        parser.add_argument("--brand-new-option", type=int, default=3, help="a new option")

    monkeypatch.setattr(options_doc, "add_arguments", with_extra)
    assert "| `--brand-new-option` | `brand-new-option` | integer | `3` | a new option |" in options_doc.render()


def test_readme_is_a_front_page():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move the detail into docs/ and link it")


def _cited_paths(text: str) -> set[str]:
    """Paths named in the text; link targets are relative to their file (test_relative_links_resolve)."""
    text = LINK.sub("", text)
    return {m.rstrip(".,:;") for m in REPO_PATH.findall(text)}


def test_cited_repository_paths_exist():
    missing = []
    for doc in doc_files():
        for cited in sorted(_cited_paths(doc.read_text(encoding="utf-8"))):
            if not (REPO / cited).exists():
                missing.append(f"{_relative(doc)}: {cited}")
    assert not missing, "the docs cite paths the repository does not have:\n" + "\n".join(missing)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.replace("`", "").strip().lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    anchors, seen, fenced = set(), {}, False
    for line in doc.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced and (m := HEADING.match(line)):
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_relative_links_resolve():
    broken = []
    for doc in doc_files():
        for target in LINK.findall(doc.read_text(encoding="utf-8")):
            if re.match(r"[a-z][a-z+.-]*:", target):  # http:, https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            linked = (doc.parent / path_part).resolve() if path_part else doc
            if not linked.exists():
                broken.append(f"{_relative(doc)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{_relative(doc)}: {target} (no heading #{anchor} in {_relative(linked)})")
    assert not broken, "broken links in the docs:\n" + "\n".join(broken)


def test_docs_cite_nothing_outside_the_repository():
    found = [f"{_relative(doc)}: {m.group(0)}" for doc in doc_files()
             for m in OUTSIDE_DOCS.finditer(doc.read_text(encoding="utf-8"))]
    assert not found, "the docs cite documents outside the repository:\n" + "\n".join(found)


@pytest.mark.parametrize("heading, slug", [
    ("Run configurations (`--replay-config`)", "run-configurations---replay-config"),
    ("The server's side of the run", "the-servers-side-of-the-run"),
    ("Labels: why a row has no answer", "labels-why-a-row-has-no-answer"),
])
def test_slug_is_githubs(heading, slug):
    assert _slug(heading) == slug


SKIPS = re.compile(r"pytest\.skip\(|importorskip\(|skipif\(|\bneed\(")


def test_every_skip_says_what_is_missing_and_is_listed():
    """A newcomer never skips silently: every test file that can skip is in docs/testing.md's
    table of what the tests need, and every importorskip says why (its default names only the
    module). shared_path's and require_vllm's skips are their helpers' (tests/support/)."""
    section = (REPO / "docs" / "testing.md").read_text().split("## What the tests need", 1)[1].split("\n## ", 1)[0]
    for path in sorted((REPO / "tests").glob("test_*.py")):
        text = path.read_text()
        if path.name != "test_docs.py" and SKIPS.search(text):
            assert path.name in section, f"{path.name} can skip: name it in docs/testing.md's table of what tests need"
        for call in re.findall(r"importorskip\([^)]*\)", text):
            assert "reason=" in call, f"{path.name}: {call} needs a reason= saying how to install it"


def run_file_names() -> list[str]:
    """Every file a run writes beside OUTPUT, as the docs name them, from replay.rules.run_files:
    each *_SUFFIX but the lock and the temporary files, and the workers' copies."""
    from replay.rules import run_files

    suffixes = [value for name, value in vars(run_files).items()
                if name.endswith("_SUFFIX") and name not in ("LOCK_SUFFIX", "TMP_SUFFIX")]
    return [f"OUTPUT{suffix}" for suffix in suffixes] + ["OUTPUT.worker-N.jsonl"]


def test_the_readme_and_the_architecture_name_every_file_a_run_writes():
    readme_table = {m for m in re.findall(r"^\| `(OUTPUT[^`]*)`", README.read_text(), re.M)}
    assert [name for name in run_file_names() if name not in readme_table] == []
    outputs = next(line for line in (REPO / "docs" / "architecture.md").read_text().splitlines()
                   if line.startswith("OUTPUT, "))
    assert [name for name in run_file_names() if name != "OUTPUT.worker-N.jsonl" and name not in outputs] == []

"""Which replay modules a module imports, read from the sources (their syntax trees), never by
importing them: the set-up cache keys its entries on the source of every module that decides a
set-up (synth/setup_cache.py), and tests/test_layout.py finds import cycles with it.

A module's imports are its `import replay.x` and `from replay.x import y` statements (y counts
as a module when replay/x/y.py or replay/x/y/ exists), and importing a module runs its
packages' __init__.py first, so those count too. Imports under `if TYPE_CHECKING:` never run and
are left out; imports inside functions run on a call and are counted unless asked otherwise.

Parsing is most of the cost; an ImportMemo keeps each source's imports by the
sha256 of its name and bytes, which decide them, so a caller can keep them across processes
and parse only the sources that changed.
"""

from __future__ import annotations

import ast
import hashlib
from collections.abc import Iterable, Mapping
from pathlib import Path

PACKAGE = "replay"
ROOT = Path(__file__).resolve().parent.parent  # the folder holding the `replay` package


def module_file(name: str, root: Path = ROOT) -> Path | None:
    """The source of module `name` (a package's __init__.py) under `root`, or None."""
    base = root.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def all_modules(root: Path = ROOT) -> list[str]:
    """Every module of the package under `root`, by name."""
    names = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


_BODIES = ("body", "orelse", "finalbody", "handlers", "cases")  # where statements hold statements


def _statements(tree: ast.Module, in_functions: bool) -> Iterable[ast.Import | ast.ImportFrom]:
    """The import statements that run: not under `if TYPE_CHECKING:`, and, without
    `in_functions`, not inside a function. Only statements are walked (an import is one), not
    the expressions in them: a tenth of the nodes."""
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        for name in _BODIES:
            for child in getattr(node, name, ()):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    yield child
                elif isinstance(child, ast.If) and _is_type_checking(child.test):
                    todo.extend(child.orelse)
                elif in_functions or not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    todo.append(child)


def _with_packages(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


class ImportMemo:
    """The replay imports each source names (before checking which of them exist), by the
    sha256 of the module's name, whether it is a package, whether imports in functions count,
    and its bytes. `known`: a memo kept from earlier (replay.synth.setup_cache keeps one on
    disk); `used`: the entries this process needed, what is worth keeping."""

    def __init__(self, known: Mapping[str, list[str]] | None = None):
        self.known = dict(known or {})
        self.used: dict[str, list[str]] = {}

    def targets(self, name: str, source: bytes, path: Path, in_functions: bool) -> list[str]:
        is_package = path.name == "__init__.py"  # its relative imports start from itself
        key = hashlib.sha256(f"{name}\0{int(is_package)}\0{int(in_functions)}\0".encode() + source).hexdigest()
        found = self.known.get(key)
        if found is None:
            found = _import_targets(name, source, path, in_functions)
        self.used[key] = found
        return found

    @property
    def parsed(self) -> bool:
        """Whether a source was parsed: `used` holds an entry `known` did not."""
        return not self.used.keys() <= self.known.keys()

    def kept(self, limit: int) -> dict[str, list[str]]:
        """What is worth keeping: every entry used, and those known from earlier that were not
        (another checkout's sources on this host, whose runs would otherwise parse them again
        after each of this one's), `limit` entries at most, the oldest known dropped first."""
        kept = {key: found for key, found in self.known.items() if key not in self.used}
        kept.update(self.used)
        return dict(list(kept.items())[-limit:])


def _import_targets(name: str, source: bytes, path: Path, in_functions: bool) -> list[str]:
    """The replay modules module `name`'s `source` imports by name, whether or not they exist."""
    tree = ast.parse(source, str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[str] = []
    for statement in _statements(tree, in_functions):
        if isinstance(statement, ast.Import):
            targets = [alias.name for alias in statement.names]
        else:
            base = statement.module or ""
            if statement.level:
                anchor = package.split(".")[: len(package.split(".")) - statement.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{alias.name}" for alias in statement.names]
        found.extend(target for target in targets if target.split(".")[0] == PACKAGE and target not in found)
    return found


def imported_modules(name: str, root: Path = ROOT, in_functions: bool = True, memo: ImportMemo | None = None) -> set[str]:
    """The replay modules that importing module `name` (or calling its functions, with
    `in_functions`) imports directly, with their packages."""
    path = module_file(name, root)
    if path is None:
        return set()
    source = path.read_bytes()
    targets = (memo.targets(name, source, path, in_functions) if memo is not None
               else _import_targets(name, source, path, in_functions))
    found: set[str] = set()
    for target in targets:
        if module_file(target, root) is not None:
            found.update(_with_packages(target))
    found.discard(name)
    return found


def import_closure(entries: Iterable[str], root: Path = ROOT, in_functions: bool = True,
                   memo: ImportMemo | None = None) -> list[str]:
    """`entries`, their packages, and every replay module they import, directly or not; sorted."""
    seen: set[str] = set()
    todo = [package for entry in entries for package in _with_packages(entry)]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(imported_modules(name, root, in_functions, memo) - seen)
    return sorted(seen)


def source_digest(entries: Iterable[str], root: Path = ROOT, memo: ImportMemo | None = None) -> str:
    """sha256 over the names and sources of import_closure(entries): any edit to a module they
    run, however far down, is a new digest."""
    digest = hashlib.sha256()
    for name in import_closure(entries, root, memo=memo):
        path = module_file(name, root)
        if path is not None:
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()

"""mypy over the package (pyproject.toml's [tool.mypy]), held to a baseline that only shrinks.

The packages the engine is made of (STRICT) must have no error at all. Every other module may
have at most the errors tests/mypy-baseline.txt counts for it (one `module count` a line): a
module that gains one fails, naming its errors; one that lost some is written down with
`--update` (which never raises a count, and adds a module it did not name, a new one, at its
count: the diff shows it), so the file only shrinks. `make types` runs it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASELINE = ROOT / "tests" / "mypy-baseline.txt"
STRICT = ("replay.run", "replay.engine", "replay.protocol", "replay.rules")
ERROR = re.compile(r"^(replay/\S+)\.py:\d+: error: ")


def module_of(path: str) -> str:
    return path.replace("/", ".").removesuffix(".__init__")


def count_errors(output: str) -> tuple[Counter[str], dict[str, list[str]]]:
    """Errors per module in mypy's output, and their lines."""
    counts: Counter[str] = Counter()
    lines: dict[str, list[str]] = {}
    for line in output.splitlines():
        match = ERROR.match(line)
        if match:
            module = module_of(match[1])
            counts[module] += 1
            lines.setdefault(module, []).append(line)
    return counts, lines


def read_baseline(path: Path = BASELINE) -> dict[str, int]:
    known = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            module, count = line.split()
            known[module] = int(count)
    return known


def problems(counts: Counter[str], known: dict[str, int]) -> list[str]:
    """The modules over their allowance: any error in STRICT, more than the baseline elsewhere."""
    found = []
    for module, count in sorted(counts.items()):
        strict = is_strict(module)
        allowed = 0 if strict else known.get(module, 0)
        if count > allowed:
            found.append(f"{module}: {count} mypy errors, {allowed} allowed" + (" (a strict package)" if strict else ""))
    return found


def is_strict(module: str) -> bool:
    return module in STRICT or module.startswith(tuple(p + "." for p in STRICT))


def write_baseline(counts: Counter[str], known: dict[str, int], path: Path = BASELINE) -> dict[str, int]:
    """Write the allowances: a module's count where it fell, never above what the file allowed;
    a module the file did not name (new) at its count; none for a strict one. Returns them."""
    kept = {m: min(c, known.get(m, c)) for m, c in counts.items() if c and not is_strict(m)}
    body = "".join(f"{m} {c}\n" for m, c in sorted(kept.items()))
    path.write_text(f"# mypy errors allowed per module (tests/support/mypy_baseline.py); {sum(kept.values())} in all\n"
                    + body)
    return kept


def main(argv: list[str]) -> int:
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    if done.returncode not in (0, 1) or "error: " not in done.stdout and done.returncode:
        sys.stderr.write(done.stdout + done.stderr)
        return 2
    counts, lines = count_errors(done.stdout)
    known = read_baseline() if BASELINE.exists() else {}
    if "--update" in argv:
        known = write_baseline(counts, known)
    over = problems(counts, known)
    for problem in over:
        module = problem.split(":")[0]
        sys.stderr.write(problem + "\n" + "".join(f"  {line}\n" for line in lines.get(module, ())))
    total = sum(counts.values())
    print(f"mypy: {total} errors, baseline {sum(known.values())}; {len(over)} module(s) over their allowance")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The types' baseline (tests/support/mypy_baseline.py, `make types`): a module may not gain a
mypy error, the strict packages may have none, and the file is only ever lowered."""

from collections import Counter

from support.mypy_baseline import count_errors, problems, read_baseline, write_baseline

OUTPUT = """replay/results/compare.py:10: error: Incompatible types  [assignment]
replay/results/compare.py:12: error: Incompatible types  [assignment]
replay/results/compare.py:12: note: a note is no error
replay/engine/plan.py:3: error: Item "None" has no attribute "x"  [union-attr]
replay/trace/__init__.py:1: error: Name "x" is not defined  [name-defined]
Found 4 errors in 3 files (checked 144 source files)
"""


def test_errors_are_counted_per_module():
    counts, lines = count_errors(OUTPUT)
    assert counts == {"replay.results.compare": 2, "replay.engine.plan": 1, "replay.trace": 1}
    assert len(lines["replay.results.compare"]) == 2


def test_a_module_over_its_baseline_or_any_error_in_a_strict_package_fails():
    counts, _ = count_errors(OUTPUT)
    assert problems(counts, {"replay.results.compare": 2, "replay.trace": 1, "replay.engine.plan": 5}) == [
        "replay.engine.plan: 1 mypy errors, 0 allowed (a strict package)"]
    assert problems(counts, {"replay.results.compare": 1, "replay.trace": 1}) == [
        "replay.engine.plan: 1 mypy errors, 0 allowed (a strict package)",
        "replay.results.compare: 2 mypy errors, 1 allowed"]


def test_the_baseline_is_only_lowered(tmp_path):
    path = tmp_path / "baseline.txt"
    write_baseline(Counter({"replay.results.compare": 3, "replay.trace": 1}),
                   {"replay.results.compare": 2, "replay.trace": 4, "replay.gone": 1}, path)
    assert read_baseline(path) == {"replay.results.compare": 2, "replay.trace": 1}


def test_the_checked_in_baseline_names_no_strict_module():
    strict = ("replay.run.", "replay.engine.", "replay.protocol.", "replay.rules.")
    assert [m for m in read_baseline() if m.startswith(strict)] == []

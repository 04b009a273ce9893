"""Every file a command writes is claimed before anything is read or written (replay/output_claim.py).

The options are found FROM THE PARSERS (`replay`'s, and the options `replay run` adds to
Locust's): an option that looks like an output path must be declared with an output role, and
every declared output of every command is attacked here with its own inputs (the same name, a
hard link, a symbolic link; the files beside a run; the trace a run's metadata names), a
device, a FIFO, a folder, a missing folder and another output of the same command. Each must
be refused with exit 2 and one line naming the option, leaving everything as it was. Before:
`replay compare A B --json A` replaced A's records, `replay report R --json R.meta.json` its
metadata, and as root `--json DEV` turned a device into a regular file, all exit 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import stat
from pathlib import Path

import pytest

from replay.cli import build_parser, main
from replay.engine.options import add_arguments
from replay.errors import OutputError
from replay.locust import outputs as locust_outputs_module
from replay.output_claim import Output, OutputFolder, PathRole, option_label
from replay.results.files import write_atomically
from replay.rules.run_files import meta_path, summary_path, tmp_path
from support.paths import char_device
from support.records import ok_record
from support.traces import BLOCK, mooncake_trace

# -- the options, from the parsers --------------------------------------------------------------


def commands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every (sub)command's parser under `parser`, leaves only."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [parser]
    return [leaf for sub in subs for child in sub.choices.values() for leaf in commands(child)]


def run_parser() -> argparse.ArgumentParser:
    """The options `replay run` adds to Locust's parser (replay.locust.plugin calls this)."""
    parser = argparse.ArgumentParser(prog="replay run")
    add_arguments(parser)
    return parser


PARSERS = [*commands(build_parser()), run_parser()]
WRITES = re.compile(r"\b(write|writes|written|save|saves|store|stores|dump|dumps|log file|to file)\b", re.IGNORECASE)
PATH_NAMES = re.compile(r"(^|_)(out|output|dir|folder|file|path|png|html|csv|log|logfile)($|_)", re.IGNORECASE)


def takes_text(action: argparse.Action) -> bool:
    """An option whose value is a string (a path could be): not a flag, a number or help."""
    return action.nargs != 0 and action.type not in (int, float) and not isinstance(action, argparse._SubParsersAction)


def looks_like_an_output(action: argparse.Action) -> bool:
    return takes_text(action) and bool(WRITES.search(action.help or ""))


def looks_like_a_path(action: argparse.Action) -> bool:
    names = [action.dest, *(action.metavar if isinstance(action.metavar, tuple) else [action.metavar or ""])]
    return looks_like_an_output(action) or (takes_text(action) and any(PATH_NAMES.search(n) for n in names))


def declared_outputs() -> list[tuple[str, str]]:
    return [(p.prog, option_label(a)) for p in PARSERS for a in p._actions if isinstance(a.type, (Output, OutputFolder))]


def test_every_option_that_looks_like_a_path_is_declared_through_the_claim():
    """A new command or output option cannot skip the claim: an option whose name says it is a
    path must be typed with a role (replay.output_claim), and one whose help says it writes,
    an Output or an OutputFolder."""
    undeclared = [f"{p.prog} {option_label(a)}" for p in PARSERS for a in p._actions
                  if looks_like_a_path(a) and not isinstance(a.type, PathRole)]
    assert undeclared == []
    inputs_that_write = [f"{p.prog} {option_label(a)}" for p in PARSERS for a in p._actions
                         if looks_like_an_output(a) and not isinstance(a.type, (Output, OutputFolder))]
    assert inputs_that_write == []
    # every output this file attacks below, and no other
    assert set(declared_outputs()) == {(prog, option) for prog, recipe in RECIPES.items() for option in recipe[1]} | {
        ("replay run", "--output")}


def test_the_check_finds_an_output_option_declared_without_a_role():
    parser = argparse.ArgumentParser()
    found = [parser.add_argument("--rows-csv", help="the rows as CSV"), parser.add_argument("--plot", help="save it here"),
             parser.add_argument("dump_dir")]
    passed = [parser.add_argument("--slo", help="ttft_ms=.."), parser.add_argument("--overwrite", action="store_true",
                                                                               help="write over it"),
              parser.add_argument("--seed", type=int, help="the output tokens' seed")]
    assert all(map(looks_like_a_path, found)) and looks_like_an_output(found[1])
    assert not any(map(looks_like_a_path, passed))


def test_every_file_option_of_locust_is_claimed_with_the_run_or_said_not_to_be():
    """`replay run` is Locust's command line: its own file options (--html ...) are claimed with
    --output (replay.locust.outputs) or listed as opened before the package's code runs."""
    from locust.argument_parser import get_parser

    import replay.locust.plugin  # noqa: F401 (adds the replay options, as `replay run` does)

    parser = get_parser(default_config_files=[])
    replays = {a.dest for a in run_parser()._actions}
    locusts = {a.dest for a in parser._actions if looks_like_an_output(a) and a.dest not in replays}
    assert locusts == set(locust_outputs_module.CLAIMED) | set(locust_outputs_module.NOT_CLAIMED)


# -- every declared output, attacked ------------------------------------------------------------

# A command's arguments ({OUT}: where a positional output goes) and its output options.
RECIPES: dict[str, tuple[list[str], list[str]]] = {
    "replay report": (["report", "{run_a}"], ["--json", "--html", "--png-dir"]),
    "replay compare": (["compare", "{run_a}", "{run_b}", "--allow-different", "--resamples", "100"],
                       ["--json", "--html"]),
    "replay trace convert": (["trace", "convert", "{trace}", "{OUT}", "--block-size", str(BLOCK)], ["OUT"]),
    "replay trace amplify": (["trace", "amplify", "{trace}", "{OUT}", "--factor", "2", "--block-size", str(BLOCK)],
                             ["OUT"]),
    "replay trace anonymize": (["trace", "anonymize", "{trace}", "{OUT}", "--tokenize-url", "http://127.0.0.1:9"],
                               ["OUT"]),
    # the proxy reads its --salt-file; an --output given again wins over the recipe's own
    "replay record": (["record", "--upstream", "http://127.0.0.1:9", "--block-size", str(BLOCK), "--port", "0",
                       "--salt-file", "{trace}", "--output", "{trace}.recorded.jsonl"], ["--output", "--raw-log"]),
}
# What each command reads (and so must never write): the inputs it is given, the files beside a
# run, the trace a run's metadata names.
VICTIMS = {"replay report": ["run_a", "run_a_meta", "run_a_summary", "trace"],
           "replay compare": ["run_a", "run_b", "run_b_meta", "run_b_summary"],
           "replay trace convert": ["trace"], "replay trace amplify": ["trace"], "replay trace anonymize": ["trace"],
           "replay record": ["trace"]}
CASES = [(prog, option) for prog, (_, options) in RECIPES.items() for option in options]


@pytest.fixture
def files(tmp_path) -> dict[str, Path]:
    """Two runs' records (with metadata naming their trace, and a summary) and the trace, in
    their own folder; the attacks' paths go in tmp_path/work."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    (tmp_path / "work").mkdir()
    trace = mooncake_trace(inputs / "trace.jsonl", rows=20, gap_ms=10)
    made = {"trace": trace}
    rng = random.Random(0)
    for name in ("run_a", "run_b"):
        run = inputs / f"{name}.jsonl"
        run.write_text("".join(json.dumps(ok_record(i, rng)) + "\n" for i in range(150)))
        meta_path(run).write_text(json.dumps({"trace": {"path": str(trace)}}) + "\n")
        summary_path(run).write_text("{}\n")
        made |= {name: run, f"{name}_meta": meta_path(run), f"{name}_summary": summary_path(run)}
    return made


def argv(prog: str, option: str, value: Path | str, files: dict[str, Path], *extra: str) -> list[str]:
    template, _ = RECIPES[prog]
    values = {name: str(path) for name, path in files.items()} | {"OUT": str(value)}
    args = [word.format(**values) for word in template]
    if option != "OUT":
        args += [option, str(value)]
    if option == "OUT" and "{OUT}" not in template:
        raise AssertionError(f"{prog}: no place for OUT")
    return [*args, *extra]


def snapshot(root: Path) -> dict[str, tuple]:
    """Every path under `root`: its kind, inode and bytes (a link: its target)."""
    out = {}
    for path in sorted(root.rglob("*")):
        st = os.lstat(path)
        body = os.readlink(path) if stat.S_ISLNK(st.st_mode) else path.read_bytes() if stat.S_ISREG(st.st_mode) else None
        out[str(path.relative_to(root))] = (stat.S_IFMT(st.st_mode), st.st_ino, body)
    return out


def refused(args: list[str], prog: str, option: str, capsys, root: Path) -> str:
    """Exit 2, one line on stderr naming the command and the option, nothing changed under root."""
    before = snapshot(root)
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"{prog}: {option} "), err
    assert "Traceback" not in err
    assert snapshot(root) == before
    return err


@pytest.mark.parametrize("prog, option", CASES)
@pytest.mark.parametrize("how", ["same name", "another spelling", "hard link", "symbolic link"])
def test_an_output_on_an_input_is_refused(prog, option, how, files, tmp_path, capsys):
    for victim in VICTIMS[prog]:
        target = files[victim]
        if how == "same name":
            value = target
        elif how == "another spelling":
            value = tmp_path / "work" / ".." / "in" / "." / target.name
        else:
            value = tmp_path / "work" / f"{victim}-{how.replace(' ', '-')}"
            (os.link if how == "hard link" else os.symlink)(target, value)
        err = refused(argv(prog, option, value, files), prog, option, capsys, tmp_path)
        assert "which this command reads" in err, err


@pytest.mark.parametrize("prog, option", CASES)
@pytest.mark.parametrize("make, kind", [(char_device, "a character device"), (os.mkfifo, "a FIFO")])
def test_an_output_on_a_device_or_a_fifo_is_refused(prog, option, make, kind, files, tmp_path, capsys):
    """As root, an atomic write's rename turned a device into a regular file (exit 0)."""
    node = tmp_path / "work" / "node"
    make(node)
    err = refused(argv(prog, option, node, files), prog, option, capsys, tmp_path)
    assert f"is {kind}, not a " in err
    assert (stat.S_ISCHR if make is char_device else stat.S_ISFIFO)(os.lstat(node).st_mode)


@pytest.mark.parametrize("prog, option", [case for case in CASES if case[1] != "--png-dir"])
def test_an_output_on_a_folder_or_on_its_temporary_file_is_refused(prog, option, files, tmp_path, capsys):
    folder = tmp_path / "work" / "folder"
    folder.mkdir()
    refused(argv(prog, option, folder, files), prog, option, capsys, tmp_path)
    out = tmp_path / "work" / "out.jsonl"  # FILE.tmp, written and renamed over FILE, a FIFO: it waited forever
    os.mkfifo(tmp_path_of(out))
    err = refused(argv(prog, option, out, files), prog, option, capsys, tmp_path)
    assert f"{tmp_path_of(out)} is a FIFO" in err
    os.unlink(tmp_path_of(out))  # a link to someone else's file: it was written through, FILE made a link to it
    (tmp_path / "someone-elses.txt").write_text("theirs\n")
    tmp_path_of(out).symlink_to(tmp_path / "someone-elses.txt")
    err = refused(argv(prog, option, out, files), prog, option, capsys, tmp_path)
    assert f"{tmp_path_of(out)} is a symbolic link" in err


def tmp_path_of(path: Path) -> Path:
    return tmp_path(path)


@pytest.mark.parametrize("prog, option", CASES)
def test_no_folder_is_made_but_the_documented_one(prog, option, files, tmp_path, capsys):
    """A missing folder is refused, and nothing made: write_atomically made every folder above
    an output (mkdir parents=True). --png-dir makes its own folder only."""
    value = tmp_path / "work" / "missing" / "deeper" / "out.json"
    err = refused(argv(prog, option, value, files), prog, option, capsys, tmp_path)
    assert f"the folder {value.parent} does not exist" in err
    blocker = tmp_path / "work" / "a-file"
    blocker.write_text("x")
    err = refused(argv(prog, option, blocker / "out.json", files), prog, option, capsys, tmp_path)
    assert f"{blocker} is a file, not a folder" in err


@pytest.mark.parametrize("prog", [prog for prog, (_, options) in RECIPES.items() if len(options) > 1])
def test_two_outputs_of_one_command_on_one_file_are_refused(prog, files, tmp_path, capsys):
    _, options = RECIPES[prog]
    same = tmp_path / "work" / "same"
    first, second = options[0], options[1]
    refused(argv(prog, first, same, files, second, str(same)), prog, second, capsys, tmp_path)


def test_an_html_page_among_the_png_files_is_refused(files, tmp_path, capsys):
    pngs = tmp_path / "work" / "pngs"
    pngs.mkdir()
    refused(argv("replay report", "--png-dir", pngs, files, "--html", str(pngs / "latency-cdf.png")),
            "replay report", "--png-dir", capsys, tmp_path)  # the options in the parser's order


@pytest.mark.parametrize("make, kind", [(os.mkfifo, "a FIFO"), (lambda p: p.symlink_to("/dev/null"),
                                                                "a symbolic link")])
def test_a_png_the_report_would_replace_is_claimed_too(make, kind, files, tmp_path, capsys):
    pngs = tmp_path / "work" / "pngs"
    pngs.mkdir()
    make(pngs / "latency-cdf.png")
    (pngs / "notes.txt").symlink_to("/dev/null")  # not a file the report writes: left alone, not refused
    err = refused(argv("replay report", "--png-dir", pngs, files, "--html", str(tmp_path / "work" / "r.html")),
                  "replay report", "--png-dir", capsys, tmp_path)
    assert f"{pngs / 'latency-cdf.png'} is {kind}" in err


def test_the_outputs_are_written_where_claimed(files, tmp_path, capsys):
    """The claim refuses only what it must: a new file, a regular file of its own, a new
    --png-dir in a folder that exists."""
    work = tmp_path / "work"
    (work / "old.json").write_text("an earlier report\n")
    assert main(argv("replay report", "--json", work / "old.json", files)) == 0
    assert json.loads((work / "old.json").read_text())["requests"] == 150
    assert main(argv("replay compare", "--json", work / "c.json", files)) == 0
    assert main(argv("replay trace convert", "OUT", work / "t.jsonl.gz", files)) == 0
    assert main(argv("replay trace amplify", "OUT", work / "a.jsonl", files)) == 0
    assert sorted(p.name for p in work.iterdir()) == ["a.jsonl", "c.json", "old.json", "t.jsonl.gz"]


# -- the writers themselves, against a node swapped in after the claim ------------------------


def test_write_atomically_replaces_only_a_regular_file_and_makes_no_folder(tmp_path):
    device = tmp_path / "fifo"
    os.mkfifo(device)
    with pytest.raises(OutputError, match="is a FIFO, not a regular file"):
        write_atomically(device, b"{}\n")
    assert stat.S_ISFIFO(os.lstat(device).st_mode) and not tmp_path_of(device).exists()
    outside = tmp_path / "outside"
    outside.write_text("someone else's\n")
    page = tmp_path / "page.html"
    tmp_path_of(page).symlink_to(outside)  # never written through
    with pytest.raises(OutputError):
        write_atomically(page, b"<html>")
    assert outside.read_text() == "someone else's\n" and not page.exists()
    with pytest.raises(OutputError):
        write_atomically(tmp_path / "missing" / "x.json", b"{}")
    assert not (tmp_path / "missing").exists()


def test_the_trace_writers_leave_a_node_swapped_in_after_the_claim(tmp_path):
    """convert_trace and amplify_trace (OUT.tmp) refuse a node they are handed, and leave it:
    their clean-up after a failed write removed whatever was at the path."""
    from replay.trace.amplify import amplify_trace
    from replay.trace.convert import convert_trace
    from replay.trace.reader import TraceStream, read_trace

    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=20, gap_ms=10)
    fifo = tmp_path / "out.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(OutputError, match="is a FIFO, not a regular file"):
        convert_trace(read_trace(trace, block_size=BLOCK), fifo)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    out = tmp_path / "amplified.jsonl"
    os.mkfifo(tmp_path_of(out))
    with pytest.raises(OutputError, match="is a FIFO, not a regular file"):
        amplify_trace(lambda: TraceStream(trace, None, BLOCK), out, 2.0)
    assert stat.S_ISFIFO(os.lstat(tmp_path_of(out)).st_mode) and not out.exists()

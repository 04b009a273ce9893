"""The one claim on every file a command writes, made before anything is read or written.

A path a command writes must be a new file or a regular file of its own: never a file the
command reads (by inode, through links and hard links, the files beside a run included), never
a device, FIFO, socket, folder or link (an atomic write's rename would replace the node, a plain
open would write into it or through it), never a second output of the same command, and never
in a folder that does not exist (a command makes only the folders its documentation says it
makes: `replay run`'s --output folder, `replay report`'s --png-dir).

Each command's parser says which of its options are paths, and how, by their argparse `type`:
an `Output`, an `OutputFolder` or an `Input` (the identity on the text; the role is the
marker). `replay/cli.py` claims every command's outputs from its parser before the command
runs (`claim_command`), and `replay run` claims its --output in its preflight from the fields
of its options (`replay.results.output`), so a new command or output option is claimed by
being declared, and tests/test_output_claim.py finds any option that looks like an output
and is not.
"""

from __future__ import annotations

import argparse
import os
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from fnmatch import fnmatch
from pathlib import Path

from replay.errors import OptionError
from replay.rules.run_files import tmp_path


@dataclass(frozen=True)
class Read:
    """A file or folder the command reads, and how a refusal names it."""

    path: Path
    label: str


@dataclass(frozen=True)
class Written:
    """What one output option writes: `paths`, the file it names first (and the temporary
    files written and renamed over it); for a folder, the folder, whose entries matching
    `entries` are replaced."""

    option: str
    value: str
    paths: tuple[Path, ...]
    entries: str | None = None  # a folder output: the glob of the files written in it
    replaced: str = "a regular file is"  # "only ... replaced" in the refusal of a node
    makes_folder: bool = False  # its folder is made when missing (replay run's --output)


class PathRole:
    """An argparse `type` marking an option's value as a path: the text, unchanged."""

    def __init__(self, name: str):
        self.__name__ = name  # argparse names a type by it in its own errors

    def __call__(self, text: str) -> str:
        return text

    def __repr__(self) -> str:
        return self.__name__


class Output(PathRole):
    """A file written whole: `files(path)` lists every file written for it (by default the
    file and FILE.tmp, renamed over it when whole)."""

    def __init__(self, name: str = "output file", files: Callable[[Path], list[Path]] | None = None):
        super().__init__(name)
        self.files = files or (lambda path: [path, tmp_path(path)])


class OutputFolder(PathRole):
    """A folder the command writes files matching `entries` in; made when missing (its parent
    must exist)."""

    def __init__(self, entries: str, name: str = "output folder"):
        super().__init__(name)
        self.entries = entries


class Input(PathRole):
    """A file or folder the command reads (a value that names nothing here, such as a Hugging
    Face id, names nothing to protect); `expand(value)` lists what else reading it reads (a
    run's records: the files beside them)."""

    def __init__(self, name: str = "input", expand: Callable[[str, str], list[Read]] | None = None):
        super().__init__(name)
        self.expand = expand or (lambda value, label: [Read(Path(value), f"{label} {value}")])


INPUT = Input()
OUTPUT = Output()

_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


def kind_of(mode: int) -> str:
    """What a node that is not a regular file is, in words."""
    return next((name for test, name in _KINDS if test(mode)), "not a file")


def open_regular(path: str | Path, flags: int) -> int:
    """`path` opened with `flags` (as os.open; created 0o666 less the umask), only if what is
    there is a regular file or nothing: no link followed, no FIFO waited on, no device written.
    The writers' own check against a node swapped in after the claim; OSError otherwise."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError:  # a link (ELOOP), a FIFO without a reader (ENXIO): say what it is
        mode = os.lstat(path).st_mode if os.path.lexists(path) else stat.S_IFREG
        if not stat.S_ISREG(mode):
            raise OSError(f"{path} is {kind_of(mode)}, not a regular file") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise OSError(f"{path} is {kind_of(mode)}, not a regular file")
    return fd


def claim(written: list[Written], read: list[Read], hint: str = "") -> None:
    """Refuse (OptionError, one line naming the option and the path) any output that is an
    input, a node other than a regular file, in a folder that does not exist, or another
    output. Makes and changes nothing."""
    identities = _identities(read)
    for n, out in enumerate(written):
        if not out.value:
            raise OptionError(f"{out.option}: names no file{hint}")
        for path in out.paths:
            _refuse_an_input(out, path, read, identities, hint)
        if out.entries is None:
            for path in out.paths:
                _refuse_all_but_regular_files(out, path, hint)
            if not out.makes_folder:
                _refuse_a_missing_folder(out, out.paths[0].parent, hint)
        else:
            _claim_folder(out, read, identities, hint)
        for earlier in written[:n]:
            _refuse_the_same(earlier, out)


def claim_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Claim the outputs of the command `args` was parsed for: every option of its parser
    (and of the parsers above it) whose type is a PathRole."""
    given = [(action, text) for action in _actions(parser, args) if isinstance(action.type, PathRole)
             for text in _values(getattr(args, action.dest, None))]
    written = []
    for action, text in given:
        if isinstance(action.type, OutputFolder):
            written.append(Written(option_label(action), text, (Path(text),), action.type.entries))
        elif isinstance(action.type, Output):
            written.append(Written(option_label(action), text, tuple(action.type.files(Path(text)))))
    if written:  # else nothing to claim, and no input to look at (a run's metadata read)
        claim(written, [r for action, text in given if isinstance(action.type, Input)
                        for r in action.type.expand(text, option_label(action))])


def _values(value: object) -> list[str]:
    """An option's value as a list of texts: none, one, or a repeated option's (append, nargs)."""
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [str(value)]


def command_prog(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The name of the (sub)command `args` was parsed for, e.g. "replay trace amplify"."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and getattr(args, action.dest, None) in action.choices:
            return command_prog(action.choices[getattr(args, action.dest)], args)
    return parser.prog


def declared_inputs(options: object) -> list[Read]:
    """What a dataclass of options (replay.engine.options) reads: its fields typed Input."""
    read = []
    for f in fields(options):
        role, value = f.metadata.get("type"), getattr(options, f.name)
        if isinstance(role, Input) and value:
            read += role.expand(value, "--" + f.name.replace("_", "-"))
    return read


def option_label(action: argparse.Action) -> str:
    """How a message names an option: its flag, or a positional's metavar (IN, OUT)."""
    if action.option_strings:
        return action.option_strings[0]
    return action.metavar if isinstance(action.metavar, str) else action.dest.upper()


def _actions(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Iterable[argparse.Action]:
    for action in parser._actions:
        yield action
        if isinstance(action, argparse._SubParsersAction) and getattr(args, action.dest, None) in action.choices:
            yield from _actions(action.choices[getattr(args, action.dest)], args)


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)  # through links: a link to an input is that input
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _identities(read: list[Read]) -> dict[tuple[int, int], Read]:
    return {ident: r for r in read if (ident := _identity(r.path)) is not None}


def _refuse_an_input(out: Written, path: Path, read: list[Read], identities: dict, hint: str) -> None:
    """`path` is a file the command reads: the same inode (a hard link, a symbolic link), or
    the same name."""
    real, ident = os.path.realpath(path), _identity(path)
    hit = identities.get(ident) if ident is not None else None
    hit = hit or next((r for r in read if os.path.realpath(r.path) == real), None)
    if hit is not None:
        what = "is" if path == Path(out.value) else f"writes {path}, which is"
        if real != os.path.realpath(hit.path):
            what += " the same file as"  # a hard link
        raise OptionError(f"{out.option} {out.value}: {what} {hit.label}, which this command reads: choose "
                          f"another {out.option}{hint}")


def _refuse_all_but_regular_files(out: Written, path: Path, hint: str) -> None:
    """A command replaces or writes through only regular files: a rename over a device replaced
    the device (as root), a plain open wrote into a FIFO or through a link."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # nothing there yet (or a file above it: said later)
        return
    except OSError as e:
        raise OptionError(f"{out.option} {out.value}: cannot inspect {path}: {e.strerror}{hint}") from None
    if not stat.S_ISREG(mode):
        raise OptionError(f"{out.option} {out.value}: {path} is {kind_of(mode)}, not a regular file; only "
                          f"{out.replaced} replaced: remove it, or choose another {out.option}{hint}")


def _refuse_a_missing_folder(out: Written, folder: Path, hint: str) -> None:
    if folder.is_dir():
        return
    blocker = next((p for p in [folder, *folder.parents] if os.path.lexists(p)), None)
    if blocker is not None and not blocker.is_dir():
        why = f"{blocker} is a file, not a folder"
    else:
        why = f"the folder {folder} does not exist: make it first"
    raise OptionError(f"{out.option} {out.value}: {why}{hint}")


def _claim_folder(out: Written, read: list[Read], identities: dict, hint: str) -> None:
    """A folder output: itself a folder (or made, in a folder that exists), and each of its
    entries that the command would replace a regular file that is not an input."""
    folder = out.paths[0]
    if not os.path.lexists(folder):
        _refuse_a_missing_folder(out, folder.parent, hint)
        return
    if not folder.is_dir():
        mode = os.lstat(folder).st_mode
        raise OptionError(f"{out.option} {out.value}: is {kind_of(mode)}, not a folder{hint}")
    for entry in sorted(folder.iterdir()):
        if fnmatch(entry.name, out.entries):
            _refuse_an_input(out, entry, read, identities, hint)
            _refuse_all_but_regular_files(out, entry, hint)


def _refuse_the_same(earlier: Written, out: Written) -> None:
    """Two outputs of one command on one file (any file either writes, or one in the other's
    folder among the files it writes there): the second would replace the first."""
    theirs = {os.path.realpath(p) for p in earlier.paths} | {i for p in earlier.paths if (i := _identity(p))}
    for path in out.paths:
        if os.path.realpath(path) in theirs or _identity(path) in theirs or _written_in(path, earlier):
            what = "" if path == Path(out.value) else f" ({path})"
            raise OptionError(f"{out.option} {out.value}: {earlier.option} {earlier.value} writes it too{what}: "
                              f"choose another {out.option}")
    if any(_written_in(p, out) for p in earlier.paths):
        raise OptionError(f"{out.option} {out.value}: {earlier.option} {earlier.value} is one of the files it writes: "
                          f"choose another {out.option}")


def _written_in(path: Path, folder: Written) -> bool:
    """Whether folder output `folder` writes a file named `path`."""
    return (folder.entries is not None and fnmatch(path.name, folder.entries)
            and os.path.realpath(path.parent) == os.path.realpath(folder.paths[0]))

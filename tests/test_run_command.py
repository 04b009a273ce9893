"""`replay run` is Locust with the packaged locustfile: its help lists Locust's options and the
replay options together; with a locustfile of the user's it is plain `locust`; `replay --version`.
That it runs replays, alone and as master and worker, from an installed wheel: test_wheel_install.py."""

import importlib.metadata
import subprocess
import sys

from replay.cli import COMMAND_MODULES, build_parser
from replay.locust.cli import LOCUSTFILE, locust_argv

REPLAY = [sys.executable, "-m", "replay"]
OPTIONS = {  # option: a piece of its help text
    "--trace TRACE": "trace file to replay",
    "--verify-server {auto,require,off}": "before the first send",
    "--server-metrics-interval S": "Prometheus /metrics",
    "--prompt-format {text,token-ids}": "list of token ids",
    "--tokenizer TOKENIZER": "tokenizer.json",
    "--replay-config REPLAY_CONFIG": "YAML file of these options",
}


def output_of(args: list[str], cwd) -> str:
    done = subprocess.run([*REPLAY, *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_run_help_lists_locusts_and_the_replay_options_in_their_group(tmp_path):
    text = output_of(["run", "--help"], tmp_path)  # an empty folder: no locustfile of the user's
    assert text.lstrip().startswith("Usage: replay run [options]")
    assert "Common options:" in text and "\ntrace replay:\n" in text
    group = text.split("\ntrace replay:\n", 1)[1]
    flat = " ".join(group.split())  # argparse wraps help texts
    for option, words in OPTIONS.items():
        assert option in flat, option
        assert words in flat.split(option, 1)[1][:400], (option, words)
    assert "--web-host" not in group  # Locust's own options are in their own groups


def test_run_with_a_locustfile_of_ones_own_is_plain_locust(tmp_path):
    (tmp_path / "mine.py").write_text("from locust import User, task\n\n\nclass U(User):\n    @task\n    def t(self):\n        pass\n")
    text = output_of(["run", "-f", "mine.py", "--help"], tmp_path)
    assert "Common options:" in text and "trace replay" not in text


def test_the_packaged_locustfile_comes_first_unless_one_is_named():
    assert LOCUSTFILE.is_file() and LOCUSTFILE.parent.name == "locust"
    assert locust_argv(["--headless"]) == ["-f", str(LOCUSTFILE), "--headless"]
    for named in (["-f", "a.py"], ["-fa.py"], ["--locustfile", "a.py"], ["--locustfile=a.py"]):
        assert locust_argv(["--worker", *named]) == ["--worker", *named]


def test_version(tmp_path):
    text = output_of(["--version"], tmp_path)
    assert text.strip() == (f"tracereplay {importlib.metadata.version('tracereplay')} "
                            f"(locust {importlib.metadata.version('locust')})")


def test_each_command_module_registers_its_own_command_only():
    """`replay COMMAND` imports COMMAND's module alone (replay/cli.py): each module must add
    exactly the command it is listed under, and the full parser (`replay --help`) every one."""
    for command in COMMAND_MODULES:
        assert set(build_parser(command)._subparsers._group_actions[0].choices) == {command}, command
    assert set(build_parser()._subparsers._group_actions[0].choices) == set(COMMAND_MODULES)


def test_a_command_imports_only_its_own_module():
    code = ("import sys; from replay.cli import main\ntry: main(['sim', '--help'])\nexcept SystemExit: pass\n"
            "print(sorted(m for m in sys.modules if m.endswith('cli') and m.startswith('replay')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert out.strip().splitlines()[-1] == "['replay.cli', 'replay.sim.cli']", out[-2000:]

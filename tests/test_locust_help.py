"""`locust -f locustfile.py --help` lists the replay options (Locust prints help before it
imports the locustfile: replay.locust_help's start-up hook, installed by `make install`)."""

import subprocess

from replay.locust_help import locustfile_of
from support.paths import REPO
from support.processes import LOCUST

OPTIONS = {  # option: a piece of its help text
    "--trace TRACE": "trace file to replay",
    "--verify-server {auto,require,off}": "before the first send",
    "--server-metrics-interval S": "Prometheus /metrics",
    "--prompt-format {text,token-ids}": "list of token ids",
    "--tokenizer TOKENIZER": "tokenizer.json",
    "--replay-config REPLAY_CONFIG": "YAML file of these options",
}


def help_text(command, cwd=REPO) -> str:
    done = subprocess.run(command + ["--help"], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_help_lists_the_replay_options_in_their_group():
    text = help_text(LOCUST)
    assert "\ntrace replay:\n" in text
    group = text.split("\ntrace replay:\n", 1)[1]
    flat = " ".join(group.split())  # argparse wraps help texts
    for option, words in OPTIONS.items():
        assert option in flat, option
        assert words in flat.split(option, 1)[1][:400], (option, words)
    assert "--web-host" not in group  # Locust's own options are in their own groups


def test_help_of_another_locustfile_has_no_replay_options(tmp_path):
    (tmp_path / "locustfile.py").write_text("from locust import User, task\n\n\nclass U(User):\n    @task\n    def t(self):\n        pass\n")
    text = help_text(LOCUST[:3] + ["-f", str(tmp_path / "locustfile.py")], cwd=tmp_path)
    assert "Common options:" in text and "trace replay" not in text


def test_the_locustfile_is_found_as_locust_finds_it(monkeypatch):
    monkeypatch.delenv("LOCUST_LOCUSTFILE", raising=False)
    assert str(locustfile_of(["locust", "--help"])) == "locustfile.py"
    assert str(locustfile_of(["locust", "-f", "a/b.py", "-h"])) == "a/b.py"
    assert str(locustfile_of(["locust", "--locustfile=run", "-h"])) == "run.py"
    monkeypatch.setenv("LOCUST_LOCUSTFILE", "x.py")
    assert str(locustfile_of(["locust", "--help"])) == "x.py"

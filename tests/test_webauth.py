"""The web UI's login (replay.locust.webauth): a real `locust` with its web UI on loopback and
`--web-login --web-user`, entered through Locust's own login form as a browser posts it,
with the Replay view behind the same login; and the start-ups it refuses with exit 2."""

from __future__ import annotations

import signal
import socket
import subprocess

import pytest
import requests

from replay.locust.webauth import Credentials, parse_web_user, safe_next
from support.ports import free_port
from support.processes import finish, run_locust, spawn_locust, start_web_locust, web_args
from support.traces import mooncake_trace
from support.waiting import wait_for

PASSWORD = "s3cret:with-colon"  # a ':' in the password is the password's


def login_redirect(response: requests.Response) -> str:
    """Where a refused request was sent: Locust's login page (flask_login's redirect)."""
    assert response.status_code == 302, (response.status_code, response.text[:200])
    return response.headers["Location"]


def log_in(base: str, password: str, page: str = "/replay",
           callback: str = "/login_submit") -> tuple[requests.Session, requests.Response]:
    """What a browser does: open a page, be sent to the login form, post the form."""
    browser = requests.Session()
    form = browser.get(f"{base}{page}", timeout=5)  # follows the redirect to /login?next=...
    assert form.status_code == 200 and form.url.startswith(f"{base}/login")
    assert f'"username_password_callback": "{callback}"' in form.text  # Locust's form, posting to ours
    posted = browser.post(f"{base}/login_submit", data={"username": "admin", "password": password},
                          allow_redirects=False, timeout=5)  # fmt: skip
    return browser, posted


def start_swarm_as(session: requests.Session, base: str, host: str) -> dict:
    """What Locust's Start button posts (test_webui.start_swarm), with the session's login."""
    return session.post(f"{base}/swarm", data={"user_count": "0", "spawn_rate": "0", "host": host}, timeout=10).json()


@pytest.mark.parametrize("workers", [0, 2], ids=["local", "master-2-workers"])
def test_login_guards_locust_ui_and_the_replay_view(tmp_path, toy_tokenizer_dir, sim, monkeypatch, workers):
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=12, gap_ms=20)
    output = tmp_path / "run.jsonl"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = [*web_args(trace, toy_tokenizer_dir, sim.url, output, port), "--web-login", "--web-user", "admin:$WEB_PW"]
    monkeypatch.setenv("WEB_PW", PASSWORD)  # the password never on the command line
    procs = start_web_locust(tmp_path, args, workers)
    try:
        wait_for(lambda: requests.get(f"{base}/login", timeout=2).ok, "the login page")
        anonymous = requests.Session()
        for page in ("/replay/stats", "/replay", "/", "/stats/requests"):
            response = anonymous.get(f"{base}{page}", allow_redirects=False, timeout=5)
            assert login_redirect(response).startswith("/login"), page
        assert login_redirect(anonymous.get(f"{base}/replay", allow_redirects=False, timeout=5)) == \
            "/login?next=%2Freplay"  # fmt: skip
        assert login_redirect(anonymous.post(f"{base}/swarm", data={"user_count": "0"}, allow_redirects=False,
                                             timeout=5)).startswith("/login")  # fmt: skip

        intruder, refused = log_in(base, "wrong")
        assert login_redirect(refused) == "/login"
        assert "Invalid username or password" in intruder.get(f"{base}/login", timeout=5).text
        assert login_redirect(intruder.get(f"{base}/replay/stats", allow_redirects=False, timeout=5))

        user, accepted = log_in(base, PASSWORD)
        assert login_redirect(accepted) == "/replay"  # back to the page the login was asked for
        wait_for(lambda: user.get(f"{base}/worker-count", timeout=2).json()["worker_count"] == workers, "workers")
        stats = user.get(f"{base}/replay/stats", timeout=5)
        assert stats.headers["Content-Type"] == "application/json"
        assert stats.json()["progress"]["rows_total"] == 12 and stats.json()["run"]["state"] == "waiting"
        assert "replay/stats" in user.get(f"{base}/replay", timeout=5).text
        index = user.get(f"{base}/", timeout=5)
        assert index.status_code == 200 and 'id="replay-view-link"' in index.text
        assert PASSWORD not in index.text and "WEB_PW" not in index.text  # e.g. among Locust's custom parameters

        started = start_swarm_as(user, base, sim.url)
        assert started["success"], started
        final = wait_for(lambda: (s := user.get(f"{base}/replay/stats", timeout=2).json())["run"]["state"]
                         == "finished" and s, "the replay to finish", timeout=30)  # fmt: skip
        assert final["progress"]["rows_done"] == 12
        # the "already run" answer (it names the output file) is for logged-in users only
        assert login_redirect(anonymous.post(f"{base}/swarm", data={"user_count": "0"}, allow_redirects=False,
                                             timeout=5)).startswith("/login")  # fmt: skip
        assert "already run" in start_swarm_as(user, base, sim.url)["message"]
    finally:
        procs[0].send_signal(signal.SIGTERM)
        finish(procs, timeout=20)
    log = (tmp_path / "master.log").read_text()
    assert "web UI login on: user 'admin'" in log and "failed login as 'admin' from 127.0.0.1" in log
    assert PASSWORD not in log and "Traceback" not in log and "all interfaces" not in log, log[-3000:]



def test_web_user_from_the_config_file_turns_the_login_on(tmp_path, toy_tokenizer_dir, sim, monkeypatch):
    """No --web-login: credentials given are a login asked for, also from --replay-config; under
    --web-base-path the login form posts, and returns, under it."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=4, gap_ms=20)
    config = tmp_path / "run.yaml"
    config.write_text("web-user: admin:$WEB_PW\n")
    port = free_port()
    base = f"http://127.0.0.1:{port}/ui"
    args = [*web_args(trace, toy_tokenizer_dir, sim.url, tmp_path / "run.jsonl", port), "--replay-config", str(config),
            "--web-base-path", "/ui"]  # fmt: skip
    monkeypatch.setenv("WEB_PW", PASSWORD)
    (proc,) = start_web_locust(tmp_path, args, workers=0)
    try:
        wait_for(lambda: requests.get(f"{base}/login", timeout=2).ok, "the login page")
        assert login_redirect(requests.get(f"{base}/replay/stats", allow_redirects=False, timeout=5))
        user, accepted = log_in(base, PASSWORD, page="/replay", callback="/ui/login_submit")
        assert login_redirect(accepted) == "/ui/replay"
        assert user.get(f"{base}/replay/stats", timeout=5).json()["progress"]["rows_total"] == 4
    finally:
        proc.send_signal(signal.SIGTERM)
        finish([proc], timeout=20)


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if "/ERROR/" in line]


def test_web_login_without_credentials_is_refused(tmp_path, toy_tokenizer_dir, sim):
    """A live server: the servers are asked what they serve before the web UI's login is set up."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=4, gap_ms=20)
    args = [*web_args(trace, toy_tokenizer_dir, sim.url, tmp_path / "run.jsonl", free_port()),
            "--web-login"]  # fmt: skip
    proc = run_locust(args, tmp_path, timeout=30, exit_code=2)
    (line,) = error_lines(proc)
    assert line.endswith("replay: --web-login needs --web-user USER:PASSWORD, the login it checks"
                         " (e.g. --web-user 'admin:$WEB_PASSWORD')")  # fmt: skip


def test_unset_password_variable_is_refused(tmp_path, toy_tokenizer_dir, monkeypatch):
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=4, gap_ms=20)
    args = [*web_args(trace, toy_tokenizer_dir, "http://127.0.0.1:9", tmp_path / "run.jsonl", free_port()),
            "--web-user", "admin:$TRACEREPLAY_UNSET_PW"]  # fmt: skip
    monkeypatch.delenv("TRACEREPLAY_UNSET_PW", raising=False)
    proc = run_locust(args, tmp_path, timeout=30, exit_code=2)
    (line,) = error_lines(proc)
    assert "--web-user: $TRACEREPLAY_UNSET_PW is not set on this host" in line


def test_all_interfaces_with_no_login_is_warned(tmp_path, toy_tokenizer_dir, sim):
    """--web-host 0.0.0.0 on a port this test holds: the warning comes at start-up, and the UI
    cannot bind, so the test never opens a UI to the network. (A live server: the servers are
    asked what they serve before the web UI's login is set up.)"""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=4, gap_ms=20)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        args = [a for a in web_args(trace, toy_tokenizer_dir, sim.url, tmp_path / "run.jsonl", port)]
        args[args.index("--web-host") + 1] = "0.0.0.0"
        proc = spawn_locust(args, tmp_path, tmp_path / "master.log")
        try:
            wait_for(lambda: "all interfaces" in (tmp_path / "master.log").read_text() or proc.poll() is not None,
                     "the warning", timeout=20)  # fmt: skip
        finally:
            proc.kill()
            proc.wait()
    log = (tmp_path / "master.log").read_text()
    assert (f"the web UI listens on all interfaces with no login: anyone who reaches port {port} can start and stop"
            " the replay; use --web-host 127.0.0.1 or --web-user USER:PASSWORD") in log, log[-2000:]


@pytest.mark.parametrize("value, expected", [
    ("admin:$PW", Credentials("admin", "p$ss:word")),  # expanded once: a '$' from a variable stays
    ("${USER_NAME}:pw", Credentials("ops", "pw")),
    ("admin:a:b", Credentials("admin", "a:b")),
    ("admin:pa$$word", Credentials("admin", "pa$word")),  # $$ a literal $, as in --header (replay.env_vars)
    ("admin:$$PW", Credentials("admin", "$PW")),
])  # fmt: skip
def test_parse_web_user(value, expected):
    assert parse_web_user(value, {"PW": "p$ss:word", "USER_NAME": "ops"}) == expected


@pytest.mark.parametrize("value, message", [
    ("admin", "--web-user: expected USER:PASSWORD"),
    ("admin:", "--web-user: the password for 'admin' is empty"),
    ("admin:$EMPTY", "--web-user: the password for 'admin' is empty"),
    (":pw", "--web-user: the user name is empty"),
    ("admin:pa$word", "--web-user: $word is not set on this host"),
    ("admin:pa$-word", "--web-user: the '$' at character 9 of the value starts no $VAR or ${VAR}; write $$ for a literal $"),
    ("adm$ :pa-word", "--web-user: the '$' at character 4 of the value starts no $VAR"),
])  # fmt: skip
def test_parse_web_user_errors(value, message):
    with pytest.raises(ValueError) as e:
        parse_web_user(value, {"EMPTY": ""})
    assert str(e.value).startswith(message)
    assert "pa$word" not in str(e.value) and "pa$-word" not in str(e.value)  # the password never shows


def test_credentials_never_print_the_password():
    assert "hunter2" not in repr(Credentials("admin", "hunter2"))
    assert Credentials("admin", "hunter2").match("admin", "hunter2")
    assert not Credentials("admin", "hunter2").match("admin", "hunter3")
    assert not Credentials("admin", "hunter2").match("root", "hunter2")


@pytest.mark.parametrize("target, expected", [
    ("/replay", "/replay"), ("/", "/"), ("//evil.example/x", None), ("https://evil.example/", None),
    ("/\\evil.example", None), (None, None),
])  # fmt: skip
def test_safe_next_stays_on_this_ui(target, expected):
    assert safe_next(target, "") == expected

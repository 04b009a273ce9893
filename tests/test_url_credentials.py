"""Credentials in a server URL (`http://user:password@host:port`) are used to connect (HTTP
Basic, as browsers and `requests` do) and never shown: every record's `endpoint`, the meta,
the summary, the server-metrics file, the logs, Locust's CSV and HTML report and `replay
report` show the URL as `http://***@host:port`.

Before this the password was written in all of those, and sent nowhere: the server got no
Authorization header (the userinfo went into the Host header instead).
"""

from __future__ import annotations

import argparse
import base64
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from replay.cli import build_parser, commands
from replay.engine.options import add_arguments
from replay.protocol.ask import Unanswered, ask, check_url
from replay.protocol.urls import redacted, shown
from replay.results.metadata import read_run_metadata
from replay.rules.run_files import summary_path
from replay.sim.process import sim_process
from support.ports import free_port
from support.processes import (
    finish,
    master_and_workers,
    replay_args,
    run_locust,
    run_replay,
    start_web_locust,
    web_args,
)
from support.records import check_records, server_samples
from support.traces import BLOCK, mooncake_trace
from support.waiting import wait_for

USER, PASSWORD = "alice", "pw-S3cr3t-Xq9"
BASIC = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
SECRETS = (PASSWORD, BASIC.split()[1])  # the password, and the header value that carries it


@pytest.fixture
def locked_sims(toy_tokenizer_dir):
    """Two sims that answer 401 to any request without the Basic credentials."""
    args = ("--block-size", str(BLOCK), "--ttft-ms", "2", "--itl-ms", "1", "--prefill-ms-per-1k", "0",
            "--require-authorization", BASIC)
    with sim_process(toy_tokenizer_dir, *args) as first, sim_process(toy_tokenizer_dir, *args) as second:
        yield first, second


def with_credentials(url: str) -> str:
    return url.replace("http://", f"http://{USER}:{PASSWORD}@", 1)


def leaks(folder: Path, *texts: str) -> list[str]:
    """Where a secret shows: files under `folder` (any depth) and the given texts."""
    found = [f"{p}: {s}" for p in sorted(folder.rglob("*")) if p.is_file() for s in SECRETS
             if s.encode() in p.read_bytes()]
    return found + [f"text {i}: {s}" for i, text in enumerate(texts) for s in SECRETS if s in text]


def test_shown_hides_the_userinfo_only():
    assert shown("http://alice:pw@127.0.0.1:8000/v1") == "http://***@127.0.0.1:8000/v1"
    assert shown("https://token@host") == "https://***@host"
    assert shown("http://127.0.0.1:8000") == "http://127.0.0.1:8000"
    assert shown("host:8000") == "host:8000"
    assert shown("http://a:b@[::1]:80/x?q=1") == "http://***@[::1]:80/x?q=1"


def test_a_credential_query_parameter_is_hidden_too():
    assert shown("http://a:b@h:9/metrics?token=T&x=1") == "http://***@h:9/metrics?token=***&x=1"
    assert shown("https://h/m?x=1&api_key=K#top") == "https://h/m?x=1&api_key=***#top"
    assert shown("http://h/m?access_token=T&monkey=1") == "http://h/m?access_token=***&monkey=1"
    assert shown("http://h/m?tokens=5&id_token=J") == "http://h/m?tokens=5&id_token=***"


def test_redacted_shows_every_url_of_a_document():
    options = {"endpoints": "http://a:b@h1:1,http://c:d@h2:2", "metrics_endpoint": ["http://e:f@x/m?token=T"],
               "slo": "ttft_ms=100", "seed": 3, "trace": "data/me@home.jsonl"}
    assert redacted(options) == {"endpoints": "http://***@h1:1,http://***@h2:2",
                                 "metrics_endpoint": ["http://***@x/m?token=***"], "slo": "ttft_ms=100", "seed": 3,
                                 "trace": "data/me@home.jsonl"}


def test_errors_show_the_url_as_shown():
    """An option's error and a server that is down name the URL without its credentials."""
    with pytest.raises(ValueError) as e:
        check_url("--host", f"http://{USER}:{PASSWORD}@127.0.0.1:99999")
    assert str(e.value) == "--host http://***@127.0.0.1:99999: the port is not a number in 0-65535"
    with pytest.raises(Unanswered) as e:
        ask(f"http://{USER}:{PASSWORD}@127.0.0.1:{free_port()}/v1/models", timeout=5)
    assert str(e.value).startswith("http://***@127.0.0.1:") and PASSWORD not in str(e.value)


def check_run(output: Path, urls: list[str], results: Path, *texts: str) -> None:
    records = check_records(output, output.parent / "trace.jsonl")
    assert {r["endpoint"] for r in records} == {shown(u) for u in urls}
    assert all(s.startswith("http://***@127.0.0.1:") for s in {shown(u) for u in urls})
    meta = read_run_metadata(output)
    assert meta["endpoints"] == [shown(u) for u in urls]
    samples = server_samples(output)
    assert {s["endpoint"] for s in samples} == {shown(u) for u in urls}
    assert all(s["metrics"] is not None for s in samples), samples[:2]  # /metrics answered: authenticated
    assert summary_path(output).exists()
    report = subprocess.run([sys.executable, "-m", "replay", "report", str(output), "--html",
                             str(results / "report-again.html")], capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr[-3000:]
    assert leaks(results, *texts, report.stdout, report.stderr) == []


def test_credentials_in_host_authenticate_and_are_never_shown(tmp_path, toy_tokenizer_dir, locked_sims):
    sim = locked_sims[0]
    results = tmp_path / "results"
    output = results / "run.jsonl"
    results.mkdir()
    trace = mooncake_trace(results / "trace.jsonl", rows=20, gap_ms=10)
    url = with_credentials(sim.url)
    proc = run_locust(replay_args(trace, toy_tokenizer_dir, url, output,
                                  "--server-metrics-interval", "0.2", "--csv", str(results / "stats"),
                                  "--html", str(results / "locust.html")), tmp_path)
    check_run(output, [url], results, proc.stdout, proc.stderr)
    assert requests.get(f"{sim.url}/debug/requests", timeout=10).json()["total"] == 20


def test_credentials_in_endpoints_authenticate_and_are_never_shown(tmp_path, toy_tokenizer_dir, locked_sims):
    results = tmp_path / "results"
    results.mkdir()
    trace = mooncake_trace(results / "trace.jsonl", rows=30, gap_ms=10)
    output = results / "run.jsonl"
    urls = [with_credentials(s.url) for s in locked_sims]
    master, workers = master_and_workers(tmp_path, replay_args(trace, toy_tokenizer_dir, urls[0], output,
                                                               "--endpoints", ",".join(urls),
                                                               "--server-metrics-interval", "0.2",
                                                               "--html", str(results / "locust.html")))
    finish([master, *workers], timeout=120)
    logs = [(tmp_path / name).read_text() for name in ("master.log", "worker0.log", "worker1.log")]
    assert master.returncode == 0, logs[0][-3000:]
    check_run(output, urls, results, *logs)
    totals = [requests.get(f"{s.url}/debug/requests", timeout=10).json()["total"] for s in locked_sims]
    assert sum(totals) == 30 and all(totals)


def test_a_wrong_password_fails_without_showing_it(tmp_path, toy_tokenizer_dir, locked_sims):
    """A server that refuses the credentials: the run fails (exit 2 in the server check, which
    is refused) and neither password shows in what it printed."""
    results = tmp_path / "results"
    results.mkdir()
    trace = mooncake_trace(results / "trace.jsonl", rows=3, gap_ms=10)
    url = locked_sims[0].url.replace("http://", f"http://{USER}:wrong-{PASSWORD}@", 1)
    proc = run_replay(replay_args(trace, toy_tokenizer_dir, url, results / "run.jsonl"), tmp_path, 120)
    assert proc.returncode != 0
    assert "401" in proc.stderr + proc.stdout
    assert leaks(results, proc.stdout, proc.stderr) == []


def test_the_web_ui_never_shows_the_credentials(tmp_path, toy_tokenizer_dir, locked_sims):
    """Locust's page (its host field, its custom parameters), the Replay view's stats and the
    swarm's answers show the URL as shown; starting with the shown host as the form gives it
    back keeps the credentials (the run authenticates)."""
    sim = locked_sims[0]
    results = tmp_path / "results"
    results.mkdir()
    trace = mooncake_trace(results / "trace.jsonl", rows=12, gap_ms=20)
    output = results / "run.jsonl"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    url = with_credentials(sim.url)
    procs = start_web_locust(tmp_path, [*web_args(trace, toy_tokenizer_dir, url, output, port),
                                        "--endpoints", url], workers=0)
    pages = []
    try:
        wait_for(lambda: requests.get(f"{base}/replay/stats", timeout=2).status_code == 200, "the web UI")
        index = requests.get(f"{base}/", timeout=5).text
        assert shown(url) in index
        pages.append(index)
        started = requests.post(f"{base}/swarm", data={"user_count": "0", "spawn_rate": "0", "host": shown(url)},
                                timeout=10).json()
        assert started["success"], started
        pages.append(str(started))
        final = wait_for(lambda: (s := requests.get(f"{base}/replay/stats", timeout=2).json())["run"]["state"]
                         == "finished" and s, "the replay to finish", timeout=60)  # fmt: skip
        pages.append(str(final))
        assert final["progress"]["rows_done"] == 12
        pages += [requests.get(f"{base}{page}", timeout=5).text for page in ("/", "/stats/requests",
                                                                             "/stats/report", "/stats/requests/csv")]
    finally:
        procs[0].send_signal(signal.SIGTERM)
        finish(procs, timeout=30)
    check_records(output, trace)
    assert leaks(results, (tmp_path / "master.log").read_text(), *pages) == []


TOKEN = "tk-Zr7Wq2Lm"  # an exporter's ?token=: a credential too


def url_options() -> list[str]:
    """Every option of `replay run` that takes URLs (a URL metavar), besides Locust's --host."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return [a.option_strings[0] for a in parser._actions if a.metavar and "URL" in str(a.metavar)]


def test_credentials_in_every_url_option_are_never_shown(tmp_path, toy_tokenizer_dir, locked_sims):
    """--host, --endpoints and --metrics-endpoint (found from the parser), each with a password
    and the exporter with a ?token= too: every file the run writes, `replay report`'s and what
    it printed hold neither. Before, OUTPUT.meta.json had --metrics-endpoint's URL in clear."""
    assert set(url_options()) >= {"--endpoints", "--metrics-endpoint"}
    sim = locked_sims[0]
    results = tmp_path / "results"
    results.mkdir()
    trace = mooncake_trace(results / "trace.jsonl", rows=10, gap_ms=20)
    output = results / "run.jsonl"
    url = with_credentials(sim.url)
    values = {"--endpoints": url, "--metrics-endpoint": f"{url}/metrics?token={TOKEN}&x=1"}
    extra = [part for flag in url_options() for part in (flag, values[flag])]
    proc = run_locust(replay_args(trace, toy_tokenizer_dir, url, output, "--server-metrics-interval", "0.2",
                                  "--header", f"X-Api-Key: {TOKEN}", *extra), tmp_path)
    check_records(output, trace)
    exporter = f"{shown(url)}/metrics?token=***&x=1"
    assert {s["endpoint"] for s in server_samples(output) if s.get("exporter")} == {exporter}
    assert read_run_metadata(output)["options"]["metrics_endpoint"] == [exporter]
    report = subprocess.run([sys.executable, "-m", "replay", "report", str(output), "--html",
                             str(results / "report-again.html")], capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr[-3000:]
    texts = (proc.stdout, proc.stderr, report.stdout, report.stderr)
    assert leaks(results, *texts) == []
    found = [str(p) for p in results.rglob("*") if p.is_file() and TOKEN.encode() in p.read_bytes()]
    assert found == [] and not any(TOKEN in text for text in texts)


def test_the_other_commands_url_options_never_show_credentials(tmp_path, toy_tokenizer_dir, locked_sims):
    """The URL options of the commands but `replay run` (found from their parsers): each given
    a password authenticates, and what the command prints holds none."""
    found = [(words, a.option_strings[0]) for words, parser in commands(build_parser()) if words != "replay run"
             for a in parser._actions if a.metavar and "URL" in str(a.metavar)]
    assert sorted(found) == [("replay prompts check", "--server"), ("replay record", "--upstream"),
                             ("replay trace anonymize", "--tokenize-url")]  # a new one: give it a case here
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=4, gap_ms=10)
    done = subprocess.run([sys.executable, "-m", "replay", "prompts", "check", "--trace", str(trace), "--block-size",
                           str(BLOCK), "--tokenizer", str(toy_tokenizer_dir), "--model", "sim",
                           "--server", with_credentials(locked_sims[0].url), "--header", f"X-Api-Key: {TOKEN}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"{shown(with_credentials(locked_sims[0].url))}: " in done.stdout
    assert leaks(tmp_path, done.stdout, done.stderr) == [] and TOKEN not in done.stdout + done.stderr
    # replay record: the upstream's credentials are the Authorization of a request that has none
    # (and of the recorder's /tokenize); the listening line, the log, the trace and its meta
    # show none; the raw log, kept for anonymize, the anonymized trace and its meta neither
    from support.record import RecordProcess

    recorded, raw = tmp_path / "recorded.jsonl", tmp_path / "raw.jsonl"
    with RecordProcess(with_credentials(locked_sims[0].url), recorded, "--raw-log", str(raw)) as proxy:
        answer = requests.post(proxy.url + "/v1/chat/completions", timeout=30,
                               json={"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert answer.status_code == 200
    [row] = [line for line in recorded.read_text().splitlines()]
    assert '"hash_ids"' in row and '"error"' not in row  # its /tokenize was let in too
    done = subprocess.run([sys.executable, "-m", "replay", "trace", "anonymize", str(raw), str(tmp_path / "again.jsonl"),
                           "--tokenize-url", with_credentials(locked_sims[1].url)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert '"hash_ids"' in (tmp_path / "again.jsonl").read_text()
    assert leaks(tmp_path, done.stdout, done.stderr, proxy.errors()) == []

"""The Replay view in a real browser: headless Chromium (the system's, driven by Selenium
through the system chromedriver; nothing is downloaded) finds Locust's Host field read-only (a
Start naming another host is refused), presses Locust's own Start button, follows the link to
the Replay view (a master and 2 workers), waits for the charts to draw (a fake dcgm-exporter's
GPUs' among them), checks the figures in the DOM (once finished: the whole run's, as the summary) and saves a screenshot
(docs/replay-view.png for the README when TRACEREPLAY_SCREENSHOT names it).

In CI (CI=true) a missing browser, driver or selenium fails the test; elsewhere it skips.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import requests

from replay.engine.live import SUMMARY_FIGURES
from replay.locust.webui import TAB_COLUMNS
from replay.results.records import read_records
from replay.rules.run_files import capacity_path, summary_path
from support.browser import BROWSERS, CHROMIUM_FLAGS, need
from support.dcgm import fake_dcgm_exporter
from support.ports import free_port
from support.processes import finish, start_web_locust, web_args
from support.traces import mooncake_trace
from support.waiting import wait_for

# The README's picture is refreshed only on request (TRACEREPLAY_SCREENSHOT=docs/replay-view.png),
# so a test run leaves the checkout clean.
SCREENSHOT_ENV = "TRACEREPLAY_SCREENSHOT"


@pytest.fixture
def browser(tmp_path):
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        need("selenium", "pip install 'tracereplay[test]'")
    chromium = next((p for p in map(shutil.which, BROWSERS) if p), None)
    if chromium is None:
        need("chromium", "apt-get install -y chromium")
    driver_path = shutil.which("chromedriver")
    if driver_path is None:
        need("chromedriver", "apt-get install -y chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium  # with the driver path given too, Selenium Manager never runs
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'profile'}")
    options.add_argument("--window-size=1440,1000")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wavy_trace(path: Path, seconds: float = 12.0) -> Path:
    """Mooncake rows whose rate swings between about 8 and 40 requests/s, for charts with a shape."""
    mooncake_trace(path, rows=400, gap_ms=1, output_length=(6, 40))
    rows, t = [], 0.0
    for line in path.read_text().splitlines():
        if t > seconds:
            break
        row = json.loads(line)
        row["timestamp"] = round(t * 1000, 3)
        rows.append(row)
        t += 1.0 / (24 + 16 * math.sin(2 * math.pi * t / 6))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def text(driver, element_id: str) -> str:
    return driver.find_element("id", element_id).text



def table_cells(browser, rows_selector: str) -> list[list[str]]:
    """The text of each cell of the rows `rows_selector` finds, read in one script: the page
    redraws its tables every second, so cells read one by one can be gone (stale) halfway."""
    return browser.execute_script(
        "return [...document.querySelectorAll(arguments[0])]"
        ".map(tr => [...tr.querySelectorAll('td')].map(td => td.innerText.trim()))", rows_selector)

@pytest.fixture
def dcgm_exporter():
    with fake_dcgm_exporter() as url:
        yield url


def test_replay_view_in_chromium(tmp_path, toy_tokenizer_dir, sim, browser, dcgm_exporter):
    trace = wavy_trace(tmp_path / "trace.jsonl")
    rows = sum(1 for _ in open(trace))
    output = tmp_path / "run.jsonl"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    procs = start_web_locust(tmp_path, [*web_args(trace, toy_tokenizer_dir, sim.url, output, port),
                                        "--metrics-endpoint", dcgm_exporter], workers=2)
    try:
        wait_for(lambda: requests.get(f"{base}/worker-count", timeout=2).json()["worker_count"] == 2, "2 workers")
        browser.get(base + "/")
        start = wait_for(lambda: browser.find_elements("css selector", "form button[type=submit]"), "Start")[0]
        users = browser.find_element("css selector", "input[name=userCount]")
        assert users.get_attribute("disabled") is not None  # the shape drives: nothing to fill in
        # the Host field shows where the replay sends, read-only: its servers were checked at start
        host = wait_for(lambda: (f := browser.find_element("css selector", "input[name=host]")).get_attribute("readonly")
                        and f, "a read-only Host field", timeout=10)  # fmt: skip
        assert host.get_attribute("value") == sim.url and "restart locust" in host.get_attribute("title")
        host.send_keys("9")
        assert host.get_attribute("value") == sim.url
        elsewhere = requests.post(f"{base}/swarm", data={"user_count": "0", "spawn_rate": "0",
                                                         "host": "http://127.0.0.1:9"}, timeout=10).json()
        assert not elsewhere["success"] and "restart locust with --host" in elsewhere["message"], elsewhere
        assert requests.get(f"{base}/replay/stats", timeout=2).json()["run"]["state"] == "waiting"
        start.click()
        stats = wait_for(lambda: (s := requests.get(f"{base}/replay/stats", timeout=2).json())["run"]["epoch"] and s,
                         "the run to start")  # fmt: skip
        assert stats["progress"]["rows_total"] == rows

        browser.find_element("id", "replay-view-link").click()
        wait_for(lambda: browser.current_url.endswith("/replay"), "the Replay view")

        def charts_drawn():
            points = int(browser.find_element("id", "chart-ttft").get_attribute("data-points"))
            return points >= 8 and browser.find_elements("css selector", "#chart-ttft polyline.series")

        wait_for(charts_drawn, "the TTFT chart to draw 8 points", timeout=30)
        # shown upper-case by CSS; a browser slowed by a busy host may see the last sends gone out
        assert text(browser, "state") in ("RUNNING", "DRAINING")
        assert text(browser, "rows-total") == str(rows)
        assert 0 < int(text(browser, "rows-sent")) <= rows
        for chart in ("ttft", "tpot", "e2e", "output", "input", "inflight", "drift", "cache"):
            svg = browser.find_element("id", f"chart-{chart}")
            assert int(svg.get_attribute("data-points")) >= 3, chart
            assert svg.find_elements("css selector", "polyline.series"), chart
        for chart in ("requests", "kv", "cache"):  # the endpoint's own side, from the master's /metrics scrapes
            svg = browser.find_element("id", f"chart-server-0-{chart}")
            assert int(svg.get_attribute("data-points")) >= 3, chart
        assert browser.find_elements("css selector", "#chart-server-0-cache polyline.series")
        for gpu in (0, 1):  # the exporter's GPUs, each its own charts
            for chart in ("util", "memory", "power", "clock", "temp"):
                assert int(browser.find_element("id", f"chart-gpu-{gpu}-{chart}").get_attribute("data-points")) >= 3
        titles = browser.execute_script("return [...document.querySelectorAll('.card h3')].map(h => h.textContent)")
        assert "gpu-node-1/gpu 0 (NVIDIA H100 80GB HBM3): utilisation" in titles, titles
        assert text(browser, "legend-gpus.0.util") == "97.0%" and text(browser, "legend-gpus.1.util") == "64.0%"
        assert text(browser, "legend-gpus.0.power_w") == browser.execute_script("return fmt(612.438)")
        assert float(text(browser, "legend-ttft_p50_ms")) >= 25  # the sim's TTFT is 30 ms
        table = table_cells(browser, "#workers tbody tr")
        assert [r[0] for r in table] == ["0", "1"] and sum(int(r[3]) for r in table) == rows
        height = browser.execute_script("return document.documentElement.scrollHeight")
        browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                                {"width": 1440, "height": height, "deviceScaleFactor": 1, "mobile": False})
        time.sleep(1.2)  # one more poll, drawn at the new size
        screenshot = Path(os.environ.get(SCREENSHOT_ENV) or tmp_path / "replay-view.png")
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        assert browser.save_screenshot(str(screenshot))

        wait_for(lambda: text(browser, "state") == "FINISHED", "the run to finish in the page", timeout=60)
        assert text(browser, "progress-pct") == "100.0%"
        # finished: the figures are the whole run's, the summary's, each shown by the page's own format
        summary = json.loads(summary_path(output).read_text())
        for key, path in SUMMARY_FIGURES.items():
            value = summary
            for part in path:
                value = value[part]
            shown = browser.execute_script("return fmt(arguments[0])", None if value is None else round(value, 3))
            assert text(browser, f"legend-{key}") == shown, key
        assert "the whole run" in text(browser, "window-note")
        assert text(browser, "rows-done") == str(rows)
        records = list(read_records(output))
        assert text(browser, "rows-sent") == str(sum(r["sent_at"] is not None for r in records))
        severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert not severe, severe

        browser.get(base + "/?tab=replay")  # the Replay tab inside Locust's own UI: the per-worker table
        tab = wait_for(lambda: table_cells(browser, "table tbody tr"), "the Replay tab's table")
        assert [row[0] for row in tab] == ["0", "1", "all"]
        drift = [column for column, _ in TAB_COLUMNS].index("drift_p99_ms")
        assert float(tab[2][drift]) == pytest.approx(summary["drift_ms"]["p99"], abs=0.01)  # the run's, as the summary
        assert browser.find_element("id", "replay-view-link").get_attribute("href") == base + "/replay"
    finally:
        procs[0].send_signal(signal.SIGTERM)
        finish(procs, timeout=20)
    assert len(records) == rows and all(r["ok"] for r in records)


def test_replay_view_of_a_capacity_search(tmp_path, toy_tokenizer_dir, sim, browser):
    """A capacity search in the web UI (one process): the Replay view shows the probe under way
    (its factor, rows, goodput so far), then the table of judged probes as OUTPUT.capacity.json
    has them, and the bracket."""
    trace = mooncake_trace(tmp_path / "trace.jsonl", rows=41, gap_ms=50)
    output = tmp_path / "run.jsonl"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = [*web_args(trace, toy_tokenizer_dir, sim.url, output, port), "--capacity-search", "--slo", "e2e_ms=60000",
            "--search-range", "1:4", "--search-precision", "0.5", "--probe-duration", "2", "--cooldown", "0.2"]
    procs = start_web_locust(tmp_path, args, workers=0)
    try:
        wait_for(lambda: requests.get(f"{base}/replay/stats", timeout=2).ok, "the web UI")
        browser.get(base + "/")
        wait_for(lambda: browser.find_elements("css selector", "form button[type=submit]"), "Start")[0].click()
        wait_for(lambda: requests.get(f"{base}/replay/stats", timeout=2).json()["run"]["epoch"], "the run to start")
        browser.get(base + "/replay")
        wait_for(lambda: text(browser, "probe-factor").startswith("probe "), "the probe under way", timeout=30)
        assert "rows " in text(browser, "probe-facts") and "target 99.0%" in text(browser, "probe-facts")
        wait_for(lambda: text(browser, "state") == "FINISHED", "the search to finish in the page", timeout=90)
        report = json.loads(capacity_path(output).read_text())
        table = table_cells(browser, "#probes tbody tr")
        assert [(row[0], row[4]) for row in table] == [(str(p["probe"]), p["verdict"]) for p in report["probes"]]
        assert text(browser, "probe-factor") == f"result: {report['result']}"
        assert "bracket:" in text(browser, "capacity-note")
        severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert not severe, severe
    finally:
        procs[0].send_signal(signal.SIGTERM)
        finish(procs, timeout=20)

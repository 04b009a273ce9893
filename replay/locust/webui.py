"""The Replay view in Locust's web UI: the page `/replay`, its data at `/replay/stats`, a
"Replay" tab with the per-worker table, and a link to the page on Locust's own UI.

Locust's React UI can add tabs, but only tables (`extended_tabs`), so the charts live on a
page of their own served by Locust's Flask app: one static file drawing SVG with plain
JavaScript, nothing to build or install. Headless runs serve nothing: their master prints the
progress line from the same figures (replay.engine.progress, set up by replay.locust.plugin).

A replay is one pass over the trace: the Start button runs it through ReplayShape (Locust
hides the user count form for a shape with use_common_options=False), and a second Start
after it ended is refused with a message, since the coordinator, output file and records
belong to that one run. Locust's Host field shows where the run sends and is read-only, and a
Start naming another host is refused (`start_refusal` says why).

Once the run has ended the view's figures are the whole run's, the summary's own
(replay.engine.live).

Every route follows Locust's login (`--web-login`, set up by replay.locust.webauth). Both are
set up by replay.locust.plugin's init listener, the login first, once `environment.replay` is set.
"""

from __future__ import annotations

from pathlib import Path

import gevent
import orjson
from flask import Response, jsonify, request
from locust.runners import STATE_RUNNING, STATE_SPAWNING, MasterRunner, WorkerRunner

from replay.engine import messages
from replay.engine.live import LiveStats
from replay.locust import webauth
from replay.protocol.urls import shown

PAGE = Path(__file__).resolve().parent / "static" / "replay.html"
TAB = "replay"
TAB_COLUMNS = (
    ("worker", "Worker"), ("host", "Host"), ("rows_assigned", "Rows assigned"), ("rows_sent", "Sent"),
    ("in_flight", "In flight"), ("failed", "Failed"), ("drift_p99_ms", "Drift p99 (ms)"),
    ("clock_offset_ms", "Clock offset (ms)"),
)  # fmt: skip
# Locust's form has no read-only Host field: this makes it one, as React (re)draws it (start_refusal says why)
HOST_FIELD = (
    "<script>(function () {"
    "const hint = 'Where this replay sends, fixed when locust started (its servers were checked then):"
    " restart locust with --host or --endpoints to replay against another';"
    "const fix = () => document.querySelectorAll('input[name=host]').forEach((input) => {"
    "if (!input.readOnly) { input.readOnly = true; input.title = hint; input.style.cursor = 'not-allowed'; } });"
    "new MutationObserver(fix).observe(document.body, {childList: true, subtree: true}); fix();"
    "})();</script>"
)
LINK = (
    '<a id="replay-view-link" href="{href}" title="Trace replay: progress, TTFT, TPOT, tokens/s, drift, cache hits"'
    ' style="position:fixed;right:20px;bottom:64px;z-index:2000;padding:10px 16px;border-radius:22px;'
    "background:#1f6f43;color:#fff;font:600 14px system-ui,sans-serif;text-decoration:none;"
    'box-shadow:0 2px 8px rgba(0,0,0,.3)">Replay view &#8599;</a>'
)


def register(environment, runner, web_ui) -> None:
    """Called by replay.locust.plugin's init listener once `environment.replay` is set: the
    master's (or local runner's) live figures and, with a web UI, the view's routes."""
    replay = environment.replay
    if isinstance(runner, WorkerRunner):
        return  # a worker's part, its report loop, is started by the plugin
    coordinator = replay.coordinator
    if coordinator is None:
        return
    if web_ui is None:
        return  # headless: the workers' reports go to the progress line (replay.locust.plugin)
    stats = LiveStats(coordinator, local_part=None if isinstance(runner, MasterRunner) else replay.part)
    if isinstance(runner, MasterRunner):
        coordinator.link.on(messages.LIVE, stats.on_report)
    # Added now, from plugin's init listener, so after plugin's test_stop listener: the coordinator has finalized.
    environment.events.test_stop.add_listener(lambda **kw: stats.on_stop())
    add_routes(web_ui, stats, base=getattr(environment.parsed_options, "web_base_path", None) or "")
    gevent.spawn(stats.run_ticks)


def add_routes(web_ui, stats: LiveStats, base: str = "") -> None:
    app = web_ui.app
    coordinator = stats.coordinator

    @app.route(f"{base}/replay")
    @web_ui.auth_required_if_enabled
    def replay_page() -> Response:
        return Response(PAGE.read_bytes(), mimetype="text/html")

    @app.route(f"{base}/replay/stats")
    @web_ui.auth_required_if_enabled
    def replay_stats() -> Response:
        since = request.args.get("since", type=float)
        return Response(orjson.dumps(stats.snapshot(since)), mimetype="application/json")

    @app.before_request
    def guard_start():
        if request.endpoint != "locust.swarm" or not webauth.logged_in(web_ui):
            return None  # not logged in: the view's own check sends the request to the login
        message = start_refusal(coordinator, web_ui.environment, request.form.get("host"))
        if message is None:
            return None
        return jsonify({"success": False, "message": message, "host": web_ui.environment.host})

    web_ui.template_args["extended_tabs"] = [{"title": "Replay", "key": TAB}]
    web_ui.template_args["extended_tables"] = [
        {"key": TAB, "structure": [{"key": key, "title": title} for key, title in TAB_COLUMNS]}
    ]

    @app.after_request
    def extend_locust_pages(response: Response) -> Response:
        if request.endpoint == "locust.request_stats" and response.is_json:
            data = response.get_json()
            data["extended_stats"] = [{"key": TAB, "data": tab_rows(stats.snapshot(since=float("inf")))}]
            response.set_data(orjson.dumps(data))
        elif request.endpoint == "locust.index" and response.mimetype == "text/html":
            page = response.get_data(as_text=True)
            if "</body>" in page:
                response.set_data(page.replace("</body>", LINK.format(href=f"{base}/replay") + HOST_FIELD + "</body>", 1))
        return response


def start_refusal(coordinator, environment, host: str | None) -> str | None:
    """Why a Start (Locust's /swarm) is refused, or None. A second one: a replay is one pass
    over the trace. One with a host other than the run's (`environment.host`, shown: see
    replay.locust.plugin): the preflight asked the run's servers before the web UI opened (their
    prompt limit decided which rows are sent; --verify-server checked them), the /metrics scraper
    and the meta file name them, and --endpoints may be several; a run sends where it looked."""
    if coordinator.started_at is not None:
        if environment.runner.state in (STATE_SPAWNING, STATE_RUNNING):
            return "The replay is running; its pace comes from the trace, so there is nothing to change."
        return (f"This replay has already run (records in {coordinator.output}). A replay is one pass over"
                " the trace: restart locust to replay it again.")  # fmt: skip
    if host is not None and host != (environment.host or ""):
        return (f"This replay sends to {environment.host}, the servers it checked when locust started; to"
                f" replay against {shown(host)}, restart locust with --host (or --endpoints) naming it.")  # fmt: skip
    return None


def tab_rows(snapshot: dict) -> list[dict]:
    """The Replay tab's table: one row per worker, then the whole run."""
    rows = [{**w, "worker": str(w["index"]) + (" (lost)" if w["lost"] else "")} for w in snapshot["workers"]]
    p = snapshot["progress"]
    rows.append({
        "worker": "all", "host": f"{p['rows_done']} of {p['rows_total']} rows done",
        "rows_assigned": p["rows_total"], "rows_sent": p["rows_sent"], "in_flight": snapshot["latest"]["in_flight"],
        "failed": sum(w["failed"] for w in snapshot["workers"]), "drift_p99_ms": snapshot["latest"]["drift_p99_ms"],
        "clock_offset_ms": None,
    })  # fmt: skip
    return [{key: ("" if row.get(key) is None else row[key]) for key, _ in TAB_COLUMNS} for row in rows]

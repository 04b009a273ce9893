"""A fake NVIDIA dcgm-exporter: serves data/dcgm-exporter.txt, a page in the exporter's format
(HELP and TYPE lines, its labels, two H100s on one node, the default collectors' series),
at /metrics. The first `idle` scrapes get the page with every GPU's utilisation at 0, the later
ones the page as written, so a run's peaks are the page's values and its first sample differs."""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

PAGE = (Path(__file__).parent / "data" / "dcgm-exporter.txt").read_text
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def idle_page(page: str) -> str:
    return re.sub(r"^(DCGM_FI_DEV_GPU_UTIL\{.*\}) \S+$", r"\1 0", page, flags=re.M)


@contextlib.contextmanager
def fake_dcgm_exporter(idle: int = 1) -> Iterator[str]:
    """`with fake_dcgm_exporter() as url:` url is the page's, http://127.0.0.1:PORT/metrics."""
    page = PAGE()
    scrapes = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            if self.path != "/metrics":
                self.send_error(404)
                return
            scrapes.append(1)
            body = (idle_page(page) if len(scrapes) <= idle else page).encode()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()

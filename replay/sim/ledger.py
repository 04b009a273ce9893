"""What reached the sim: each generation request's id as it arrived, and its connections.

Why: a replay must send every trace row exactly once. The replay client stamps each
generation request with `X-Request-Id: <run id>-<request id>`, and only the server can tell
what was actually received (a row sent twice, or never). So the id is counted at arrival,
before the body is parsed or a slot is taken: rejected, failed and still-running requests
count too. One Counter increment per request; the ledger grows by one entry per distinct id
(tens of bytes), which a test server can afford for millions of rows.

Connections are counted for the same reason from the other side: a load generator that
opens a connection per request, or far more than it has requests in flight, shows up here
as `connections_accepted` far above the number of requests.
"""

from __future__ import annotations

from collections import Counter

import orjson


class Ledger:
    def __init__(self) -> None:
        self.ids: Counter[str] = Counter()
        self.total = 0  # generation requests that carried an id
        self.without_id = 0  # generation requests that did not
        self.connections_accepted = 0
        self.connections_open = 0

    def arrived(self, request_id: str | None) -> None:
        """Count one generation request; an absent or empty id counts as without one."""
        if request_id:
            self.ids[request_id] += 1
            self.total += 1
        else:
            self.without_id += 1

    def to_json(self) -> bytes:
        """`GET /debug/requests`: {"total", "without_id", "connections_accepted", "ids": {id: times}}."""
        return orjson.dumps({"total": self.total, "without_id": self.without_id,
                             "connections_accepted": self.connections_accepted, "ids": self.ids})

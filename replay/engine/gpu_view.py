"""The Replay view's GPUs: the --metrics-endpoint exporters' DCGM series (replay.results.gpu_metrics)
from the master's scrape rounds, GPU by GPU, as the page charts them.

GPUs are listed in the order they first appear and never removed, so an index into `info()`
keeps naming the same GPU in every history point's `gpus` (the page adds charts for new ones).
"""

from __future__ import annotations

from replay.results.gpu_metrics import gpus

MIB_PER_GIB = 1024.0


class GpuView:
    def __init__(self) -> None:
        self.order: list[tuple[str, str]] = []  # (exporter, GPU name)
        self.models: dict[tuple[str, str], str | None] = {}
        self.now: dict[tuple[str, str], dict] = {}  # the last scrape's fields; absent: it failed

    def on_round(self, t: float, results: dict[str, dict | None]) -> None:
        for url, metrics in results.items():
            seen = gpus(metrics) if metrics else {}
            for key in [k for k in self.now if k[0] == url]:
                del self.now[key]
            for name, gpu in seen.items():
                key = (url, name)
                if key not in self.models:
                    self.order.append(key)
                    self.models[key] = gpu["model"]
                self.now[key] = gpu

    def latest(self) -> list[dict]:
        """Per GPU in `info()` order: utilisation as a fraction, memory in GiB, power (W), SM clock (MHz), °C."""
        out = []
        for key in self.order:
            g = self.now.get(key, {})
            util, used, free = g.get("util_pct"), g.get("fb_used_mib"), g.get("fb_free_mib")
            out.append({
                "util": None if util is None else round(util / 100, 4),
                "fb_used_gib": None if used is None else round(used / MIB_PER_GIB, 3),
                "fb_free_gib": None if free is None else round(free / MIB_PER_GIB, 3),
                "power_w": g.get("power_w"), "sm_clock_mhz": g.get("sm_clock_mhz"), "temp_c": g.get("temp_c"),
            })  # fmt: skip
        return out

    def info(self) -> list[dict]:
        return [{"exporter": url, "gpu": name, "model": self.models[(url, name)]} for url, name in self.order]

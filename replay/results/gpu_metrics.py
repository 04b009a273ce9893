"""GPU telemetry from the `--metrics-endpoint` exporters: NVIDIA dcgm-exporter's series, per GPU.

An exporter's page is kept whole in OUTPUT.server-metrics.jsonl (replay.results.server_metrics:
`"exporter": true`, series keyed `NAME{labels}`); this module picks the DCGM series it knows out
of a sample, GPU by GPU, for the Replay view's and the HTML report's charts and for the
summary's peaks. Every other series stays in the file, raw, for whoever wants it.

A GPU is named by the labels dcgm-exporter gives it: `Hostname` (the node) and `gpu` (its
index there); `UUID` and `modelName` are carried along. Labels are read with the `vllm:cache_config_info`
parser's rule (replay.protocol.prometheus.LABEL).
"""

from __future__ import annotations

from collections.abc import Iterable

from replay.protocol.prometheus import LABEL

# dcgm-exporter's series -> (field, what it is, unit); the default collectors' names and units
DCGM = {
    "DCGM_FI_DEV_GPU_UTIL": ("util_pct", "utilisation", "%"),
    "DCGM_FI_DEV_FB_USED": ("fb_used_mib", "memory used", "MiB"),
    "DCGM_FI_DEV_FB_FREE": ("fb_free_mib", "memory free", "MiB"),
    "DCGM_FI_DEV_POWER_USAGE": ("power_w", "power", "W"),
    "DCGM_FI_DEV_SM_CLOCK": ("sm_clock_mhz", "SM clock", "MHz"),
    "DCGM_FI_DEV_GPU_TEMP": ("temp_c", "temperature", "°C"),
}
FIELDS = tuple(field for field, _, _ in DCGM.values())
LEAST = ("fb_free_mib",)  # the summary gives these their least over the run, the others their peak


def gpu_name(labels: dict[str, str]) -> str:
    """`node/gpu N` (or `gpu N` without a Hostname label)."""
    gpu = f"gpu {labels.get('gpu', labels.get('UUID', '?'))}"
    return f"{labels['Hostname']}/{gpu}" if labels.get("Hostname") else gpu


def gpus(series: dict[str, float]) -> dict[str, dict]:
    """The GPUs of one exporter sample: {gpu name: {"gpu", "uuid", "model", "hostname", field: value}}."""
    out: dict[str, dict] = {}
    for key, value in series.items():
        name, _, labels_text = key.partition("{")
        if name not in DCGM:
            continue
        labels = dict(LABEL.findall(labels_text))
        gpu = out.setdefault(gpu_name(labels), {"gpu": labels.get("gpu"), "uuid": labels.get("UUID"),
                                                "model": labels.get("modelName"), "hostname": labels.get("Hostname")})
        gpu[DCGM[name][0]] = value
    return out


def exporter_section(samples: Iterable[dict]) -> dict:
    """The summary's `server.exporters`: per exporter URL its samples, failures and GPUs, each
    GPU with the peak of every DCGM field over the run (the least, for free memory)."""
    out: dict[str, dict] = {}
    for s in samples:
        entry = out.setdefault(s["endpoint"], {"samples": 0, "samples_failed": 0, "error": None, "series": 0,
                                               "gpus": {}})
        entry["samples"] += 1
        if not s.get("ok"):
            entry["samples_failed"] += 1
            entry["error"] = entry["error"] or s.get("error")
            continue
        metrics = s.get("metrics") or {}
        entry["series"] = max(entry["series"], len(metrics))
        for name, now in gpus(metrics).items():
            gpu = entry["gpus"].setdefault(name, {k: now[k] for k in ("gpu", "uuid", "model", "hostname")})
            for field in FIELDS:
                if field in now:
                    key = ("least_" if field in LEAST else "peak_") + field
                    pick = min if field in LEAST else max
                    gpu[key] = now[field] if gpu.get(key) is None else pick(gpu[key], now[field])
    return {url: out[url] for url in sorted(out)}


def format_exporters(exporters: dict) -> list[str]:
    """The summary's lines: each exporter, each GPU's peaks."""
    lines = []
    for url, e in exporters.items():
        ok = e["samples"] - e["samples_failed"]
        if not ok:
            lines.append(f"{url} (exporter): no metrics: {e['error']}")
            continue
        lines.append(f"{url} (exporter): {ok} samples, {e['series']} series, {len(e['gpus'])} GPUs")
        for name, gpu in e["gpus"].items():
            lines.append(f"  {name}" + (f" ({gpu['model']})" if gpu["model"] else "") + ":")
            figures = []
            for field, label, unit in DCGM.values():
                key = ("least_" if field in LEAST else "peak_") + field
                if gpu.get(key) is not None:
                    figures.append(f"{'least' if field in LEAST else 'peak'} {label} {gpu[key]:g} {unit}")
            lines.append("    " + ", ".join(figures))
    return lines

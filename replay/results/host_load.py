"""How busy the host was while a run sent, for the fidelity certificate's schedule line: sends
late while other processes had the CPU (or the hypervisor took it) are the host's doing, not
the replay's, and the certificate says so, so that a user reruns on a quiet host instead of
distrusting the tool (docs/fidelity.md#the-host).

Read from Linux's /proc by the process that runs the coordinator, at the go and at the end
(`sample`, then `figures`): the host's CPU times (/proc/stat: busy, steal, all), its load
average (/proc/loadavg), this process's own CPU time (os.times) and the time its main thread
was runnable but waited for a CPU (/proc/self/schedstat). The figures say something about the
sends only where this process is the one that sends (a local run: `senders_here`); a master's
workers are processes of their own, perhaps on other hosts. Without /proc there are none.

`busy_host` is the rule, on figures alone (so it is tested on recorded figures): the host was
busy when others used at least half of its CPUs, the hypervisor stole 5%, the load average
reached the number of CPUs, or this process waited for a CPU 1% of the time; but not when this
process itself wanted half a core or more (it ran or waited to run half the time:
`client_limited`): a replay that keeps its sends on time sleeps most of the time, and one that
cannot keep up at its rate is its own limit, which a quiet host would not lift.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

OTHERS_SHARE_BUSY = 0.5  # others used at least this share of the host's CPUs
STEAL_SHARE_BUSY = 0.05  # the hypervisor took at least this share
LOAD_PER_CPU_BUSY = 1.0  # the 1-minute load average reached this many runnable tasks a CPU
WAITED_SHARE_BUSY = 0.01  # this process waited for a CPU at least this share of the time
OWN_CORE_SHARE_LIMITED = 0.5  # this process ran or waited to run this share of the time: it was its own limit


@dataclass(frozen=True)
class HostSample:
    t: float  # time.monotonic()
    busy_s: float  # the host's CPU seconds spent working (user, nice, system, irq, softirq)
    all_s: float  # ... in all (idle, iowait and steal included)
    steal_s: float
    own_s: float  # this process's CPU seconds (its threads; children it waited for not)
    waited_s: float | None  # this process's main thread: runnable, waiting for a CPU (None: no schedstat)
    load_1m: float


def sample(proc: Path = Path("/proc")) -> HostSample | None:
    """The host now; None where /proc cannot say."""
    try:
        fields = (proc / "stat").read_text().split("\n", 1)[0].split()
        load = float((proc / "loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if not fields or fields[0] != "cpu":
        return None
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    user, nice, system, idle, iowait, irq, softirq, steal = (int(v) / tick for v in (fields[1:9] + ["0"] * 8)[:8])
    waited = None
    try:
        waited = int((proc / "self" / "schedstat").read_text().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    times = os.times()
    return HostSample(time.monotonic(), user + nice + system + irq + softirq,
                      user + nice + system + idle + iowait + irq + softirq + steal, steal,
                      times.user + times.system, waited, load)


def figures(start: HostSample | None, end: HostSample | None, *, senders_here: bool) -> dict | None:
    """The host between two samples, as the certificate keeps it (OUTPUT.meta.json's
    `host_load`); None without both."""
    if start is None or end is None or end.t <= start.t or end.all_s <= start.all_s:
        return None
    wall = end.t - start.t
    cpus = os.cpu_count() or 1
    all_s = end.all_s - start.all_s
    busy = (end.busy_s - start.busy_s) / all_s
    own = (end.own_s - start.own_s) / (wall * cpus)
    waited = (None if start.waited_s is None or end.waited_s is None
              else max(end.waited_s - start.waited_s, 0.0) / wall)  # fmt: skip
    return {
        "senders_here": senders_here,
        "cpus": cpus,
        "wall_s": round(wall, 3),
        "busy_share": round(busy, 4),
        "own_share": round(own, 4),
        "own_core_share": round((end.own_s - start.own_s) / wall, 4),
        "others_share": round(max(busy - own, 0.0), 4),
        "steal_share": round((end.steal_s - start.steal_s) / all_s, 4),
        "load_1m": max(start.load_1m, end.load_1m),
        "waited_share": None if waited is None else round(waited, 4),
    }


def busy_host(host: dict | None) -> str | None:
    """Why the host was busy while the run sent (one phrase), or None: not busy, not measured
    where the sends were made, or this process was its own limit."""
    if not host or not host.get("senders_here") or client_limited(host):
        return None
    why = []
    cpus = host.get("cpus") or 1
    if (host.get("others_share") or 0.0) >= OTHERS_SHARE_BUSY:
        why.append(f"other processes used {100 * host['others_share']:.0f}% of its {cpus} CPUs")
    if (host.get("steal_share") or 0.0) >= STEAL_SHARE_BUSY:
        why.append(f"the hypervisor took {100 * host['steal_share']:.0f}% (steal)")
    if (host.get("load_1m") or 0.0) >= LOAD_PER_CPU_BUSY * cpus:
        why.append(f"load average {host['load_1m']:.1f} on {cpus} CPUs")
    if (host.get("waited_share") or 0.0) >= WAITED_SHARE_BUSY:
        why.append(f"the replay waited for a CPU {100 * host['waited_share']:.1f}% of the time")
    return "; ".join(why) or None


def client_limited(host: dict | None) -> str | None:
    """Why the replay itself was its limit (one phrase), or None: where the figures are the
    senders', the share of a core it ran or waited to run."""
    if not host or not host.get("senders_here"):
        return None
    wanted = (host.get("own_core_share") or 0.0) + (host.get("waited_share") or 0.0)
    if wanted < OWN_CORE_SHARE_LIMITED:
        return None
    return (f"the replay itself wanted {100 * wanted:.0f}% of a core: at this rate one process cannot keep up "
            "(more workers: --processes N, docs/distributed.md)")


def describe(host: dict | None) -> str | None:
    """The host's figures in one line, for the summary."""
    if not host:
        return None
    text = (f"others {100 * host['others_share']:.0f}% of {host['cpus']} CPUs, replay {100 * host['own_core_share']:.0f}% "
            f"of a core, steal {100 * host['steal_share']:.1f}%, load {host['load_1m']:.2f}")
    if host.get("waited_share") is not None:
        text += f", waited for a CPU {100 * host['waited_share']:.2f}%"
    return text if host.get("senders_here") else text + " (this host; the workers' own not measured)"

"""Start-up cost: a worker's set-up cold and warm, and what a whole short replay costs per request.

1. Set-up: a fresh process builds a worker's `BodyBuilder` (tokenizer, safe vocabulary, template
   frames) for each tokenizer, cold (an empty set-up cache, $TRACEREPLAY_CACHE_DIR) and warm
   (the cache the cold run wrote). Wall and CPU seconds of the set-up itself (a cold set-up's
   child process counted in), and the peak RSS of the process (imports included) or of that
   child, whichever is larger.
2. Replay: a real `locust -f locustfile.py --headless` (one process: master and worker parts)
   replays a --rows-row, --seconds-s trace against `replay sim` (each on a core of its own),
   to completion; CPU seconds (user + system) and peak RSS from wait4 on the reaped child,
   start-up included: both count its own children, the set-up child of a cold start
   (replay/synth/setup_child.py) too; the locust process's own peak is read from its VmHWM.
   CPU per request = that CPU / rows, then split into the locust process's own and its child
   processes' (the cold set-up child, the end-of-run cache child), from its getrusage at exit.
   The first run starts with an empty cache (cold), the others reuse it (warm).

The project's bytecode is compiled first (as `make` does, and pip for an installed package):
with PYTHONDONTWRITEBYTECODE set, as on CI machines and in the Dockerfile, each start would
otherwise compile the whole package again, ~0.05 s CPU, which is not set-up.

With --against TREE (another checkout, e.g. `git worktree add /tmp/base COMMIT`), the replays
are made alternately by this checkout and TREE (its locustfile and replay on PYTHONPATH, a set-up
cache of its own), run for run, on the same trace and sim, and the medians of each and the ratio
of their own CPU are printed: two sets of runs minutes apart differ by more than a few percent.

Median of --runs. Exits 1 when a run fails, a row is not ok or not exact, or a warm set-up
did not read the cache.

    .venv/bin/python bench/startup.py [--tokenizers qwen2,llama3,llama2] [--runs 5]
                                      [--rows 250] [--seconds 60] [--replay-runs 3] [--no-replay]
                                      [--against TREE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)

from common import LOCUST, compile_bytecode, high_water_kib, locust_cpu, split_cores, tree_env, tree_label  # noqa: E402

from replay.results.records import read_records  # noqa: E402
from replay.sim.process import sim_process  # noqa: E402

SHARED = REPO.parent / "shared"
BLOCK = 32
CACHE_ENV = "TRACEREPLAY_CACHE_DIR"

SET_UP = """
import json, resource, sys, time
import gevent, locust  # a worker has these loaded before its set-up
from replay.engine.dispatcher import BodyBuilder
from replay.engine.options import ReplayOptions
options = ReplayOptions(trace="unused", tokenizer=sys.argv[1], api=sys.argv[2], model="m")
def children_cpu():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # a cold set-up's child process (setup_child)
    return usage.ru_utime + usage.ru_stime
wall, cpu = time.perf_counter(), time.process_time() + children_cpu()
builder = BodyBuilder(options, 512)
wall, cpu = time.perf_counter() - wall, time.process_time() + children_cpu() - cpu
cached = getattr(builder.synth, "set_up_from_cache", None)
peak = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
print(json.dumps({"wall_s": wall, "cpu_s": cpu, "cached": cached, "peak_rss_mib": peak / 1024}))
"""


def tokenizer_dir(name: str) -> Path:
    if name == "toy":
        from replay.synth.toy import build_toy_tokenizer

        return build_toy_tokenizer(Path(tempfile.mkdtemp(prefix="toy-tokenizer-")))
    return SHARED / "tokenizers" / name


def set_up_once(tokenizer: Path, api: str, cache: Path, cpu: int | None) -> dict:
    preexec = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
    env = {**os.environ, CACHE_ENV: str(cache)}
    out = subprocess.run([sys.executable, "-c", SET_UP, str(tokenizer), api], capture_output=True, text=True,
                         env=env, preexec_fn=preexec, cwd=REPO)
    if out.returncode != 0:
        raise RuntimeError(f"set-up failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_set_up(names: list[str], api: str, runs: int, cpu: int | None) -> list[str]:
    problems = []
    print(f"worker set-up (BodyBuilder, api {api}), median of {runs} runs, one process each, on cpu {cpu}")
    print(f"{'tokenizer':<10} {'cold wall s':>11} {'cold cpu s':>10} {'cold RSS MiB':>12} "
          f"{'warm wall s':>11} {'warm cpu s':>10} {'warm RSS MiB':>12}  loadavg")
    for name in names:
        tokenizer = tokenizer_dir(name)
        if not tokenizer.exists():
            print(f"{name:<10} skipped: {tokenizer} is absent")
            continue
        cold, warm = [], []
        for _ in range(runs):
            with tempfile.TemporaryDirectory(prefix="bench-cache-") as cache:
                cold.append(set_up_once(tokenizer, api, Path(cache), cpu))
                warm.append(set_up_once(tokenizer, api, Path(cache), cpu))
        if any(r["cached"] is True for r in cold) or any(r["cached"] is False for r in warm):
            problems.append(f"{name}: a cold set-up read the cache or a warm one did not")

        def med(rs: list[dict], key: str) -> float:
            return statistics.median(r[key] for r in rs)

        print(f"{name:<10} {med(cold, 'wall_s'):11.3f} {med(cold, 'cpu_s'):10.3f} {med(cold, 'peak_rss_mib'):12.0f} "
              f"{med(warm, 'wall_s'):11.3f} {med(warm, 'cpu_s'):10.3f} {med(warm, 'peak_rss_mib'):12.0f}  "
              f"{open('/proc/loadavg').read().split()[0]}", flush=True)
    return problems


def write_trace(path: Path, rows: int, seconds: float, seed: int = 0) -> None:
    """Mooncake rows at uniform random times over `seconds`: 1-40 blocks, half of them behind
    one of a few shared prefixes, as a production trace's system prompts and sessions."""
    rng = random.Random(seed)
    times = sorted(rng.uniform(0, seconds * 1000) for _ in range(rows))
    next_id = 10_000
    with open(path, "w") as f:
        for t in times:
            blocks = rng.randint(1, 40)
            shared = min(blocks, rng.randint(0, 20)) if rng.random() < 0.5 else 0
            family = 1000 * rng.randrange(4)
            ids = [family + k for k in range(shared)] + list(range(next_id, next_id + blocks - shared))
            next_id += blocks - shared
            row = {"timestamp": round(t, 3), "input_length": blocks * BLOCK - rng.randrange(BLOCK),
                   "output_length": rng.randint(10, 60), "hash_ids": ids}
            f.write(json.dumps(row) + "\n")


def replay_once(tokenizer: Path, url: str, trace: Path, out: Path, cache: Path, cpu: int | None,
                extra: list[str], tree: Path = REPO) -> dict:
    """One replay of `trace` by `tree`'s locustfile and replay package."""
    usage_file = out.with_name(out.name + ".cpu")
    cmd = [sys.executable, "-c", LOCUST, str(usage_file), "-f", str(tree / "locustfile.py"), "--headless", "--host", url,
           "--trace", str(trace), "--block-size", str(BLOCK), "--tokenizer", str(tokenizer), "--model", "sim",
           "--api", "openai-completions", "--output", str(out), "--overwrite", "--loglevel", "WARNING",
           "--only-summary", *extra]
    preexec = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
    env = {**tree_env(tree), CACHE_ENV: str(cache)}
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, text=True, preexec_fn=preexec, env=env, cwd=tree)
        own_peak_kib = 0  # the locust process's own high-water mark (wait4's is its children's too)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            own_peak_kib = max(own_peak_kib, high_water_kib(proc.pid))
            time.sleep(0.2)
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        text = log.read()
    records = list(read_records(out)) if out.exists() else []
    problems = []
    if proc.returncode != 0:
        problems.append(f"locust exit {proc.returncode}: {text[-1500:]}")
    bad = [r for r in records if not r["ok"] or r["prompt_tokens"] != r["input_length"]]
    if bad:
        problems.append(f"{len(bad)} of {len(records)} records not ok or not exact, e.g. {bad[0]}")
    cpu_s = usage.ru_utime + usage.ru_stime
    own_s, children_s = locust_cpu(usage_file) if usage_file.exists() else (float("nan"), float("nan"))
    return {"cpu_s": cpu_s, "user_s": usage.ru_utime, "sys_s": usage.ru_stime,
            "cpu_ms_per_req": cpu_s * 1000.0 / max(1, len(records)),
            "own_ms_per_req": own_s * 1000.0 / max(1, len(records)),
            "children_ms_per_req": children_s * 1000.0 / max(1, len(records)),
            "peak_rss_mib": usage.ru_maxrss / 1024, "own_peak_rss_mib": own_peak_kib / 1024,
            "records": len(records), "problems": problems}


def bench_replay(name: str, rows: int, seconds: float, runs: int, client: int | None, server: int | None,
                 extra: list[str] = (), against: Path | None = None) -> list[str]:
    tokenizer = tokenizer_dir(name)
    if not tokenizer.exists():
        print(f"replay skipped: {tokenizer} is absent")
        return []
    trees = [REPO] if against is None else [REPO, against]
    print(f"replay: {rows} rows over {seconds:g} s, {name}, openai-completions, locust --headless on cpu {client}, "
          f"sim on cpu {server}; run 1 cold (empty cache), then warm{'; ' + ' '.join(extra) if extra else ''}"
          f"{'; alternately with ' + str(against) if against else ''}")
    problems = []
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        tmp = Path(tmp)
        trace = tmp / "trace.jsonl"
        write_trace(trace, rows, seconds)
        results: dict[Path, list[dict]] = {tree: [] for tree in trees}
        with sim_process(tokenizer, "--block-size", str(BLOCK), "--ttft-ms", "20", "--itl-ms", "2",
                         "--prefill-ms-per-1k", "0", "--max-num-seqs", "100000", cpu=server) as sim:
            for k in range(runs + 1):
                for t, tree in enumerate(trees):
                    r = replay_once(tokenizer, sim.url, trace, tmp / f"run-{t}.jsonl", tmp / f"cache-{t}", client,
                                    list(extra), tree)
                    results[tree].append(r)
                    problems += r["problems"]
                    print(f"  run {k + 1} ({'cold' if k == 0 else 'warm'}{_named(tree, trees)}): {r['records']} records, "
                          f"CPU {r['cpu_s']:.2f} s ({r['user_s']:.2f} user + {r['sys_s']:.2f} sys) "
                          f"= {r['cpu_ms_per_req']:.2f} ms/request (own {r['own_ms_per_req']:.2f} + children "
                          f"{r['children_ms_per_req']:.2f}), peak RSS {r['peak_rss_mib']:.0f} MiB "
                          f"(the largest process; locust's own {r['own_peak_rss_mib']:.0f} MiB)  "
                          f"loadavg {open('/proc/loadavg').read().split()[0]}", flush=True)
    own = {}
    for tree in trees:
        cold, warm = results[tree][0], results[tree][1:]
        own[tree] = statistics.median(r["own_ms_per_req"] for r in warm)
        print(f"median of {len(warm)} warm runs{_named(tree, trees)}: CPU "
              f"{statistics.median(r['cpu_ms_per_req'] for r in warm):.2f} ms/request (target <= 5; own {own[tree]:.2f} "
              f"+ children {statistics.median(r['children_ms_per_req'] for r in warm):.2f}), peak RSS "
              f"{statistics.median(r['peak_rss_mib'] for r in warm):.0f} MiB (target <= 200 MB); "
              f"cold run: {cold['cpu_ms_per_req']:.2f} ms/request, {cold['peak_rss_mib']:.0f} MiB "
              f"(locust's own {cold['own_peak_rss_mib']:.0f} MiB; the rest is the set-up's child process)")
    if against is not None:
        print(f"own CPU a request of the warm runs, this checkout / {against}: {own[REPO] / own[against]:.3f}")
    return problems


def _named(tree: Path, trees: list[Path]) -> str:
    """`tree` as a run's label where two trees take turns."""
    return "" if len(trees) == 1 else f", {tree_label(tree)}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizers", default="qwen2,llama3,llama2")
    parser.add_argument("--api", default="openai-chat")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--replay-tokenizer", default="qwen2")
    parser.add_argument("--rows", type=int, default=250)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--replay-runs", type=int, default=3, help="warm replays (after one cold)")
    parser.add_argument("--no-replay", action="store_true")
    parser.add_argument("--replay-args", default="", help="more locust flags for the replay, e.g. "
                        "'--verify-server off --server-metrics-interval 0' to leave those parts out")
    parser.add_argument("--no-set-up", action="store_true")
    parser.add_argument("--against", type=Path, metavar="TREE",
                        help="another checkout whose replays alternate with this one's (the set-up part is not run for it)")
    args = parser.parse_args()
    client, server = split_cores()
    compile_bytecode()
    if args.against is not None:
        compile_bytecode(args.against)
    problems = []
    if not args.no_set_up:
        problems += bench_set_up(args.tokenizers.split(","), args.api, args.runs, client)
    if not args.no_replay:
        problems += bench_replay(args.replay_tokenizer, args.rows, args.seconds, args.replay_runs, client, server,
                                 shlex.split(args.replay_args), args.against.resolve() if args.against else None)
    for p in problems:
        print(f"PROBLEM: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

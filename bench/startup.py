"""Start-up cost: a worker's set-up cold and warm, and what a whole short replay costs per request.

1. Set-up: a fresh process builds a worker's `BodyBuilder` (tokenizer, safe vocabulary, template
   frames) for each tokenizer, cold (an empty set-up cache, $TRACEREPLAY_CACHE_DIR) and warm
   (the cache the cold run wrote). Wall and CPU seconds of the set-up itself (a cold set-up's
   child process counted in), and the peak RSS of the process (imports included) or of that
   child, whichever is larger.
2. Replay: the user's command, `replay run --headless` (as `python -m replay run`, the replay
   package of the checkout measured on PYTHONPATH; one process: master and worker parts) replays a --rows-row, --seconds-s trace against `replay sim` (each on a core of its own),
   to completion; CPU seconds (user + system) and peak RSS from wait4 on the reaped child,
   start-up included: both count its own children, the set-up child of a cold start
   (replay/synth/setup_child.py) too; the replay process's own peak is read from its VmHWM.
   CPU per request = that CPU / rows, then split into the replay process's own and its child
   processes' (the cold set-up child, the end-of-run cache child), from its getrusage at exit.
   The first run starts with an empty cache (cold), the others reuse it (warm).

3. Fixed costs (--costs; issue 40): for each of --cost-tokenizers and --cost-apis, --cost-runs
   replays (`replay run`, as in 2.) of the same trace (the first cold, the others' median is the figure), their process
   tree sampled from /proc (common.TreeWatch): the tree's CPU before the first send, its CPU and
   the wall time from the last answer to the exit, the cache-fidelity follower's CPU (and the
   end's own cache child's), the tree's CPU a request and its peak RSS as the sum of the
   processes alive at once (each run's line names the processes that made it up); then a replay of two rows --idle-seconds apart, whose CPU a second
   while nothing is due is the idle cost; then a burst of 8 rows of 30,000 tokens due at the same
   millisecond, alone and among sends every 20 ms, with the first tokenizer. Run it alone, it
   needs no network (with --against TREE, TREE's replays alternate with this checkout's):

       .venv/bin/python bench/startup.py --costs [--cost-tokenizers qwen2,llama3,DIR] [--rows 250] [--seconds 60]

The project's bytecode is compiled first (as `make` does, and pip for an installed package):
with PYTHONDONTWRITEBYTECODE set, as on CI machines and in the Dockerfile, each start would
otherwise compile the whole package again, ~0.05 s CPU, which is not set-up.

With --against TREE (another checkout, e.g. `git worktree add /tmp/base COMMIT`), the replays
are made alternately by this checkout and TREE (its replay package on PYTHONPATH, a set-up
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

from common import (  # noqa: E402
    REPLAY,
    TreeWatch,
    compile_bytecode,
    high_water_kib,
    locust_cpu,
    split_cores,
    tree_env,
    tree_label,
)

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
    if "/" in name:  # a tokenizer folder of its own (a larger vocabulary than ../shared holds, say)
        return Path(name).resolve()
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
                extra: list[str], tree: Path = REPO, api: str = "openai-completions", watch: bool = False) -> dict:
    """One replay of `trace` by `replay run` (the user's command: its entry points read, its
    collector and imports as a user's run has them) with `tree`'s replay package. `watch`: its
    process tree is sampled (common.TreeWatch) for the fixed costs (`fixed_costs`)."""
    usage_file = out.with_name(out.name + ".cpu")
    cmd = [sys.executable, "-c", REPLAY, str(usage_file), "run", "--headless", "--host", url,
           "--trace", str(trace), "--block-size", str(BLOCK), "--tokenizer", str(tokenizer), "--model", "sim",
           "--api", api, "--output", str(out), "--overwrite", "--loglevel", "WARNING",
           "--only-summary", *extra]
    preexec = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
    env = {**tree_env(tree), CACHE_ENV: str(cache)}
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, text=True, preexec_fn=preexec, env=env, cwd=tree)
        own_peak_kib = 0  # the replay process's own high-water mark (wait4's is its children's too)
        tree_watch = TreeWatch(proc.pid) if watch else None
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                exited_at = time.time()
                break
            own_peak_kib = max(own_peak_kib, high_water_kib(proc.pid))
            time.sleep(0.2 if tree_watch is None else 0.005)
        if tree_watch is not None:
            tree_watch.stop()
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        text = log.read()
    records = list(read_records(out)) if out.exists() else []
    problems = []
    if proc.returncode != 0:
        problems.append(f"replay run exit {proc.returncode}: {text[-1500:]}")
    # a row shorter than the template's frame is sent as an empty content (replay/synth/prompts.py): not exact
    bad = [r for r in records if not r["ok"] or (r["prompt_tokens"] != r["input_length"] and r["input_length"] >= 64)]
    if bad:
        problems.append(f"{len(bad)} of {len(records)} records not ok or not exact, e.g. {bad[0]}")
    cpu_s = usage.ru_utime + usage.ru_stime
    own_s, children_s = locust_cpu(usage_file) if usage_file.exists() else (float("nan"), float("nan"))
    return {"cpu_s": cpu_s, "user_s": usage.ru_utime, "sys_s": usage.ru_stime,
            "cpu_ms_per_req": cpu_s * 1000.0 / max(1, len(records)),
            "own_ms_per_req": own_s * 1000.0 / max(1, len(records)),
            "children_ms_per_req": children_s * 1000.0 / max(1, len(records)),
            "peak_rss_mib": usage.ru_maxrss / 1024, "own_peak_rss_mib": own_peak_kib / 1024,
            "records": len(records), "problems": problems,
            **(fixed_costs(tree_watch, records, cpu_s, exited_at) if tree_watch is not None else {})}


def fixed_costs(watch: TreeWatch, records: list[dict], cpu_s: float, exited_at: float) -> dict:
    """A run's fixed costs from its tree's samples and its records: CPU before the first send,
    CPU and wall after the last answer, the cache-fidelity follower's CPU (and the end's own
    cache child's, when the end computed the section), the tree's peak RSS (the processes alive
    at once), and its CPU a second while nothing was due (`idle_cpu_ms_s`, between the first
    answer and the last send, when the trace leaves a gap there)."""
    sent = sorted(r["sent_at"] for r in records if r.get("sent_at"))
    answered = sorted(r["finished_at"] for r in records if r.get("finished_at"))
    if not sent or not answered:
        return {}
    first_send, last_answer = sent[0], answered[-1]
    idle = watch.cpu_rate(answered[0] + 1.0, sent[-1] - 1.0) if len(sent) == 2 else None
    return {"before_first_send_cpu_s": watch.cpu_at(first_send),
            "after_last_answer_cpu_s": cpu_s - watch.cpu_at(last_answer),
            "after_last_answer_wall_s": exited_at - last_answer,
            "follower_cpu_s": watch.cpu_of("--follow"),
            "end_cache_child_cpu_s": watch.cpu_of("cache_child") - watch.cpu_of("--follow"),
            "set_up_child_cpu_s": watch.cpu_of("setup_child"),
            "tree_peak_rss_mib": watch.peak_rss_kib() / 1024,
            "at_peak": ", ".join(f"{_short(cmd)} {kib / 1024:.0f}" for cmd, kib in watch.at_peak),
            "idle_cpu_ms_s": None if idle is None else idle * 1000.0}


def _short(cmd: str) -> str:
    """A member's command line, told apart in a few words: the module it runs, or replay run."""
    words = cmd.split()
    if "-m" in words[:-1]:
        return " ".join(words[words.index("-m") + 1:][:2])
    return "replay run" if "runpy.run_module" in cmd else " ".join(words[:2])[-40:]


def bench_replay(name: str, rows: int, seconds: float, runs: int, client: int | None, server: int | None,
                 extra: list[str] = (), against: Path | None = None) -> list[str]:
    tokenizer = tokenizer_dir(name)
    if not tokenizer.exists():
        print(f"replay skipped: {tokenizer} is absent")
        return []
    trees = [REPO] if against is None else [REPO, against]
    print(f"replay: {rows} rows over {seconds:g} s, {name}, openai-completions, replay run --headless on cpu {client}, "
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
                          f"(the largest process; replay run's own {r['own_peak_rss_mib']:.0f} MiB)  "
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
              f"(replay run's own {cold['own_peak_rss_mib']:.0f} MiB; the rest is the set-up's child process)")
    if against is not None:
        print(f"own CPU a request of the warm runs, this checkout / {against}: {own[REPO] / own[against]:.3f}")
    return problems


COST_COLUMNS = (("before_first_send_cpu_s", "CPU before 1st send s", 1.0),
                ("after_last_answer_cpu_s", "CPU after last answer s", 1.0),
                ("after_last_answer_wall_s", "wall after last answer s", 1.0),
                ("follower_cpu_s", "follower CPU s", 1.0),
                ("end_cache_child_cpu_s", "end's cache child CPU s", 1.0),
                ("cpu_ms_per_req", "tree CPU ms/request", 1.0),
                ("tree_peak_rss_mib", "tree peak RSS MiB", 1.0))


def write_idle_trace(path: Path, seconds: float) -> None:
    """Two rows `seconds` apart: between the first's answer and the second's send nothing is due."""
    with open(path, "w") as f:
        for t, ids in ((0.0, [1, 2]), (seconds * 1000.0, [3, 4])):
            f.write(json.dumps({"timestamp": t, "input_length": 2 * BLOCK, "output_length": 10, "hash_ids": ids}) + "\n")


def bench_costs(names: list[str], apis: list[str], rows: int, seconds: float, runs: int, idle_seconds: float,
                client: int | None, server: int | None, extra: list[str], against: Path | None = None) -> list[str]:
    """Each fixed cost of a run (issue 40), per tokenizer and api: `runs` replays of a `rows`-row,
    `seconds`-s trace, the first with an empty set-up cache (cold), the others warm; the warm runs'
    median is the figure. Then one replay of two rows `idle_seconds` apart for the idle CPU."""
    problems = []
    print(f"fixed costs: {rows} rows over {seconds:g} s, streamed, replay run --headless on cpu {client}, sim on cpu "
          f"{server}; warm set-up cache (median of {runs - 1} runs after a cold one); idle: 2 rows "
          f"{idle_seconds:g} s apart; host load {os.getloadavg()[0]:.2f}")
    for name in names:
        tokenizer = tokenizer_dir(name)
        if not tokenizer.exists():
            print(f"{name}: skipped, {tokenizer} is absent")
            continue
        with tempfile.TemporaryDirectory(prefix="bench-costs-") as tmp, \
                sim_process(tokenizer, "--block-size", str(BLOCK), "--ttft-ms", "20", "--itl-ms", "2",
                            "--prefill-ms-per-1k", "0", "--max-num-seqs", "100000", cpu=server) as sim:
            tmp = Path(tmp)
            trace, idle_trace = tmp / "trace.jsonl", tmp / "idle.jsonl"
            write_trace(trace, rows, seconds)
            write_idle_trace(idle_trace, idle_seconds)
            trees = [REPO] if against is None else [REPO, against]
            for api in apis:
                results: dict[Path, list[dict]] = {tree: [] for tree in trees}
                for k in range(runs):
                    for t, tree in enumerate(trees):  # alternately, run for run: the host's load falls on both
                        r = replay_once(tokenizer, sim.url, trace, tmp / "run.jsonl", tmp / f"cache-{t}", client, extra,
                                        tree, api=api, watch=True)
                        problems += r["problems"]
                        results[tree].append(r)
                        print(f"  {name} {api} run {k + 1} ({'cold' if k == 0 else 'warm'}{_named(tree, trees)}): "
                              + ", ".join(f"{label} {r.get(key, float('nan')):.3f}" for key, label, _ in COST_COLUMNS)
                              + f" (at the peak, MiB: {r.get('at_peak')})  loadavg {os.getloadavg()[0]:.2f}", flush=True)
                for t, tree in enumerate(trees):
                    idle = replay_once(tokenizer, sim.url, idle_trace, tmp / "idle-run.jsonl", tmp / f"cache-{t}", client,
                                       extra, tree, api=api, watch=True)
                    problems += idle["problems"]
                    warm = results[tree][1:] or results[tree]
                    figures = {key: statistics.median(r.get(key, float("nan")) for r in warm) for key, _, _ in COST_COLUMNS}
                    print(f"{name} {api} (warm median{_named(tree, trees)}): " + ", ".join(
                          f"{label} {figures[key]:.3f}" for key, label, _ in COST_COLUMNS)
                          + f", idle CPU {idle.get('idle_cpu_ms_s') or float('nan'):.2f} ms/s"
                          + f"  loadavg {os.getloadavg()[0]:.2f}", flush=True)
    return problems


def write_burst_trace(path: Path, rows: int, tokens: int, at_s: float, background_ms: float) -> None:
    """`rows` rows of `tokens` tokens due at the same millisecond, `at_s` into the trace (past the
    builder's window at the go, so they are built while the run sends), among short rows
    `background_ms` apart (0: none), as a busy trace's."""
    with open(path, "w") as f:
        f.write(json.dumps({"timestamp": 0.0, "input_length": 2 * BLOCK, "output_length": 5, "hash_ids": [1, 2]}) + "\n")
        t, k = background_ms, 0
        while background_ms and t < (at_s + 3.0) * 1000.0:
            f.write(json.dumps({"timestamp": t, "input_length": BLOCK, "output_length": 5, "hash_ids": [10**7 + k]}) + "\n")
            t, k = t + background_ms, k + 1
        for k in range(rows):
            ids = [10**6 * (k + 1) + j for j in range(-(-tokens // BLOCK))]
            f.write(json.dumps({"timestamp": at_s * 1000.0, "input_length": tokens, "output_length": 5,
                                "hash_ids": ids}) + "\n")


def bench_burst(name: str, client: int | None, server: int | None, rows: int = 8, tokens: int = 30000,
                at_s: float = 15.0) -> list[str]:
    """A burst of `rows` prompts of `tokens` tokens due at the same millisecond (issue 40: all
    sent within 5 ms of due on an idle core), alone and among sends every 20 ms: each burst row's
    lag, and the other rows' p99 and max."""
    tokenizer = tokenizer_dir(name)
    problems = []
    print(f"burst: {rows} rows of {tokens} tokens due at {at_s:g} s, {name}, openai-chat, replay run on cpu {client}")
    with tempfile.TemporaryDirectory(prefix="bench-burst-") as tmp, \
            sim_process(tokenizer, "--block-size", str(BLOCK), "--ttft-ms", "20", "--itl-ms", "2",
                        "--prefill-ms-per-1k", "0", "--max-num-seqs", "100000", cpu=server) as sim:
        tmp = Path(tmp)
        for background_ms in (0.0, 20.0):
            trace = tmp / "burst.jsonl"
            write_burst_trace(trace, rows, tokens, at_s, background_ms)
            r = replay_once(tokenizer, sim.url, trace, tmp / "run.jsonl", tmp / "cache", client,
                            ["--verify-server", "off"], api="openai-chat")
            problems += r["problems"]
            records = list(read_records(tmp / "run.jsonl"))
            burst = sorted(x["drift_ms"] for x in records if x["input_length"] == tokens)
            others = sorted(x["drift_ms"] for x in records if x["input_length"] != tokens)
            print(f"  {'alone' if not background_ms else f'among sends every {background_ms:g} ms'}: burst lag ms "
                  f"{', '.join(f'{d:.2f}' for d in burst)} (max {burst[-1]:.2f}; target <= 5 on an idle core); "
                  f"other rows p99 {others[int(len(others) * 0.99)]:.2f} max {others[-1]:.2f} ms  "
                  f"loadavg {os.getloadavg()[0]:.2f}", flush=True)
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
    parser.add_argument("--replay-args", default="", help="more `replay run` flags for the replay, e.g. "
                        "'--verify-server off --server-metrics-interval 0' to leave those parts out")
    parser.add_argument("--no-set-up", action="store_true")
    parser.add_argument("--costs", action="store_true",
                        help="only the fixed costs of a run (CPU before the first send, after the last answer, the "
                        "follower's, idle CPU, the tree's peak RSS), for --cost-tokenizers and --cost-apis")
    parser.add_argument("--cost-tokenizers", default="qwen2,llama3,llama2",
                        help="names in ../shared/tokenizers, or folders (a path with a '/')")
    parser.add_argument("--cost-apis", default="openai-chat,openai-completions")
    parser.add_argument("--cost-runs", type=int, default=3, help="replays per tokenizer and api, the first cold")
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--against", type=Path, metavar="TREE",
                        help="another checkout whose replays alternate with this one's (the set-up part is not run for it)")
    args = parser.parse_args()
    client, server = split_cores()
    compile_bytecode()
    if args.against is not None:
        compile_bytecode(args.against)
    problems = []
    if args.costs:
        problems += bench_costs(args.cost_tokenizers.split(","), args.cost_apis.split(","), args.rows, args.seconds,
                                args.cost_runs, args.idle_seconds, client, server, shlex.split(args.replay_args),
                                args.against.resolve() if args.against else None)
        problems += bench_burst(args.cost_tokenizers.split(",")[0], client, server)
        args.no_set_up = args.no_replay = True
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

"""Tree benchmark: a multi-turn chat trace through the cache, requests/s and hit rate.

Trace and schedule come from the peers' own generator, `../shared/peerbench/trace_gen.py`
(imported at run time, never copied), so every implementation sees the same requests:
200 sessions x 8 turns, one shared 1024-token system prompt, user messages and replies of
~100 tokens (normal, sd 25), vocab 32000, 32 sessions active at once in waves, a device pool
of 131072 slots, page sizes 1 and 16. `--deep`: 64 sessions x 80 turns (~17k-token
contexts), 16 active at once, a 524288-slot pool (32 active 17k contexts would not fit
131072 slots; the pool still forces eviction of finished sessions).

Per request, in the peers' order (`sglang_radix_bench.py`): a wave first admits every
request (match, lock, allocate with eviction) and inserts its prompt (`cache`, as after
prefill), then, for each request, extends for the reply and finishes (insert prompt+reply,
unlock, free duplicates and the partial last page). Three ways to drive the same ops:

- `sync`:    `CacheCore` alone, plain method calls (the in-process baseline);
- `actor`:   through `CacheRuntime`, one awaited call per op (4 round trips per request);
- `batched`: through `CacheRuntime.step`, one message per wave step (2 per wave, all
  active sessions in each).

Configuration: no host tier (`host_tokens=0`: the trace measures the device tree, and the
peers have no host tier either), KV shape 1 layer x 1 head x dim 1 (the pool's tensor is
tiny; nothing here touches KV data), LRU, tracing at its production default (a
`SlotTracer` with no sink and debug logging off; no `trace_path`). Benchmarks run on uvloop.

Hit rate = device-hit tokens / prompt tokens over all admits, the peers' definition; on the
default trace it must be 0.9449 (page 1) and 0.9413 (page 16), as for every peer. Our
`admit` matches at most `len(prompt) - 1` tokens (the last token is always computed);
on this trace that never changes a match, since every prompt ends with >= 1 new user token.

`--peers PYTHON` (e.g. ../peer-venv/bin/python, set up per ../shared/peerbench/README.md)
also runs SGLang's RadixCache, UnifiedRadixCache (Rust core) and vLLM's KVCacheManager in
subprocesses on the same trace, alternating with our repeats (median of `--peer-repeats`);
vLLM at block size 16 only unless `--vllm-page-sizes 1,16` (at 1 it hashes every token). They
run through `benchmarks/peers/tree_peers.py`: the peers' own protocol and helpers, with their
inputs (prompt + reply, keys, token lists) built before their timer, as ours are before ours.
Every mode (and page size) first runs `--warmup` untimed times (default 1): one-off costs (the
first trace through a fresh process, the copy kernel's compilation with a host tier) stay out.

Tree shape note: a request that grows its own unshared leaf (prompt, then reply, turn after
turn) keeps it one node (`RadixTree.insert(extend_leaf=True)`), where the peers add a node per
insert; evicting such a leaf frees the whole session chain at once. Hit rates are unchanged.

    .venv/bin/python benchmarks/bench_tree.py [--quick] [--deep] [--peers ../peer-venv/bin/python]

Last stdout line: one JSON object (docs/BENCHMARKS.md): per page size the batched
actor req/s (measured), the sync core req/s (baseline), their ratio, the single-call actor
figures, hit rates, and the peers' medians when run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from benchmarks._common import ROOT, emit_json  # noqa: E402
from runtime.config import HASH_ALGOS, RuntimeConfig  # noqa: E402
from runtime.errors import CapacityError  # noqa: E402
from runtime.messages import Admit, Cache, Extend, Finish  # noqa: E402
from runtime.runtime import CacheRuntime  # noqa: E402
from runtime.trace import SlotTracer, configure_logging  # noqa: E402
from runtime.tree.cache import CacheCore  # noqa: E402

PEERBENCH = ROOT.parent / "shared" / "peerbench"
EXPECTED_HIT = {1: 0.9449, 16: 0.9413}  # the peers' hit rates on the default trace
DEFAULT = dict(sessions=200, turns=8, sys_len=1024, turn_len=200, vocab=32000, conc=32, pool=131072, seed=0)
DEEP = dict(DEFAULT, sessions=64, turns=80, conc=16, pool=524288)
QUICK = dict(DEFAULT, sessions=60)
QUICK_DEEP = dict(DEEP, sessions=16, turns=40, conc=8, pool=131072)


def load_trace_gen(peerbench: Path) -> Any:
    path = peerbench / "trace_gen.py"
    if not path.is_file():
        sys.exit(f"bench_tree: {path} not found. The trace comes from the peers' generator in "
                 f"../shared/peerbench/ (next to the repository root); pass --peerbench DIR if it lives elsewhere.")
    spec = importlib.util.spec_from_file_location("peerbench_trace_gen", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Workload:
    """The trace as waves of (rid, prompt, prompt+reply, reply length), token arrays int32."""

    def __init__(self, tg: Any, p: dict[str, int]) -> None:
        trace = tg.build_trace(p["sessions"], p["turns"], p["sys_len"], p["turn_len"], p["vocab"], p["seed"])
        waves = tg.schedule(trace, p["conc"], p["seed"])
        rid_of = {}
        reqs = []
        for sid, sess in enumerate(trace):
            for t, (prompt, reply) in enumerate(sess):
                rid_of[sid, t] = len(reqs)
                pr = np.asarray(prompt, dtype=np.int32)
                full = np.concatenate((pr, np.asarray(reply, dtype=np.int32)))
                reqs.append((len(reqs), pr, full, len(reply)))
        self.waves = [[reqs[rid_of[st]] for st in wave] for wave in waves]
        self.num_requests = len(reqs)
        self.prompt_tokens = sum(len(r[1]) for r in reqs)
        self.max_len = max(len(r[2]) for r in reqs)


def make_config(page_size: int, pool: int) -> RuntimeConfig:
    return RuntimeConfig(num_layers=1, num_kv_heads=1, head_dim=1, page_size=page_size, device_slots=pool,
                         host_tokens=0, eviction_policy="lru")


def _hit(stats: dict[str, int]) -> float:
    served = stats["tokens_device_hit"] + stats["tokens_host_hit"]
    return served / (served + stats["tokens_recomputed"])


# -- the three drivers ----------------------------------------------------------------
def run_sync(cfg: RuntimeConfig, w: Workload) -> tuple[float, float, float]:
    core = CacheCore(cfg, SlotTracer(cfg.page_size))
    assert core.residency.tracer is not None and not core.residency.tracer.active, "tracing must be at its production default"
    admit, cache, extend, finish = core.admit, core.cache, core.extend, core.finish
    gc.collect()
    t0, c0 = time.perf_counter(), time.process_time()
    for wave in w.waves:
        for rid, prompt, _full, _n in wave:
            admit(rid, prompt)
            cache(rid, prompt)
        for rid, _prompt, full, n in wave:
            extend(rid, n)
            finish(rid, full)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert not core.requests
    return wall, cpu, _hit(core.stats)


async def _actor(cfg: RuntimeConfig, w: Workload) -> tuple[float, float, float]:
    async with CacheRuntime.open(cfg) as rt:
        assert not rt.tracer.active, "tracing must be at its production default"
        admit, cache, extend, finish = rt.admit, rt.cache, rt.extend, rt.finish
        gc.collect()
        t0, c0 = time.perf_counter(), time.process_time()
        for wave in w.waves:
            for rid, prompt, _full, _n in wave:
                await admit(rid, prompt)
                await cache(rid, prompt)
            for rid, _prompt, full, n in wave:
                await extend(rid, n)
                await finish(rid, full)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        stats = await rt.stats()
        assert stats["requests"]["live"] == 0
    return wall, cpu, stats["requests"]["hit_rate"]


def _check(results: tuple[Any, ...]) -> None:
    for r in results:
        if isinstance(r, BaseException):
            raise r


async def _batched(cfg: RuntimeConfig, w: Workload) -> tuple[float, float, float]:
    async with CacheRuntime.open(cfg) as rt:
        assert not rt.tracer.active, "tracing must be at its production default"
        step = rt.step
        gc.collect()
        t0, c0 = time.perf_counter(), time.process_time()
        for wave in w.waves:
            items: list[Any] = []
            for rid, prompt, _full, _n in wave:
                items.append(Admit(rid, prompt))
                items.append(Cache(rid, prompt))
            _check(await step(items))
            items = []
            for rid, _prompt, full, n in wave:
                items.append(Extend(rid, n))
                items.append(Finish(rid, full))
            _check(await step(items))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        stats = await rt.stats()
        assert stats["requests"]["live"] == 0
    return wall, cpu, stats["requests"]["hit_rate"]


# -- the host tier (--host) ----------------------------------------------------------
HOST_POLICIES = ("none", "write_through_selective", "write_through", "write_back")


def make_host_config(page_size: int, pool: int, policy: str) -> RuntimeConfig:
    """The tree benchmark's runtime with a host tier twice the device pool (`none`: no host tier)
    and the CPU copy engine (worker-thread copies of a tiny KV: what is measured is the loop)."""
    host = 0 if policy == "none" else 2 * pool
    return RuntimeConfig(num_layers=1, num_kv_heads=1, head_dim=1, page_size=page_size, device_slots=pool,
                         host_tokens=host, eviction_policy="lru", copy_engine="cpu",
                         write_policy="write_through_selective" if policy == "none" else policy)


async def _host(cfg: RuntimeConfig, w: Workload) -> tuple[float, float, dict[str, Any]]:
    """The batched driver as a scheduler with a host tier must run it, four steps per wave:
    admits, then (once their host loads are ready) the prompts' caches, extends, finishes; an
    item refused for capacity (write-backs still copying) is retried after the loop turns."""
    retries = 0

    async def run(make: Any, group: list[Any]) -> list[Any]:
        nonlocal retries
        out: list[Any] = [None] * len(group)
        todo = list(range(len(group)))
        while todo:
            res = await rt.step([m for i in todo for m in make(group[i])])
            per = len(res) // len(todo)
            again = []
            for i, k in zip(todo, range(0, len(res), per)):
                errs = [r for r in res[k:k + per] if isinstance(r, BaseException)]
                if errs and not all(isinstance(e, CapacityError) for e in errs):
                    raise errs[0]
                if errs:
                    again.append(i)
                else:
                    out[i] = res[k]
            if again:
                retries += len(again)
                await asyncio.sleep(0.0002)
            todo = again
        return out

    async with CacheRuntime.open(cfg) as rt:
        gc.collect()
        t0, c0 = time.perf_counter(), time.process_time()
        for wave in w.waves:
            admitted = await run(lambda r: [Admit(r[0], r[1])], wave)
            for res in admitted:
                for ready in res.readiness:
                    await ready.wait_all()
            await run(lambda r: [Cache(r[0], r[1])], wave)
            await run(lambda r: [Extend(r[0], r[3])], wave)
            await run(lambda r: [Finish(r[0], r[2])], wave)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        stats = await rt.stats()
        assert stats["requests"]["live"] == 0
    return wall, cpu, {"hit_rate": stats["requests"]["hit_rate"], "host_hit_rate": stats["host"]["hit_rate"],
                  "backups": stats["copies"]["backups_issued"], "loads": stats["copies"]["loads_issued"], "capacity_retries": retries}


def host_bench(w: Workload, pages: list[int], pool: int, repeats: int, warmup: int) -> list[dict[str, Any]]:
    """Every write policy against no host tier, alternating, median of `repeats` after `warmup`
    untimed runs of each (the first run in a process pays one-off costs: the copy kernel's
    compilation, during which write-throughs pile up and admits are refused for capacity); the
    loop's cost per copy = (wall with the policy - wall without a host tier) / (backups + loads).
    Every timed run's figures are kept (`runs`); the row's counts are the median run's."""
    walls: dict[tuple[int, str], list[float]] = {(ps, p): [] for ps in pages for p in HOST_POLICIES}
    cpus: dict[tuple[int, str], list[float]] = {(ps, p): [] for ps in pages for p in HOST_POLICIES}
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {(ps, p): [] for ps in pages for p in HOST_POLICIES}
    for ps in pages:
        for policy in HOST_POLICIES:
            for _ in range(warmup):
                _loop_run(_host(make_host_config(ps, pool, policy), w))
    for rep in range(repeats):
        for ps in pages:
            for policy in HOST_POLICIES[rep % 4:] + HOST_POLICIES[:rep % 4]:
                wall, cpu, d = _loop_run(_host(make_host_config(ps, pool, policy), w))
                walls[ps, policy].append(wall)
                cpus[ps, policy].append(cpu)
                runs[ps, policy].append({"req_per_s": round(w.num_requests / wall), "cpu_s": round(cpu, 4), **d})
                print(f"# rep {rep} page {ps} {policy:24s} {w.num_requests / wall:8.0f} req/s  hit {d['hit_rate']:.4f}"
                      f" (host {d['host_hit_rate']:.4f})  backups {d['backups']} loads {d['loads']}"
                      f" retries {d['capacity_retries']}", flush=True)
    rows = []
    for ps in pages:
        base = statistics.median(walls[ps, "none"])
        base_cpu = statistics.median(cpus[ps, "none"])
        for policy in HOST_POLICIES:
            ws = walls[ps, policy]
            wall = statistics.median(ws)
            d = runs[ps, policy][sorted(range(len(ws)), key=ws.__getitem__)[len(ws) // 2]]
            ops = d["backups"] + d["loads"]
            rows.append({"page_size": ps, "policy": policy, "req_per_s": round(w.num_requests / wall, 1),
                         "req_per_s_runs": [round(w.num_requests / x) for x in ws],
                         "vs_no_host": round(base / wall, 3),
                         "cpu_vs_no_host": round(base_cpu / statistics.median(cpus[ps, policy]), 3),
                         **{k: v for k, v in d.items() if k not in ("req_per_s", "cpu_s")},
                         "runs": runs[ps, policy],
                         "loop_us_per_copy": round((wall - base) / ops * 1e6, 1) if ops else None})
    print(f"{'page':>4} {'policy':24s} {'req/s':>8} {'vs none':>8} {'cpu vs':>7} {'backups':>8} {'loads':>6} {'hit':>7} "
          f"{'host hit':>8} {'us/copy':>8}")
    for r in rows:
        per = "" if r["loop_us_per_copy"] is None else f"{r['loop_us_per_copy']:8.1f}"
        print(f"{r['page_size']:4d} {r['policy']:24s} {r['req_per_s']:8.0f} {r['vs_no_host']:7.2f}x "
              f"{r['cpu_vs_no_host']:6.2f}x {r['backups']:8d} "
              f"{r['loads']:6d} {r['hit_rate']:7.4f} {r['host_hit_rate']:8.4f} {per:>8}")
    return rows


def _loop_run(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency of the benchmarks
        return asyncio.run(coro)
    return uvloop.run(coro)


MODES = {
    "sync": run_sync,
    "actor": lambda cfg, w: _loop_run(_actor(cfg, w)),
    "batched": lambda cfg, w: _loop_run(_batched(cfg, w)),
    # KV events on (docs/EVENTS.md): recorded and batched per turn, nobody subscribed, pages
    # hashed with each `hash_algo` (`batched+events` is `batched+events-sha256`, the default)...
    "batched+events": lambda cfg, w: _loop_run(_batched(cfg.replace(kv_events=True), w)),
    **{f"batched+events-{algo}": (lambda cfg, w, algo=algo: _loop_run(_batched(
        cfg.replace(kv_events=True, hash_algo=algo), w))) for algo in HASH_ALGOS},
    # ...and published over ZMQ on 127.0.0.1 (encoding and sending on the publisher's thread)
    "batched+zmq": lambda cfg, w: _loop_run(_batched(
        cfg.replace(kv_events=True, kv_events_endpoint="tcp://127.0.0.1:*"), w)),
    **{f"batched+zmq-{algo}": (lambda cfg, w, algo=algo: _loop_run(_batched(
        cfg.replace(kv_events=True, kv_events_endpoint="tcp://127.0.0.1:*", hash_algo=algo), w))) for algo in HASH_ALGOS},
}


# -- peers --------------------------------------------------------------------------------
def peer_commands(py: str, peerbench: Path, p: dict[str, int], pages: list[int],
                  vllm_pages: list[int]) -> dict[str, list[str]]:
    """The peers through `benchmarks/peers/tree_peers.py`: the peers' protocol and helpers, their
    inputs built before the timer as ours are (their own drivers build them inside it)."""
    common = ["--peerbench", str(peerbench), "--sessions", str(p["sessions"]), "--turns", str(p["turns"]),
              "--sys-len", str(p["sys_len"]), "--turn-len", str(p["turn_len"]), "--vocab", str(p["vocab"]),
              "--conc", str(p["conc"]), "--pool", str(p["pool"]), "--seed", str(p["seed"])]
    ps = ",".join(map(str, pages))
    driver = str(ROOT / "benchmarks" / "peers" / "tree_peers.py")
    cmds = {
        "sglang_radix": [py, driver, "--backend", "radix", "--page-sizes", ps, *common],
        "sglang_unified_rust": [py, driver, "--backend", "unified", "--page-sizes", ps, *common],
    }
    vps = [x for x in vllm_pages if x in pages]
    if vps:
        cmds["vllm"] = [py, driver, "--backend", "vllm", "--page-sizes", ",".join(map(str, vps)), "--hash", "sha256",
                        *common]
    return cmds


def run_peer(cmd: list[str], cwd: Path) -> dict[int, dict[str, Any]]:
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"peer run failed ({' '.join(cmd[1:4])}): {out.stderr[-2000:]}")
    res = {}
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            res[int(d.get("page_size", d.get("block_size")))] = d
    return res


# -- main -----------------------------------------------------------------------------
def main() -> None:
    configure_logging()  # production default: INFO to stderr (the library never configures)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller trace (no hit-rate cross-check)")
    ap.add_argument("--deep", action="store_true", help="deep conversations: 80 turns, ~17k-token contexts")
    ap.add_argument("--repeats", type=int, default=5, help="repeats per mode (median; >= 5)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed runs of each mode (and page size) first, to leave one-off costs out")
    ap.add_argument("--page-sizes", default="1,16")
    ap.add_argument("--modes", default="sync,actor,batched",
                    help="comma-separated, of: " + ", ".join(MODES))
    ap.add_argument("--peers", default=None, metavar="PYTHON", help="python of the peer venv: also run the peers")
    ap.add_argument("--peer-repeats", type=int, default=3)
    ap.add_argument("--host", action="store_true",
                    help="with a host tier: every write policy against none, and the loop's cost per copy")
    ap.add_argument("--vllm-page-sizes", default="16",
                    help="block sizes for vLLM (its default is 16; at 1 it hashes every token: ~200 req/s)")
    ap.add_argument("--peerbench", default=str(PEERBENCH), help="directory of the peers' bench scripts")
    for k in DEFAULT:
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=None)
    a = ap.parse_args()

    peerbench = Path(a.peerbench).resolve()
    if a.peers:  # the peers run from their own directory: keep the venv's path, not its symlink target
        a.peers = os.path.abspath(a.peers)
    tg = load_trace_gen(peerbench)
    params = dict((QUICK_DEEP if a.deep else QUICK) if a.quick else (DEEP if a.deep else DEFAULT))
    for k in DEFAULT:
        v = getattr(a, k)
        if v is not None:
            params[k] = v
    pages = [int(x) for x in a.page_sizes.split(",")]
    modes = [m for m in a.modes.split(",") if m]
    t0 = time.perf_counter()
    w = Workload(tg, params)
    print(f"# trace {params} -> {w.num_requests} requests, {len(w.waves)} waves, {w.prompt_tokens} prompt tokens, "
          f"max context {w.max_len}; built in {time.perf_counter() - t0:.2f}s", flush=True)
    if w.max_len > params["pool"]:
        sys.exit("bench_tree: a context is longer than the pool")

    if a.host:
        emit_json({"bench": "tree_host", "trace": params, "requests": w.num_requests, "repeats": a.repeats,
                   "measured": "batched actor API with a host tier (CPU copy engine), requests/s",
                   "baseline": "the same without a host tier", "loop": "uvloop",
                   "warmup_runs": a.warmup, "results": host_bench(w, pages, params["pool"], a.repeats, a.warmup)})
        return
    cfgs = {ps: make_config(ps, params["pool"]) for ps in pages}
    walls: dict[tuple[int, str], list[float]] = {(ps, m): [] for ps in pages for m in modes}
    hits: dict[tuple[int, str], set[float]] = {(ps, m): set() for ps in pages for m in modes}
    run_hits: dict[tuple[int, str], list[float]] = {(ps, m): [] for ps in pages for m in modes}
    cpus: dict[tuple[int, str], list[float]] = {(ps, m): [] for ps in pages for m in modes}
    peer_res: dict[str, dict[int, list[dict[str, Any]]]] = {}
    vllm_pages = [int(x) for x in a.vllm_page_sizes.split(",") if x]
    peer_cmds = peer_commands(a.peers, peerbench, params, pages, vllm_pages) if a.peers else {}
    for ps in pages:
        for m in modes:
            for _ in range(a.warmup):
                MODES[m](cfgs[ps], w)
    for rep in range(a.repeats):
        # interleave: every repeat runs every mode at every page size, order rotated
        order = [(ps, m) for ps in pages for m in modes]
        k = rep % len(order)
        for ps, m in order[k:] + order[:k]:
            wall, cpu, hit = MODES[m](cfgs[ps], w)
            walls[ps, m].append(wall)
            cpus[ps, m].append(cpu)
            hits[ps, m].add(round(hit, 6))
            run_hits[ps, m].append(round(hit, 6))
            print(f"# rep {rep} page {ps} {m:8s} {w.num_requests / wall:10.0f} req/s  hit {hit:.4f}", flush=True)
        if rep < a.peer_repeats:
            for name, cmd in peer_cmds.items():
                for ps, d in run_peer(cmd, peerbench).items():
                    peer_res.setdefault(name, {}).setdefault(ps, []).append(d)
                    print(f"# rep {rep} page {ps} {name:20s} {d['req_per_s']:10.0f} req/s  hit {d['hit_rate']:.4f}",
                          flush=True)

    default_trace = all(params[k] == DEFAULT[k] for k in DEFAULT)
    results = []
    for ps in pages:
        row: dict[str, Any] = {"page_size": ps}
        for m in modes:
            ws = walls[ps, m]
            (hit,) = hits[ps, m] if len(hits[ps, m]) == 1 else (sorted(hits[ps, m]),)
            row[m] = {"req_per_s": round(w.num_requests / statistics.median(ws), 1),
                      "req_per_s_runs": [round(w.num_requests / x) for x in ws], "hit_rate": hit,
                      "hit_rate_runs": run_hits[ps, m],
                      # process CPU seconds per run (every thread): steadier than wall on a shared machine
                      "cpu_s_runs": [round(x, 4) for x in cpus[ps, m]],
                      "req_per_cpu_s": round(w.num_requests / statistics.median(cpus[ps, m]), 1)}
        if "batched" in modes:
            for m in modes:
                if m.startswith("batched+"):
                    row[f"ratio_{m}_vs_batched"] = round(row[m]["req_per_s"] / row["batched"]["req_per_s"], 3)
                    row[f"cpu_ratio_{m}_vs_batched"] = round(row[m]["req_per_cpu_s"] / row["batched"]["req_per_cpu_s"], 3)
        if "sync" in modes:
            base = row["sync"]["req_per_s"]
            for m in ("actor", "batched"):
                if m in modes:
                    row[f"ratio_{m}_vs_sync"] = round(row[m]["req_per_s"] / base, 3)
            if "batched" in modes:
                row["measured_req_per_s"] = row["batched"]["req_per_s"]
                row["baseline_req_per_s"] = base
                row["ratio"] = row["ratio_batched_vs_sync"]
        if default_trace and ps in EXPECTED_HIT:
            row["hit_rate_expected"] = EXPECTED_HIT[ps]
            row["hit_rate_ok"] = all(round(row[m]["hit_rate"], 4) == EXPECTED_HIT[ps] for m in modes
                                     if not isinstance(row[m]["hit_rate"], list))
        if peer_res:
            peers = {}
            for name, by_ps in peer_res.items():
                runs = by_ps.get(ps)
                if runs:
                    peers[name] = {"req_per_s": round(statistics.median(d["req_per_s"] for d in runs), 1),
                                   "req_per_s_runs": [d["req_per_s"] for d in runs],
                                   "hit_rate": runs[0]["hit_rate"], "impl": runs[0].get("impl")}
            row["peers"] = peers
            rust = peers.get("sglang_unified_rust")
            if rust:
                for m in ("sync", "actor", "batched"):
                    if m in modes:
                        row[f"ratio_{m}_vs_rust"] = round(row[m]["req_per_s"] / rust["req_per_s"], 2)
        results.append(row)

    emit_json({
        "bench": "tree",
        "variant": "deep" if a.deep else "default",
        "quick": a.quick,
        "trace": params,
        "requests": w.num_requests,
        "waves": len(w.waves),
        "repeats": a.repeats,
        "warmup_runs": a.warmup,
        "peer_repeats": min(a.peer_repeats, a.repeats) if a.peers else 0,
        "measured": "batched actor API (CacheRuntime.step, 2 messages per wave), requests/s",
        "baseline": "synchronous CacheCore in the same process, requests/s",
        "model_shape": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "kv_dtype": "float32"},
        "host_tier": False,
        "tracing": "production default (no trace_path, debug logging off)",
        "loop": "uvloop",
        "results": results,
    })


if __name__ == "__main__":
    main()

"""The Mooncake master-kill scenario, run as a program (a crash must be seen as a failure, so the
test runs it in a child process, inside a private network namespace):

    python -m tests.integration.mooncake_master_kill --policy timeout --kill-at 1.5 --requests 400 [--restart-after 10]
    python -m tests.integration.mooncake_master_kill --policy timeout --requests 400 --no-storage  # the baseline

A local Mooncake cluster (master + metadata server on 127.0.0.1, this process's children), a
runtime with storage on Mooncake (page_first host pool: zero-copy), two request streams serving
fingerprinted KV over a few shared prompts with a flush now and then (so that pages are written
through, looked up and read back), and the master killed (SIGKILL) under load. Then the streams
stop, the runtime closes, the backend closes and the cluster stops. Every cached prefix an admit
returned is checked against its fingerprint (no wrong data).

Prints one line ``RESULT {json}`` (the figures the test asserts on) and exits 0; the process
then exits normally (worker threads joined, Mooncake torn down), which is where an unsafe
teardown used to crash.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from typing import Any

from runtime.errors import CapacityError, HiCacheError
from runtime.runtime import CacheRuntime
from runtime.storage.mooncake_backend import MooncakeBackend
from runtime.storage.mooncake_cluster import LocalMooncakeCluster
from tests.integration.support import bad_positions, compute, small_config, toks

PROMPTS = 6        # distinct prompts the streams share (so storage has what they ask for)
PROMPT_TOKENS = 64  # 16 pages of 4 tokens
WARM_REQUESTS = 20  # served before the kill, whatever the kill time (a loaded machine starts slowly)


async def stream(rt: CacheRuntime, name: str, stop: asyncio.Event, rng: random.Random, out: dict[str, Any]) -> None:
    n = 0
    while not stop.is_set() and out["requests"] < out["budget"]:
        n += 1
        rid = f"{name}-{n}"
        prompt = toks(PROMPT_TOKENS + 1, 1000 + rng.randrange(PROMPTS))
        try:
            await rt.prepare(rid, prompt)
            res = await rt.admit(rid, prompt)
        except CapacityError:
            out["capacity"] += 1
            await asyncio.sleep(0.005)
            continue
        try:
            for r in res.readiness:
                await r.wait_all()
            bad = bad_positions(rt.device_pool, res.slots[:res.cached], prompt[:res.cached])
            out["wrong_positions"] += len(bad)
            out["cached_tokens"] += res.cached
            compute(rt, res.slots, prompt, start=res.cached)
            await rt.finish(rid, prompt[:PROMPT_TOKENS])
        except HiCacheError as exc:  # a failed load: the request is gone, its KV never served
            out["errors"].append(repr(exc))
            try:
                await rt.abort(rid)
            except HiCacheError:
                pass
        out["requests"] += 1
        if rng.random() < 0.15:
            await rt.flush()  # the next admits of these prompts read them back from storage
        await asyncio.sleep(0)


async def scenario(args: argparse.Namespace, cluster: LocalMooncakeCluster | None) -> dict[str, Any]:
    """`args.requests` requests over two streams; with a cluster, its master killed at
    `args.kill_at` s (and restarted `args.restart_after` s later, if given)."""
    config = small_config(copy_engine="cpu", host_tokens=1024, host_layout="page_first", device_slots=512,
                          prefetch_policy=args.policy, storage_timeout_s=args.storage_timeout,
                          prefetch_timeout_base_s=0.2, prefetch_timeout_max_s=0.5, debug_invariants=False)
    page_bytes = config.page_size * config.bytes_per_token
    backend = None if cluster is None else MooncakeBackend(page_bytes, cluster.config(
        global_segment_size=32 << 20, local_buffer_size=16 << 20, key_prefix=f"kill-{args.policy}-{os.getpid()}/",
        close_timeout_s=args.close_timeout))
    out: dict[str, Any] = {"requests": 0, "cached_tokens": 0, "wrong_positions": 0, "capacity": 0, "errors": [],
                           # (with a restart: load until storage is measured back, whatever the count)
                           "budget": args.requests if args.restart_after is None else float("inf")}
    loop = asyncio.get_running_loop()
    rt_closed_in = backend_closed_in = -1.0
    marks: dict[str, Any] = {}
    async with CacheRuntime.open(config, storage=backend) as rt:
        stop = asyncio.Event()
        t_start = loop.time()
        tasks = [asyncio.create_task(stream(rt, f"s{i}", stop, random.Random(args.seed * 10 + i), out))
                 for i in range(2)]
        if cluster is not None:
            while out["requests"] < WARM_REQUESTS and loop.time() - t_start < 30:  # a slow start is no load
                await asyncio.sleep(0.01)
            await asyncio.sleep(max(0.0, args.kill_at - (loop.time() - t_start)))
            at_death = (await rt.stats())["storage"]
            cluster.kill_master()
            t_kill = loop.time()
            marks.update(killed_at_requests=out["requests"], calls_at_death=at_death["calls_running"]
                         + at_death["calls_waiting"], overdue_before_death=at_death["ops_overdue"])
            watch = asyncio.create_task(first_down(rt, t_kill, loop, marks))
            if args.restart_after is not None:
                marks.update(await restart(rt, cluster, args.restart_after, t_kill, loop))
                stop.set()
        await asyncio.gather(*tasks)
        t_end = loop.time()
        marks["workload_s"] = round(t_end - t_start, 3)
        if cluster is not None:
            watch.cancel()
            marks.update(after_kill_s=round(t_end - t_kill, 3), after_kill_requests=out["requests"] - marks["killed_at_requests"])
        stop.set()
        before = await rt.stats()
        t0 = loop.time()
        await rt.close()
        rt_closed_in = loop.time() - t0
    if backend is None:
        return {**out, **marks, "errors": out["errors"][:5], "policy": args.policy, "storage": False}
    transfer = rt._transfer.counters
    t0 = time.monotonic()
    backend.close()
    backend_closed_in = time.monotonic() - t0
    bstats = backend.stats()
    s = before["storage"]
    return {
        **out, **marks, "errors": out["errors"][:5], "policy": args.policy, "storage": True,
        "runtime_close_s": round(rt_closed_in, 3), "backend_close_s": round(backend_closed_in, 3),
        "inflight_before_close": s["calls_running"], "health_at_end": s["health"], "probes": s["probes"],
        "health_changes": s["health_changes"], "ops_skipped": transfer["storage_ops_skipped"],
        "ops_submitted": transfer.get("storage_ops_submitted"), "ops_done": transfer["storage_ops_done"],
        "ops_failed": transfer["storage_ops_failed"], "ops_abandoned": transfer.get("storage_ops_abandoned"),
        "ops_overdue": transfer["storage_ops_overdue"], "storage_probes_run": transfer["storage_probes"],
        "inflight_after_close": len(rt._transfer.storage.inflight),
        "copies_issued": rt._core.stats["backups_issued"] + rt._core.stats["loads_issued"],
        "copies_settled": transfer["ops_done"] + transfer["ops_failed"], "copies_inflight": len(rt._transfer.copies.inflight),
        "backend_calls_abandoned": bstats.get("calls_abandoned_at_close"),
        "backend_calls_running": bstats.get("calls_running"),
        "mooncake_errors": bstats["errors"], "pages_written": bstats["pages_written"], "pages_read": bstats["pages_read"],
    }


async def first_down(rt: CacheRuntime, t_kill: float, loop: asyncio.AbstractEventLoop, marks: dict[str, Any]) -> None:
    """Note how long after the kill the storage tier went down (`down_after_s`)."""
    while (await rt.stats())["storage"]["health"] != "down":
        await asyncio.sleep(0.02)
    marks["down_after_s"] = round(loop.time() - t_kill, 3)


async def restart(rt: CacheRuntime, cluster: LocalMooncakeCluster, after_s: float, t_kill: float,
                  loop: asyncio.AbstractEventLoop) -> dict[str, Any]:
    """The master back `after_s` s after the kill, on the same address: how long until the
    storage tier is healthy again and until storage hits resume (the new master holds nothing:
    pages are written anew, then read back after a flush)."""
    seen = set()
    while loop.time() - t_kill < after_s:
        seen.add((await rt.stats())["storage"]["health"])
        await asyncio.sleep(0.05)
    cluster.restart_master()
    t_back = loop.time()
    hits = (await rt.stats())["storage"]["hit_tokens"]
    marks: dict[str, Any] = {"health_while_dead": sorted(seen), "healthy_after_s": None, "hits_after_s": None}
    while loop.time() - t_back < 15 and (marks["healthy_after_s"] is None or marks["hits_after_s"] is None):
        s = (await rt.stats())["storage"]
        if marks["healthy_after_s"] is None and s["health"] == "healthy":
            marks["healthy_after_s"] = round(loop.time() - t_back, 3)
        if marks["hits_after_s"] is None and s["hit_tokens"] > hits:
            marks["hits_after_s"] = round(loop.time() - t_back, 3)
        await asyncio.sleep(0.05)
    return marks


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--policy", choices=("timeout", "wait_complete"), required=True)
    p.add_argument("--kill-at", type=float, default=1.5)
    p.add_argument("--requests", type=int, default=400, help="requests over both streams")
    p.add_argument("--restart-after", type=float, default=None, help="restart the master this long after the kill")
    p.add_argument("--no-storage", action="store_true", help="the same workload with no storage tier (a baseline)")
    p.add_argument("--storage-timeout", type=float, default=1.0)
    p.add_argument("--close-timeout", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None)
    args = p.parse_args()
    if args.no_storage:
        print("PIDS {}", flush=True)
        print("RESULT " + json.dumps(asyncio.run(scenario(args, None))), flush=True)
        return 0
    cluster = LocalMooncakeCluster(log_dir=args.log_dir).start()
    print("PIDS " + json.dumps(cluster.pids), flush=True)
    try:
        result = asyncio.run(scenario(args, cluster))
    finally:
        cluster.stop()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

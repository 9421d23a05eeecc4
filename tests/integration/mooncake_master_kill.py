"""The Mooncake master-kill scenario, run as a program (a crash must be seen as a failure, so the
test runs it in a child process, inside a private network namespace):

    python -m tests.integration.mooncake_master_kill --policy timeout --kill-at 1.5 --duration 3

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
    while not stop.is_set():
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


async def scenario(args: argparse.Namespace, cluster: LocalMooncakeCluster) -> dict[str, Any]:
    config = small_config(copy_engine="cpu", host_tokens=1024, host_layout="page_first", device_slots=512,
                          prefetch_policy=args.policy, storage_timeout_s=args.storage_timeout,
                          prefetch_timeout_base_s=0.2, prefetch_timeout_max_s=0.5, debug_invariants=False)
    page_bytes = config.page_size * config.bytes_per_token
    backend = MooncakeBackend(page_bytes, cluster.config(global_segment_size=32 << 20, local_buffer_size=16 << 20,
                                                         key_prefix=f"kill-{args.policy}-{os.getpid()}/",
                                                         close_timeout_s=args.close_timeout))
    out: dict[str, Any] = {"requests": 0, "cached_tokens": 0, "wrong_positions": 0, "capacity": 0, "errors": []}
    loop = asyncio.get_running_loop()
    rt_closed_in = backend_closed_in = -1.0
    async with CacheRuntime.open(config, storage=backend) as rt:
        stop = asyncio.Event()
        tasks = [asyncio.create_task(stream(rt, f"s{i}", stop, random.Random(args.seed * 10 + i), out))
                 for i in range(2)]
        t0 = loop.time()
        while out["requests"] < WARM_REQUESTS and loop.time() - t0 < 30:  # under load: a slow start is no load
            await asyncio.sleep(0.01)
        await asyncio.sleep(max(0.0, args.kill_at - (loop.time() - t0)))
        os.kill(cluster.master_pid, signal.SIGKILL)
        out["killed_at_requests"] = out["requests"]
        await asyncio.sleep(max(0.0, args.duration - (loop.time() - t0)))
        stop.set()
        await asyncio.gather(*tasks)
        before = await rt.stats()
        t0 = loop.time()
        await rt.close()
        rt_closed_in = loop.time() - t0
    transfer = rt._transfer.counters
    t0 = time.monotonic()
    backend.close()
    backend_closed_in = time.monotonic() - t0
    bstats = backend.stats()
    return {
        **out, "errors": out["errors"][:5], "policy": args.policy,
        "runtime_close_s": round(rt_closed_in, 3), "backend_close_s": round(backend_closed_in, 3),
        "inflight_before_close": before["storage"]["calls_running"],
        "ops_submitted": transfer.get("storage_ops_submitted"), "ops_done": transfer["storage_ops_done"],
        "ops_failed": transfer["storage_ops_failed"], "ops_abandoned": transfer.get("storage_ops_abandoned"),
        "ops_overdue": transfer["storage_ops_overdue"],
        "inflight_after_close": len(rt._transfer.storage.inflight),
        "copies_issued": rt._core.stats["backups_issued"] + rt._core.stats["loads_issued"],
        "copies_settled": transfer["ops_done"] + transfer["ops_failed"], "copies_inflight": len(rt._transfer.copies.inflight),
        "backend_calls_abandoned": bstats.get("calls_abandoned_at_close"),
        "backend_calls_running": bstats.get("calls_running"),
        "mooncake_errors": bstats["errors"], "pages_written": bstats["pages_written"], "pages_read": bstats["pages_read"],
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--policy", choices=("timeout", "wait_complete"), required=True)
    p.add_argument("--kill-at", type=float, default=1.5)
    p.add_argument("--duration", type=float, default=3.0)
    p.add_argument("--storage-timeout", type=float, default=1.0)
    p.add_argument("--close-timeout", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None)
    args = p.parse_args()
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

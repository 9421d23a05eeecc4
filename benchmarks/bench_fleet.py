"""Fleet benchmark: a multi-turn chat trace over N runtime instances, routed by KV events vs round
robin vs random (examples/router.py), against the single-instance ideal (an infinite cache).

Trace (seeded): `--tenants` system prompts of `--sys-len` tokens; `--sessions` conversations,
each on one tenant's system prompt, of `--turns` turns (a user message and a reply of ~turn_len/2
tokens each, normal, sd turn_len/8); `--conc` conversations run at once, closed loop (a turn is
sent when the previous one's reply is back); a finished conversation is replaced by the next.

Fleet: `--instances` processes, each a `CacheRuntime` (page 16, `--device-tokens` device slots,
as many host slots, write_through_selective, prefetch wait_complete) with a simulated forward
(examples/router.py `FleetConfig`: 20 us per computed prompt token, 1 us per token loaded from
host, +4 us per token read from storage; one forward at a time per instance, so TTFT includes
queueing) and one shared file storage directory (fresh per policy). The router follows every
instance's KV events over ZMQ on 127.0.0.1.

Reported per policy: prompt tokens served per tier (device, host, storage) and recomputed,
recomputed / ideal, TTFT median and p99, requests per instance. The ideal is one instance with
an infinite cache, fed the requests of the cache-aware run as they were sent: a request finds
every whole page of its prompt (at most len - 1 tokens) that a request finished before it was
sent held in its prompt or reply (`ideal`). With a trace's conversations running at once, two
requests on one system prompt sent together both compute it, on one instance as on many; the
stricter `ideal_sequential` lets a request find the pages of every request sent before it (as if
none ran at once). Target: cache-aware routing recomputes <= 1.1x the ideal, round
robin far above it. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import emit_json, median, percentile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def load_router() -> Any:
    spec = importlib.util.spec_from_file_location("hicache_router_example", ROOT / "examples" / "router.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (its dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


def build_trace(p: dict[str, int]) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Sessions, each a list of (prompt, reply) int32 arrays."""
    rng = np.random.default_rng(p["seed"])
    systems = [rng.integers(0, 32000, p["sys_len"], dtype=np.int32) for _ in range(p["tenants"])]
    sessions = []
    for s in range(p["sessions"]):
        hist = systems[s % p["tenants"]]
        turns = []
        for _ in range(p["turns"]):
            u, a = (max(1, int(rng.normal(p["turn_len"] / 2, p["turn_len"] / 8))) for _ in range(2))
            prompt = np.concatenate((hist, rng.integers(0, 32000, u, dtype=np.int32)))
            reply = rng.integers(0, 32000, a, dtype=np.int32)
            turns.append((prompt, reply))
            hist = np.concatenate((prompt, reply))
        sessions.append(turns)
    return sessions


async def run_policy(router_mod: Any, policy: str, trace: list[Any], p: dict[str, int]) -> dict[str, Any]:
    fleet = router_mod.FleetConfig(device_tokens=p["device_tokens"], host_tokens=p["device_tokens"])
    order: list[tuple[int, int, float, float]] = []  # session, turn, sent, done (seconds)
    results: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="hicache-fleet-") as storage_dir:
        async with router_mod.Router(p["instances"], fleet, storage_dir, policy=policy, seed=p["seed"],
                                     load_bound=p["load_bound"]) as router:
            pending = list(range(len(trace)))

            async def worker() -> None:
                while pending:
                    s = pending.pop(0)
                    for t, (prompt, reply) in enumerate(trace[s]):
                        sent = time.perf_counter()
                        results.append(await router.submit(f"s{s}t{t}", prompt, reply))
                        order.append((s, t, sent, time.perf_counter()))

            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(p["conc"])))
            wall = time.perf_counter() - t0
    prompt = sum(r.prompt_tokens for r in results)
    device = sum(r.device for r in results)
    storage = sum(r.storage for r in results)
    host = sum(r.host for r in results) - storage
    ttft = [r.ttft_s for r in results]
    return {"policy": policy, "requests": len(results), "prompt_tokens": prompt, "device_tokens": device,
            "host_tokens": host, "storage_tokens": storage, "recomputed_tokens": prompt - device - host - storage,
            "ttft_median_ms": round(median(ttft) * 1e3, 2), "ttft_p99_ms": round(percentile(ttft, 99) * 1e3, 2),
            "per_instance": [sum(1 for r in results if r.instance == i) for i in range(p["instances"])],
            "wall_s": round(wall, 2), "order": order}


def ideal_recomputed(trace: list[Any], order: list[tuple[int, int, float, float]], page_size: int,
                     sequential: bool = False) -> int:
    """One instance, infinite cache, the requests of `order` (see the module docstring)."""
    seen: set[bytes] = set()  # a page is known with all the pages before it: keys are prefix bytes
    recomputed = 0
    pb = page_size * 4
    by_done = sorted(order, key=lambda r: r[3])
    done = 0
    for s, t, sent, _ in sorted(order, key=lambda r: r[2]):
        while not sequential and done < len(by_done) and by_done[done][3] < sent:
            ds, dt = by_done[done][0], by_done[done][1]
            full = np.concatenate(trace[ds][dt]).tobytes()
            seen.update(full[: k * pb] for k in range(1, len(full) // pb + 1))
            done += 1
        prompt = trace[s][t][0]
        raw = prompt.tobytes()
        limit = (len(prompt) - 1) // page_size
        cached = 0
        while cached < limit and raw[: (cached + 1) * pb] in seen:
            cached += 1
        recomputed += len(prompt) - cached * page_size
        if sequential:
            full = np.concatenate(trace[s][t]).tobytes()
            seen.update(full[: k * pb] for k in range(1, len(full) // pb + 1))
    return recomputed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--sys-len", type=int, default=1024)
    ap.add_argument("--turn-len", type=int, default=200)
    ap.add_argument("--conc", type=int, default=16)
    ap.add_argument("--device-tokens", type=int, default=16384)
    ap.add_argument("--load-bound", type=int, default=4, help="cache-aware routing: requests above the least loaded")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default="events,round_robin,random")
    ap.add_argument("--quick", action="store_true", help="a small trace (smoke run)")
    a = ap.parse_args()
    p = {k: getattr(a, k) for k in ("instances", "tenants", "sessions", "turns", "sys_len", "turn_len", "conc",
                                    "device_tokens", "seed", "load_bound")}
    if a.quick:
        p.update(sessions=16, turns=3, sys_len=256, device_tokens=4096)
    router_mod = load_router()
    try:
        import uvloop
        run = uvloop.run
    except ImportError:  # pragma: no cover
        run = asyncio.run
    trace = build_trace(p)
    rows = []
    for policy in a.policies.split(","):
        row = run(run_policy(router_mod, policy, trace, p))
        rows.append(row)
        print(f"# {policy}: {row['wall_s']} s", flush=True)
    page = router_mod.FleetConfig().page_size
    ideal = ideal_recomputed(trace, rows[0]["order"], page)
    ideal_seq = ideal_recomputed(trace, rows[0]["order"], page, sequential=True)
    print(f"{'policy':12s} {'device':>9} {'host':>8} {'storage':>8} {'recomputed':>10} {'vs ideal':>8} "
          f"{'TTFT p50':>9} {'p99':>8}  per instance")
    for r in rows:
        r["recomputed_vs_ideal"] = round(r["recomputed_tokens"] / ideal, 3)
        r["recomputed_vs_ideal_sequential"] = round(r["recomputed_tokens"] / ideal_seq, 3)
        n = r["prompt_tokens"]
        print(f"{r['policy']:12s} {r['device_tokens'] / n:9.1%} {r['host_tokens'] / n:8.1%} "
              f"{r['storage_tokens'] / n:8.1%} {r['recomputed_tokens']:10d} {r['recomputed_vs_ideal']:7.2f}x "
              f"{r['ttft_median_ms']:7.1f}ms {r['ttft_p99_ms']:6.1f}ms  {r['per_instance']}")
        del r["order"]
    print(f"ideal (one instance, infinite cache): {ideal} tokens recomputed; sequential: {ideal_seq}")
    emit_json({"bench": "fleet", "trace": p, "ideal_recomputed_tokens": ideal,
               "ideal_sequential_recomputed_tokens": ideal_seq,
               "baseline": "round robin and random routing over the same fleet, and the single-instance ideal",
               "results": rows})


if __name__ == "__main__":
    main()

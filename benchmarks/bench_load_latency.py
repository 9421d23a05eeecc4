"""Load latency through the public API: admit a prompt whose prefix is cached only on host, then
wait for each layer of its load, against one contiguous pinned copy of the same bytes.

Per prefix size (``--tokens``, default 512 / 2,048 / 8,192), in one runtime, ``--repeats`` (12)
rounds of each scenario (alternating) of:

1. the prefix is cached (admit + finish, write-through: its pages are backed up to host) and
   pushed off the device by filler prompts (admit + finish of ``device_slots`` tokens, so every
   older page is evicted from the device), and their backups are let finish;
2. ``busy`` only: more fillers, half the device pool's worth, whose write-through backups are
   still in flight when the prompt is admitted (a server's normal state: the requests that just
   pushed a prefix off are being backed up);
3. ``admit`` of prefix + one page of new tokens (the hit is loaded from host), then await
   ``readiness.wait(layer)`` for every layer in order (on CUDA also each layer's CUDA event).

Reported per size and scenario (medians): admit time, admit -> every layer ready (awaited), the
contiguous copy of the same bytes (one ``copy_`` from a pinned host tensor, the link's speed),
their ratio, and the first layer ready after admit returned; on CUDA the same through the events
(``event.synchronize``, no poller). Targets (GPU, issue acceptance): idle ratio <= 1.5 at 2,048
and 8,192 tokens, <= 3 at 512; first layer <= 1 ms after admit; busy <= 2x idle.

Geometry: Llama-3-8B's KV by default (32 layers, 8 KV heads, head dim 128, bf16: 128 KiB a
token), page 16, a device pool of 65,536 tokens (8 GiB; busy: 4 GiB of backups in flight), host
twice that. ``--quick`` (CPU): 8 layers, 512 / 2,048 tokens, an 8,192-token device pool (128 MiB
of backups in flight), 5 rounds. The last stdout line is JSON.

    python benchmarks/bench_load_latency.py --quick                # CPU
    python benchmarks/bench_load_latency.py --device cuda          # GPU
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import emit_json, median  # noqa: E402
from runtime.config import RuntimeConfig  # noqa: E402
from runtime.runtime import CacheRuntime  # noqa: E402
from runtime.trace import configure_logging  # noqa: E402

PAGE = 16
FILLER = 2048  # tokens per filler prompt (at most a quarter of the device pool)


class Tokens:
    """Unique random prompts (no two share a first page)."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def __call__(self, n: int) -> np.ndarray:
        return self.rng.integers(3, 1 << 30, n, dtype=np.int64).astype(np.int32)


def token_bytes(args: argparse.Namespace) -> int:
    return args.layers * 2 * args.kv_heads * args.head_dim * 2  # K and V, bf16


async def idle(rt: CacheRuntime, timeout: float = 120.0) -> None:
    """Until no backup is running or queued."""
    deadline = time.perf_counter() + timeout
    while True:
        s = await rt.stats()
        if not s["transfer"]["inflight_backups"] and not s["queues"]["waiting_backups"]:
            return
        if time.perf_counter() > deadline:
            raise TimeoutError("backups still in flight")
        await asyncio.sleep(0.002)


async def cache(rt: CacheRuntime, rid: str, tokens: np.ndarray) -> None:
    """Admit and finish `tokens` (their KV "computed": the runtime caches whatever the slots hold)."""
    while not await rt.can_admit(tokens):
        await asyncio.sleep(0.002)  # room locked by backups in flight
    await rt.admit(rid, tokens)
    await rt.finish(rid, tokens)


def contiguous_copy(nbytes: int, device: str, repeats: int) -> float:
    """Median seconds of one contiguous copy of `nbytes` from (pinned) host memory to `device`."""
    pin = device.startswith("cuda")
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if not pin:
        src_np, dst_np = src.numpy(), dst.numpy()
    times = []
    for _ in range(repeats + 1):
        if pin:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if pin:
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
        else:  # one memcpy (torch's CPU copy_ splits over OpenMP threads: ms of waits on a loaded machine)
            np.copyto(dst_np, src_np)
        times.append(time.perf_counter() - t0)
    return median(times[1:])


async def one_round(rt: CacheRuntime, tok: Tokens, n: int, busy: bool, device_slots: int, rnd: str,
                    num_layers: int) -> dict[str, float]:
    filler = min(FILLER, device_slots // 4)
    prefix = tok(n)
    await cache(rt, f"p{rnd}", prefix)
    await idle(rt)  # the prefix's own backup is done: it is on host
    for i in range(device_slots // filler + 1):  # every older page leaves the device
        await cache(rt, f"f{rnd}.{i}", tok(filler))
    await idle(rt)
    if busy:  # half the pool's worth of new prefixes, their backups in flight (they lock their pages)
        for i in range(device_slots // 2 // filler):
            await cache(rt, f"b{rnd}.{i}", tok(filler))
    prompt = np.concatenate([prefix, tok(PAGE)])
    cuda = rt.config.device.startswith("cuda")
    t0 = time.perf_counter()
    res = await rt.admit(f"q{rnd}", prompt)
    t_admit = time.perf_counter()
    if res.loaded_host != n:
        raise RuntimeError(f"expected a host hit of {n} tokens, got {res.loaded_host} (device {res.cached_device})")
    (rd,) = res.readiness
    ready = []
    if cuda:  # the events, as a model's stream would wait on them (no poller)
        while rd.event(0) is None and not rd.done():
            await asyncio.sleep(0)
        ev_ready = []
        for layer in range(num_layers):
            rd.event(layer).synchronize()
            ev_ready.append(time.perf_counter())
    for layer in range(num_layers):
        await rd.wait(layer)
        ready.append(time.perf_counter())
    await rt.abort(f"q{rnd}")
    out = {"admit_s": t_admit - t0, "all_s": ready[-1] - t0, "first_after_admit_s": ready[0] - t_admit,
           "layer_gap_s": (ready[-1] - ready[0]) / max(1, num_layers - 1)}
    if cuda:
        out.update(event_all_s=ev_ready[-1] - t0, event_first_after_admit_s=ev_ready[0] - t_admit)
    return out


async def run_size(args: argparse.Namespace, n: int) -> list[dict[str, Any]]:
    """One runtime per size (opening one pins twice the device pool on host: seconds on a GPU
    machine), the scenarios' rounds alternating in it."""
    cfg = RuntimeConfig(num_layers=args.layers, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                        kv_dtype="bfloat16", page_size=PAGE, device_slots=args.device_slots,
                        host_tokens=2 * args.device_slots, write_policy="write_through", device=args.device)
    tok = Tokens(n)
    rounds: dict[str, list[dict[str, float]]] = {sc: [] for sc in args.scenarios}
    async with CacheRuntime.open(cfg) as rt:
        await one_round(rt, tok, n, False, args.device_slots, "warm", args.layers)
        for r in range(args.repeats):
            for sc in args.scenarios:
                rounds[sc].append(await one_round(rt, tok, n, sc == "busy", args.device_slots, f"{sc}{r}", args.layers))
        await idle(rt)
    rows = []
    for sc in args.scenarios:
        row: dict[str, Any] = {"tokens": n, "scenario": sc, "bytes": n * token_bytes(args)}
        for key in rounds[sc][0]:
            row[key.replace("_s", "_ms")] = 1e3 * median([r[key] for r in rounds[sc]])
        rows.append(row)
    return rows


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for n in args.tokens:
        contig = contiguous_copy(n * token_bytes(args), args.device, max(21, args.repeats))
        for row in await run_size(args, n):
            row["contig_ms"] = 1e3 * contig
            row["ratio"] = row["all_ms"] / row["contig_ms"]
            if "event_all_ms" in row:
                row["event_ratio"] = row["event_all_ms"] / row["contig_ms"]
            rows.append(row)
            print(f"  {n} {row['scenario']}: {row['all_ms']:.2f} ms", file=sys.stderr, flush=True)
    idle_by = {r["tokens"]: r for r in rows if r["scenario"] == "idle"}
    for r in rows:
        if r["scenario"] == "busy" and r["tokens"] in idle_by:
            r["busy_vs_idle"] = r["all_ms"] / idle_by[r["tokens"]]["all_ms"]
    return rows


def main() -> None:
    configure_logging()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CPU scale: 8 layers, 512 / 2,048 tokens, 8,192-token pool, 5 rounds")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--scenarios", nargs="+", default=["idle", "busy"], choices=["idle", "busy"])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--device-slots", type=int, default=65536)
    ap.add_argument("--repeats", type=int, default=12)
    args = ap.parse_args()
    if args.quick:
        args.layers, args.tokens, args.device_slots, args.repeats = 8, [512, 2048], 8192, 5
    if any(n % PAGE or n + PAGE > args.device_slots // 2 for n in args.tokens):
        ap.error(f"--tokens must be multiples of {PAGE} that fit half the device pool with a page to spare")
    rows = asyncio.run(main_async(args))
    print(f"{args.device}: {args.layers} layers x {args.kv_heads} KV heads x {args.head_dim} (bf16, "
          f"{token_bytes(args) // 1024} KiB a token), page {PAGE}, device pool {args.device_slots} tokens")
    print(f"{'tokens':>7} {'scenario':>8} {'admit':>8} {'all ready':>10} {'contig':>8} {'ratio':>6} "
          f"{'1st layer':>9} {'gap/layer':>9} {'busy/idle':>9}")
    for r in rows:
        bi = f"{r['busy_vs_idle']:.2f}" if "busy_vs_idle" in r else "-"
        print(f"{r['tokens']:>7} {r['scenario']:>8} {r['admit_ms']:>6.2f}ms {r['all_ms']:>8.2f}ms {r['contig_ms']:>6.2f}ms "
              f"{r['ratio']:>6.2f} {r['first_after_admit_ms']:>7.2f}ms {r['layer_gap_ms']:>7.3f}ms {bi:>9}")
        if "event_all_ms" in r:
            print(f"{'':>16} events: all ready {r['event_all_ms']:.2f} ms ({r['event_ratio']:.2f}x), first layer "
                  f"{r['event_first_after_admit_ms']:.2f} ms after admit")
    emit_json({"bench": "load_latency", "device": args.device, "quick": args.quick,
               "machine": platform.processor() or platform.machine(), "layers": args.layers,
               "kv_heads": args.kv_heads, "head_dim": args.head_dim, "page": PAGE,
               "device_slots": args.device_slots, "repeats": args.repeats, "rows": rows})


if __name__ == "__main__":
    main()

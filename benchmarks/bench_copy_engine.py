"""Copy-engine throughput: backup (device->host) and load (host->device) of scattered pages.

For each page size and host layout, one transfer of >= 256 MiB (``--quick``: 32 MiB) of
random scattered pages (random on both sides) is timed through a pluggable async
*candidate* (default: `CpuCopyEngine.submit` + awaiting ``done`` through the
`CompletionBridge`; CUDA engine when CUDA is available), interleaved with two baselines
measured on the same bytes in the same process:

- ``index``: torch ``index_select`` + ``index_copy_`` of the same pages, per layer and K/V
  (slot indices on layer_first sides, page indices on the page_first host side);
- ``contig``: one contiguous ``copy_`` of the same byte count.

Median of ``--repeats`` (>= 5) rounds; each round runs candidate, index, contig in turn.
The last stdout line is one JSON object with every figure, baseline and ratio.

A later candidate (through the transfer actor) plugs in with ``--candidate module:factory``
where ``factory(pools) -> (async fn(plan) -> None, async close())``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import importlib
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np

# torch's OpenMP threads (libgomp) spin-wait after every parallel region of the torch baselines
# by default, on the 2 cores the copy under test needs: the same copy took 1.2-1.7x as long (A/B in docs/BENCHMARKS.md).
# Passive waits (set before torch loads libgomp) keep the baselines from slowing the candidate;
# they cost the index baseline 10-20% and the contiguous copy nothing. OMP_WAIT_POLICY=ACTIVE
# in the environment measures with spinning instead. bench_transfer imports this module before
# torch for the same setting.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import git_commit  # noqa: E402,F401 (bench_transfer imports it from here)
from runtime.completion import CompletionBridge  # noqa: E402
from runtime.memory.pools import DevicePool, HostPool, KVShape  # noqa: E402
from runtime.messages import Direction, PoolTransfer, TransferPlan  # noqa: E402
from runtime.trace import configure_logging  # noqa: E402

Candidate = Callable[[TransferPlan], Awaitable[None]]
CandidateFactory = Callable[[dict], Awaitable[tuple[Candidate, Callable[[], Awaitable[None]]]]]


# ---------------------------------------------------------------------------------------
# candidates
# ---------------------------------------------------------------------------------------


async def engine_candidate(pools: dict, **engine_kw) -> tuple[Candidate, Callable[[], Awaitable[None]]]:
    """Default candidate: the copy engine + completion bridge, awaited on the running loop."""
    if torch.cuda.is_available() and next(iter(pools.values()))[0].device.type == "cuda":
        from runtime.transfer.cuda_engine import CudaCopyEngine

        engine = CudaCopyEngine(pools)
    else:
        from runtime.transfer.cpu_engine import CpuCopyEngine

        engine = CpuCopyEngine(pools, **engine_kw)
    bridge = CompletionBridge().start()

    async def run(plan: TransferPlan) -> None:
        await bridge.watch(engine.submit(plan).done)

    async def close() -> None:
        await bridge.aclose()
        engine.close()

    return run, close


def load_factory(spec: str | None) -> CandidateFactory:
    if not spec:
        return engine_candidate
    mod, _, name = spec.partition(":")
    return getattr(importlib.import_module(mod), name)


# ---------------------------------------------------------------------------------------
# baselines
# ---------------------------------------------------------------------------------------


def index_baseline(device: DevicePool, host: HostPool, direction: Direction, src: torch.Tensor, dst: torch.Tensor) -> Callable[[], None]:
    """torch index_select + index_copy_ per layer and part (K and V, or the latent) on the same pages."""
    L, ps = device.shape.num_layers, device.page_size
    H, D = device.shape.num_kv_heads, device.shape.head_dim
    backup = direction is Direction.BACKUP
    dev_slots, host_slots = (src, dst) if backup else (dst, src)
    dev_slots = dev_slots.to(device.device)
    host_pages = (host_slots[::ps] // ps).contiguous()
    sync = torch.cuda.synchronize if device.device.type == "cuda" else (lambda: None)

    def run() -> None:
        for layer in range(L):
            for kv in range(device.shape.parts):
                d = device.buffer[kv, layer]
                if host.layout == "layer_first":
                    h = host.buffer[kv, layer]
                    if backup:
                        h.index_copy_(0, host_slots, d.index_select(0, dev_slots).to("cpu"))
                    else:
                        d.index_copy_(0, dev_slots, h.index_select(0, host_slots).to(d.device))
                else:
                    h = host.buffer[:, layer, kv]  # [P, ps, H, D]
                    if backup:
                        h.index_copy_(0, host_pages, d.index_select(0, dev_slots).to("cpu").view(-1, ps, H, D))
                    else:
                        d.index_copy_(0, dev_slots, h.index_select(0, host_pages).reshape(-1, H, D).to(d.device))
        sync()

    return run


def contig_baseline(nbytes: int, direction: Direction, device: torch.device) -> Callable[[], None]:
    host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dev = torch.ones(nbytes, dtype=torch.uint8, device=device)
    src, dst = (dev, host) if direction is Direction.BACKUP else (host, dev)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def run() -> None:
        dst.copy_(src, non_blocking=True)
        sync()

    return run


# ---------------------------------------------------------------------------------------
# setup
# ---------------------------------------------------------------------------------------


def scattered(num_pages: int, pool_pages: int, ps: int, rng: np.random.Generator) -> torch.Tensor:
    pages = rng.permutation(pool_pages)[:num_pages]
    return torch.from_numpy((pages[:, None] * ps + np.arange(ps)).reshape(-1).astype(np.int64))


def setup(shape: KVShape, ps: int, layout: str, mib: int, device: torch.device, seed: int):
    tokens = -(-(mib << 20) // shape.bytes_per_token)
    tokens = -(-tokens // ps) * ps
    num_pages = tokens // ps
    pool_pages = max(num_pages * 5 // 2, num_pages + 1)
    dev = DevicePool(shape, pool_pages * ps, ps, device)
    dev.buffer.uniform_(-1, 1)
    host = HostPool(shape, pool_pages * ps, ps, layout)
    rng = np.random.default_rng(seed)
    return dev, host, scattered(num_pages, pool_pages, ps, rng), scattered(num_pages, pool_pages, ps, rng), tokens


def _ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


async def measure(args, shape: KVShape, device: torch.device, factory: CandidateFactory) -> list[dict]:
    rows = []
    for ps in args.page_sizes:
        for layout in args.layouts:
            dev, host, dev_slots, host_slots, tokens = setup(shape, ps, layout, args.mib, device, args.seed)
            nbytes = tokens * shape.bytes_per_token
            run, close = await factory({"kv": (dev, host)})
            try:
                for direction in (Direction.BACKUP, Direction.LOAD):
                    src, dst = (dev_slots, host_slots) if direction is Direction.BACKUP else (host_slots, dev_slots)
                    idx = index_baseline(dev, host, direction, src, dst)
                    contig = contig_baseline(nbytes, direction, device)
                    op = [0]

                    async def cand() -> None:
                        op[0] += 1
                        await run(TransferPlan(op[0], direction, (PoolTransfer("kv", src.clone(), dst.clone()),)))

                    # warm up (page faults, thread start) and check the data once
                    await cand()
                    if direction is Direction.BACKUP:
                        probe = np.linspace(0, src.numel() - 1, 64).astype(np.int64)
                        ok = torch.equal(host.read_slots(dst[probe]), dev.read_slots(src[probe]))
                    else:
                        probe = np.linspace(0, src.numel() - 1, 64).astype(np.int64)
                        ok = torch.equal(dev.read_slots(dst[probe]), host.read_slots(src[probe]))
                    if not ok:
                        raise AssertionError(f"candidate copied wrong data (ps={ps}, {layout}, {direction.name})")
                    idx()
                    contig()
                    t = {"candidate": [], "index": [], "contig": []}
                    for _ in range(args.repeats):
                        t0 = time.perf_counter()
                        await cand()
                        t["candidate"].append(time.perf_counter() - t0)
                        t0 = time.perf_counter()
                        idx()
                        t["index"].append(time.perf_counter() - t0)
                        t0 = time.perf_counter()
                        contig()
                        t["contig"].append(time.perf_counter() - t0)
                    med = {k: _ms(v) for k, v in t.items()}
                    row = {
                        "page_size": ps,
                        "layout": layout,
                        "direction": direction.name.lower(),
                        "mib": round(nbytes / 2**20, 1),
                        "pages": int(src.numel() // ps),
                        "candidate_ms": round(med["candidate"], 2),
                        "index_ms": round(med["index"], 2),
                        "contig_ms": round(med["contig"], 2),
                        "candidate_gbps": round(nbytes / med["candidate"] / 1e6, 2),
                        "vs_index": round(med["index"] / med["candidate"], 3),
                        "vs_contig": round(med["contig"] / med["candidate"], 3),
                    }
                    rows.append(row)
                    print(
                        f"ps={ps:<3} {layout:<11} {row['direction']:<6} {row['mib']:>6} MiB  "
                        f"cand {row['candidate_ms']:8.1f} ms ({row['candidate_gbps']:5.2f} GB/s)  "
                        f"index {row['index_ms']:8.1f} ms  contig {row['contig_ms']:7.1f} ms  "
                        f"vs_index {row['vs_index']:5.2f}  vs_contig {row['vs_contig']:5.2f}",
                        flush=True,
                    )
                    del idx, contig
            finally:
                await close()
            del dev, host
            gc.collect()
    return rows


# ---------------------------------------------------------------------------------------


def add_common_args(p: argparse.ArgumentParser) -> None:
    """The options `bench_copy_engine` and `bench_transfer` share (shape, sizes, rounds, engine)."""
    p.add_argument("--quick", action="store_true", help="32 MiB per transfer, 5 repeats")
    p.add_argument("--mib", type=int, default=None, help="MiB per transfer (default 256, quick 32)")
    p.add_argument("--repeats", type=int, default=None, help="rounds (median; default 7, quick 5; min 5)")
    p.add_argument("--page-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    p.add_argument("--layouts", type=lambda s: s.split(","), default=["layer_first", "page_first"])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--copy-threads", type=int, default=None, help="CpuCopyEngine copy_threads (default: engine default)")
    p.add_argument("--load-groups", choices=["layer", "geometric"], default=None, help="CpuCopyEngine load_groups")


def parse_common_args(p: argparse.ArgumentParser) -> tuple[argparse.Namespace, KVShape, torch.device, dict]:
    """Parse, fill in the ``--quick`` defaults; (args, shape, device, engine keyword arguments set)."""
    args = p.parse_args()
    args.mib = args.mib or (32 if args.quick else 256)
    args.repeats = max(5, args.repeats or (5 if args.quick else 7))
    shape = KVShape(args.layers, args.kv_heads, args.head_dim, getattr(torch, args.dtype))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    engine_kw = {k: v for k, v in (("copy_threads", args.copy_threads), ("load_groups", args.load_groups)) if v is not None}
    return args, shape, device, engine_kw


def use_uvloop() -> None:
    with contextlib.suppress(ImportError):
        import uvloop  # the design installs uvloop in benchmarks

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def main() -> None:
    configure_logging()  # production default: INFO to stderr (the library never configures)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--candidate", default=None, help="module:factory (default: copy engine + bridge)")
    args, shape, device, engine_kw = parse_common_args(p)
    meta = {
        "benchmark": "copy_engine",
        "shape": {"layers": shape.num_layers, "kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim, "dtype": args.dtype},
        "bytes_per_token": shape.bytes_per_token,
        "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "git_commit": git_commit(),
        "mib_per_transfer": args.mib,
        "engine_options": {"copy_threads": args.copy_threads, "load_groups": args.load_groups},
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }
    use_uvloop()
    factory = load_factory(args.candidate)
    if args.candidate is None and engine_kw:
        factory = functools.partial(engine_candidate, **engine_kw)
    rows = asyncio.run(measure(args, shape, device, factory))
    meta["loop"] = type(asyncio.get_event_loop_policy()).__module__.split(".")[0]
    summary = {
        "min_vs_index": min(r["vs_index"] for r in rows),
        "min_vs_contig_ps16_64": min((r["vs_contig"] for r in rows if r["page_size"] >= 16), default=None),
    }
    print(
        json.dumps(
            {
                **meta,
                "mode": "throughput",
                "candidate": args.candidate or "engine+bridge",
                "page_sizes": args.page_sizes,
                "layouts": args.layouts,
                "baselines": ["index_select+index_copy_", "contiguous copy_"],
                "results": rows,
                "summary": summary,
            }
        )
    )


if __name__ == "__main__":
    main()

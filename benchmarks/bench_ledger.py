"""Benchmark: `SlotLedger` alloc / assign / free cost per page, flat across pool sizes.

For pools of 10^4, 10^5 and 10^6 slots (page size 16 and 1) a round allocates a batch of
pages (a typical request: 8 pages) for each of many distinct request owners, hands each
batch to a node owner (insert), then frees it; every phase is timed separately and reported
per page. The pool is pre-filled to half with long-lived owners and the free stack is
shuffled, so allocations come from a fragmented pool.

Baseline (same process, interleaved with the candidate in every repeat): a plain in-line
numpy free-stack allocator with no owners, pins or validation (alloc = pop pages and expand
to slots; free = push pages back).

Tracing runs at the production default: a `SlotTracer` with no sinks and debug logging off
(`tracer.active` is False), so the cost is one flag test per call.

Usage: python benchmarks/bench_ledger.py [--quick]. Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from runtime.memory.ledger import SlotLedger
from runtime.memory.owners import Owner, Tier
from runtime.trace import SlotTracer, configure_logging


class BaselineStack:
    """The simplest page allocator: a numpy free stack, no owners."""

    def __init__(self, num_slots: int, page_size: int) -> None:
        self.page_size = page_size
        n = num_slots // page_size
        self.stack = np.arange(n - 1, -1, -1, dtype=np.int64)
        self.top = n
        self.offsets = np.arange(page_size, dtype=np.int64)

    def alloc(self, k: int) -> np.ndarray:
        top = self.top
        if k > top:
            raise MemoryError
        pages = self.stack[top - k : top][::-1].copy()
        self.top = top - k
        if self.page_size == 1:
            return pages
        return (pages[:, None] * self.page_size + self.offsets).reshape(-1)

    def free(self, slots: np.ndarray) -> None:
        pages = slots[:: self.page_size] // self.page_size
        top = self.top
        self.stack[top : top + len(pages)] = pages[::-1]
        self.top = top + len(pages)


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "uncommitted"
    except Exception:
        return "uncommitted"


def make_ledger(num_slots: int, page_size: int, seed: int) -> SlotLedger:
    led = SlotLedger(num_slots, page_size, Tier.DEVICE, tracer=SlotTracer(page_size))
    assert led._tracer is not None and not led._tracer.active
    # Half the pool held by long-lived nodes, in batches, then a random half of that freed,
    # so the free stack is fragmented.
    rng = np.random.default_rng(seed)
    held = []
    half = led.num_pages // 2
    i = 0
    while led.num_pages - led.num_free_pages() < half:
        k = min(64, half - (led.num_pages - led.num_free_pages()))
        owner = Owner.node(10**9 + i)
        held.append((led.alloc(k, owner), owner))
        i += 1
    for idx in rng.permutation(len(held))[: len(held) // 4]:
        slots, owner = held[idx]
        led.free(slots, owner)
    return led


def run_candidate(led: SlotLedger, batch: int, nbatches: int, rounds: int, base_id: int) -> tuple[float, float, float]:
    t_alloc = t_assign = t_free = 0.0
    pc = time.perf_counter
    for r in range(rounds):
        reqs = [Owner.request(base_id + r * nbatches + j, 0) for j in range(nbatches)]
        nodes = [Owner.node(base_id + r * nbatches + j) for j in range(nbatches)]
        out = [None] * nbatches
        t0 = pc()
        for j in range(nbatches):
            out[j] = led.alloc(batch, reqs[j], rid=j)
        t1 = pc()
        for j in range(nbatches):
            led.assign(out[j], reqs[j], nodes[j], rid=j)
        t2 = pc()
        for j in range(nbatches):
            led.free(out[j], nodes[j])
        t3 = pc()
        t_alloc += t1 - t0
        t_assign += t2 - t1
        t_free += t3 - t2
    pages = batch * nbatches * rounds
    return t_alloc / pages, t_assign / pages, t_free / pages


def run_baseline(stack: BaselineStack, batch: int, nbatches: int, rounds: int) -> tuple[float, float]:
    t_alloc = t_free = 0.0
    pc = time.perf_counter
    for _ in range(rounds):
        out = [None] * nbatches
        t0 = pc()
        for j in range(nbatches):
            out[j] = stack.alloc(batch)
        t1 = pc()
        for j in range(nbatches):
            stack.free(out[j])
        t2 = pc()
        t_alloc += t1 - t0
        t_free += t2 - t1
    pages = batch * nbatches * rounds
    return t_alloc / pages, t_free / pages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer operations and repeats (under a minute)")
    ap.add_argument("--batch", type=int, default=8, help="pages per request (default 8)")
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args()
    configure_logging(json_output=False)  # production default: INFO, tracer inactive

    repeats = args.repeats or (5 if args.quick else 9)
    rounds = 4 if args.quick else 20
    batch = args.batch
    pool_sizes = [10**4, 10**5, 10**6]
    page_sizes = [16, 1]

    # Build every configuration first, then interleave them inside each repeat (pool sizes,
    # baseline and candidate), so drift on a shared machine hits all of them alike.
    configs = []
    base_id = 0
    for ps in page_sizes:
        for num_slots in pool_sizes:
            num_slots -= num_slots % ps
            led = make_ledger(num_slots, ps, seed=num_slots + ps)
            stack = BaselineStack(num_slots, ps)
            stack.top = led.num_free_pages()  # same free-page count (contents irrelevant to cost)
            nbatches = max(1, min(128, led.num_free_pages() // batch - 1))
            run_candidate(led, batch, nbatches, 1, base_id)  # warm-up
            base_id += nbatches
            run_baseline(stack, batch, nbatches, 1)
            samples: dict[str, list[float]] = {"alloc": [], "assign": [], "free": [], "base_alloc": [], "base_free": []}
            configs.append((ps, num_slots, led, stack, nbatches, samples))

    for rep in range(repeats):
        for ps, num_slots, led, stack, nbatches, samples in configs:
            order = (0, 1) if rep % 2 == 0 else (1, 0)  # alternate which goes first
            for which in order:
                if which == 0:
                    ba, bf = run_baseline(stack, batch, nbatches, rounds)
                    samples["base_alloc"].append(ba)
                    samples["base_free"].append(bf)
                else:
                    a, s, f = run_candidate(led, batch, nbatches, rounds, base_id)
                    base_id += rounds * nbatches
                    samples["alloc"].append(a)
                    samples["assign"].append(s)
                    samples["free"].append(f)

    results = []
    for ps, num_slots, led, stack, nbatches, samples in configs:
        led.check()
        med = {k: statistics.median(v) * 1e9 for k, v in samples.items()}  # ns per page
        results.append(
            {
                "page_size": ps,
                "pool_slots": num_slots,
                "batch_pages": batch,
                "ops_per_repeat": rounds * nbatches,
                "ns_per_page": {k: round(med[k], 1) for k in ("alloc", "assign", "free")},
                "baseline_ns_per_page": {"alloc": round(med["base_alloc"], 1), "free": round(med["base_free"], 1)},
                "ratio_alloc": round(med["alloc"] / med["base_alloc"], 2),
                "ratio_free": round(med["free"] / med["base_free"], 2),
            }
        )

    # Flatness: largest pool vs smallest, per page size and phase.
    flat = {}
    for ps in page_sizes:
        rows = [r for r in results if r["page_size"] == ps]
        small, large = rows[0], rows[-1]
        flat[f"ps{ps}"] = {
            k: round(large["ns_per_page"][k] / small["ns_per_page"][k], 2) for k in ("alloc", "assign", "free")
        }

    hdr = f"{'page':>4} {'pool slots':>10} {'alloc ns/pg':>11} {'assign ns/pg':>12} {'free ns/pg':>10} {'base alloc':>10} {'base free':>9} {'x alloc':>7} {'x free':>6}"
    print(f"SlotLedger cost per page, batch={batch} pages/request, median of {repeats} repeats "
          f"(tracer inactive = production default), torch threads={torch.get_num_threads()}")
    print(hdr)
    for r in results:
        n = r["ns_per_page"]
        b = r["baseline_ns_per_page"]
        print(f"{r['page_size']:>4} {r['pool_slots']:>10} {n['alloc']:>11.1f} {n['assign']:>12.1f} {n['free']:>10.1f} "
              f"{b['alloc']:>10.1f} {b['free']:>9.1f} {r['ratio_alloc']:>7.2f} {r['ratio_free']:>6.2f}")
    print("flatness (10^6-slot pool / 10^4-slot pool, per page):", json.dumps(flat))

    summary = {
        "benchmark": "bench_ledger",
        "metric": "ns per page (alloc/assign/free), SlotLedger vs plain numpy free stack",
        "results": results,
        "flatness_large_over_small": flat,
        "repeats": repeats,
        "quick": args.quick,
        "batch_pages": batch,
        "page_sizes": page_sizes,
        "model_shape": None,
        "tracer": "inactive (production default)",
        "torch_threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "commit": git_commit(),
    }
    print(json.dumps(summary, separators=(",", ":")))


if __name__ == "__main__":
    main()

"""Decode step cost: N running requests each commit their tokens and get one new slot.

Candidate: one `rt.step([Commit(rid, len) ..., Extend(rid, 1) ...])` through the public façade
(the tree actor, the fake copy engine, no host tier), p50/p99 per step. Baseline in the same
run: a plain in-line decode allocator, vectorised numpy over the batch (a free-page stack, one
array of sequence lengths and one of last slots: the bookkeeping a serving engine's own decode
allocation does, with no ownership, tree or message), p50/p99 per step. Contexts start at
`--context` tokens; each measured step is one token more. Last stdout line: one JSON object.

    .venv/bin/python benchmarks/bench_decode.py [--quick] [--context 256] [--page-sizes 1,16]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import emit_json, percentile  # noqa: E402
from runtime.config import RuntimeConfig  # noqa: E402
from runtime.messages import Commit, Extend  # noqa: E402
from runtime.runtime import CacheRuntime  # noqa: E402
from runtime.trace import configure_logging  # noqa: E402
from runtime.transfer.fake_engine import FakeCopyEngine  # noqa: E402


class InlineDecode:
    """The baseline: per step, requests whose next token starts a page take one page each from a
    free stack (one slice), every request's new slot is its last slot + 1 or its new page's
    first slot (one `where`)."""

    def __init__(self, n: int, context: int, page_size: int, num_pages: int) -> None:
        self.ps = page_size
        self.stack = np.arange(num_pages - 1, -1, -1, dtype=np.int64)
        self.top = num_pages
        pages_each = -(-context // page_size)
        first = self.take(n * pages_each).reshape(n, pages_each)
        self.seq = np.full(n, context, dtype=np.int64)
        self.last = first[:, -1] * page_size + (context - 1) % page_size

    def take(self, k: int) -> np.ndarray:
        pages = self.stack[self.top - k:self.top][::-1]
        self.top -= k
        return pages

    def step(self) -> np.ndarray:
        need = self.seq % self.ps == 0
        k = int(np.count_nonzero(need))
        new = self.last + 1
        if k:
            new[need] = self.take(k) * self.ps
        self.seq += 1
        self.last = new
        return new


async def runtime_steps(n: int, context: int, page_size: int, steps: int) -> list[float]:
    slots = (n * (context + steps + 1) // page_size + n + 8) * page_size
    cfg = RuntimeConfig(num_layers=2, num_kv_heads=1, head_dim=2, kv_dtype="float32", page_size=page_size,
                        device_slots=slots, host_tokens=0, mailbox_capacity=1 << 16)
    times: list[float] = []
    async with CacheRuntime.open(cfg, engine_factory=FakeCopyEngine) as rt:
        rng = np.random.default_rng(0)
        rids = [f"r{i}" for i in range(n)]
        for rid in rids:
            await rt.admit(rid, rng.integers(0, 30000, context, dtype=np.int32))
        seq = context
        for _ in range(steps):
            items = [Commit(rid, seq) for rid in rids] + [Extend(rid, 1) for rid in rids]
            t0 = time.perf_counter()
            out = await rt.step(items)
            times.append(time.perf_counter() - t0)
            assert not any(isinstance(r, BaseException) for r in out), out[:3]
            seq += 1
        for rid in rids:
            await rt.abort(rid)
    return times


def inline_steps(n: int, context: int, page_size: int, steps: int) -> list[float]:
    d = InlineDecode(n, context, page_size, n * (context + steps + 1) // page_size + n + 8)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        d.step()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps, N up to 256")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--page-sizes", default="1,16")
    ap.add_argument("--steps", type=int, default=None)
    args = ap.parse_args()
    configure_logging()
    ns = (1, 16, 64, 256) if args.quick else (1, 16, 64, 256, 1024)
    steps = args.steps or (20 if args.quick else 50)
    try:
        import uvloop
        loop_name = "uvloop"
        run = uvloop.run
    except ImportError:  # pragma: no cover
        loop_name, run = "asyncio", asyncio.run
    results = []
    print(f"context {args.context} tokens, {steps} steps per point, loop {loop_name}")
    print(f"{'page':>4} {'N':>5} {'step p50':>10} {'step p99':>10} {'inline p50':>11} {'inline p99':>11} {'ratio p50':>10} {'us/req':>7}")
    for ps in (int(x) for x in args.page_sizes.split(",")):
        for n in ns:
            rt_t = run(runtime_steps(n, args.context, ps, steps))
            base = inline_steps(n, args.context, ps, steps)
            r = {"page_size": ps, "n": n, "step_p50_ms": percentile(rt_t, 50) * 1e3,
                 "step_p99_ms": percentile(rt_t, 99) * 1e3, "inline_p50_ms": percentile(base, 50) * 1e3,
                 "inline_p99_ms": percentile(base, 99) * 1e3}
            r["ratio_p50"] = r["step_p50_ms"] / r["inline_p50_ms"]
            results.append(r)
            print(f"{ps:>4} {n:>5} {r['step_p50_ms']:9.3f}m {r['step_p99_ms']:9.3f}m {r['inline_p50_ms']:10.4f}m "
                  f"{r['inline_p99_ms']:10.4f}m {r['ratio_p50']:9.0f}x {r['step_p50_ms'] * 1e3 / n:7.1f}")
    emit_json({"bench": "decode", "context": args.context, "steps": steps, "loop": loop_name, "results": results})


if __name__ == "__main__":
    main()

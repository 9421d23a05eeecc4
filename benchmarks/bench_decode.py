"""Decode step cost: N running requests each commit their tokens and get one new slot.

Candidates, through the public façade (the tree actor, the fake copy engine, no host tier), p50/p99
per step: `rt.decode_step(rids)` (one message, one result tensor) and the general
`rt.step([Commit(rid, len) ..., Extend(rid, 1) ...])`. With `--peers PYTHON` (the peer venv of
../shared/peerbench), SGLang's own decode allocation for the same N in the same sitting
(`benchmarks/peers/sglang_decode_alloc.py`). Baseline in the same
run: a plain in-line decode allocator, vectorised numpy over the batch (a free-page stack, one
array of sequence lengths and one of last slots: the bookkeeping a serving engine's own decode
allocation does, with no ownership, tree or message), p50/p99 per step. Contexts start at
`--context` tokens; each measured step is one token more. Last stdout line: one JSON object.

    .venv/bin/python benchmarks/bench_decode.py [--quick] [--context 256] [--page-sizes 1,16] [--peers PYTHON]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
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


async def runtime_steps(n: int, context: int, page_size: int, steps: int, mode: str) -> list[float]:
    """Step times through the façade: `decode` = `rt.decode_step(rids)` (one message, one
    result tensor); `step` = `rt.step([Commit(rid, len)..., Extend(rid, 1)...])`."""
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
            if mode == "decode":
                t0 = time.perf_counter()
                out = await rt.decode_step(rids)
                times.append(time.perf_counter() - t0)
                assert out.shape == (n,)
            else:
                items = [Commit(rid, seq) for rid in rids] + [Extend(rid, 1) for rid in rids]
                t0 = time.perf_counter()
                res = await rt.step(items)
                times.append(time.perf_counter() - t0)
                assert not any(isinstance(r, BaseException) for r in res), res[:3]
            seq += 1
        for rid in rids:
            await rt.abort(rid)
    return times


def peer_steps(python: str, context: int, page_sizes: str, ns: tuple[int, ...], steps: int) -> dict:
    """SGLang's own decode allocation for the same N, page and context, in this sitting
    (`benchmarks/peers/sglang_decode_alloc.py`, run with the peer venv's python)."""
    driver = Path(__file__).resolve().parent / "peers" / "sglang_decode_alloc.py"
    cmd = [python, str(driver), "--context", str(context), "--page-sizes", page_sizes,
           "--ns", ",".join(map(str, ns)), "--steps", str(steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {(r["page_size"], r["n"]): r for r in rows}


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
    ap.add_argument("--peers", default=None, metavar="PYTHON",
                    help="python of the peer venv (../shared/peerbench/README.md): SGLang's alloc_for_decode too")
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
    peers = peer_steps(args.peers, args.context, args.page_sizes, ns, max(steps, 200)) if args.peers else {}
    results = []
    print(f"context {args.context} tokens, {steps} steps per point, loop {loop_name}; times in ms")
    print(f"{'page':>4} {'N':>5} {'decode p50':>10} {'p99':>7} {'step p50':>9} {'p99':>7} {'inline p50':>10} "
          f"{'sglang p50':>10} {'p99':>7} {'decode/sglang':>13} {'us/req':>7}")
    for ps in (int(x) for x in args.page_sizes.split(",")):
        for n in ns:
            dec = run(runtime_steps(n, args.context, ps, steps, "decode"))
            stp = run(runtime_steps(n, args.context, ps, steps, "step"))
            base = inline_steps(n, args.context, ps, steps)
            r = {"page_size": ps, "n": n,
                 "decode_p50_ms": percentile(dec, 50) * 1e3, "decode_p99_ms": percentile(dec, 99) * 1e3,
                 "step_p50_ms": percentile(stp, 50) * 1e3, "step_p99_ms": percentile(stp, 99) * 1e3,
                 "inline_p50_ms": percentile(base, 50) * 1e3, "inline_p99_ms": percentile(base, 99) * 1e3}
            peer = peers.get((ps, n))
            if peer is not None:
                r["sglang_p50_ms"], r["sglang_p99_ms"] = peer["p50_ms"], peer["p99_ms"]
                r["ratio_decode_vs_sglang_p50"] = r["decode_p50_ms"] / peer["p50_ms"]
            results.append(r)
            sg = (f"{r['sglang_p50_ms']:10.3f} {r['sglang_p99_ms']:7.3f} {r['ratio_decode_vs_sglang_p50']:12.2f}x"
                  if peer is not None else f"{'-':>10} {'-':>7} {'-':>13}")
            print(f"{ps:>4} {n:>5} {r['decode_p50_ms']:10.3f} {r['decode_p99_ms']:7.3f} {r['step_p50_ms']:9.3f} "
                  f"{r['step_p99_ms']:7.3f} {r['inline_p50_ms']:10.4f} {sg} {r['decode_p50_ms'] * 1e3 / n:7.2f}")
    emit_json({"bench": "decode", "context": args.context, "steps": steps, "loop": loop_name,
               "peer": next(iter(peers.values()), {}).get("version") if peers else None, "results": results})


if __name__ == "__main__":
    main()

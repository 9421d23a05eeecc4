#!/usr/bin/env python3
"""SGLang's own decode-step KV-slot allocation, timed on CPU (peer reference for bench_decode.py).

What it measures: for each page size P (--page-sizes, default 1,16) and batch size N (--ns,
default 1,16,64,256,1024), N running requests that already hold --context tokens (default 256)
of KV slots; then --steps (default 200) decode steps, each giving every request one new slot,
the way SGLang 0.5.23's scheduler does it for a decode batch. Per step it times (perf_counter)
exactly the allocation part of `ScheduleBatch.prepare_for_decode`:

    batch.out_cache_loc = alloc_for_decode(batch, token_per_req=1)   # sglang.srt.mem_cache.allocation
    for req in batch.reqs: req.decode_batch_idx += 1
    batch.seq_lens = batch.seq_lens + 1; batch.seq_lens_cpu = ... + 1; batch.orig_seq_lens = ... + 1

`alloc_for_decode` dispatches (device "cpu") to `alloc_for_decode_default`, which does
`maybe_evict_swa()` (a no-op here), then for P == 1 `alloc_token_slots` ->
`TokenToKVPoolAllocator.alloc(N)`, for P > 1 the `last_loc` gather from req_to_token and
`alloc_paged_token_slots_decode` -> `PagedTokenToKVPoolAllocator.alloc_decode` (its torch
fallback `alloc_decode_naive`: the platform reports no Triton on CPU), both after
`evict_from_tree_cache` (nothing to evict: the pool holds N*(context+steps+1) tokens plus slack),
then writes the new slots into `ReqToTokenPool.req_to_token`, `alloc_aux_to_lengths` (no aux
cache: no-op) and the per-request `kv_allocated_len`/`kv_committed_len` counters.

The objects are SGLang's real ones, on device "cpu": `ScheduleBatch` (only the fields the decode
path reads are set), `Req`, `ReqToTokenPool`, `TokenToKVPoolAllocator` /
`PagedTokenToKVPoolAllocator` and a `RadixCache` as the tree cache (empty: no prefix sharing in
this set-up). The initial --context slots come from the same allocator (one `alloc` per request,
whole pages for P > 1, as a prefill leaves them). Not timed: `check_decode_mem` (the scheduler's
capacity check before `prepare_for_decode`), the model, sampling. On a GPU server `seq_lens` and
the pools live on the device; here every tensor is a CPU tensor.

After the steps it checks that every request's req_to_token row holds context+steps slots, that no
slot is shared between requests, and, for P > 1, that token t sits at offset t % P of its page and
consecutive tokens share a page until the page boundary.

Output: one JSON line per (page_size, n) on stdout ({"page_size", "n", "p50_ms", "p99_ms",
"steps", "context", "version"}); human-readable lines go to stderr.

Run with the peer venv (set up per the peer bench directory's README; PEER_PY is its python,
e.g. ../peer-venv/bin/python next to the repository), from the repository root:

    $PEER_PY benchmarks/peers/sglang_decode_alloc.py
    $PEER_PY benchmarks/peers/sglang_decode_alloc.py --context 256 --page-sizes 1,16 --ns 1,16,64,256,1024 --steps 200

Its inputs are built before the timer (the batch, the requests, their context slots): only the
allocation step is timed, as bench_decode.py times only our decode step.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.abc
import importlib.machinery
import json
import logging
import os
import sys
import time
import types
import warnings
from array import array

warnings.filterwarnings("ignore")
os.environ.setdefault("SGLANG_LOG_LEVEL", "error")


# --------------------------------------------------------------------------- torchvision stub
# PyPI torchvision does not load beside torch 2.13.0+cpu, and sglang imports it at module level
# only for multimodal code (schedule_batch -> configs -> multimodal utils) that this driver never
# runs. An empty stand-in module tree is enough to get past those imports.
class _AnyModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        child = _AnyModule(f"{self.__name__}.{name}")
        child.__path__ = []
        sys.modules[child.__name__] = child
        setattr(self, name, child)
        return child

    def __call__(self, *args, **kwargs):
        return self

    def __mro_entries__(self, bases):
        return (object,)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    roots = ("torchvision",)

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = _AnyModule(spec.name)
        mod.__path__ = []
        mod.__version__ = "0.28.0"  # a release that matches torch 2.13 (transformers parses it)
        return mod

    def exec_module(self, module):
        pass


def _install_stubs() -> None:
    try:  # a working torchvision, if there is one, is left alone
        import torchvision  # noqa: F401
        return
    except Exception:
        for name in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
            del sys.modules[name]
    sys.meta_path.insert(0, _StubFinder())


def log(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


_install_stubs()
logging.disable(logging.WARNING)
_t0 = time.perf_counter()
with contextlib.redirect_stdout(sys.stderr):  # keep import chatter off stdout
    import torch
    import sglang
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.mem_cache.allocation import alloc_for_decode
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.sampling.sampling_params import SamplingParams
IMPORT_S = time.perf_counter() - _t0
SGLANG_VERSION = getattr(sglang, "__version__", "?")
FUNC = "sglang.srt.mem_cache.allocation.alloc_for_decode(batch, token_per_req=1)"


class _ModelConfig:
    """The one ModelConfig field alloc_for_decode_default reads."""

    is_encoder_decoder = False


# --------------------------------------------------------------------------- set-up
def pool_tokens(n: int, context: int, steps: int, page_size: int) -> int:
    """Every request's context+steps tokens in whole pages, plus one spare page each, plus slack:
    never short, so no eviction is ever attempted."""
    pages_each = -(-(context + steps + 1) // page_size) + 1
    return (n * pages_each + 64) * page_size


def make_batch(n: int, context: int, steps: int, page_size: int):
    size = pool_tokens(n, context, steps, page_size)
    if page_size == 1:
        alloc = TokenToKVPoolAllocator(size, torch.bfloat16, "cpu", None, False)
    else:
        alloc = PagedTokenToKVPoolAllocator(size, page_size, torch.bfloat16, "cpu", None, False)
    rtp = ReqToTokenPool(size=n, max_context_len=context + steps + 8, device="cpu",
                         enable_memory_saver=False)
    tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=rtp,
                                      token_to_kv_pool_allocator=alloc, page_size=page_size))
    reqs = [Req(rid=f"r{i}", origin_input_text="", origin_input_ids=array("q", [1] * context),
                sampling_params=SamplingParams(temperature=0, max_new_tokens=steps + 1))
            for i in range(n)]
    rows = rtp.alloc(reqs)
    assert rows is not None and len(rows) == n
    # "Prefill": each request takes its context slots from the allocator (whole pages for P > 1;
    # the tail of the last page is what decode fills next) and records them in its row.
    pages_each = -(-context // page_size)
    for req, row in zip(reqs, rows):
        slots = alloc.alloc(pages_each * page_size)
        assert slots is not None
        rtp.write((row, slice(0, context)), slots[:context].to(torch.int32))
        req.kv.kv_allocated_len = context
        req.kv.kv_committed_len = context
    idx = torch.tensor(rows, dtype=torch.int64)
    seq = torch.full((n,), context, dtype=torch.int64)
    batch = ScheduleBatch(
        reqs=reqs, req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc, tree_cache=tree,
        model_config=_ModelConfig(), enable_overlap=False, device="cpu",
        forward_mode=ForwardMode.DECODE,
        req_pool_indices=idx, req_pool_indices_cpu=idx.clone(),
        seq_lens=seq, seq_lens_cpu=seq.clone(), orig_seq_lens=seq.to(torch.int32),
        seq_lens_sum=int(seq.sum()),
    )
    return batch, alloc


def decode_alloc_step(batch) -> None:
    """The allocation half of ScheduleBatch.prepare_for_decode (sglang 0.5.23), verbatim."""
    batch.out_cache_loc = alloc_for_decode(batch, token_per_req=1)
    for req in batch.reqs:
        req.decode_batch_idx += 1
    batch.seq_lens = batch.seq_lens + 1
    batch.seq_lens_cpu = batch.seq_lens_cpu + 1
    batch.orig_seq_lens = batch.orig_seq_lens + 1
    batch.seq_lens_sum = None


def run_point(n: int, context: int, steps: int, page_size: int) -> list[float]:
    batch, alloc = make_batch(n, context, steps, page_size)
    avail0 = alloc.available_size()
    gc.collect()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        decode_alloc_step(batch)
        times.append(time.perf_counter() - t0)
    check(batch, alloc, n, context, steps, page_size, avail0)
    return times


def check(batch, alloc, n: int, context: int, steps: int, page_size: int, avail0: int) -> None:
    total = context + steps
    assert torch.equal(batch.seq_lens_cpu, torch.full((n,), total, dtype=torch.int64))
    assert all(r.kv.kv_allocated_len == total for r in batch.reqs)
    slots = batch.req_to_token_pool.req_to_token[batch.req_pool_indices, :total].to(torch.int64)
    assert torch.equal(batch.out_cache_loc, slots[:, total - 1]), "last step's slots not in req_to_token"
    assert bool((slots > 0).all()), "unwritten (zero) entry in req_to_token"
    assert torch.unique(slots).numel() == n * total, "a slot is held by two tokens"
    if page_size == 1:
        assert alloc.available_size() == avail0 - n * steps
    else:
        pos = torch.arange(total)
        assert bool((slots % page_size == pos % page_size).all()), "token not at its page offset"
        same_page = slots[:, 1:] // page_size == slots[:, :-1] // page_size
        inside = (pos[1:] % page_size != 0).expand_as(same_page)
        assert bool((same_page == inside).all()), "page changes off a page boundary (or not at one)"
        new_pages = n * (-(-total // page_size) - -(-context // page_size))
        assert alloc.available_size() == avail0 - new_pages * page_size


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q / 100 * (len(ordered) - 1)))))]


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=256, help="tokens each request holds before step 1")
    ap.add_argument("--page-sizes", default="1,16", help="comma-separated page sizes")
    ap.add_argument("--ns", default="1,16,64,256,1024", help="comma-separated numbers of running requests")
    ap.add_argument("--steps", type=int, default=200, help="timed decode steps per point")
    a = ap.parse_args()
    if a.context < 1 or a.steps < 1:
        ap.error("--context and --steps must be >= 1")
    log(f"# sglang {SGLANG_VERSION} (import {IMPORT_S:.1f}s), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; {FUNC}; context {a.context}, {a.steps} steps; ms per step")
    # Warm-up (first-call costs: lazy imports, op dispatch) on a throwaway batch per page size.
    for ps in ints(a.page_sizes):
        run_point(4, a.context, 20, ps)
    for ps in ints(a.page_sizes):
        for n in ints(a.ns):
            t = run_point(n, a.context, a.steps, ps)
            rec = {"page_size": ps, "n": n,
                   "p50_ms": round(percentile(t, 50) * 1e3, 4), "p99_ms": round(percentile(t, 99) * 1e3, 4),
                   "steps": a.steps, "context": a.context,
                   "version": f"sglang {SGLANG_VERSION} alloc_for_decode"}
            log(f"page {ps:>3} N {n:>5}: p50 {rec['p50_ms']:.4f}  p99 {rec['p99_ms']:.4f}  "
                f"({rec['p50_ms'] * 1e3 / n:.2f} us/req at p50)")
            print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The peers of bench_tree.py (SGLang's RadixCache / UnifiedRadixCache, vLLM's KVCacheManager) on
the same trace, with their inputs prepared before the timer, as bench_tree prepares ours.

The peers' own drivers (`sglang_radix_bench.py`, `vllm_prefix_bench.py` in the peer bench
directory, imported here at run time, never copied) build each request's inputs inside their
timed loop: SGLang's concatenates prompt + reply and builds each `RadixKey` there, vLLM's converts
the prompt and reply arrays to Python lists there (about 4.4 µs a request). bench_tree hands our
side int32 arrays built before its timer. This driver runs the peers' protocol, operation for
operation (their cache, allocator, eviction, insert, re-lock and free helpers: the same functions),
but builds those inputs first:

- SGLang: per request `prompt + reply`, and the `RadixKey`s of the prompt, of its page-aligned
  part and of the page-aligned prompt + reply (what the timed loop passes to `match_prefix` and
  `insert`);
- vLLM: per request the prompt and reply as the Python lists `Request` and
  `append_output_token_ids` take (vLLM's block hashing stays in the timer: it is the cache's own
  work, as our page hashing with KV events is ours).

Output: one JSON object per page size, as the peers' drivers print (`page_size` / `block_size`,
`req_per_s`, `hit_rate`, `impl`), plus `"inputs": "prepared"`.

    PEER_PY=../peer-venv/bin/python   # set up per the peer bench directory's README
    $PEER_PY benchmarks/peers/tree_peers.py --peerbench DIR --backend unified --page-sizes 1,16
    $PEER_PY benchmarks/peers/tree_peers.py --peerbench DIR --backend vllm --page-sizes 16
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any


def load(peerbench: Path, name: str) -> Any:
    """A peer driver as a module (its `main` does not run)."""
    sys.path.insert(0, str(peerbench))
    spec = importlib.util.spec_from_file_location(f"peer_{name}", peerbench / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# -- SGLang ---------------------------------------------------------------------------------
def sglang_run(sg: Any, cache: Any, alloc: Any, trace: Any, waves: list, ps: int) -> tuple[float, float]:
    """`sglang_radix_bench.run` (insert at prefill, no verify), its inputs built before the timer."""
    RadixKey, InsertParams, MatchParams = sg.RadixKey, sg.InsertParams, sg.MatchPrefixParams
    prepared = {}
    for wave in waves:
        for sid, turn in wave:
            prompt, reply = trace[sid][turn]
            full = prompt + reply
            n_p, n_f = len(prompt) // ps * ps, len(full) // ps * ps
            prepared[sid, turn] = (RadixKey(prompt), len(prompt), n_p, RadixKey(prompt[:n_p]), len(full), n_f,
                                   RadixKey(full[:n_f]))
    st = sg.Stats()  # (the helpers below count into it; only the hit rate is read here)
    hit = total = 0
    t_start = time.perf_counter()
    for wave in waves:
        inflight = []
        for sid, turn in wave:
            key, plen, n_p, key_p, flen, n_f, key_f = prepared[sid, turn]
            m = cache.match_prefix(MatchParams(key=key))
            node, p = m.last_device_node, m.device_prefix_len
            total += plen
            hit += p
            lk = cache.lock(node)
            prefix_idx = cache.path_device_indices(node)[:p] if p else sg.torch.empty(0, dtype=sg.torch.int64)
            row = sg.torch.cat((prefix_idx, sg.alloc_or_evict(cache, alloc, plen - p, st, ps)))
            protected = p
            if n_p > p:
                r = cache.insert(InsertParams(key=key_p, value=row[:n_p].clone(), prev_prefix_len=protected))
                if isinstance(cache, sg.RadixCache) and r.prefix_len > protected:
                    alloc.free(row[protected: r.prefix_len])
                m = cache.match_prefix(MatchParams(key=key_p))  # re-lock at the new node (`relock`)
                row[:n_p] = cache.path_device_indices(m.last_device_node)
                cache.unlock(lk)
                lk = cache.lock(m.last_device_node)
                protected = n_p
            inflight.append((lk, protected, row, flen, n_f, key_f))
        for lk, protected, row, flen, n_f, key_f in inflight:
            extra = flen - len(row)
            if extra > 0:
                row = sg.torch.cat((row, sg.alloc_or_evict(cache, alloc, extra, st, ps)))
            r = cache.insert(InsertParams(key=key_f, value=row[:n_f].clone(), prev_prefix_len=protected))
            if isinstance(cache, sg.RadixCache) and r.prefix_len > protected:
                alloc.free(row[protected: r.prefix_len])
            if len(row) > n_f:
                alloc.free(row[n_f:])
            cache.unlock(lk)
    return time.perf_counter() - t_start, hit / total


# -- vLLM -----------------------------------------------------------------------------------
def vllm_run(vl: Any, mgr: Any, trace: Any, waves: list, hasher: Any) -> tuple[float, float]:
    """`vllm_prefix_bench.run` (no verify), the token lists built before the timer."""
    lists = {(sid, turn): (list(trace[sid][turn][0]), list(trace[sid][turn][1])) for wave in waves
             for sid, turn in wave}
    sp = vl.SamplingParams(max_tokens=1 << 20)
    hit = total = 0
    rid = 0
    t_start = time.perf_counter()
    for wave in waves:
        inflight = []
        for sid, turn in wave:
            prompt, reply = lists[sid, turn]
            req = vl.Request(f"r{rid}", prompt, sp, None, block_hasher=hasher)
            rid += 1
            blocks, h, _ = mgr.get_computed_blocks(req)
            total += len(prompt)
            hit += h
            if mgr.allocate_slots(req, len(prompt) - h, h, blocks) is None:
                raise RuntimeError(f"pool exhausted (prefill) usage={mgr.usage:.3f}")
            req.num_computed_tokens = len(prompt)
            inflight.append((req, reply))
        for req, reply in inflight:
            req.append_output_token_ids(reply)
            if mgr.allocate_slots(req, len(reply)) is None:
                raise RuntimeError(f"pool exhausted (decode) usage={mgr.usage:.3f}")
            req.num_computed_tokens += len(reply)
            mgr.free(req)
    return time.perf_counter() - t_start, hit / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peerbench", required=True, help="directory of the peers' drivers and trace_gen.py")
    ap.add_argument("--backend", choices=["radix", "unified", "vllm"], required=True)
    ap.add_argument("--page-sizes", default="1,16")
    ap.add_argument("--hash", default="sha256", help="vLLM's block hash (sha256 | xxhash | ...)")
    for name, default in (("sessions", 200), ("turns", 8), ("sys-len", 1024), ("turn-len", 200), ("vocab", 32000),
                          ("conc", 32), ("pool", 131072), ("seed", 0)):
        ap.add_argument(f"--{name}", type=int, default=default)
    a = ap.parse_args()
    peerbench = Path(a.peerbench).resolve()
    pages = [int(x) for x in a.page_sizes.split(",") if x]
    if a.backend == "vllm":
        vl = load(peerbench, "vllm_prefix_bench")
        trace = vl.build_trace(a.sessions, a.turns, a.sys_len, a.turn_len, a.vocab, a.seed)
        waves = vl.schedule(trace, a.conc, a.seed)
        hash_fn = vl.get_hash_fn_by_name(a.hash)
        vl.init_none_hash(hash_fn)
        max_len = max(len(p) + len(r) for s in trace for p, r in s)
        for bs in pages:
            mgr = vl.make_manager(a.pool // bs, bs, max_len + bs)
            wall, hit = vllm_run(vl, mgr, trace, waves, vl.get_request_block_hasher(bs, hash_fn))
            n = sum(len(s) for s in trace)
            print(json.dumps({"impl": "vllm.v1 KVCacheManager/BlockPool", "block_size": bs, "hash": a.hash,
                              "requests": n, "wall_s": round(wall, 3), "req_per_s": round(n / wall, 1),
                              "hit_rate": round(hit, 4), "inputs": "prepared"}), flush=True)
        return
    sg = load(peerbench, "sglang_radix_bench")
    trace = sg.build_trace(a.sessions, a.turns, a.sys_len, a.turn_len, a.vocab, a.seed)
    waves = sg.schedule(trace, a.conc, a.seed)
    for ps in pages:
        cache, alloc = sg.make_radix(a.pool, ps) if a.backend == "radix" else sg.make_unified(a.pool, ps, "rust")
        wall, hit = sglang_run(sg, cache, alloc, trace, waves, ps)
        n = sum(len(s) for s in trace)
        impl = type(cache).__name__ + (f"[{cache._tree_core_backend}]" if hasattr(cache, "_tree_core_backend") else "")
        print(json.dumps({"backend": a.backend, "impl": impl, "page_size": ps, "requests": n, "wall_s": round(wall, 3),
                          "req_per_s": round(n / wall, 1), "hit_rate": round(hit, 4), "inputs": "prepared"}), flush=True)


if __name__ == "__main__":
    main()

"""The invariant checks of decode offload: retired requests, offload copies in flight, landed chunks."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from runtime.invariants.common import _check_cached_prefix, _fail

if TYPE_CHECKING:
    from runtime.tree.cache import CacheCore


def _check_offload(core: "CacheCore", claim, roots: set, quiescent: bool) -> None:
    """Seed 000: a retired request (finished or aborted, device slots not yet released) keeps
    owning its device slots and its prefix lock; every offload copy in flight reads slots
    that its request, live or retired, still maps (so nothing it reads was freed); landed
    host chunks belong to their request; the ranges of one request never overlap."""
    offload = core.offload
    retired = offload.retired
    offload_ops = list(offload.ops.values())
    if not (retired or offload_ops or offload.landed or offload.inflight):
        return
    ps = core.page_size
    records = _check_retired(core, claim, roots)
    ranges: dict = {}
    inflight: dict = {}
    for op in offload_ops:
        key = (op.rid, op.generation)
        rec = records.get(key)
        if rec is None:
            _fail(f"offload op {op.op_id} reads the device slots of {op.rid!r}#{op.generation}, which was "
                  "released while the copy is in flight (seed 000)")
        if op.host_owner != rec.owner:
            _fail(f"offload op {op.op_id} host slots are not owned by its request")
        if op.start % ps or op.length % ps or op.start + op.length > rec.num_slots:
            _fail(f"offload op {op.op_id} range [{op.start}, {op.start + op.length}) is not whole pages of its request")
        if not np.array_equal(rec.slots[op.start: op.start + op.length], op.device):
            _fail(f"offload op {op.op_id} reads slots that {op.rid!r}#{op.generation} no longer maps")
        inflight.setdefault(key, set()).add(op.op_id)
        ranges.setdefault(key, []).append((op.start, op.start + op.length))
    if inflight != {k: set(v) for k, v in offload.inflight.items()}:
        _fail(f"offloads in flight per request {offload.inflight!r} != offload ops {inflight!r}")
    for key, chunks in offload.landed.items():
        rec = records.get(key)
        if rec is None:
            _fail(f"landed offload chunks of {key!r}, which is neither live nor retired")
        for start, end, host in chunks:
            if len(host) != end - start:
                _fail(f"landed chunk [{start}, {end}) of {key!r} holds {len(host)} host slots")
            claim("host", host, rec.owner, f"landed offload of {key!r}")
            ranges.setdefault(key, []).append((start, end))
    for key, spans in ranges.items():
        spans.sort()
        for (_, e0), (s1, _) in zip(spans, spans[1:]):
            if s1 < e0:
                _fail(f"offload ranges of {key!r} overlap: {spans}")
    if quiescent and (retired or offload.landed or offload.inflight):
        _fail(f"offload state left at quiescence: retired {list(retired)[:5]}, landed {list(offload.landed)[:5]}")


def _check_retired(core: "CacheCore", claim: Callable[..., None], roots: set) -> dict:
    """Retired requests (released, waiting for their offloads): each once, not live, no session
    turn, reading a private copy of its row, its own pages and cached prefix as a live request's.
    Returns every request record by (rid, generation), live and retired."""
    ps = core.page_size
    records = {(rec.rid, rec.generation): rec for rec in core.requests.values()}
    for key, z in core.offload.retired.items():
        rec = z.rec
        if key != (rec.rid, rec.generation):
            _fail(f"retired request filed under {key!r} is {rec.rid!r}#{rec.generation}")
        if key in records:
            _fail(f"request {rec.rid!r}#{rec.generation} is both live and retired")
        newer = core.requests.get(rec.rid)
        if newer is not None and newer.generation <= rec.generation:
            _fail(f"request {rec.rid!r} admitted again without a newer generation")
        if rec.session is not None:
            _fail(f"session turn {rec.rid!r} was retired for offload")
        if rec.table is core.table:
            _fail(f"retired request {rec.rid!r}#{rec.generation} still reads a row of the live table")
        if not (rec.cached_len <= rec.seq_len <= rec.num_slots) or rec.cached_len % ps:
            _fail(f"retired request {rec.rid!r}#{rec.generation} lengths inconsistent")
        if z.final_len is not None and not 0 <= z.final_len <= rec.seq_len:
            _fail(f"retired request {rec.rid!r}#{rec.generation} final length {z.final_len} beyond {rec.seq_len}")
        claim("device", rec.slots[rec.own_start:], rec.owner, f"retired request {rec.rid!r}#{rec.generation}")
        claim("device", rec.dups, rec.owner, f"retired request {rec.rid!r}#{rec.generation} duplicates")
        path: list = []
        node = rec.last_node
        while node is not None and node not in roots:
            path.append(node)
            node = node.parent
        parts = [n.device for n in reversed(path) if n.device is not None]
        held = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        if rec.failed is None:
            _check_cached_prefix(rec, held, f"retired request {rec.rid!r}#{rec.generation}")
        records[key] = rec
    return records

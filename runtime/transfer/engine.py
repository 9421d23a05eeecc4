"""Copy-engine protocol and what every engine shares: plan resolution and the CPU page-row kernel.

An engine copies the pages of a `TransferPlan` between a `DevicePool` and a `HostPool`
(BACKUP: device -> host, LOAD: host -> device) and reports completion per layer.

Resolution (seed 001): `resolve(plan, page_sizes)` is a pure function. Everything an
engine needs (numpy page indices, sorted, merged into contiguous runs) is derived into
new, read-only arrays; the plan's tensors are never modified or replaced, and nothing
derived shares storage with them. The tree may keep referencing the plan's tensors.

CPU kernel (`copy_layers`): data is copied as *page rows* (one page of one layer's K or V,
contiguous in both host layouts, see `runtime.memory.pools`). A run of pages adjacent on
both sides is one slice assignment per layer group covering its K and V rows of every layer
in the group (rows viewed as machine words, so numpy releases the GIL: it keeps it for
copies of <= 500 items). Runs too small for that (`slice_threshold`) go through a
gather/scatter of page rows per (K/V, layer), rows viewed as opaque void items (one memcpy
each), chunked so that the gathered temporary stays in L2 and a call that keeps the GIL
moves at most ~0.5 MiB. The kernels are numpy, not torch: torch's OpenMP-parallel index
ops slow down by 10-20x when another process competes for the cores.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from runtime.errors import LengthError, ValidationError
from runtime.messages import Direction, TransferPlan

__all__ = [
    "Completion",
    "CopyHandle",
    "CopyEngine",
    "FutureCompletion",
    "ResolvedTransfer",
    "ResolvedPlan",
    "resolve",
    "check_bounds",
    "SplitRuns",
    "split_runs",
    "slice_threshold",
    "chunk_pages_for",
    "row_bytes_of",
    "pool_pair",
    "copy_layers",
    "layer_count",
    "DEFAULT_SLICE_MIN_BYTES",
    "DEFAULT_INDEX_CHUNK_BYTES",
]

# Crossover between one slice assignment per run and the gathered index path (measured with
# `benchmarks/bench_copy_engine.py --crossover`): a slice call costs ~2 us of Python
# and numpy overhead; the index path costs ~100 ns per page row plus a second pass over the
# bytes. A run goes to the slice path when one call would move at least
#     slice_min_bytes * R / (R + ROW_OVERHEAD_BYTES)        (R = bytes of one page row)
# i.e. ~36 KiB for large rows and ~6 KiB for 384-byte rows.
DEFAULT_SLICE_MIN_BYTES = 36 << 10
ROW_OVERHEAD_BYTES = 1792
DEFAULT_INDEX_CHUNK_BYTES = 512 << 10


@runtime_checkable
class Completion(Protocol):
    """Something that finishes elsewhere. ``synchronize`` blocks and raises the copy's error if it failed."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class FutureCompletion:
    """`Completion` over a `concurrent.futures.Future` (CPU worker copies).

    ``future`` is exposed so that the completion bridge can use ``add_done_callback``
    instead of polling.
    """

    __slots__ = ("future",)

    def __init__(self, future: cf.Future) -> None:
        self.future = future

    def query(self) -> bool:
        return self.future.done()

    def synchronize(self) -> None:
        self.future.result()

    def __repr__(self) -> str:
        return f"FutureCompletion({self.future!r})"


@dataclass(frozen=True)
class CopyHandle:
    """What `CopyEngine.submit` returns.

    ``layers``: one completion per layer, in layer order, each finishing no later than the
    next (a BACKUP may share one completion for all layers). ``done``: every layer finished.
    ``layer_events``: CUDA events per layer (for ``stream.wait_event``) or None.
    """

    op_id: int
    layers: tuple[Completion, ...]
    done: Completion
    layer_events: tuple[Any, ...] | None = None


class CopyEngine(Protocol):
    def submit(self, plan: TransferPlan) -> CopyHandle:
        """Start copying every `PoolTransfer` of ``plan`` (BACKUP device->host, LOAD host->device); non-blocking."""
        ...

    def close(self) -> None:
        """Wait for in-flight copies, stop workers; later submits raise `RuntimeClosed`."""
        ...


# ---------------------------------------------------------------------------------------
# Resolution (pure)
# ---------------------------------------------------------------------------------------


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


@dataclass(frozen=True, eq=False)
class ResolvedTransfer:
    """One pool's part of a plan, resolved: page indices sorted by source page and merged runs.

    ``src_pages[i] -> dst_pages[i]``; ``runs[r] = (src_page, dst_page, num_pages)`` covers the
    same pairs, adjacent on both sides. Arrays are new, int64 and read-only.
    """

    pool: str
    page_size: int
    src_pages: np.ndarray
    dst_pages: np.ndarray
    runs: np.ndarray

    @property
    def num_pages(self) -> int:
        return int(self.src_pages.size)


@dataclass(frozen=True, eq=False)
class ResolvedPlan:
    op_id: int
    direction: Direction
    transfers: tuple[ResolvedTransfer, ...]


def _to_numpy_copy(t: torch.Tensor, what: str) -> np.ndarray:
    if not isinstance(t, torch.Tensor):
        raise ValidationError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise ValidationError(f"{what} must be an integer tensor, got {t.dtype}")
    if t.dim() != 1:
        raise ValidationError(f"{what} must be 1-D, got shape {tuple(t.shape)}")
    # .cpu() is a no-op (same object) for a CPU tensor: np.array(copy=True) makes the array ours.
    return np.array(t.detach().cpu().numpy(), dtype=np.int64, copy=True)


def _pages_of(slots: np.ndarray, page_size: int, what: str) -> np.ndarray:
    if slots.size % page_size:
        raise LengthError(f"{what}: {slots.size} slots is not a whole number of pages of {page_size}")
    starts = slots[::page_size]
    if page_size > 1:
        ok = (starts % page_size == 0).all() and (
            slots.reshape(-1, page_size) == starts[:, None] + np.arange(page_size, dtype=np.int64)
        ).all()
    else:
        ok = True
    if not ok:
        raise LengthError(f"{what}: slots are not whole, aligned pages of {page_size}")
    return starts // page_size


def _runs(src_pages: np.ndarray, dst_pages: np.ndarray) -> np.ndarray:
    n = src_pages.size
    if n == 0:
        return np.empty((0, 3), dtype=np.int64)
    brk = np.flatnonzero((np.diff(src_pages) != 1) | (np.diff(dst_pages) != 1)) + 1
    starts = np.concatenate(([0], brk))
    lengths = np.diff(np.concatenate((starts, [n])))
    return np.stack((src_pages[starts], dst_pages[starts], lengths), axis=1)


def resolve(plan: TransferPlan, page_sizes: int | Mapping[str, int]) -> ResolvedPlan:
    """Derive what a copy needs from ``plan`` into new objects; ``plan`` is left untouched.

    Validates that every transfer has equal-length, page-aligned src/dst slot indices and
    no destination page twice. ``page_sizes``: one page size, or one per pool name.
    """
    out = []
    for i, t in enumerate(plan.transfers):
        if isinstance(page_sizes, int):
            ps = page_sizes
        elif t.pool in page_sizes:
            ps = page_sizes[t.pool]
        else:
            raise ValidationError(f"transfer {i}: unknown pool {t.pool!r}")
        src = _to_numpy_copy(t.src, f"transfer {i} ({t.pool}) src")
        dst = _to_numpy_copy(t.dst, f"transfer {i} ({t.pool}) dst")
        if src.size != dst.size:
            raise LengthError(f"transfer {i} ({t.pool}): src has {src.size} slots, dst {dst.size}")
        sp = _pages_of(src, ps, f"transfer {i} ({t.pool}) src")
        dp = _pages_of(dst, ps, f"transfer {i} ({t.pool}) dst")
        order = np.argsort(sp, kind="stable")
        sp, dp = sp[order], dp[order]
        sorted_dp = np.sort(dp)
        if sorted_dp.size > 1 and not (np.diff(sorted_dp) != 0).all():
            raise ValidationError(f"transfer {i} ({t.pool}): a destination page appears twice")
        out.append(ResolvedTransfer(t.pool, ps, _frozen(sp), _frozen(dp), _frozen(_runs(sp, dp))))
    return ResolvedPlan(plan.op_id, plan.direction, tuple(out))


def check_bounds(rt: ResolvedTransfer, src_pages: int, dst_pages: int) -> None:
    """Raise `ValidationError` if a page index is outside its pool."""
    for arr, limit, side in ((rt.src_pages, src_pages, "src"), (rt.dst_pages, dst_pages, "dst")):
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= limit):
            raise ValidationError(f"{rt.pool}: {side} page index out of range [0, {limit})")


def layer_count(pools: Mapping[str, Any], resolved: ResolvedPlan) -> int:
    """Layers reported by a handle: the most layers among the plan's pools (at least 1)."""
    return max([pools[t.pool][0].shape.num_layers for t in resolved.transfers] or [1])


# ---------------------------------------------------------------------------------------
# CPU kernel: page rows
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class SplitRuns:
    """Runs copied by slices (Python lists, ready for a loop) and pages for the index path."""

    slice_runs: list[tuple[int, int, int]]
    idx_src: np.ndarray
    idx_dst: np.ndarray

    @property
    def num_pages(self) -> int:
        return sum(n for _, _, n in self.slice_runs) + int(self.idx_src.size)

    def shards(self, k: int, *, spread_slices: bool = True) -> list["SplitRuns"]:
        """Split into up to ``k`` parts of about equal pages (for parallel copy threads).

        ``spread_slices=False`` keeps every slice run in part 0 (small slice calls are bound
        by Python overhead, which threads do not parallelize and GIL ping-pong slows down)
        and splits only the index pages evenly.
        """
        if k <= 1 or self.num_pages < 2 * k:
            return [self]
        run_parts: list[list[tuple[int, int, int]]] = [[] for _ in range(k)]
        loads = [0] * k
        if spread_slices:
            for r in sorted(self.slice_runs, key=lambda r: -r[2]):
                i = loads.index(min(loads))
                run_parts[i].append(r)
                loads[i] += r[2]
            n = int(self.idx_src.size)
            total = sum(loads) + n
            target = [max(0, total // k - loads[i]) for i in range(k)]
        else:
            run_parts[0] = list(self.slice_runs)
            n = int(self.idx_src.size)
            target = [-(-n // k)] * k
        out = []
        start = 0
        for i in range(k):
            take = n - start if i == k - 1 else min(target[i], n - start)
            out.append(SplitRuns(run_parts[i], self.idx_src[start : start + take], self.idx_dst[start : start + take]))
            start += take
        return [p for p in out if p.num_pages]


def slice_threshold(row_bytes: int, slice_min_bytes: int = DEFAULT_SLICE_MIN_BYTES) -> float:
    """Bytes one slice call must move to beat the index path, for page rows of ``row_bytes``."""
    return slice_min_bytes * row_bytes / (row_bytes + ROW_OVERHEAD_BYTES)


def split_runs(
    rt: ResolvedTransfer, row_bytes: int, layers_per_call: int, slice_min_bytes: int, floor_bytes: float = 0
) -> SplitRuns:
    """Send each run to the slice path when one call would move enough bytes
    (`slice_threshold`, and at least ``floor_bytes``), else to the index path."""
    runs = rt.runs
    if runs.size == 0:
        e = np.empty(0, dtype=np.int64)
        return SplitRuns([], e, e)
    call_bytes = runs[:, 2] * (2 * layers_per_call * row_bytes)
    long = call_bytes >= max(slice_threshold(row_bytes, slice_min_bytes), floor_bytes)
    slice_runs = [tuple(r) for r in runs[long].tolist()]
    short = runs[~long]
    if short.size == 0:
        e = np.empty(0, dtype=np.int64)
        return SplitRuns(slice_runs, e, e)
    if (short[:, 2] == 1).all():
        return SplitRuns(slice_runs, short[:, 0].copy(), short[:, 1].copy())
    lengths = short[:, 2]
    offs = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return SplitRuns(slice_runs, np.repeat(short[:, 0], lengths) + offs, np.repeat(short[:, 1], lengths) + offs)


def copy_layers(
    src_rows: np.ndarray,
    dst_rows: np.ndarray,
    layers: slice,
    split: SplitRuns,
    chunk_pages: int,
    kv: int | None = None,
) -> None:
    """Copy the page rows of ``split`` for ``layers`` (``[2, L, P, W]`` row views on both sides);
    ``kv`` = 0 or 1 copies only K or only V (to split one copy over two threads)."""
    kvs = (0, 1) if kv is None else (kv,)
    if split.slice_runs:
        kv_sel = slice(None) if kv is None else slice(kv, kv + 1)
        s_l = src_rows[kv_sel, layers]
        d_l = dst_rows[kv_sel, layers]
        for s, d, n in split.slice_runs:
            d_l[:, :, d : d + n] = s_l[:, :, s : s + n]
    n = split.idx_src.size
    if n:
        # index path on opaque rows: numpy copies one void item with one memcpy, which beats a
        # sub-array of words for small rows; a call keeps the GIL only below 500 items, and then
        # moves at most a chunk (~0.5 MiB).
        void = np.dtype((np.void, src_rows.shape[-1] * src_rows.itemsize))
        src_v = src_rows.view(void)[..., 0]
        dst_v = dst_rows.view(void)[..., 0]
        start, stop, _ = layers.indices(src_rows.shape[1])
        bounds = [(i, min(i + chunk_pages, n)) for i in range(0, n, chunk_pages)]
        si = [split.idx_src[a:b] for a, b in bounds]
        di = [split.idx_dst[a:b] for a, b in bounds]
        for layer in range(start, stop):
            for k in kvs:
                sr = src_v[k, layer]
                dr = dst_v[k, layer]
                for a, b in zip(si, di):
                    dr[b] = sr[a]


def chunk_pages_for(row_bytes: int, chunk_bytes: int = DEFAULT_INDEX_CHUNK_BYTES) -> int:
    return max(1, chunk_bytes // max(1, row_bytes))


def row_bytes_of(pool: Any) -> int:
    shape = pool.shape
    return pool.page_size * shape.token_elems * shape.itemsize


def pool_pair(pools: Mapping[str, Sequence[Any]], name: str) -> tuple[Any, Any]:
    try:
        device, host = pools[name]
    except KeyError:
        raise ValidationError(f"unknown pool {name!r} in transfer plan") from None
    return device, host

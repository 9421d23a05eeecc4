"""Copy-engine protocol and what every engine shares: plan resolution and the CPU page-row kernel.

An engine copies the pages of a `TransferPlan` between a `DevicePool` and a `HostPool`
(BACKUP: device -> host, LOAD: host -> device) and reports completion per layer.

Resolution (seed 001): `resolve(plan, page_sizes)` is a pure function. Everything an
engine needs (numpy page indices, sorted, merged into contiguous runs) is derived into
new, read-only arrays; the plan's tensors are never modified or replaced, and nothing
derived shares storage with them. The tree may keep referencing the plan's tensors.

CPU kernel (`copy_layers`): data is copied as *page rows* (one page of one layer's K or V,
contiguous in both host layouts, see `runtime.memory.pools`) by a compiled one-pass loop
(`runtime.transfer.row_kernel`) that releases the GIL; `shard_pages` splits a copy over
threads.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from runtime.errors import LengthError, ValidationError
from runtime.messages import Direction, PoolTransfer, TransferPlan
from runtime.transfer.row_kernel import RowView, copy_rows

__all__ = [
    "Completion",
    "CopyHandle",
    "CopyEngine",
    "FutureCompletion",
    "ResolvedTransfer",
    "ResolvedPlan",
    "resolve",
    "check_bounds",
    "row_bytes_of",
    "pool_pair",
    "copy_layers",
    "shard_pages",
    "layer_count",
]



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
    ``ranks``: under one control plane over tensor-parallel ranks, each rank's own handle (rank
    r's load readiness follows its own copy); empty for one rank.
    """

    op_id: int
    layers: tuple[Completion, ...]
    done: Completion
    layer_events: tuple[Any, ...] | None = None
    ranks: tuple["CopyHandle", ...] = ()


class CopyEngine(Protocol):
    def submit(self, plan: TransferPlan) -> CopyHandle:
        """Start copying every `PoolTransfer` of ``plan`` (BACKUP device->host, LOAD host->device); non-blocking."""
        ...

    def close(self) -> None:
        """Wait for in-flight copies, stop workers; later submits raise `RuntimeClosed`."""
        ...


def merged_plan(op_id: int, plans: Sequence[TransferPlan]) -> TransferPlan:
    """One plan copying every page of `plans` (one direction), per pool in order of appearance:
    several copies as one engine submission. The index tensors are new (`torch.cat`)."""
    by_pool: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for plan in plans:
        for t in plan.transfers:
            src, dst = by_pool.setdefault(t.pool, ([], []))
            src.append(t.src)
            dst.append(t.dst)
    return TransferPlan(op_id, plans[0].direction,
                        tuple(PoolTransfer(pool, torch.cat(src), torch.cat(dst)) for pool, (src, dst) in by_pool.items()))


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
    if t.dtype not in _INDEX_DTYPES:
        raise ValidationError(f"{what} must be an integer tensor, got {t.dtype}")
    if t.dim() != 1:
        raise ValidationError(f"{what} must be 1-D, got shape {tuple(t.shape)}")
    # np.array(copy=True) makes the array ours. An integer tensor never requires grad (no
    # detach); .numpy() refuses a tensor off the CPU, which is then copied over first.
    try:
        view = t.numpy()
    except TypeError:
        view = t.cpu().numpy()
    return np.array(view, dtype=np.int64, copy=True)


_INDEX_DTYPES = frozenset((torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8))


def _pages_of(slots: np.ndarray, page_size: int, what: str) -> np.ndarray:
    if page_size == 1:
        return slots
    if slots.size % page_size:
        raise LengthError(f"{what}: {slots.size} slots is not a whole number of pages of {page_size}")
    starts = slots[::page_size]
    if not (slots.reshape(-1, page_size) - starts[:, None] == np.arange(page_size, dtype=np.int64)).all() or (
            starts % page_size).any():
        raise LengthError(f"{what}: slots are not whole, aligned pages of {page_size}")
    return starts // page_size


def _runs(src_pages: np.ndarray, dst_pages: np.ndarray, src_step: np.ndarray, dst_step: np.ndarray) -> np.ndarray:
    """(src start, dst start, length) of each run of pages adjacent on both sides; `*_step`:
    the differences of consecutive pages."""
    brk = ((src_step != 1) | (dst_step != 1)).nonzero()[0]
    first = np.empty(brk.size + 1, dtype=np.int64)  # each run's first position
    first[0] = 0
    np.add(brk, 1, out=first[1:])
    runs = np.empty((first.size, 3), dtype=np.int64)
    runs[:, 0] = src_pages[first]
    runs[:, 1] = dst_pages[first]
    last = runs[:, 2]
    last[:-1] = first[1:]
    last[-1] = src_pages.size
    last -= first
    return runs


def resolve(plan: TransferPlan, page_sizes: int | Mapping[str, int]) -> ResolvedPlan:
    """Derive what a copy needs from ``plan`` into new objects; ``plan`` is left untouched.

    Validates that every transfer has equal-length, page-aligned src/dst slot indices and
    no destination page twice. ``page_sizes``: one page size, or one per pool name. A few
    numpy calls per transfer, whatever its length: it runs on the event loop for every copy.
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
        if sp.size > 1:
            # (argmin and one index: the cheapest "any below" numpy has for a short array)
            src_step = sp[1:] - sp[:-1]
            if src_step[src_step.argmin()] < 0:  # into source order (a node's slots usually are)
                order = np.argsort(sp, kind="stable")
                sp, dp = sp[order], dp[order]
                src_step = sp[1:] - sp[:-1]
            dst_step = dp[1:] - dp[:-1]
            # ascending destinations cannot repeat; otherwise a sorted copy tells
            if dst_step[dst_step.argmin()] <= 0 and not np.diff(np.sort(dp)).all():
                raise ValidationError(f"transfer {i} ({t.pool}): a destination page appears twice")
            runs = _runs(sp, dp, src_step, dst_step)
        else:
            runs = np.array([[sp[0], dp[0], 1]], dtype=np.int64) if sp.size else np.empty((0, 3), dtype=np.int64)
        out.append(ResolvedTransfer(t.pool, ps, _frozen(sp), _frozen(dp), _frozen(runs)))
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
# CPU kernel: page rows (`runtime.transfer.row_kernel`)
# ---------------------------------------------------------------------------------------


def shard_pages(src_pages: np.ndarray, dst_pages: np.ndarray, k: int, min_pages: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    """Split page pairs into up to ``k`` parts of about equal size, each of at least
    ``min_pages`` pages (so that a small copy is not split over threads for nothing)."""
    n = int(src_pages.size)
    parts = max(1, min(k, n // max(1, min_pages)))
    if parts == 1:
        return [(src_pages, dst_pages)] if n else []
    bounds = np.linspace(0, n, parts + 1).astype(np.int64)
    return [(src_pages[a:b], dst_pages[a:b]) for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())]


def copy_layers(src: RowView, dst: RowView, layers: slice, src_pages: np.ndarray, dst_pages: np.ndarray) -> None:
    """Copy the K and V rows of ``layers`` for each page pair ``src_pages[i] -> dst_pages[i]``."""
    lo, hi, _ = layers.indices(src.num_layers)
    if lo < hi and src_pages.size:
        copy_rows(src, dst, lo, hi, src_pages, dst_pages)


def row_bytes_of(pool: Any) -> int:
    shape = pool.shape
    return pool.page_size * shape.token_elems * shape.itemsize


def pool_pair(pools: Mapping[str, Sequence[Any]], name: str) -> tuple[Any, Any]:
    try:
        device, host = pools[name]
    except KeyError:
        raise ValidationError(f"unknown pool {name!r} in transfer plan") from None
    return device, host

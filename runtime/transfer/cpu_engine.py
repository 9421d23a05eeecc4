"""CPU copy engine: worker threads copy page rows with a compiled kernel (GIL released), reporting per layer.

Workers: one single-thread executor per direction: copies of one direction run in
submission order, and a load never waits behind a large backup (the CPU analogue of
separate load and write-back CUDA streams). Loads come first: a backup copies in steps of
about ``BACKUP_STEP_BYTES`` and, before each step, waits while any load is in flight, so that a
load (what a request waits for) has the cores and the copy threads to itself and never shares
them with a backup (which nobody waits for) queued before it. A backup of at most ``INLINE_BACKUP_BYTES`` is
copied inline in ``submit`` instead (no hand-off; acks still go out in issue order). ``copy_threads`` (default 2) splits each
copy step by pages over the worker plus shared helper threads (`shard_pages`); a step
smaller than ``SHARD_MIN_BYTES`` per thread stays on the worker.

Completions: a LOAD reports per layer, layer ``i`` no later than layer ``i + 1``; a BACKUP
copies all layers at once and shares one completion for every layer. Completions are
`FutureCompletion`s over `concurrent.futures.Future`s (the bridge uses their callbacks).

Load granularity (``load_groups``): ``"layer"`` copies one layer per step; ``"geometric"``
(default) copies groups of 1, 1, 2, 4, 8, ... layers, so that layers 0 and 1 are ready after
a small fraction of the copy while later layers move in larger (faster) steps; every layer
of a group completes when the group is copied.

Fault injection (tests): ``fault(op_id, layer)`` is called in the worker before each layer
is copied; an exception it raises fails that layer's group and every later layer.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from collections.abc import Callable, Mapping

from runtime.errors import ConfigError, RuntimeClosed, ValidationError
from runtime.memory.pools import DevicePool, HostPool
from runtime.messages import Direction, TransferPlan
from runtime.transfer.engine import (
    CopyHandle,
    FutureCompletion,
    ResolvedPlan,
    check_bounds,
    copy_layers,
    layer_count,
    pool_pair,
    resolve,
    row_bytes_of,
    shard_pages,
)
from runtime.transfer.row_kernel import RowView

__all__ = ["CpuCopyEngine", "check_pool_pairs", "layer_groups"]

FaultHook = Callable[[int, int], None]

# A thread hand-off costs tens of microseconds: split a copy step only when every thread
# gets at least this much to copy.
SHARD_MIN_BYTES = 256 << 10
# A backup this small is copied inline in `submit` (its completion is done when it returns): the
# copy costs less than handing it to the worker thread, which on a loaded machine costs the
# caller's thread a context switch and a GIL round trip (docs/BENCHMARKS.md, write-through).
INLINE_BACKUP_BYTES = SHARD_MIN_BYTES
# A backup yields to loads between steps of about this many bytes: a load waits for at most one
# step (~1 ms at a few GB/s) of a backup that was already copying.
BACKUP_STEP_BYTES = 4 << 20


def check_pool_pairs(pools: Mapping[str, tuple[DevicePool, HostPool]]) -> None:
    if not pools:
        raise ConfigError("a copy engine needs at least one (device, host) pool pair")
    for name, (device, host) in pools.items():
        if device.shape != host.shape:
            raise ConfigError(f"pool {name!r}: device shape {device.shape} != host shape {host.shape}")
        if device.page_size != host.page_size:
            raise ConfigError(f"pool {name!r}: device page_size {device.page_size} != host {host.page_size}")


class CpuCopyEngine:
    """Copies between CPU-resident device pools and host pools in worker threads."""

    # the transfer actor may hand it a burst's backups as one plan (`merged_plan`): one hand-off
    # to the worker and one completion instead of one per backup
    coalesce_backups = True

    def __init__(
        self,
        pools: Mapping[str, tuple[DevicePool, HostPool]],
        *,
        workers_per_direction: int = 1,
        copy_threads: int | None = None,
        load_groups: str = "geometric",
        fault: FaultHook | None = None,
        inline_backup_bytes: int = INLINE_BACKUP_BYTES,
    ) -> None:
        check_pool_pairs(pools)
        if workers_per_direction < 1:
            raise ConfigError("workers_per_direction must be >= 1")
        if copy_threads is None:
            copy_threads = min(2, os.cpu_count() or 1)
        if copy_threads < 1:
            raise ConfigError("copy_threads must be >= 1")
        if load_groups not in ("layer", "geometric"):
            raise ConfigError(f"load_groups must be 'layer' or 'geometric', got {load_groups!r}")
        self._load_groups = load_groups
        self._copy_threads = copy_threads
        self._helpers = (
            cf.ThreadPoolExecutor(copy_threads - 1, thread_name_prefix="hicache-copy-helper") if copy_threads > 1 else None
        )
        self._pools = dict(pools)
        self._rows = {name: (RowView(d.page_rows()), RowView(h.page_rows())) for name, (d, h) in self._pools.items()}
        self._page_sizes = {name: d.page_size for name, (d, _) in self._pools.items()}
        self._fault = fault
        self._inline_backup_bytes = inline_backup_bytes  # (0: every backup goes to its worker)
        self._executors = {
            d: cf.ThreadPoolExecutor(workers_per_direction, thread_name_prefix=f"hicache-copy-{d.name.lower()}")
            for d in Direction
        }
        self._lock = threading.Lock()
        self._inflight: dict[int, cf.Future] = {}
        self._closed = False
        self._loads = 0  # loads submitted and not finished: backups wait while there are any
        self._no_loads = threading.Condition(self._lock)

    # ---- public -------------------------------------------------------------------------

    def submit(self, plan: TransferPlan) -> CopyHandle:
        resolved = resolve(plan, self._page_sizes)
        for rt in resolved.transfers:
            device, host = pool_pair(self._pools, rt.pool)
            src, dst = (device, host) if plan.direction is Direction.BACKUP else (host, device)
            check_bounds(rt, src.num_pages, dst.num_pages)
        num_layers = layer_count(self._pools, resolved)
        per_layer = plan.direction is Direction.LOAD
        groups = layer_groups(num_layers, self._load_groups) if per_layer else []
        # one future per copy step, shared by its layers: the bridge watches it once (one loop
        # wake-up per step, not per layer, while the copy threads need the cores)
        group_futs = [cf.Future() for _ in groups]
        inline = not per_layer and self._plan_bytes(resolved) <= self._inline_backup_bytes
        with self._lock:
            if self._closed:
                raise RuntimeClosed("copy engine is closed")
            if plan.op_id in self._inflight:
                raise ValidationError(f"op {plan.op_id} is already in flight")
            if not inline:
                if per_layer:
                    self._loads += 1
                fut = self._executors[plan.direction].submit(self._run, resolved, num_layers, groups, group_futs)
                self._inflight[plan.op_id] = fut
        if inline:
            fut = cf.Future()
            fut.set_running_or_notify_cancel()
            try:
                self._run(resolved, num_layers, groups, group_futs)
            except Exception as exc:  # noqa: BLE001 - a failed copy, reported through its completion
                fut.set_exception(exc)
            else:
                fut.set_result(None)
        else:
            fut.add_done_callback(lambda _f, op=plan.op_id: self._forget(op))
        done = FutureCompletion(fut)
        if per_layer:
            layers = tuple(c for (lo, hi), f in zip(groups, group_futs) for c in (FutureCompletion(f),) * (hi - lo))
        else:
            layers = (done,) * num_layers
        return CopyHandle(plan.op_id, layers, done, None)

    def inflight(self) -> list[int]:
        with self._lock:
            return list(self._inflight)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        for ex in self._executors.values():
            ex.shutdown(wait=True)
        if self._helpers is not None:
            self._helpers.shutdown(wait=True)

    def _plan_bytes(self, resolved: ResolvedPlan) -> int:
        total = 0
        for rt in resolved.transfers:
            device, _ = self._pools[rt.pool]
            total += rt.src_pages.size * device.shape.parts * device.shape.num_layers * row_bytes_of(device)
        return total

    # ---- worker -------------------------------------------------------------------------

    def _forget(self, op_id: int) -> None:
        with self._lock:
            self._inflight.pop(op_id, None)

    def _load_finished(self) -> None:
        with self._lock:
            self._loads -= 1
            if not self._loads:
                self._no_loads.notify_all()

    def _wait_for_loads(self) -> None:
        """Before a backup step: let every load in flight finish first (loads are never starved
        by this; a backup is, for as long as loads keep coming, as a backup should be)."""
        with self._lock:
            while self._loads:
                self._no_loads.wait()

    def _jobs(self, resolved: ResolvedPlan, layers_per_call: int) -> list:
        """Per pool: (src rows, dst rows, page shards), for copy steps of ``layers_per_call`` layers."""
        jobs = []
        for rt in resolved.transfers:
            device, _ = self._pools[rt.pool]
            dev_rows, host_rows = self._rows[rt.pool]
            src_rows, dst_rows = (dev_rows, host_rows) if resolved.direction is Direction.BACKUP else (host_rows, dev_rows)
            step_bytes_per_page = device.shape.parts * min(layers_per_call, device.shape.num_layers) * row_bytes_of(device)
            min_pages = -(-SHARD_MIN_BYTES // step_bytes_per_page)
            jobs.append((src_rows, dst_rows, shard_pages(rt.src_pages, rt.dst_pages, self._copy_threads, min_pages)))
        return jobs

    def _copy(self, jobs: list, layers: slice) -> None:
        """Copy ``layers`` of every job, shards in parallel (the first on this thread)."""
        inline = []
        remote = []
        for src_rows, dst_rows, shards in jobs:
            for i, (sp, dp) in enumerate(shards):
                (inline if i == 0 else remote).append((src_rows, dst_rows, layers, sp, dp))
        futs = [self._helpers.submit(copy_layers, *a) for a in remote] if remote else []  # type: ignore[union-attr]
        try:
            for a in inline:
                copy_layers(*a)
        finally:
            for f in futs:
                f.result()

    def _run(self, resolved: ResolvedPlan, num_layers: int, groups: list[tuple[int, int]],
             group_futs: list[cf.Future]) -> None:
        live = {f for f in group_futs if f.set_running_or_notify_cancel()}
        if not group_futs:  # BACKUP: steps of a few layers, loads first; one completion
            if self._fault is not None:
                self._fault(resolved.op_id, 0)
            per_layer_bytes = max(1, self._plan_bytes(resolved) // max(1, num_layers))
            step = max(1, min(num_layers, BACKUP_STEP_BYTES // per_layer_bytes))
            jobs = self._jobs(resolved, step)
            for lo in range(0, num_layers, step):
                self._wait_for_loads()
                self._copy(jobs, slice(lo, lo + step))
            return
        try:
            self._run_load(resolved, groups, group_futs, live)
        finally:
            self._load_finished()

    def _run_load(self, resolved: ResolvedPlan, groups: list[tuple[int, int]], group_futs: list[cf.Future],
                  live: set[cf.Future]) -> None:
        g = 0
        try:
            jobs_by_size: dict[int, list] = {}
            for g, (lo, hi) in enumerate(groups):
                if self._fault is not None:
                    for layer in range(lo, hi):
                        self._fault(resolved.op_id, layer)
                jobs = jobs_by_size.get(hi - lo)
                if jobs is None:
                    jobs = jobs_by_size[hi - lo] = self._jobs(resolved, hi - lo)
                self._copy(jobs, slice(lo, hi))
                if group_futs[g] in live:
                    group_futs[g].set_result(None)
        except BaseException as exc:
            for f in group_futs[g:]:
                if f in live and not f.done():
                    f.set_exception(exc)
            raise


def layer_groups(num_layers: int, mode: str = "geometric") -> list[tuple[int, int]]:
    """``[lo, hi)`` layer ranges copied per step: one layer each, or 1, 1, 2, 4, 8, ... layers."""
    if mode == "layer":
        return [(i, i + 1) for i in range(num_layers)]
    out = []
    lo, size = 0, 1
    while lo < num_layers:
        hi = min(num_layers, lo + size)
        out.append((lo, hi))
        if len(out) >= 2:
            size *= 2
        lo = hi
    return out

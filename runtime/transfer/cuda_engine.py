"""CUDA copy engine (the only module that touches ``torch.cuda``): thin by design.

One copy stream per direction. `submit` makes the copy stream wait for the caller's
current stream (the model's writes before a backup, earlier reads of slots before a load
overwrites them) and moves a plan's pages through a pinned staging buffer, one DMA per
transfer (backup) or per layer (load), the scattered pages gathered and scattered on each side
in bulk:

- backup: one gather kernel (`index_select` of the page rows of every layer) into a device
  staging buffer, one ``non_blocking`` copy to pinned host staging, then, once that copy's
  event fires, the compiled row kernel (`runtime.transfer.row_kernel`, GIL released) scatters
  the rows into the host pool's pages on the engine's worker thread; the finish completion is
  that scatter. The layer events fire when the gather has read the device pages (a model may
  then overwrite them).
- load: the row kernel gathers the host pages into pinned staging on the calling thread, then
  per layer one ``non_blocking`` copy to device staging and one ``index_copy_`` into the device
  pool's pages, and a `torch.cuda.Event` per layer: ``CopyHandle.layer_events``, which a model
  stream can ``wait_event`` before computing that layer.

One copy per piece (a run of adjacent pages per layer and K/V, as before) cost ~16 µs of Python
and launch each: 0.02-1.5 GB/s on an H100 at 1- to 64-token pages (docs/BENCHMARKS.md,
"Transfer on a GPU"). Staging buffers live until the op's finish (they are kept in the op's
in-flight record).
A ``fault(op_id, layer)`` hook (tests) that raises while issuing layer ``i`` fails layers
``i..`` and the finish completion with that error; earlier layers still complete.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from runtime.errors import ConfigError, RuntimeClosed, ValidationError
from runtime.memory.pools import DevicePool, HostPool
from runtime.messages import Direction, TransferPlan
from runtime.transfer.cpu_engine import check_pool_pairs
from runtime.transfer.engine import (CopyHandle, FutureCompletion, check_bounds, layer_count, pool_pair, resolve,
                                     shard_pages)
from runtime.transfer.row_kernel import RowView, copy_rows

__all__ = ["CudaCopyEngine", "CudaEventCompletion"]


class CudaEventCompletion:
    """`Completion` over a recorded CUDA event; ``error`` set when issuing the copy failed."""

    __slots__ = ("event", "error")

    def __init__(self, event: torch.cuda.Event, error: BaseException | None = None) -> None:
        self.event = event
        self.error = error

    def query(self) -> bool:
        return self.error is not None or self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()
        if self.error is not None:
            raise self.error


class CudaCopyEngine:
    def __init__(
        self,
        pools: Mapping[str, tuple[DevicePool, HostPool]],
        *,
        copy_threads: int | None = None,
        fault: Callable[[int, int], None] | None = None,
    ) -> None:
        check_pool_pairs(pools)
        if copy_threads is None:
            copy_threads = min(8, os.cpu_count() or 1)
        if copy_threads < 1:
            raise ConfigError("copy_threads must be >= 1")
        devices = {d.device for d, _ in pools.values()}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise ConfigError(f"CudaCopyEngine needs device pools on one CUDA device, got {devices}")
        for name, (_, host) in pools.items():
            if not host.pinned:
                raise ConfigError(f"pool {name!r}: host pool must be pinned for asynchronous copies")
        self._device = next(iter(devices))
        self._pools = dict(pools)
        self._page_sizes = {name: d.page_size for name, (d, _) in self._pools.items()}
        # page rows: device [2, L, P, row bytes] (uint8, on the GPU), host as the row kernel sees them
        self._dev_rows = {name: _device_rows(d) for name, (d, _) in self._pools.items()}
        self._host_rows = {name: RowView(h.page_rows()) for name, (_, h) in self._pools.items()}
        self._streams = {d: torch.cuda.Stream(self._device) for d in Direction}
        self._scatter = cf.ThreadPoolExecutor(1, thread_name_prefix="hicache-cuda-scatter")
        # the host side's row copies (load gathers, backup scatters) split over this many threads
        self._copy_threads = copy_threads
        self._helpers = (cf.ThreadPoolExecutor(copy_threads - 1, thread_name_prefix="hicache-cuda-rows")
                         if copy_threads > 1 else None)
        self._fault = fault
        self._lock = threading.Lock()
        self._inflight: dict[int, Any] = {}  # op id -> its finish (an event or a future) and staging
        self._closed = False

    def submit(self, plan: TransferPlan) -> CopyHandle:
        resolved = resolve(plan, self._page_sizes)
        for rt in resolved.transfers:
            device, host = pool_pair(self._pools, rt.pool)
            src, dst = (device, host) if plan.direction is Direction.BACKUP else (host, device)
            check_bounds(rt, src.num_pages, dst.num_pages)
        num_layers = layer_count(self._pools, resolved)
        with self._lock:
            if self._closed:
                raise RuntimeClosed("copy engine is closed")
            if plan.op_id in self._inflight:
                raise ValidationError(f"op {plan.op_id} is already in flight")
        backup = plan.direction is Direction.BACKUP
        stream = self._streams[plan.direction]
        stream.wait_stream(torch.cuda.current_stream(self._device))
        events = [torch.cuda.Event() for _ in range(num_layers)]
        finish = torch.cuda.Event()
        error: BaseException | None = None
        failed_at = num_layers
        staging: list[Any] = []  # kept alive until the op's finish
        scatters: list[tuple[RowView, RowView, int, np.ndarray]] = []  # backup: staging rows -> host pages
        with torch.cuda.stream(stream):
            if backup:
                try:
                    if self._fault is not None:
                        for layer in range(num_layers):
                            failed_at = layer
                            self._fault(plan.op_id, layer)
                        failed_at = num_layers
                    for rt in resolved.transfers:
                        scatters.append(self._backup_to_staging(rt, staging))
                except Exception as exc:  # noqa: BLE001 - reported through the completions
                    error = exc
                    if failed_at == num_layers:  # (not the fault hook's: nothing was copied)
                        failed_at = 0
                for e in events:
                    e.record(stream)
            else:
                try:
                    loads = [self._load_to_staging(rt, staging) for rt in resolved.transfers]
                except Exception as exc:  # noqa: BLE001
                    error, failed_at, loads = exc, 0, []
                for layer in range(num_layers):
                    if error is None:
                        try:
                            if self._fault is not None:
                                self._fault(plan.op_id, layer)
                            for dev_rows, idx, host_staging, dev_staging in loads:
                                if layer < dev_rows.shape[1]:
                                    dev_staging[layer].copy_(host_staging[layer], non_blocking=True)
                                    dev_rows[:, layer].index_copy_(1, idx, dev_staging[layer])
                        except Exception as exc:  # noqa: BLE001
                            error, failed_at = exc, layer
                    events[layer].record(stream)
            finish.record(stream)
        layers = tuple(CudaEventCompletion(e, error if i >= failed_at else None) for i, e in enumerate(events))
        if backup and error is None:
            fut = self._scatter.submit(self._scatter_rows, finish, scatters)
            done: Any = _FinishFuture(self, plan.op_id, fut)
            record: Any = (fut, staging)
        else:
            done = _Finish(self, plan.op_id, finish, error)
            record = (finish, staging)
        with self._lock:
            for op, (waitable, _) in list(self._inflight.items()):  # prune finished ops nobody queried
                if (waitable.done() if isinstance(waitable, cf.Future) else waitable.query()):
                    del self._inflight[op]
            self._inflight[plan.op_id] = record
        return CopyHandle(plan.op_id, layers, done, tuple(events))

    def _backup_to_staging(self, rt: Any, staging: list) -> tuple[RowView, RowView, int, np.ndarray]:
        """Gather one pool's device pages into pinned host staging (queued on the current stream)."""
        dev_rows = self._dev_rows[rt.pool]
        idx = torch.tensor(rt.src_pages, dtype=torch.int64).to(self._device, non_blocking=True)
        dev_staging = dev_rows.index_select(2, idx)  # [2, L, n, row bytes]
        host_staging = torch.empty(dev_staging.shape, dtype=torch.uint8, pin_memory=True)
        host_staging.copy_(dev_staging, non_blocking=True)
        staging.extend((idx, dev_staging, host_staging))
        host_rows = self._host_rows[rt.pool]
        staged = RowView(_as_words(host_staging.numpy(), host_rows.flat.dtype))
        return staged, host_rows, dev_rows.shape[1], rt.dst_pages

    def _load_to_staging(self, rt: Any, staging: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gather one pool's host pages into pinned staging now; the device side is per layer."""
        dev_rows = self._dev_rows[rt.pool]
        n, num_layers, row_bytes = len(rt.src_pages), dev_rows.shape[1], dev_rows.shape[3]
        host_staging = torch.empty((num_layers, 2, n, row_bytes), dtype=torch.uint8, pin_memory=True)
        host_rows = self._host_rows[rt.pool]
        staged = RowView(_as_words(host_staging.numpy(), host_rows.flat.dtype).transpose(1, 0, 2, 3))
        self._rows(host_rows, staged, num_layers, rt.src_pages, np.arange(n, dtype=np.int64))
        idx = torch.tensor(rt.dst_pages, dtype=torch.int64).to(self._device, non_blocking=True)
        dev_staging = torch.empty((num_layers, 2, n, row_bytes), dtype=torch.uint8, device=self._device)
        staging.extend((idx, host_staging, dev_staging))
        return dev_rows, idx, host_staging, dev_staging

    def _scatter_rows(self, dma_done: torch.cuda.Event, scatters: list[tuple[RowView, RowView, int, np.ndarray]]) -> None:
        """Backup, on the scatter worker: once the staging copy landed, rows to the host pool's pages."""
        dma_done.synchronize()
        for staged, host_rows, num_layers, host_pages in scatters:
            self._rows(staged, host_rows, num_layers, np.arange(len(host_pages), dtype=np.int64), host_pages)

    def _rows(self, src: RowView, dst: RowView, num_layers: int, src_pages: np.ndarray, dst_pages: np.ndarray) -> None:
        """Row copies of every layer, pages split over the copy threads (each part >= 256 KiB)."""
        row_bytes = src.row_words * src.flat.itemsize
        shards = shard_pages(src_pages, dst_pages, self._copy_threads, -(-(256 << 10) // (2 * num_layers * row_bytes)))
        futs = [self._helpers.submit(copy_rows, src, dst, 0, num_layers, sp, dp)  # type: ignore[union-attr]
                for sp, dp in shards[1:]]
        try:
            for sp, dp in shards[:1]:
                copy_rows(src, dst, 0, num_layers, sp, dp)
        finally:
            for f in futs:
                f.result()

    def _forget(self, op_id: int) -> None:
        with self._lock:
            self._inflight.pop(op_id, None)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            records = list(self._inflight.values())
        for waitable, _ in records:
            if isinstance(waitable, cf.Future):
                cf.wait([waitable])
            else:
                waitable.synchronize()
        for s in self._streams.values():
            s.synchronize()
        self._scatter.shutdown(wait=True)
        if self._helpers is not None:
            self._helpers.shutdown(wait=True)
        with self._lock:
            self._inflight.clear()


def _device_rows(device: DevicePool) -> torch.Tensor:
    """``[2, L, P, row bytes]`` uint8 view of a device pool: row ``[kv, layer, page]`` is one page
    of one layer's K or V (the same rows as `DevicePool.page_rows`, on the GPU)."""
    shape = device.shape
    row_bytes = device.page_size * shape.token_elems * shape.itemsize
    return device.buffer.view(torch.uint8).reshape(2, shape.num_layers, -1, row_bytes)


def _as_words(raw: np.ndarray, word: np.dtype) -> np.ndarray:
    """A uint8 array whose last axis is whole rows, viewed in the host rows' machine word."""
    return raw.view(word)


class _FinishFuture(FutureCompletion):
    """A backup's finish (its host-side scatter); forgets the op in the engine once observed done."""

    __slots__ = ("_engine", "_op_id")

    def __init__(self, engine: "CudaCopyEngine", op_id: int, future: cf.Future) -> None:
        super().__init__(future)
        self._engine = engine
        self._op_id = op_id

    def query(self) -> bool:
        ok = super().query()
        if ok:
            self._engine._forget(self._op_id)
        return ok

    def synchronize(self) -> None:
        try:
            super().synchronize()
        finally:
            self._engine._forget(self._op_id)


class _Finish(CudaEventCompletion):
    """The finish completion; forgets the op in the engine once observed complete."""

    __slots__ = ("_engine", "_op_id")

    def __init__(self, engine: CudaCopyEngine, op_id: int, event: torch.cuda.Event, error: BaseException | None) -> None:
        super().__init__(event, error)
        self._engine = engine
        self._op_id = op_id

    def query(self) -> bool:
        ok = super().query()
        if ok:
            self._engine._forget(self._op_id)
        return ok

    def synchronize(self) -> None:
        try:
            super().synchronize()
        finally:
            self._engine._forget(self._op_id)

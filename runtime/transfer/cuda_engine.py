"""CUDA copy engine (the only module that touches ``torch.cuda``): thin by design.

One copy stream per direction. `submit` makes the copy stream wait for the caller's
current stream (the model's writes before a backup, earlier reads of slots before a load
overwrites them), then queues, layer by layer, one Triton kernel launch that copies the layer's
page rows between the device pool and the pinned host pool directly (`runtime.transfer.zero_copy`:
the GPU reads and writes the mapped host memory; no staging, no host-side pass), and records one
`torch.cuda.Event` per layer and a finish event. ``CopyHandle.layer_events`` are those events: a
model stream can ``wait_event(layer_events[i])`` before computing layer ``i``.

On an H100 the kernel moves ~50 GB/s at 1- to 64-token pages, near one contiguous pinned copy
(25-36 GB/s through the transfer actor); the engine before it issued one ``cudaMemcpyAsync`` per
run of adjacent pages per layer and K/V (~16 µs each: 0.02-1.5 GB/s), and a staging version
(gather kernel, one DMA, a CPU scatter) reached 10.5-15.5 GB/s (docs/BENCHMARKS.md, "Transfer
on a GPU").
A ``fault(op_id, layer)`` hook (tests) that raises while issuing layer ``i`` fails layers
``i..`` and the finish completion with that error; earlier layers still complete.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from runtime.errors import ConfigError, RuntimeClosed, ValidationError
from runtime.memory.pools import DevicePool, HostPool
from runtime.messages import Direction, TransferPlan
from runtime.transfer.cpu_engine import check_pool_pairs
from runtime.transfer.engine import CopyHandle, check_bounds, layer_count, pool_pair, resolve, row_bytes_of

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
        fault: Callable[[int, int], None] | None = None,
    ) -> None:
        from runtime.transfer import zero_copy  # (Triton: CUDA builds of torch only)

        check_pool_pairs(pools)
        devices = {d.device for d, _ in pools.values()}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise ConfigError(f"CudaCopyEngine needs device pools on one CUDA device, got {devices}")
        for name, (_, host) in pools.items():
            if not host.pinned:
                raise ConfigError(f"pool {name!r}: host pool must be pinned for asynchronous copies")
        self._zc = zero_copy
        self._device = next(iter(devices))
        self._pools = dict(pools)
        self._page_sizes = {name: d.page_size for name, (d, _) in self._pools.items()}
        self._rows = {name: (_rows(zero_copy, d.buffer, d, page_first=False),
                             _rows(zero_copy, h.buffer, d, page_first=h.layout == "page_first"))
                      for name, (d, h) in self._pools.items()}
        self._streams = {d: torch.cuda.Stream(self._device) for d in Direction}
        self._fault = fault
        self._lock = threading.Lock()
        self._inflight: dict[int, tuple[torch.cuda.Event, list[Any]]] = {}  # op -> finish, its page indices
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
        copies = []
        with torch.cuda.stream(stream):
            try:
                for rt in resolved.transfers:
                    dev_rows, host_rows = self._rows[rt.pool]
                    src, dst = (dev_rows, host_rows) if backup else (host_rows, dev_rows)
                    copies.append((src, dst, self._on_device(rt.src_pages), self._on_device(rt.dst_pages)))
            except Exception as exc:  # noqa: BLE001
                error, failed_at = exc, 0
            for layer in range(num_layers):
                if error is None:
                    try:
                        if self._fault is not None:
                            self._fault(plan.op_id, layer)
                        for src, dst, src_pages, dst_pages in copies:
                            if layer < src.num_layers:
                                self._zc.copy_rows(src, dst, layer, layer + 1, src_pages, dst_pages)
                    except Exception as exc:  # noqa: BLE001 - reported through the completions
                        error, failed_at = exc, layer
                events[layer].record(stream)
            finish.record(stream)
        with self._lock:
            for op, (ev, _) in list(self._inflight.items()):  # prune finished ops nobody queried
                if ev.query():
                    del self._inflight[op]
            self._inflight[plan.op_id] = (finish, copies)  # (the page indices live until the finish)
        layers = tuple(CudaEventCompletion(e, error if i >= failed_at else None) for i, e in enumerate(events))
        return CopyHandle(plan.op_id, layers, _Finish(self, plan.op_id, finish, error), tuple(events))

    def _on_device(self, pages: Any) -> torch.Tensor:
        """Page indices as an int64 CUDA tensor, copied on the copy stream (ordered before the kernels)."""
        return torch.tensor(pages, dtype=torch.int64).pin_memory().to(self._device, non_blocking=True)

    def _forget(self, op_id: int) -> None:
        with self._lock:
            self._inflight.pop(op_id, None)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            events = [ev for ev, _ in self._inflight.values()]
        for e in events:
            e.synchronize()
        for s in self._streams.values():
            s.synchronize()
        with self._lock:
            self._inflight.clear()


def _rows(zero_copy: Any, buffer: torch.Tensor, device: DevicePool, *, page_first: bool) -> Any:
    """A pool's page rows for the kernel (row = one page of one layer's part: K, V, latent, state)."""
    shape = device.shape
    return zero_copy.RowTensor(buffer, page_first=page_first, num_layers=shape.num_layers,
                               row_bytes=row_bytes_of(device), parts=shape.parts)


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

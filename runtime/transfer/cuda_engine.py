"""CUDA copy engine (the only module that touches ``torch.cuda``): thin by design.

One copy stream per direction. `submit` makes the copy stream wait for the caller's
current stream (the model's writes before a backup, earlier reads of slots before a load
overwrites them), then issues, layer by layer, ``non_blocking`` copies between contiguous
slices of the device pool and the pinned host pool, and records one `torch.cuda.Event`
per layer and a finish event. ``CopyHandle.layer_events`` are those events: a model
stream can ``wait_event(layer_events[i])`` before computing layer ``i``.

Pieces: layer_first host: one copy per run of adjacent pages per (K/V, layer);
page_first host: one copy per page per (K/V, layer) (a page's rows of one layer are
contiguous, consecutive pages are not). Every piece is a contiguous-to-contiguous
``cudaMemcpyAsync``; a gather kernel that coalesces scattered pages is future work.

Issuing happens on the calling thread (launch cost: a few microseconds per piece).
A ``fault(op_id, layer)`` hook (tests) that raises while issuing layer ``i`` fails layers
``i..`` and the finish completion with that error; earlier layers still complete.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import torch

from runtime.errors import ConfigError, RuntimeClosed, ValidationError
from runtime.memory.pools import DevicePool, HostPool
from runtime.messages import Direction, TransferPlan
from runtime.transfer.cpu_engine import check_pool_pairs
from runtime.transfer.engine import CopyHandle, check_bounds, layer_count, pool_pair, resolve

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
        check_pool_pairs(pools)
        devices = {d.device for d, _ in pools.values()}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise ConfigError(f"CudaCopyEngine needs device pools on one CUDA device, got {devices}")
        for name, (_, host) in pools.items():
            if not host.pinned:
                raise ConfigError(f"pool {name!r}: host pool must be pinned for asynchronous copies")
        self._device = next(iter(devices))
        self._pools = dict(pools)
        self._page_sizes = {name: d.page_size for name, (d, _) in self._pools.items()}
        self._streams = {d: torch.cuda.Stream(self._device) for d in Direction}
        self._fault = fault
        self._lock = threading.Lock()
        self._inflight: dict[int, torch.cuda.Event] = {}
        self._closed = False

    def submit(self, plan: TransferPlan) -> CopyHandle:
        resolved = resolve(plan, self._page_sizes)
        pieces = []
        for rt in resolved.transfers:
            device, host = pool_pair(self._pools, rt.pool)
            src, dst = (device, host) if plan.direction is Direction.BACKUP else (host, device)
            check_bounds(rt, src.num_pages, dst.num_pages)
            pieces.append((device, host, rt.runs.tolist()))
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
        with torch.cuda.stream(stream):
            for layer in range(num_layers):
                if error is None:
                    try:
                        if self._fault is not None:
                            self._fault(plan.op_id, layer)
                        for device, host, runs in pieces:
                            if layer < device.shape.num_layers:
                                self._copy_layer(device, host, runs, layer, backup)
                    except Exception as exc:  # noqa: BLE001 - reported through the completions
                        error, failed_at = exc, layer
                events[layer].record(stream)
            finish.record(stream)
        with self._lock:
            for op, ev in list(self._inflight.items()):  # prune finished ops nobody queried
                if ev.query():
                    del self._inflight[op]
            self._inflight[plan.op_id] = finish
        layers = tuple(CudaEventCompletion(e, error if i >= failed_at else None) for i, e in enumerate(events))
        return CopyHandle(plan.op_id, layers, _Finish(self, plan.op_id, finish, error), tuple(events))

    @staticmethod
    def _copy_layer(device: DevicePool, host: HostPool, runs: list, layer: int, backup: bool) -> None:
        ps = device.page_size
        for kv in (0, 1):
            dev = device.buffer[kv, layer]
            if host.layout == "layer_first":
                hst = host.buffer[kv, layer]
                for s, d, n in runs:
                    hs, ds = (d, s) if backup else (s, d)  # (host page, device page)
                    h_sl = hst[hs * ps : (hs + n) * ps]
                    d_sl = dev[ds * ps : (ds + n) * ps]
                    (h_sl.copy_(d_sl, non_blocking=True) if backup else d_sl.copy_(h_sl, non_blocking=True))
            else:
                for s, d, n in runs:
                    hs, ds = (d, s) if backup else (s, d)
                    for i in range(n):
                        h_sl = host.buffer[hs + i, layer, kv]
                        d_sl = dev[(ds + i) * ps : (ds + i + 1) * ps]
                        (h_sl.copy_(d_sl, non_blocking=True) if backup else d_sl.copy_(h_sl, non_blocking=True))

    def _forget(self, op_id: int) -> None:
        with self._lock:
            self._inflight.pop(op_id, None)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            events = list(self._inflight.values())
        for e in events:
            e.synchronize()
        for s in self._streams.values():
            s.synchronize()
        with self._lock:
            self._inflight.clear()


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

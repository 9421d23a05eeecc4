"""CUDA copy engine (the only module that touches ``torch.cuda``): thin by design.

One copy stream per direction, the load stream at the device's highest priority and the backup
stream at its lowest: a load is what a request waits for, and where both copy, the GPU schedules
the load kernel's blocks before the backup's waiting ones (a backup of several GiB in flight is a
server's normal state). `submit` makes the copy stream wait for the caller's current stream (the
model's writes before a backup, earlier reads of slots before a load overwrites them), then queues
the plan's page indices (one host -> device copy from a staging buffer made once,
`runtime.transfer.index_staging`: nothing is pinned per submit) and the copy itself: Triton kernel
launches that copy page rows between the device pool and the pinned host pool directly
(`runtime.transfer.zero_copy`: the GPU reads and writes the mapped host memory; no staging, no
host-side pass). A BACKUP is one launch for every layer; a LOAD one launch per group of layers of
1, 1, 2, 4, 8, ... (`cpu_engine.layer_groups`): layer 0 is ready after a small part of the copy
and a load costs about six launches, not one per layer. One `torch.cuda.Event` is recorded after
each launch and a finish event after all; ``CopyHandle.layer_events`` gives each layer its group's
event: a model stream can ``wait_event(layer_events[i])`` before computing layer ``i``. Each
completion also carries a future that a thread per stream sets as soon as its event completes
(`runtime.transfer.event_waiter`): the completion bridge takes its callback instead of polling
the event from the loop, whose ticks are a millisecond apart.

On an H100 the kernel moves ~50 GB/s at 1- to 64-token pages, near one contiguous pinned copy
(25-36 GB/s through the transfer actor); the engine before it issued one ``cudaMemcpyAsync`` per
run of adjacent pages per layer and K/V (~16 µs each: 0.02-1.5 GB/s), and a staging version
(gather kernel, one DMA, a CPU scatter) reached 10.5-15.5 GB/s (docs/BENCHMARKS.md, "Transfer
on a GPU").
A ``fault(op_id, layer)`` hook (tests) that raises while issuing layer ``i`` fails the layers from
the first of ``i``'s group on and the finish completion with that error; earlier layers still
complete.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from runtime.errors import ConfigError, RuntimeClosed, ValidationError
from runtime.memory.pools import DevicePool, HostPool
from runtime.messages import Direction, TransferPlan
from runtime.transfer.cpu_engine import check_pool_pairs, layer_groups
from runtime.transfer.engine import CopyHandle, check_bounds, layer_count, pool_pair, resolve, row_bytes_of
from runtime.transfer.event_waiter import EventWaiter
from runtime.transfer.index_staging import IndexStaging

__all__ = ["CudaCopyEngine", "CudaEventCompletion"]


class CudaEventCompletion:
    """`Completion` over a recorded CUDA event; ``error`` set when issuing the copy failed.
    ``future``: done when the event is (`EventWaiter`), so that the completion bridge takes its
    callback instead of polling ``query()``."""

    __slots__ = ("event", "error", "future")

    def __init__(self, event: torch.cuda.Event, error: BaseException | None = None,
                 future: cf.Future | None = None) -> None:
        self.event = event
        self.error = error
        self.future = future

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
        # (lower is higher; torch maps a value past the device's range to its nearest end: loads
        # at the top of the range, backups at 0, its bottom)
        self._streams = {Direction.LOAD: torch.cuda.Stream(self._device, priority=-(1 << 10)),
                         Direction.BACKUP: torch.cuda.Stream(self._device, priority=0)}
        self._staging = IndexStaging(lambda n: torch.empty(n, dtype=torch.int64, pin_memory=True))
        self._waiters = {d: EventWaiter(f"hicache-cuda-events-{d.name.lower()}") for d in Direction}
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
        groups = [(0, num_layers)] if backup else layer_groups(num_layers)
        stream = self._streams[plan.direction]
        stream.wait_stream(torch.cuda.current_stream(self._device))
        # blocking sync: the waiter thread sleeps until the event, it does not spin
        group_events = [torch.cuda.Event(blocking=True) for _ in groups]
        finish = torch.cuda.Event(blocking=True)
        error: BaseException | None = None
        failed_at = num_layers
        copies = []
        with torch.cuda.stream(stream):
            try:
                copies = self._stage(resolved, backup, stream)
            except Exception as exc:  # noqa: BLE001
                error, failed_at = exc, 0
            for (lo, hi), event in zip(groups, group_events):
                if error is None:
                    try:
                        if self._fault is not None:
                            for layer in range(lo, hi):
                                self._fault(plan.op_id, layer)
                        for src, dst, src_pages, dst_pages in copies:
                            if lo < src.num_layers:
                                self._zc.copy_rows(src, dst, lo, min(hi, src.num_layers), src_pages, dst_pages)
                    except Exception as exc:  # noqa: BLE001 - reported through the completions
                        error, failed_at = exc, lo
                event.record(stream)
            finish.record(stream)
        with self._lock:
            for op, (ev, _) in list(self._inflight.items()):  # prune finished ops nobody queried
                if ev.query():
                    del self._inflight[op]
            self._inflight[plan.op_id] = (finish, copies)  # (the page indices live until the finish)
        waiter = self._waiters[plan.direction]
        events: list[torch.cuda.Event] = []
        layers: list[CudaEventCompletion] = []
        for (lo, hi), event in zip(groups, group_events):
            err = error if lo >= failed_at else None
            c = CudaEventCompletion(event, err, waiter.watch(event, err))  # (one per group, its layers share it)
            events += [event] * (hi - lo)
            layers += [c] * (hi - lo)
        done = waiter.watch(finish, error)
        done.add_done_callback(lambda _f, op=plan.op_id: self._forget(op))
        return CopyHandle(plan.op_id, tuple(layers), _Finish(self, plan.op_id, finish, error, done), tuple(events))

    def _stage(self, resolved: Any, backup: bool, stream: torch.cuda.Stream) -> list[tuple[Any, Any, Any, Any]]:
        """(src rows, dst rows, src pages, dst pages) per transfer, the page indices copied to the
        device on ``stream`` in one copy from a reused staging buffer (ordered before the kernels)."""
        staged = self._staging.stage([a for rt in resolved.transfers for a in (rt.src_pages, rt.dst_pages)])
        ready = None
        try:
            on_device = staged.split(staged.host.to(self._device, non_blocking=True))
            ready = torch.cuda.Event()
            ready.record(stream)
        finally:
            self._staging.release_after(staged, ready)
        copies = []
        for k, rt in enumerate(resolved.transfers):
            dev_rows, host_rows = self._rows[rt.pool]
            src, dst = (dev_rows, host_rows) if backup else (host_rows, dev_rows)
            copies.append((src, dst, on_device[2 * k], on_device[2 * k + 1]))
        return copies

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
        for w in self._waiters.values():
            w.close()
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

    def __init__(self, engine: CudaCopyEngine, op_id: int, event: torch.cuda.Event, error: BaseException | None,
                 future: cf.Future | None = None) -> None:
        super().__init__(event, error, future)
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

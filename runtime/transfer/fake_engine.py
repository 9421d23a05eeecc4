"""Fake copy engine for tests: nothing moves until the test says so.

`submit` records the operation and copies nothing. The test then calls
``release(op_id, layers=None)`` (copy and complete every remaining layer, or the layers up
to and including layer index ``layers``; each layer's data is copied *before* its completion is marked)
or ``fail(op_id, exc)`` (every remaining completion raises ``exc``). ``pending()`` lists
the op ids in flight. With ``auto_release=True`` every submit copies and completes at
once (the conformance suite runs it like a real engine).

Completions mimic CUDA events: ``query()`` never blocks; ``synchronize()`` blocks on a
`threading.Event` until the layer is released or failed, so it is only for a *different*
thread than the one that will release (the completion bridge never calls it before
``query()`` is true). Every layer has its own completion, for BACKUP too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from runtime.errors import RuntimeClosed, StateError, ValidationError
from runtime.memory.pools import DevicePool, HostPool
from runtime.messages import Direction, TransferPlan
from runtime.transfer.cpu_engine import check_pool_pairs
from runtime.transfer.engine import (
    CopyHandle,
    ResolvedPlan,
    check_bounds,
    copy_layers,
    layer_count,
    pool_pair,
    resolve,
)
from runtime.transfer.row_kernel import RowView

__all__ = ["FakeCopyEngine", "FakeCompletion"]


class FakeCompletion:
    """A completion the test finishes by hand: ``query()`` non-blocking, ``synchronize()`` blocks."""

    __slots__ = ("_event", "_error")

    def __init__(self) -> None:
        self._event = threading.Event()
        self._error: BaseException | None = None

    def query(self) -> bool:
        return self._event.is_set()

    def synchronize(self, timeout: float | None = None) -> None:
        if not self._event.wait(timeout):
            raise TimeoutError("fake completion not released")
        if self._error is not None:
            raise self._error

    def _complete(self, error: BaseException | None = None) -> None:
        if not self._event.is_set():
            self._error = error
            self._event.set()


@dataclass(eq=False)
class _FakeOp:
    resolved: ResolvedPlan
    layers: tuple[FakeCompletion, ...]
    done: FakeCompletion
    jobs: list = field(default_factory=list)
    next_layer: int = 0


class FakeCopyEngine:
    def __init__(
        self,
        pools: Mapping[str, tuple[DevicePool, HostPool]],
        *,
        auto_release: bool = False,
        fault: Callable[[int, int], None] | None = None,
    ) -> None:
        check_pool_pairs(pools)
        self._pools = dict(pools)
        self._rows = {name: (RowView(d.page_rows()), RowView(h.page_rows())) for name, (d, h) in self._pools.items()}
        self._page_sizes = {name: d.page_size for name, (d, _) in self._pools.items()}
        self.auto_release = auto_release
        self._fault = fault
        self._ops: dict[int, _FakeOp] = {}
        self._cond = threading.Condition()
        self._closed = False
        self.submitted: list[TransferPlan] = []  # every plan, in submit order (tests inspect it)

    def submit(self, plan: TransferPlan) -> CopyHandle:
        resolved = resolve(plan, self._page_sizes)
        jobs = []
        for rt in resolved.transfers:
            device, host = pool_pair(self._pools, rt.pool)
            src, dst = (device, host) if plan.direction is Direction.BACKUP else (host, device)
            check_bounds(rt, src.num_pages, dst.num_pages)
            dev_rows, host_rows = self._rows[rt.pool]
            src_rows, dst_rows = (dev_rows, host_rows) if plan.direction is Direction.BACKUP else (host_rows, dev_rows)
            jobs.append((src_rows, dst_rows, rt.src_pages, rt.dst_pages))
        n = layer_count(self._pools, resolved)
        op = _FakeOp(resolved, tuple(FakeCompletion() for _ in range(n)), FakeCompletion(), jobs)
        with self._cond:
            if self._closed:
                raise RuntimeClosed("copy engine is closed")
            if plan.op_id in self._ops:
                raise ValidationError(f"op {plan.op_id} is already in flight")
            self._ops[plan.op_id] = op
            self.submitted.append(plan)
        handle = CopyHandle(plan.op_id, op.layers, op.done, None)
        if self.auto_release:
            try:
                self.release(plan.op_id)
            except Exception:
                pass  # the failure is in the completions
        return handle

    def pending(self, direction: Direction | None = None) -> list[int]:
        """Op ids in flight, in submit order (only those of `direction` if given)."""
        with self._cond:
            return [op_id for op_id, op in self._ops.items() if direction is None or op.resolved.direction is direction]

    def release(self, op_id: int, layers: int | None = None) -> None:
        """Copy then complete the remaining layers up to layer index ``layers`` (inclusive; None = all).

        A ``fault`` hook that raises fails this layer and the rest (and re-raises here).
        """
        op = self._op(op_id)
        n = len(op.layers)
        last = n - 1 if layers is None else min(int(layers), n - 1)
        while op.next_layer <= last:
            layer = op.next_layer
            try:
                if self._fault is not None:
                    self._fault(op_id, layer)
                for src_rows, dst_rows, src_pages, dst_pages in op.jobs:
                    copy_layers(src_rows, dst_rows, slice(layer, layer + 1), src_pages, dst_pages)
            except Exception as exc:
                self.fail(op_id, exc)
                raise
            op.next_layer += 1
            op.layers[layer]._complete()
        if op.next_layer == n:
            op.done._complete()
            self._finish(op_id)

    def fail(self, op_id: int, exc: BaseException) -> None:
        """Every completion not yet released raises ``exc``."""
        op = self._op(op_id)
        for c in op.layers[op.next_layer :]:
            c._complete(exc)
        op.next_layer = len(op.layers)
        op.done._complete(exc)
        self._finish(op_id)

    def close(self, timeout: float | None = None) -> None:
        """Stop intake and wait until every op is released or failed (by another thread)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._closed = True
            while self._ops:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"fake engine close: ops still pending {list(self._ops)}")
                self._cond.wait(left)

    def _op(self, op_id: int) -> _FakeOp:
        with self._cond:
            op = self._ops.get(op_id)
        if op is None:
            raise StateError(f"op {op_id} is not pending")
        return op

    def _finish(self, op_id: int) -> None:
        with self._cond:
            self._ops.pop(op_id, None)
            self._cond.notify_all()

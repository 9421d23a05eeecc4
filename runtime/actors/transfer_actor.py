"""TransferActor: owns the copy engine, the completion bridge, the copies and storage calls in flight.

It allocates and frees nothing and never touches a ledger: the requester pinned the
plan's slots when it issued the plan and unpins them when it applies the ack. Every
completion (CUDA event, worker future, fake event) becomes an awaitable through the
bridge; per-layer completions of a load resolve the plan's `LayerReadiness` as they
arrive, and the op's ack goes back to the requester's mailbox without blocking (acks
are internal sends), in issue order per direction.

Two parts own the state, each written only by itself: `CopyQueue` (copies waiting, in the
engine and finished, per direction) and `StorageCalls` (`runtime/actors/storage_calls.py`: the
storage backend's calls in worker threads). Every completion comes back as a message into this
actor's mailbox: `CopyDone` from the bridge, `StorageDone` / `StorageDeadline` / `StorageRemoved`
from the storage workers and timers.

Back-pressure: at most `max_inflight_loads` loads and `max_queued_backups` backups are
in the engine at once; more wait in the queue (never fail).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from runtime.actors.base import DEFERRED, Actor, Reply
from runtime.actors.storage_calls import StorageCalls
from runtime.completion import CompletionBridge, as_transfer_error
from runtime.errors import RuntimeClosed, TransferError
from runtime.messages import (
    CopyDone,
    Direction,
    DrainTransfer,
    RemoveStoragePages,
    SetStorageBackend,
    StorageDeadline,
    StorageDone,
    StorageProbe,
    StorageRemoved,
    StorageWatch,
    SubmitCopy,
    SubmitStorage,
    TransferAck,
    TransferMessage,
    TransferStats,
)
from runtime.stats import LatencyHistogram
from runtime.storage.integrity import PageSeal
from runtime.trace import get_logger
from runtime.transfer.engine import CopyEngine, merged_plan
from runtime.transfer.state_io import StateBlobIO

log = get_logger("hicache.transfer")


@dataclass(slots=True)
class _InFlight:
    submit: SubmitCopy
    done: bool = False
    error: str | None = None
    started: float = 0.0  # perf_counter() when the engine took it (latency histogram)


# Backups coalesced into one engine submission at most: each one's ack waits for the whole
# submission, and a caller refused for capacity waits for the acks of the write-backs it started.
BACKUPS_PER_SUBMISSION = 8


class CopyQueue:
    """The copies of both directions: waiting for room in the engine, in it, finished and not
    acked yet (acks leave in issue order per direction)."""

    def __init__(self, max_inflight_loads: int, max_queued_backups: int, coalesce_backups: bool) -> None:
        self.limits = {Direction.LOAD: max_inflight_loads, Direction.BACKUP: max_queued_backups}
        self.waiting: dict[Direction, deque[SubmitCopy]] = {d: deque() for d in Direction}
        self.inflight: dict[int, _InFlight] = {}
        self.issue_order: dict[Direction, deque[int]] = {d: deque() for d in Direction}
        self.running = {d: 0 for d in Direction}
        self.to_pump: set[Direction] = set()  # directions with copies queued in this burst
        # an engine that copies several backups as one submission (one hand-off to its copy
        # thread, one completion): a burst's backups start together, each still acked alone
        self.coalesce_backups = coalesce_backups

    def add(self, msg: SubmitCopy) -> None:
        direction = msg.plan.direction
        self.waiting[direction].append(msg)
        self.issue_order[direction].append(msg.plan.op_id)
        self.inflight[msg.plan.op_id] = _InFlight(msg)
        self.to_pump.add(direction)  # at the burst's end, with the rest of the burst's copies

    def finished(self, msg: CopyDone) -> _InFlight:
        entry = self.inflight[msg.op_id]
        entry.done, entry.error = True, msg.error
        direction = entry.submit.plan.direction
        self.running[direction] -= 1
        self.to_pump.add(direction)
        return entry

    def startable(self) -> list[list[SubmitCopy]]:
        """The groups to start now (loads first: requests wait on them), each one engine
        submission; counted running from here on."""
        groups: list[list[SubmitCopy]] = []
        for direction in (Direction.LOAD, Direction.BACKUP):
            if direction not in self.to_pump:
                continue
            queue = self.waiting[direction]
            limit = self.limits[direction]
            while queue and self.running[direction] < limit:
                n = min(len(queue), limit - self.running[direction], BACKUPS_PER_SUBMISSION)
                if n > 1 and direction is Direction.BACKUP and self.coalesce_backups:
                    group = [queue.popleft() for _ in range(n)]
                else:
                    group = [queue.popleft()]
                self.running[direction] += len(group)
                groups.append(group)
        self.to_pump.clear()
        return groups

    def acked(self, direction: Direction) -> list[_InFlight]:
        """The finished copies whose acks may leave now (every earlier one's did), in order."""
        order = self.issue_order[direction]
        out = []
        while order and self.inflight[order[0]].done:
            out.append(self.inflight.pop(order.popleft()))
        return out

    def abandon_waiting(self) -> None:
        """Stopping with copies still queued (close drains first, so normally none): they will
        never start; fail their readiness so that no waiter hangs."""
        for queue in self.waiting.values():
            while queue:
                submit = queue.popleft()
                if submit.readiness is not None:
                    submit.readiness.fail_all(TransferError(
                        f"copy {submit.plan.op_id} never started: the transfer actor stopped"))

    def stats(self) -> dict[str, int]:
        return {"inflight_loads": self.running[Direction.LOAD], "inflight_backups": self.running[Direction.BACKUP],
                "queued_loads": len(self.waiting[Direction.LOAD]), "queued_backups": len(self.waiting[Direction.BACKUP])}


class TransferActor(Actor[TransferMessage]):
    name = "transfer"

    # -- state -------------------------------------------------------------------
    def __init__(self, engine: CopyEngine, *, max_inflight_loads: int, max_queued_backups: int,
                 mailbox_capacity: int, bytes_per_slot: int = 0, storage: Any = None,
                 host_pool: Any = None, storage_timeout_s: float = 5.0,
                 pool_slot_bytes: dict[str, int] | None = None, rank_host_pools: Sequence[Any] = (),
                 state_io: StateBlobIO | None = None, seal: PageSeal | None = None,
                 storage_max_inflight_ops: int = 4, storage_max_overdue_pages: int | None = None) -> None:
        """`bytes_per_slot`: a KV slot's bytes (a token's); `pool_slot_bytes`: a slot's bytes in the
        plan's other pools (a recurrent state's components), for the byte counters;
        `rank_host_pools`: under one control plane over tensor-parallel ranks, every rank's host
        pool (rank 0's is `host_pool`), each rank's storage I/O its own (`SubmitStorage.rank_keys`);
        `state_io`: a hybrid model's host state pool as storage ops write and read its snapshots;
        `seal`: the page tags written with every page and checked on every page read (one per
        runtime: its count of refused pages outlives a detach / attach of the backend)."""
        super().__init__(mailbox_capacity)
        self.engine = engine
        self.bridge: CompletionBridge | None = None  # (started with the actor's task)
        self.copies = CopyQueue(max_inflight_loads, max_queued_backups,
                                getattr(engine, "coalesce_backups", False) is True)
        self.storage = StorageCalls(self._post, backend=storage, host_pool=host_pool, bytes_per_slot=bytes_per_slot,
                                    timeout_s=storage_timeout_s, rank_host_pools=rank_host_pools, state_io=state_io,
                                    seal=seal, max_inflight=storage_max_inflight_ops,
                                    max_overdue_pages=storage_max_overdue_pages)
        self.drain_waiters: list[Reply[None]] = []
        self.pool_slot_bytes = {"kv": bytes_per_slot, **(pool_slot_bytes or {})}
        self._counts = {"ops_done": 0, "ops_failed": 0, "bytes_device_to_host": 0, "bytes_host_to_device": 0}
        # latency per direction, observed where a copy completes (stats() and metrics read them)
        self.latency = {"load_seconds": LatencyHistogram(), "backup_seconds": LatencyHistogram()}
        self.handlers = {
            SubmitCopy: self.on_submit,
            CopyDone: self.on_copy_done,
            DrainTransfer: self.on_drain,
            TransferStats: self.on_stats,
            # the storage calls' own (a drain waiting is answered after the burst, `after_burst`)
            SubmitStorage: self.storage.submit,
            StorageDone: self.storage.done,
            StorageDeadline: self.storage.deadline,
            StorageProbe: self.storage.probe,
            StorageWatch: self.storage.watch,
            StorageRemoved: self.storage.removed,
            RemoveStoragePages: self.storage.remove,
            SetStorageBackend: self.on_set_storage,
        }

    @property
    def counters(self) -> dict[str, int]:
        """Copy and storage counters (a snapshot)."""
        return {**self._counts, **self.storage.counters}

    def started(self) -> None:
        self.bridge = CompletionBridge().start()
        self.storage.register()

    async def stopping(self) -> None:
        assert self.bridge is not None
        self.storage.stop()
        self.copies.abandon_waiting()
        await self.bridge.aclose()
        await asyncio.to_thread(self.engine.close)

    def _post(self, msg: Any) -> None:
        """On the loop thread: a completion into this actor's mailbox (a storage worker's, a timer's)."""
        try:
            self.mailbox.put_internal(msg)
        except RuntimeClosed:  # stopped: its op was abandoned at the stop
            self.storage.returned_after_stop(msg)

    # -- copies ------------------------------------------------------------------
    def on_submit(self, msg: SubmitCopy) -> None:
        self.copies.add(msg)

    def on_copy_done(self, msg: CopyDone) -> None:
        entry = self.copies.finished(msg)
        direction = entry.submit.plan.direction
        self.latency["load_seconds" if direction is Direction.LOAD else "backup_seconds"].observe(
            time.perf_counter() - entry.started)
        self._flush_acks(direction)

    def after_burst(self) -> None:
        if self.copies.to_pump:
            for group in self.copies.startable():
                self._start(group)
        if self.drain_waiters:  # (whatever the burst settled: copies, storage ops, removals)
            self._maybe_drained()

    def _start(self, group: list[SubmitCopy]) -> None:
        """Start one copy, or several backups as one engine submission (their pages concatenated
        under the first op id); each op is acked alone, in issue order, with the submission's
        outcome. Only a lone copy has a readiness (a load)."""
        assert self.bridge is not None
        first = group[0]
        ids = tuple(submit.plan.op_id for submit in group)
        plan = first.plan if len(group) == 1 else merged_plan(ids[0], [submit.plan for submit in group])
        started = time.perf_counter()
        inflight = self.copies.inflight
        for op_id in ids:
            inflight[op_id].started = started
        log.debug("copy_start", op=ids[0], direction=plan.direction.value, ops=len(ids))
        try:
            handle = self.engine.submit(plan)
        except Exception as exc:  # noqa: BLE001 - an engine that refuses a plan is a failed copy
            for op_id in ids:
                self.mailbox.put_internal(CopyDone(op_id, repr(exc)))
            if first.readiness is not None:
                first.readiness.fail_all(as_transfer_error(exc))
            return
        if first.readiness is not None:
            first.readiness.bind(self.bridge, handle)
        done = self.bridge.watch(handle.done)
        done.add_done_callback(lambda fut, ids=ids: self._on_done_future(ids, fut))

    def _on_done_future(self, ids: tuple[int, ...], fut: asyncio.Future[None]) -> None:
        if fut.cancelled():
            error: str | None = "cancelled"
        else:
            exc = fut.exception()
            error = None if exc is None else repr(exc.__cause__ or exc)
        try:
            for op_id in ids:
                self.mailbox.put_internal(CopyDone(op_id, error))
        except Exception:  # noqa: BLE001 - mailbox aborted: the runtime already failed
            pass

    def _flush_acks(self, direction: Direction) -> None:
        counts = self._counts
        for entry in self.copies.acked(direction):
            plan = entry.submit.plan
            if entry.error is None:
                counts["ops_done"] += 1
                key = "bytes_device_to_host" if direction is Direction.BACKUP else "bytes_host_to_device"
                # every rank runs the plan on its own pools (one control plane): every rank's bytes
                moved = sum(t.src.numel() * self.pool_slot_bytes.get(t.pool, 0) for t in plan.transfers)
                counts[key] += max(1, len(self.storage.rank_pools)) * moved
            else:
                counts["ops_failed"] += 1
                log.warning("copy_failed", op=plan.op_id, direction=direction.value, error=entry.error)
            try:
                entry.submit.ack_to.put_internal(TransferAck(plan.op_id, direction, entry.error))
            except RuntimeClosed:  # the requester stopped first (close without a drain): nobody to ack
                log.warning("ack_undeliverable", op=plan.op_id, direction=direction.value)

    # -- storage -------------------------------------------------------------------
    # storage controls (sent by the tree actor once no storage op is in flight)
    def on_set_storage(self, msg: SetStorageBackend) -> Any:
        """Attach (a backend) or detach (None) the storage backend; replies with the previous one."""
        return self.storage.set_backend(msg.backend, running=self.bridge is not None)

    # -- drains and stats ------------------------------------------------------------
    def on_drain(self, msg: DrainTransfer) -> Any:
        if msg.reply is not None:
            self.drain_waiters.append(msg.reply)
        self._maybe_drained()
        return DEFERRED

    def on_stats(self, msg: TransferStats) -> dict[str, Any]:
        return {**self._counts, **self.copies.stats(), "mailbox_depth": self.mailbox.depth, **self.storage.stats(),
                **{name: hist.snapshot() for name, hist in self.latency.items()}}

    def _maybe_drained(self) -> None:
        if self.drain_waiters and not self.copies.inflight and self.storage.settled():
            for reply in self.drain_waiters:
                reply.set_result(None)
            self.drain_waiters.clear()

"""TransferActor: owns the copy engine, the completion bridge and the in-flight copies.

It allocates and frees nothing and never touches a ledger: the requester pinned the
plan's slots when it issued the plan and unpins them when it applies the ack. Every
completion (CUDA event, worker future, fake event) becomes an awaitable through the
bridge; per-layer completions of a load resolve the plan's `LayerReadiness` as they
arrive, and the op's ack goes back to the requester's mailbox without blocking (acks
are internal sends), in issue order per direction.

Back-pressure: at most `max_inflight_loads` loads and `max_queued_backups` backups are
in the engine at once; more wait in this actor's queues (never fail).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from runtime.actors.base import DEFERRED, Actor, Mailbox, Reply
from runtime.completion import CompletionBridge, LayerReadiness, as_transfer_error
from runtime.errors import RuntimeClosed, TransferError
from runtime.messages import Direction, TransferAck, TransferPlan
from runtime.trace import get_logger
from runtime.transfer.engine import CopyEngine

log = get_logger("hicache.transfer")


@dataclass(frozen=True, slots=True)
class SubmitCopy:
    """Run `plan`; ack to `ack_to`. A load's `readiness` resolves layer by layer."""

    plan: TransferPlan
    ack_to: Mailbox[Any]
    readiness: LayerReadiness | None = None
    reply: None = None


@dataclass(frozen=True, slots=True)
class DrainCopies:
    """Reply once nothing is queued or in flight (used by close)."""

    reply: Reply[None] | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class TransferStatsQuery:
    reply: Reply[dict[str, int]] | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class _CopyDone:
    op_id: int
    error: str | None
    reply: None = None


TransferMessage = SubmitCopy | DrainCopies | TransferStatsQuery | _CopyDone


@dataclass(slots=True)
class _InFlight:
    submit: SubmitCopy
    done: bool = False
    error: str | None = None


class TransferActor(Actor[TransferMessage]):
    name = "transfer"

    # -- state -------------------------------------------------------------------
    def __init__(self, engine: CopyEngine, *, max_inflight_loads: int, max_queued_backups: int,
                 mailbox_capacity: int, bytes_per_slot: int = 0) -> None:
        super().__init__(mailbox_capacity)
        self.engine = engine
        self.bridge: CompletionBridge | None = None
        self.limits = {Direction.LOAD: max_inflight_loads, Direction.BACKUP: max_queued_backups}
        self.waiting: dict[Direction, deque[SubmitCopy]] = {d: deque() for d in Direction}
        self.inflight: dict[int, _InFlight] = {}
        self.issue_order: dict[Direction, deque[int]] = {d: deque() for d in Direction}
        self.running = {d: 0 for d in Direction}
        self.drain_waiters: list[Reply[None]] = []
        self.bytes_per_slot = bytes_per_slot
        self.counters = {"ops_done": 0, "ops_failed": 0, "bytes_device_to_host": 0, "bytes_host_to_device": 0}
        self.handlers = {
            SubmitCopy: self.on_submit,
            _CopyDone: self.on_copy_done,
            DrainCopies: self.on_drain,
            TransferStatsQuery: self.on_stats,
        }

    async def run(self) -> None:
        self.bridge = CompletionBridge().start()
        try:
            await super().run()
        finally:
            self._abandon_queued()
            await self.bridge.aclose()
            await asyncio.to_thread(self.engine.close)

    # -- handlers ----------------------------------------------------------------
    def on_submit(self, msg: SubmitCopy) -> None:
        direction = msg.plan.direction
        self.waiting[direction].append(msg)
        self.issue_order[direction].append(msg.plan.op_id)
        self.inflight[msg.plan.op_id] = _InFlight(msg)
        self._pump(direction)

    def on_copy_done(self, msg: _CopyDone) -> None:
        entry = self.inflight[msg.op_id]
        entry.done, entry.error = True, msg.error
        direction = entry.submit.plan.direction
        self.running[direction] -= 1
        self._flush_acks(direction)
        self._pump(direction)
        self._maybe_drained()

    def on_drain(self, msg: DrainCopies) -> Any:
        if msg.reply is not None:
            self.drain_waiters.append(msg.reply)
        self._maybe_drained()
        return DEFERRED

    def on_stats(self, msg: TransferStatsQuery) -> dict[str, int]:
        return {
            **self.counters,
            "inflight_loads": self.running[Direction.LOAD],
            "inflight_backups": self.running[Direction.BACKUP],
            "queued_loads": len(self.waiting[Direction.LOAD]),
            "queued_backups": len(self.waiting[Direction.BACKUP]),
            "mailbox_depth": self.mailbox.depth,
        }

    # -- helpers -----------------------------------------------------------------
    def _pump(self, direction: Direction) -> None:
        queue = self.waiting[direction]
        while queue and self.running[direction] < self.limits[direction]:
            self._start(queue.popleft())

    def _start(self, submit: SubmitCopy) -> None:
        assert self.bridge is not None
        plan = submit.plan
        self.running[plan.direction] += 1
        log.debug("copy_start", op=plan.op_id, direction=plan.direction.value, slots=plan.num_slots)
        try:
            handle = self.engine.submit(plan)
        except Exception as exc:  # noqa: BLE001 - an engine that refuses a plan is a failed copy
            self.mailbox.put_internal(_CopyDone(plan.op_id, repr(exc)))
            if submit.readiness is not None:
                submit.readiness.fail_all(as_transfer_error(exc))
            return
        if submit.readiness is not None:
            submit.readiness.bind(self.bridge, handle)
        done = self.bridge.watch(handle.done)
        done.add_done_callback(lambda fut, op_id=plan.op_id: self._on_done_future(op_id, fut))

    def _on_done_future(self, op_id: int, fut: asyncio.Future[None]) -> None:
        if fut.cancelled():
            error: str | None = "cancelled"
        else:
            exc = fut.exception()
            error = None if exc is None else repr(exc.__cause__ or exc)
        try:
            self.mailbox.put_internal(_CopyDone(op_id, error))
        except Exception:  # noqa: BLE001 - mailbox aborted: the runtime already failed
            pass

    def _flush_acks(self, direction: Direction) -> None:
        order = self.issue_order[direction]
        while order and self.inflight[order[0]].done:
            entry = self.inflight.pop(order.popleft())
            plan = entry.submit.plan
            if entry.error is None:
                self.counters["ops_done"] += 1
                key = "bytes_device_to_host" if direction is Direction.BACKUP else "bytes_host_to_device"
                self.counters[key] += plan.num_slots * self.bytes_per_slot
            else:
                self.counters["ops_failed"] += 1
                log.warning("copy_failed", op=plan.op_id, direction=direction.value, error=entry.error)
            try:
                entry.submit.ack_to.put_internal(TransferAck(plan.op_id, direction, entry.error))
            except RuntimeClosed:  # the requester stopped first (close without a drain): nobody to ack
                log.warning("ack_undeliverable", op=plan.op_id, direction=direction.value)

    def _abandon_queued(self) -> None:
        """Stopping with copies still queued (close drains first, so normally none): they will
        never start; fail their readiness so that no waiter hangs."""
        for queue in self.waiting.values():
            while queue:
                submit = queue.popleft()
                if submit.readiness is not None:
                    submit.readiness.fail_all(TransferError(
                        f"copy {submit.plan.op_id} never started: the transfer actor stopped"))

    def _maybe_drained(self) -> None:
        if self.drain_waiters and not self.inflight:
            for reply in self.drain_waiters:
                reply.set_result(None)
            self.drain_waiters.clear()

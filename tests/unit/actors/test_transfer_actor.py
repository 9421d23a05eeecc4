"""TransferActor with a small requester actor that keeps its own ledgers (issue 3, item 4).

The requester pins an op's source and destination slots when it issues the op and unpins
them when it applies the op's ack; a failed copy rolls back (destination freed, nothing
marked as loaded / backed up). The transfer actor never touches a ledger. Copies run on
the fake engine, so every test holds them in flight as long as it needs and completes
them in any order, layer by layer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from runtime.actors.base import Actor, Mailbox, Reply
from runtime.actors.transfer_actor import DrainCopies, SubmitCopy, TransferActor, TransferStatsQuery
from runtime.completion import LayerReadiness
from runtime.errors import TransferError
from runtime.memory.ledger import SlotLedger
from runtime.memory.owners import Owner, Tier
from runtime.memory.pools import DevicePool, HostPool, KVShape
from runtime.messages import Direction, PoolTransfer, TransferAck, TransferPlan
from runtime.supervisor import State, Supervisor
from runtime.transfer.fake_engine import FakeCopyEngine

SHAPE = KVShape(num_layers=4, num_kv_heads=2, head_dim=4, dtype=torch.float32)
PS = 2
DEV_PAGES = 48
HOST_PAGES = 48
RESIDENT = 12  # pages of data each tier holds before the test starts (copy sources)
DATA = Owner.node(0)


# ---------------------------------------------------------------------------------------
# the requester
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Issue:
    """Copy the pages holding `src` (slots on the source tier) to newly allocated pages."""

    direction: Direction
    src: np.ndarray
    corrupt: bool = False  # send a plan the engine refuses (destination out of range)
    reply: Reply[Issued] | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class Issued:
    op_id: int
    src: np.ndarray
    dst: np.ndarray
    readiness: LayerReadiness | None


@dataclass(slots=True)
class _Op:
    direction: Direction
    src: np.ndarray
    dst: np.ndarray
    owner: Owner


class Requester(Actor[Any]):
    """A stand-in for the tree actor: owns both ledgers, pins at issue, unpins at ack."""

    name = "requester"

    def __init__(self, transfer: Mailbox[Any], engine: FakeCopyEngine) -> None:
        super().__init__(64)
        self.transfer = transfer
        self.engine = engine
        self.ledgers = {
            Tier.DEVICE: SlotLedger(DEV_PAGES * PS, PS, Tier.DEVICE),
            Tier.HOST: SlotLedger(HOST_PAGES * PS, PS, Tier.HOST),
        }
        self.resident = {tier: led.alloc(RESIDENT, DATA) for tier, led in self.ledgers.items()}
        self.ops: dict[int, _Op] = {}
        self.next_op = 1
        self.acks: list[TransferAck] = []
        self.loaded: dict[int, np.ndarray] = {}  # op -> device slots holding loaded data
        self.backed_up: dict[int, np.ndarray] = {}  # op -> host slots holding backed-up data
        self.rolled_back: list[int] = []
        self.ack_while_in_engine: list[int] = []  # an ack must never arrive before its copy ends
        self.on_ack: Callable[[TransferAck], None] | None = None
        self.handlers = {Issue: self.on_issue, TransferAck: self.on_ack_msg}

    @staticmethod
    def tiers(direction: Direction) -> tuple[Tier, Tier]:
        return (Tier.DEVICE, Tier.HOST) if direction is Direction.BACKUP else (Tier.HOST, Tier.DEVICE)

    def on_issue(self, msg: Issue) -> Issued:
        src_tier, dst_tier = self.tiers(msg.direction)
        op_id, self.next_op = self.next_op, self.next_op + 1
        owner = Owner.node(op_id)
        src = np.asarray(msg.src, dtype=np.int64).copy()
        dst = self.ledgers[dst_tier].alloc(len(src) // PS, owner)
        self.ledgers[src_tier].pin(src, op_id)
        self.ledgers[dst_tier].pin(dst, op_id)
        self.ops[op_id] = _Op(msg.direction, src, dst, owner)
        plan_dst = dst + (10_000 * PS if msg.corrupt else 0)
        plan = TransferPlan(op_id, msg.direction, (PoolTransfer("kv", torch.tensor(src), torch.tensor(plan_dst)),))
        readiness = LayerReadiness.pending(SHAPE.num_layers, op_id) if msg.direction is Direction.LOAD else None
        self.transfer.put_internal(SubmitCopy(plan, self.mailbox, readiness))
        return Issued(op_id, src, dst.copy(), readiness)

    def on_ack_msg(self, ack: TransferAck) -> None:
        if ack.op_id in self.engine.pending():
            self.ack_while_in_engine.append(ack.op_id)
        op = self.ops.pop(ack.op_id)
        src_tier, dst_tier = self.tiers(op.direction)
        self.ledgers[src_tier].unpin(op.src, ack.op_id)
        self.ledgers[dst_tier].unpin(op.dst, ack.op_id)
        if ack.error is not None:
            self.ledgers[dst_tier].free(op.dst, op.owner)  # roll back: the destination never became valid
            self.rolled_back.append(ack.op_id)
        elif op.direction is Direction.LOAD:
            self.loaded[ack.op_id] = op.dst
        else:
            self.backed_up[ack.op_id] = op.dst
        self.acks.append(ack)
        if self.on_ack is not None:
            self.on_ack(ack)

    # -- test helpers ------------------------------------------------------------------
    def pins(self, tier: Tier, slots: np.ndarray) -> list[int]:
        return [self.ledgers[tier].pin_count(int(s)) for s in slots[::PS]]

    def total_pins(self) -> int:
        return sum(int(led.snapshot().pins.sum()) for led in self.ledgers.values())

    def ack_ids(self, direction: Direction) -> list[int]:
        return [a.op_id for a in self.acks if a.direction is direction]


@dataclass
class Harness:
    sup: Supervisor
    req: Requester
    transfer: TransferActor
    engine: FakeCopyEngine
    dev: DevicePool
    host: HostPool

    async def issue(self, direction: Direction, pages: int = 2, start: int = 0, corrupt: bool = False) -> Issued:
        src_tier = Tier.DEVICE if direction is Direction.BACKUP else Tier.HOST
        src = self.req.resident[src_tier][start * PS:(start + pages) * PS]
        return await self.sup.ask(self.req.mailbox, Issue(direction, src, corrupt, Reply()))

    async def stats(self) -> dict[str, int]:
        return await self.sup.ask(self.transfer.mailbox, TransferStatsQuery(Reply()))

    async def drain(self) -> None:
        await self.sup.ask_internal(self.transfer.mailbox, DrainCopies(Reply()))


async def until(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.001)


async def idle(turns: int = 30) -> None:
    """Give the actors and the completion poller time to act (and to do what they must not)."""
    for _ in range(turns):
        await asyncio.sleep(0.001)


@asynccontextmanager
async def harness(*, max_inflight_loads: int = 3, max_queued_backups: int = 8, layout: str = "layer_first",
                  fault: Callable[[int, int], None] | None = None, check_pins: bool = True) -> AsyncIterator[Harness]:
    dev = DevicePool(SHAPE, DEV_PAGES * PS, PS)
    host = HostPool(SHAPE, HOST_PAGES * PS, PS, layout, pin_memory=False)
    gen = torch.Generator().manual_seed(3)
    host.buffer.copy_(torch.randn(host.buffer.shape, generator=gen))
    dev.buffer[:, :, : RESIDENT * PS].copy_(torch.randn(dev.buffer[:, :, : RESIDENT * PS].shape, generator=gen))
    engine = FakeCopyEngine({"kv": (dev, host)}, fault=fault)
    transfer = TransferActor(engine, max_inflight_loads=max_inflight_loads, max_queued_backups=max_queued_backups,
                             mailbox_capacity=64, bytes_per_slot=SHAPE.bytes_per_token)
    req = Requester(transfer.mailbox, engine)
    sup = Supervisor([req, transfer])
    await sup.start()
    h = Harness(sup, req, transfer, engine, dev, host)
    try:
        yield h
    finally:
        if sup.state is State.OPEN:
            draining = asyncio.ensure_future(h.drain())
            while not draining.done():
                for op_id in engine.pending():
                    engine.release(op_id)
                await asyncio.sleep(0.001)
            await draining
        await sup.stop()
    sup.raise_if_failed()
    assert not req.ack_while_in_engine, req.ack_while_in_engine
    if check_pins:
        assert req.total_pins() == 0 and not req.ops


def layer_of(pool: DevicePool | HostPool, slots: np.ndarray, layer: int) -> torch.Tensor:
    return pool.read_slots(slots)[layer]


# ---------------------------------------------------------------------------------------
# ordering
# ---------------------------------------------------------------------------------------


async def test_acks_follow_issue_order_per_direction_when_completions_are_reversed():
    async with harness(max_inflight_loads=3, max_queued_backups=3) as h:
        loads = [await h.issue(Direction.LOAD, 2, start=2 * i) for i in range(3)]
        backups = [await h.issue(Direction.BACKUP, 2, start=2 * i) for i in range(3)]
        await until(lambda: len(h.engine.pending()) == 6)

        # loads finish last-issued first; the middle one fails
        h.engine.release(loads[2].op_id)
        await loads[2].readiness.wait_all()  # its data is usable at once ...
        assert torch.equal(layer_of(h.dev, loads[2].dst, 3), layer_of(h.host, loads[2].src, 3))
        h.engine.fail(loads[1].op_id, RuntimeError("dma error"))
        with pytest.raises(TransferError):
            await loads[1].readiness.wait(0)
        await idle()
        assert h.req.ack_ids(Direction.LOAD) == []  # ... but its ack waits for the earlier loads
        assert h.req.pins(Tier.DEVICE, loads[2].dst) == [1] * 2  # still pinned until the ack

        # backups complete in reverse too, independent of the loads
        for b in reversed(backups):
            h.engine.release(b.op_id)
        await until(lambda: len(h.req.ack_ids(Direction.BACKUP)) == 3)
        assert h.req.ack_ids(Direction.BACKUP) == [b.op_id for b in backups]
        assert h.req.ack_ids(Direction.LOAD) == []

        h.engine.release(loads[0].op_id)
        await until(lambda: len(h.req.ack_ids(Direction.LOAD)) == 3)
        assert h.req.ack_ids(Direction.LOAD) == [ld.op_id for ld in loads]
        assert [a.ok for a in h.req.acks if a.direction is Direction.LOAD] == [True, False, True]
        assert h.req.rolled_back == [loads[1].op_id]
        assert set(h.req.loaded) == {loads[0].op_id, loads[2].op_id}
        assert h.req.total_pins() == 0
        st = await h.stats()
        assert st["ops_done"] == 5 and st["ops_failed"] == 1
        assert st["bytes_host_to_device"] == 2 * 2 * PS * SHAPE.bytes_per_token
        assert st["bytes_device_to_host"] == 3 * 2 * PS * SHAPE.bytes_per_token


# ---------------------------------------------------------------------------------------
# back-pressure
# ---------------------------------------------------------------------------------------


async def test_fourth_load_waits_for_a_slot_instead_of_failing():
    async with harness(max_inflight_loads=3) as h:
        loads = [await h.issue(Direction.LOAD, 1, start=i) for i in range(4)]
        await until(lambda: len(h.engine.pending()) == 3)
        await idle()
        assert [p.op_id for p in h.engine.submitted] == [ld.op_id for ld in loads[:3]]
        st = await h.stats()
        assert (st["inflight_loads"], st["queued_loads"]) == (3, 1)
        assert not loads[3].readiness.done()  # waiting, not failed
        assert h.req.pins(Tier.DEVICE, loads[3].dst) == [1]  # the requester pinned it at issue

        # a backup is not held up by full load slots
        b = await h.issue(Direction.BACKUP, 1)
        await until(lambda: b.op_id in h.engine.pending())

        h.engine.release(loads[1].op_id)  # completion (not the ack, still behind op 1) frees a slot
        await until(lambda: loads[3].op_id in h.engine.pending())
        st = await h.stats()
        assert (st["inflight_loads"], st["queued_loads"]) == (3, 0)
        for ld in (loads[0], loads[2], loads[3]):
            h.engine.release(ld.op_id)
        for ld in loads:
            await ld.readiness.wait_all()
            assert torch.equal(h.dev.read_slots(ld.dst), h.host.read_slots(ld.src))
        await until(lambda: len(h.req.ack_ids(Direction.LOAD)) == 4)
        assert h.req.ack_ids(Direction.LOAD) == [ld.op_id for ld in loads]
        assert not h.req.rolled_back


async def test_backups_beyond_the_queue_bound_wait():
    async with harness(max_queued_backups=2) as h:
        backups = [await h.issue(Direction.BACKUP, 1, start=i) for i in range(5)]
        await until(lambda: len(h.engine.pending()) == 2)
        await idle()
        st = await h.stats()
        assert (st["inflight_backups"], st["queued_backups"]) == (2, 3)
        assert h.req.acks == []
        started = [backups[0].op_id, backups[1].op_id]
        for expect_next in (2, 3, 4):
            h.engine.release(h.engine.pending()[0])
            await until(lambda n=expect_next: backups[n].op_id in h.engine.pending())
            assert len(h.engine.pending()) == 2
            started.append(backups[expect_next].op_id)
        assert [p.op_id for p in h.engine.submitted] == started
        for op in h.engine.pending():
            h.engine.release(op)
        await until(lambda: len(h.req.acks) == 5)
        assert h.req.ack_ids(Direction.BACKUP) == [b.op_id for b in backups]
        for b in backups:
            assert torch.equal(h.host.read_slots(b.dst), h.dev.read_slots(b.src))


# ---------------------------------------------------------------------------------------
# failures
# ---------------------------------------------------------------------------------------


async def test_failed_copy_gives_error_ack_and_typed_error_to_waiters():
    async with harness() as h:
        ld = await h.issue(Direction.LOAD, 2)
        b = await h.issue(Direction.BACKUP, 2)
        await until(lambda: len(h.engine.pending()) == 2)
        waiters = [asyncio.ensure_future(ld.readiness.wait(layer)) for layer in range(SHAPE.num_layers)]
        h.engine.fail(ld.op_id, RuntimeError("dma error"))
        h.engine.fail(b.op_id, OSError("host memory gone"))
        for w in waiters:
            with pytest.raises(TransferError) as info:
                await w
            assert isinstance(info.value.__cause__, RuntimeError)
        await until(lambda: len(h.req.acks) == 2)
        by_op = {a.op_id: a for a in h.req.acks}
        assert "dma error" in by_op[ld.op_id].error and "host memory gone" in by_op[b.op_id].error
        # the requester rolled back: destinations freed, nothing loaded / backed up, nothing pinned
        assert h.req.rolled_back == [ld.op_id, b.op_id]
        assert h.req.loaded == {} and h.req.backed_up == {}
        assert h.req.ledgers[Tier.DEVICE].owners_of(ld.dst) == [None, None]
        assert h.req.ledgers[Tier.HOST].owners_of(b.dst) == [None, None]
        assert h.req.total_pins() == 0
        assert (await h.stats())["ops_failed"] == 2


async def test_plan_the_engine_refuses_fails_its_op_and_the_actor_lives_on():
    async with harness() as h:
        bad = await h.issue(Direction.LOAD, 1, corrupt=True)
        with pytest.raises(TransferError):
            await bad.readiness.wait_all()
        await until(lambda: len(h.req.acks) == 1)
        assert not h.req.acks[0].ok and h.req.rolled_back == [bad.op_id]
        good = await h.issue(Direction.LOAD, 1)
        await until(lambda: good.op_id in h.engine.pending())
        h.engine.release(good.op_id)
        await good.readiness.wait_all()
        await until(lambda: len(h.req.acks) == 2)
        assert h.req.acks[1].ok
        assert (await h.stats())["inflight_loads"] == 0  # the refused op gave its slot back


async def test_failure_after_some_layers_keeps_the_ready_layers():
    async with harness() as h:
        ld = await h.issue(Direction.LOAD, 2)
        await until(lambda: ld.op_id in h.engine.pending())
        h.engine.release(ld.op_id, layers=1)
        await ld.readiness.wait(1)
        h.engine.fail(ld.op_id, RuntimeError("lost layer 2"))
        with pytest.raises(TransferError):
            await ld.readiness.wait(2)
        assert ld.readiness.ready(0) and ld.readiness.ready(1) and not ld.readiness.ready(3)
        await until(lambda: len(h.req.acks) == 1)
        assert not h.req.acks[0].ok and ld.op_id not in h.req.loaded


# ---------------------------------------------------------------------------------------
# cancellation and close
# ---------------------------------------------------------------------------------------


async def test_cancelled_waiter_neither_cancels_the_copy_nor_unpins():
    async with harness() as h:
        ld = await h.issue(Direction.LOAD, 2)
        await until(lambda: ld.op_id in h.engine.pending())
        waiter = asyncio.ensure_future(ld.readiness.wait_all())
        other = asyncio.ensure_future(ld.readiness.wait(SHAPE.num_layers - 1))
        await idle(5)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await idle()
        assert ld.op_id in h.engine.pending()  # the copy goes on
        assert h.req.pins(Tier.DEVICE, ld.dst) == [1, 1] and h.req.pins(Tier.HOST, ld.src) == [1, 1]
        assert h.req.acks == [] and not other.done() and not ld.readiness.done()
        h.engine.release(ld.op_id)
        await other  # the other waiter of the same readiness is unaffected
        await ld.readiness.wait_all()  # and a new one sees it ready
        await until(lambda: len(h.req.acks) == 1)
        assert h.req.acks[0].ok and ld.op_id in h.req.loaded
        assert h.req.total_pins() == 0
        assert torch.equal(h.dev.read_slots(ld.dst), h.host.read_slots(ld.src))


async def test_close_waits_for_every_copy_in_flight_and_queued():
    async with harness(max_inflight_loads=2, max_queued_backups=1) as h:
        issued = [await h.issue(Direction.LOAD, 1, start=i) for i in range(3)]
        issued += [await h.issue(Direction.BACKUP, 1, start=i) for i in range(2)]
        await until(lambda: len(h.engine.pending()) == 3)  # 2 loads + 1 backup; 2 queued

        drained_with: list[int] = []

        async def close() -> None:  # what CacheRuntime.close does: drain, then close the mailboxes
            await h.drain()
            drained_with.append(len(h.engine.submitted))
            await h.sup.stop()

        closing = asyncio.ensure_future(close())
        released = 0
        while len(h.engine.submitted) < 5 or h.engine.pending():
            await idle(10)
            assert not closing.done(), f"close finished with {len(h.engine.pending())} copies in flight"
            pending = h.engine.pending()
            if pending:
                h.engine.release(pending[-1])
                released += 1
        await asyncio.wait_for(closing, 5)
        assert released == 5 and drained_with == [5]
        assert sorted(a.op_id for a in h.req.acks) == [i.op_id for i in issued]  # every ack applied
        assert h.req.total_pins() == 0


async def test_closing_the_mailbox_waits_for_copies_in_flight():
    """Without a drain first, stopping still never returns while the engine holds a copy, and a
    copy still queued (never started) fails its readiness instead of leaving waiters hanging."""
    async with harness(max_inflight_loads=1, check_pins=False) as h:
        first = await h.issue(Direction.LOAD, 1)
        queued = await h.issue(Direction.LOAD, 1, start=1)
        await until(lambda: first.op_id in h.engine.pending())
        stopping = asyncio.ensure_future(h.sup.stop())
        await idle()
        assert not stopping.done()
        h.engine.release(first.op_id)
        await asyncio.wait_for(stopping, 5)
        await first.readiness.wait_all()
        with pytest.raises(TransferError):
            await asyncio.wait_for(queued.readiness.wait(0), 5)
        assert [p.op_id for p in h.engine.submitted] == [first.op_id]


async def test_ack_to_a_stopped_requester_does_not_fail_the_runtime():
    """Supervisor.stop closes the requester's mailbox before the transfer actor's: a completion
    handled in between has nobody to ack, which must not crash the transfer actor."""
    async with harness(check_pins=False) as h:
        b = await h.issue(Direction.BACKUP, 1)
        await until(lambda: b.op_id in h.engine.pending())
        h.req.mailbox.close()
        h.engine.release(b.op_id)
        await until(lambda: not h.transfer.inflight)
        assert h.sup.failure is None
        await h.sup.stop()


# ---------------------------------------------------------------------------------------
# layer-wise loading
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
async def test_layer_zero_is_read_while_later_layers_are_in_flight(layout):
    async with harness(layout=layout) as h:
        ld = await h.issue(Direction.LOAD, 3, start=1)
        await until(lambda: ld.op_id in h.engine.pending())
        want = h.host.read_slots(ld.src)  # [L, 2, n, H, D]
        seen: dict[int, bool] = {}

        async def consumer(layer: int) -> None:
            await ld.readiness.wait(layer)
            # data of this layer is right the moment its readiness resolves
            seen[layer] = torch.equal(h.dev.read_slots(ld.dst)[layer], want[layer])

        consumers = [asyncio.ensure_future(consumer(layer)) for layer in range(SHAPE.num_layers)]
        await idle(5)
        assert not any(c.done() for c in consumers)

        h.engine.release(ld.op_id, layers=0)
        await consumers[0]
        assert seen == {0: True}
        await idle()
        # later layers are still in flight: not ready, not copied, the op still pinned and unacked
        assert not any(c.done() for c in consumers[1:])
        assert not ld.readiness.ready(1)
        assert torch.count_nonzero(h.dev.read_slots(ld.dst)[1:]) == 0
        assert ld.op_id in h.engine.pending() and h.req.acks == []
        assert h.req.pins(Tier.DEVICE, ld.dst) == [1, 1, 1]

        h.engine.release(ld.op_id, layers=2)
        await asyncio.gather(*consumers[1:3])
        assert not consumers[3].done() and h.req.acks == []
        h.engine.release(ld.op_id)
        await consumers[3]
        assert seen == {layer: True for layer in range(SHAPE.num_layers)}
        await until(lambda: len(h.req.acks) == 1)
        assert h.req.acks[0].ok and h.req.total_pins() == 0

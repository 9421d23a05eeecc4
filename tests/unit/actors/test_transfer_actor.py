"""TransferActor with a small requester actor that keeps its own ledgers.

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
from runtime.actors.transfer_actor import TransferActor
from runtime.messages import DrainTransfer, SubmitCopy, TransferStats
from runtime.completion import LayerReadiness
from runtime.errors import TransferError
from runtime.memory.ledger import SlotLedger
from runtime.memory.owners import Owner, Tier
from runtime.memory.pools import DevicePool, HostPool, KVShape
from runtime.messages import Direction, PoolTransfer, StorageAck, TransferAck, TransferPlan
from runtime.supervisor import State, Supervisor
from runtime.storage.backend import write_pages
from runtime.storage.integrity import PageSeal
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
        return await self.sup.ask(self.transfer.mailbox, TransferStats(Reply()))

    async def drain(self) -> None:
        await self.sup.ask_internal(self.transfer.mailbox, DrainTransfer(Reply()))


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
                  fault: Callable[[int, int], None] | None = None, check_pins: bool = True,
                  coalesce: bool = False) -> AsyncIterator[Harness]:
    dev = DevicePool(SHAPE, DEV_PAGES * PS, PS)
    host = HostPool(SHAPE, HOST_PAGES * PS, PS, layout, pin_memory=False)
    gen = torch.Generator().manual_seed(3)
    host.buffer.copy_(torch.randn(host.buffer.shape, generator=gen))
    dev.buffer[:, :, : RESIDENT * PS].copy_(torch.randn(dev.buffer[:, :, : RESIDENT * PS].shape, generator=gen))
    engine = FakeCopyEngine({"kv": (dev, host)}, fault=fault)
    engine.coalesce_backups = coalesce  # as the CPU engine does: a burst's backups in one submission
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


async def test_a_bursts_backups_go_to_the_engine_together_and_are_acked_one_by_one():
    """With an engine that coalesces backups, the backups queued in one burst are one submission
    (at most BACKUPS_PER_SUBMISSION); each still gets its own ack, in issue order, and its pages
    copied. Checked failing with `_on_done_future` acking only the first op of the group."""
    async with harness(max_queued_backups=8, coalesce=True) as h:
        backups = await asyncio.gather(*(h.issue(Direction.BACKUP, 1, start=i) for i in range(5)))
        await until(lambda: len(h.engine.pending()) > 0)
        await idle()
        assert len(h.engine.submitted) < 5  # one burst: fewer submissions than backups
        assert sum(p.num_slots for p in h.engine.submitted) == 5 * PS
        st = await h.stats()
        assert (st["inflight_backups"], st["queued_backups"]) == (5, 0)
        for op in h.engine.pending():
            h.engine.release(op)
        await until(lambda: len(h.req.acks) == 5)
        assert h.req.ack_ids(Direction.BACKUP) == sorted(b.op_id for b in backups)
        for b in backups:
            assert torch.equal(h.host.read_slots(b.dst), h.dev.read_slots(b.src))
        st = await h.stats()
        assert st["ops_done"] == 5 and st["bytes_device_to_host"] == 5 * PS * SHAPE.bytes_per_token


async def test_a_failed_coalesced_submission_fails_each_of_its_backups():
    async with harness(max_queued_backups=8, coalesce=True) as h:
        backups = await asyncio.gather(*(h.issue(Direction.BACKUP, 1, start=i) for i in range(4)))
        await until(lambda: len(h.engine.pending()) > 0)
        await idle()
        for op in h.engine.pending():
            h.engine.fail(op, OSError("host memory gone"))
        await until(lambda: len(h.req.acks) == 4)
        assert all(not a.ok and "host memory gone" in a.error for a in h.req.acks)
        assert sorted(h.req.rolled_back) == sorted(b.op_id for b in backups)
        assert h.req.backed_up == {} and h.req.total_pins() == 0
        assert (await h.stats())["ops_failed"] == 4


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
        await until(lambda: not h.transfer.copies.inflight)
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


# ---------------------------------------------------------------------------------------
# storage ops: results checked against the backend contract, a deadline per op
# ---------------------------------------------------------------------------------------

PAGE_BYTES = SHAPE.bytes_per_token * PS


class LyingBackend:
    """A backend whose results are whatever a test says (`lies`: call name -> fn(nkeys) -> value);
    calls without a lie answer truthfully for a store holding every key. Without a "get_prefix"
    lie it has no get_prefix (reads go through exists_prefix + get_batch)."""

    page_bytes = PAGE_BYTES
    exists_is_local = False

    def __init__(self, **lies: Callable[[int], Any]) -> None:
        self.lies = lies
        if "get_prefix" not in lies:
            self.get_prefix = None

    def exists_prefix(self, keys):
        return self.lies.get("exists_prefix", lambda n: n)(len(keys))

    @staticmethod
    def _fill(keys, dests, tags) -> None:
        for i, (k, d) in enumerate(zip(keys, dests)):
            d[:] = 7  # a read writes the destination pages (page_first: pool rows), with their true tags
            tags[i] = PageSeal().tag(k, d)

    def get_prefix(self, keys, dests, tags=None):  # noqa: F811 - shadowed per instance when not lied about
        self._fill(keys, dests, tags)
        return self.lies["get_prefix"](len(keys))

    def get_batch(self, keys, dests, tags=None):
        self._fill(keys, dests, tags)
        return self.lies.get("get_batch", lambda n: [True] * n)(len(keys))

    def set_batch(self, keys, srcs, tags=None):
        return self.lies.get("set_batch", lambda n: [True] * n)(len(keys))

    def close(self) -> None:
        pass

    def stats(self) -> dict:
        return {}


class _Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict]] = []

    def warning(self, event: str, **kw: Any) -> None:
        self.seen.append((event, kw))

    def debug(self, event: str, **kw: Any) -> None:
        pass

    def named(self, event: str) -> list[dict]:
        return [kw for e, kw in self.seen if e == event]


@asynccontextmanager
async def storage_actor(backend: Any, *, layout: str = "page_first", timeout_s: float | None = None,
                        rank_hosts: list[HostPool] | None = None,
                        ) -> AsyncIterator[tuple[Supervisor, TransferActor, Mailbox[Any]]]:
    """A transfer actor with a storage backend, alone; its acks go to a plain mailbox. `timeout_s`:
    its storage_timeout_s (None: the default); `rank_hosts`: one host pool per tensor-parallel rank
    (None: one rank, a host pool of `layout`)."""
    dev = DevicePool(SHAPE, DEV_PAGES * PS, PS)
    kwargs: dict[str, Any] = {} if timeout_s is None else {"storage_timeout_s": timeout_s}
    if rank_hosts is None:
        host = HostPool(SHAPE, HOST_PAGES * PS, PS, layout, pin_memory=False)
    else:
        host, kwargs["rank_host_pools"] = rank_hosts[0], rank_hosts
    transfer = TransferActor(FakeCopyEngine({"kv": (dev, host)}), max_inflight_loads=3, max_queued_backups=8,
                             mailbox_capacity=64, bytes_per_slot=SHAPE.bytes_per_token, storage=backend,
                             host_pool=host, **kwargs)
    sup = Supervisor([transfer])
    await sup.start()
    try:
        yield sup, transfer, Mailbox(64)
    finally:
        await sup.stop()
    sup.raise_if_failed()


async def next_msgs(box: Mailbox[Any], timeout: float = 5.0) -> list[Any]:
    """The next acks (the backend's health changes that come with them left out)."""
    from runtime.messages import StorageHealthChanged

    while True:
        burst = [m for m in await asyncio.wait_for(box.get_burst(), timeout) if type(m) is not StorageHealthChanged]
        if burst:
            return burst


def storage_op(op_id: int, kind: str, ack_to: Mailbox[Any], n: int = 3) -> Any:
    from runtime.messages import SubmitStorage

    keys = tuple(f"key{op_id}-{i}".encode() for i in range(n))
    pages = () if kind == "lookup" else tuple(range(n))
    return SubmitStorage(op_id, kind == "write", keys, pages, ack_to)


@pytest.mark.parametrize("kind,lies", [
    ("lookup", dict(exists_prefix=lambda n: -1)),
    ("lookup", dict(exists_prefix=lambda n: n + 3)),
    ("lookup", dict(exists_prefix=lambda n: None)),
    ("lookup", dict(exists_prefix=lambda n: True)),  # a bool is not a count
    ("lookup", dict(exists_prefix=lambda n: 1.0)),
    ("read", dict(get_prefix=lambda n: -1)),
    ("read", dict(get_prefix=lambda n: n + 3)),
    ("read", dict(get_prefix=lambda n: np.int64(n + 1))),
    ("read", dict(exists_prefix=lambda n: -2)),  # no get_prefix: exists_prefix + get_batch
    ("read", dict(get_batch=lambda n: [True] * (n + 1))),
    ("read", dict(get_batch=lambda n: [1] * n)),  # ints, not bools
    ("read", dict(get_batch=lambda n: None)),
    ("write", dict(set_batch=lambda n: [True] * (n - 1))),
    ("write", dict(set_batch=lambda n: [True] * (n + 1))),
    ("write", dict(set_batch=lambda n: None)),
    ("write", dict(set_batch=lambda n: "yes")),
])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
async def test_a_result_outside_the_backend_contract_is_a_miss_for_the_whole_op(kind, lies, layout, monkeypatch):
    """Every value a backend returns is checked before use: out of contract, the op's ack says 0
    pages (no per-page flags) with an error, and it is counted and logged. Before the fix counts were
    passed on (acks of pages=-1, 6, 4, 1 for a bool) and so were wrong-length flags; None and
    non-bools failed with a TypeError/IndexError ack that named no contract and counted nothing."""
    from runtime.actors import storage_calls

    events = _Events()
    monkeypatch.setattr(storage_calls, "log", events)
    async with storage_actor(LyingBackend(**lies), layout=layout) as (sup, transfer, acks):
        transfer.mailbox.put_internal(storage_op(1, kind, acks))
        [ack] = await next_msgs(acks)
        assert isinstance(ack, StorageAck)
        assert (ack.op_id, ack.pages, ack.ok) == (1, 0, ())
        assert ack.error is not None and "contract" in ack.error
        st = await sup.ask(transfer.mailbox, TransferStats(Reply()))
        assert (st["storage_backend_errors"], st["storage_ops_failed"], st["storage_errors"]) == (1, 1, 0)
        assert st["storage_bytes_read"] == st["storage_bytes_written"] == 0
        [ev] = events.named("storage_backend_contract_violation")
        assert ev["op"] == 1 and ev["call"] in lies and isinstance(ev["value"], str)


@pytest.mark.parametrize("kind,lies,pages", [
    ("lookup", dict(exists_prefix=lambda n: np.int64(2)), 2),  # numpy integers are counts
    ("lookup", dict(exists_prefix=lambda n: 0), 0),
    ("read", dict(get_prefix=lambda n: n), 3),
    ("read", dict(get_prefix=lambda n: np.uint32(1)), 1),
    ("read", dict(get_batch=lambda n: [True, False, True][:n]), 1),  # a prefix ends at a miss
    ("write", dict(set_batch=lambda n: [np.bool_(True), False, True]), 2),
    ("write", dict(set_batch=lambda n: np.array([True, True, False])), 2),
])
async def test_results_inside_the_contract_are_used(kind, lies, pages):
    async with storage_actor(LyingBackend(**lies)) as (sup, transfer, acks):
        transfer.mailbox.put_internal(storage_op(1, kind, acks))
        [ack] = await next_msgs(acks)
        assert (ack.pages, ack.error) == (pages, None)
        if kind == "write":
            assert len(ack.ok) == 3 and sum(ack.ok) == pages
        st = await sup.ask(transfer.mailbox, TransferStats(Reply()))
        assert st["storage_backend_errors"] == 0 and st["storage_ops_done"] == 1


@pytest.mark.parametrize("kind,method", [("lookup", "exists_prefix"), ("read", "get_batch"), ("write", "set_batch")])
async def test_a_held_backend_call_is_overdue_at_its_deadline_and_acked_when_it_returns(tmp_path, kind, method,
                                                                                       monkeypatch):
    """A backend call still running at `storage_timeout_s`: the requester gets one StorageOverdue
    (logged, counted), the op stays in flight (no early ack), a drain for close completes without
    it, and the real StorageAck follows when the call returns. Before the fix it failed at once: there
    was no StorageOverdue (ImportError) and no deadline (TransferActor took no storage_timeout_s)."""
    from runtime.actors import storage_calls
    from runtime.messages import StorageOverdue
    from runtime.storage.backend import FaultPlan, FaultyBackend
    from runtime.storage.file_backend import FileBackend

    events = _Events()
    monkeypatch.setattr(storage_calls, "log", events)
    inner = FileBackend(tmp_path, PAGE_BYTES)
    fb = FaultyBackend(inner, FaultPlan(hold_at={1}, methods={method}))
    keys = [f"key1-{i}".encode() for i in range(3)]
    if kind != "write":
        write_pages(inner, keys, [np.full(PAGE_BYTES, i, np.uint8) for i in range(3)], PageSeal())
    loop = asyncio.get_running_loop()
    try:
        async with storage_actor(fb, timeout_s=0.3) as (sup, transfer, acks):
            t0 = loop.time()
            transfer.mailbox.put_internal(storage_op(1, kind, acks))
            assert await asyncio.to_thread(fb.wait_held, 1, 5.0)
            [overdue] = await next_msgs(acks)
            assert isinstance(overdue, StorageOverdue) and overdue.op_id == 1
            assert loop.time() - t0 >= 0.25
            st = await sup.ask(transfer.mailbox, TransferStats(Reply()))
            assert (st["storage_ops_overdue"], st["storage_calls_running"]) == (1, 1)
            assert [e["op"] for e in events.named("storage_op_overdue")] == [1]
            # a drain (close) no longer waits for the overdue op; the op is abandoned only if the
            # actor stops before its call returns (it returns here first: not abandoned)
            await asyncio.wait_for(sup.ask_internal(transfer.mailbox, DrainTransfer(Reply())), 2.0)
            await idle(20)
            assert acks.depth == 0  # sent once; no ack while the call is held
            fb.release()
            [ack] = await next_msgs(acks)
            assert isinstance(ack, StorageAck) and ack.op_id == 1 and ack.error is None
            assert ack.pages == 3  # every page was stored / found / read
            st = await sup.ask(transfer.mailbox, TransferStats(Reply()))
            assert (st["storage_ops_overdue"], st["storage_calls_running"], st["storage_ops_done"]) == (1, 0, 1)
        assert events.named("storage_ops_abandoned_at_close") == [] and transfer.counters["storage_ops_abandoned"] == 0
    finally:
        fb.release()
        inner.close()


async def test_an_op_done_before_its_deadline_gets_no_overdue_and_the_drain_waits_for_it(tmp_path):
    """The deadline only covers calls that outlive it; before it, a drain waits for the op."""
    from runtime.storage.backend import FaultPlan, FaultyBackend
    from runtime.storage.file_backend import FileBackend

    inner = FileBackend(tmp_path, PAGE_BYTES)
    fb = FaultyBackend(inner, FaultPlan(hold_at={1}, methods={"set_batch"}))
    try:
        async with storage_actor(fb, timeout_s=30.0) as (sup, transfer, acks):
            transfer.mailbox.put_internal(storage_op(1, "write", acks))
            assert await asyncio.to_thread(fb.wait_held, 1, 5.0)
            drain = asyncio.ensure_future(sup.ask_internal(transfer.mailbox, DrainTransfer(Reply())))
            await idle(50)
            assert not drain.done() and acks.depth == 0
            fb.release()
            [ack] = await next_msgs(acks)
            assert isinstance(ack, StorageAck) and ack.pages == 3
            await asyncio.wait_for(drain, 2.0)
            st = await sup.ask(transfer.mailbox, TransferStats(Reply()))
            assert st["storage_ops_overdue"] == 0 and not transfer.storage.timers
    finally:
        fb.release()
        inner.close()


# -- one control plane over tensor-parallel ranks: each rank's storage I/O its own ------------------


class KeyedBackend:
    """An in-memory backend: page bytes by key, every call recorded; `refuse`: keys a write fails."""

    page_bytes = PAGE_BYTES
    exists_is_local = False
    get_prefix = None

    def __init__(self, refuse: set[bytes] = frozenset()) -> None:
        self.pages: dict[bytes, bytes] = {}
        self.tags: dict[bytes, bytes | None] = {}  # stored with each page (the storage tier's)
        self.refuse = refuse
        self.calls: list[tuple[str, tuple[bytes, ...]]] = []

    def exists_prefix(self, keys):
        self.calls.append(("exists_prefix", tuple(keys)))
        return next((i for i, k in enumerate(keys) if k not in self.pages), len(keys))

    def get_batch(self, keys, dests, tags=None):
        self.calls.append(("get_batch", tuple(keys)))
        for i, (k, d) in enumerate(zip(keys, dests)):
            if k in self.pages:
                np.asarray(memoryview(d).cast("B"))[:] = np.frombuffer(self.pages[k], np.uint8)
                if tags is not None:
                    tags[i] = self.tags[k]
        return [k in self.pages for k in keys]

    def set_batch(self, keys, srcs, tags=None):
        self.calls.append(("set_batch", tuple(keys)))
        for k, s, t in zip(keys, srcs, tags or [None] * len(keys)):
            if k not in self.refuse:
                self.pages[k], self.tags[k] = bytes(memoryview(s).cast("B")), t
        return [k not in self.refuse for k in keys]

    def close(self) -> None:
        pass

    def stats(self) -> dict:
        return {}


@asynccontextmanager
async def ranks_actor(backend: Any, ranks: int) -> AsyncIterator[tuple[TransferActor, list[HostPool], Mailbox[Any]]]:
    """A transfer actor storing for `ranks` ranks, each with its own (page_first) host pool."""
    hosts = [HostPool(SHAPE, HOST_PAGES * PS, PS, "page_first", pin_memory=False) for _ in range(ranks)]
    async with storage_actor(backend, rank_hosts=hosts) as (_, transfer, box):
        yield transfer, hosts, box


def rank_op(op_id: int, kind: str, ack_to: Mailbox[Any], ranks: int, n: int = 3, replicated: bool = False) -> Any:
    from runtime.messages import SubmitStorage

    lists = tuple(tuple(f"r{r}-p{i}".encode() for i in range(n)) for r in range(ranks))
    pages = () if kind == "lookup" else tuple(range(n))
    return SubmitStorage(op_id, kind == "write", lists[0], pages, ack_to, rank_keys=() if replicated else lists)


def fill(hosts: list[HostPool], n: int = 3) -> None:
    """Rank r's host page p holds the value 10 * r + p."""
    for r, host in enumerate(hosts):
        for p in range(n):
            host.buffer.view(HOST_PAGES, -1)[p] = 10 * r + p


async def test_a_write_stores_every_ranks_shard_under_its_keys_and_a_page_only_when_all_did():
    backend = KeyedBackend(refuse={b"r1-p1"})
    async with ranks_actor(backend, 2) as (transfer, hosts, acks):
        fill(hosts)
        transfer.mailbox.put_internal(rank_op(1, "write", acks, 2))
        [ack] = await next_msgs(acks)
    assert (ack.pages, ack.ok, ack.error) == (2, (True, False, True), None)  # rank 1 lost page 1: not stored
    assert [c for c, _ in backend.calls] == ["set_batch", "set_batch"]
    for r in range(2):
        for p in range(3):
            key = f"r{r}-p{p}".encode()
            if key != b"r1-p1":  # each rank's own page bytes under its own key
                assert set(np.frombuffer(backend.pages[key], np.float32)) == {10 * r + p}


async def test_a_lookup_and_a_read_count_the_pages_every_rank_has_each_into_its_own_pool():
    backend = KeyedBackend()
    async with ranks_actor(backend, 2) as (transfer, hosts, acks):
        fill(hosts)
        transfer.mailbox.put_internal(rank_op(1, "write", acks, 2))
        await next_msgs(acks)
        del backend.pages[b"r1-p2"]  # rank 1's last page gone
        backend.calls.clear()
        transfer.mailbox.put_internal(rank_op(2, "lookup", acks, 2))
        [ack] = await next_msgs(acks)
        assert ack.pages == 2
        assert backend.calls == [("exists_prefix", (b"r0-p0", b"r0-p1", b"r0-p2")),
                                 ("exists_prefix", (b"r1-p0", b"r1-p1", b"r1-p2"))]
        for host in hosts:
            host.buffer.zero_()
        transfer.mailbox.put_internal(rank_op(3, "read", acks, 2))
        [ack] = await next_msgs(acks)
        assert (ack.pages, ack.error) == (2, None)
        for r, host in enumerate(hosts):
            for p in range(2):
                assert set(host.buffer.view(HOST_PAGES, -1)[p].tolist()) == {10 * r + p}


async def test_a_replicated_shard_is_written_by_rank_0_and_read_by_every_rank():
    backend = KeyedBackend()
    async with ranks_actor(backend, 3) as (transfer, hosts, acks):
        fill(hosts)
        transfer.mailbox.put_internal(rank_op(1, "write", acks, 3, replicated=True))
        [ack] = await next_msgs(acks)
        assert ack.pages == 3 and [c for c, _ in backend.calls] == ["set_batch"]
        for host in hosts:
            host.buffer.zero_()
        transfer.mailbox.put_internal(rank_op(2, "read", acks, 3, replicated=True))
        [ack] = await next_msgs(acks)
        assert ack.pages == 3
        for host in hosts:  # rank 0's latent, in every rank's pool
            for p in range(3):
                assert set(host.buffer.view(HOST_PAGES, -1)[p].tolist()) == {p}


async def test_an_op_without_a_key_list_per_rank_fails_and_touches_nothing():
    from runtime.messages import SubmitStorage

    backend = KeyedBackend()
    async with ranks_actor(backend, 2) as (transfer, hosts, acks):
        transfer.mailbox.put_internal(SubmitStorage(1, True, (b"a",), (0,), acks, rank_keys=((b"a",),)))
        [ack] = await next_msgs(acks)
    assert ack.pages == 0 and "1 key lists for 2 ranks" in ack.error and backend.calls == []

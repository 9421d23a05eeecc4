"""OffloadActor on its own: its decisions (stride, release rule, generations) against a stub
tree actor that answers StartOffload and records ReleaseOffloaded."""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator

import pytest

from runtime.actors.base import Actor, Reply
from runtime.actors.offload_actor import OffloadActor
from runtime.errors import RuntimeFailed
from runtime.messages import (
    OffloadAck,
    OffloadCommit,
    DrainOffload,
    OffloadFinish,
    OffloadStarted,
    OffloadStats,
    ReleaseOffloaded,
    StartOffload,
)
from runtime.supervisor import Supervisor


@dataclass(frozen=True, slots=True)
class Ping:
    reply: Reply[None] | None = field(default=None, compare=False)


class StubTree(Actor):
    name = "stub-tree"

    def __init__(self) -> None:
        super().__init__(1000)
        self.starts: list[tuple] = []
        self.releases: list[tuple] = []
        self.full = False
        self.next_op = 100
        self.handlers = {StartOffload: self.on_start, ReleaseOffloaded: self.on_release, Ping: lambda m: None}

    def on_start(self, msg: StartOffload) -> OffloadStarted | None:
        self.starts.append((msg.rid, msg.generation, msg.start, msg.end))
        if self.full:
            return None
        self.next_op += 1
        return OffloadStarted(self.next_op, msg.start, msg.end)

    def on_release(self, msg: ReleaseOffloaded) -> None:
        self.releases.append((msg.rid, msg.generation))


class Harness:
    def __init__(self, sup: Supervisor, tree: StubTree, off: OffloadActor) -> None:
        self.sup, self.tree, self.off = sup, tree, off

    def tell(self, msg) -> None:
        self.off.mailbox.put_internal(msg)

    async def sync(self) -> dict:
        """Everything queued so far is handled by both actors; returns the offload stats."""
        stats = await self.sup.ask_internal(self.off.mailbox, OffloadStats(Reply()))
        await self.sup.ask_internal(self.tree.mailbox, Ping(Reply()))
        return stats

    def ops_of(self, rid, gen) -> list[int]:
        return sorted(self.off.requests[(rid, gen)].inflight)


@asynccontextmanager
async def harness(page_size: int = 4, stride: int | None = None) -> AsyncIterator[Harness]:
    tree = StubTree()
    off = OffloadActor(tree.mailbox, page_size=page_size, stride=stride or page_size, mailbox_capacity=1000)
    sup = Supervisor([tree, off])
    await sup.start()
    try:
        yield Harness(sup, tree, off)
    finally:
        await sup.stop()
    sup.raise_if_failed()


# -- stride ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("pages_per_stride", [1, 2])
async def test_stride_offloads_whole_page_chunks(page_size, pages_per_stride):
    stride = page_size * pages_per_stride
    async with harness(page_size, stride) as h:
        last = 6 * page_size + page_size // 2  # ends mid-page (page size 1: on a boundary)
        for n in range(1, last + 1):  # one commit per decoded token
            h.tell(OffloadCommit("a", 1, n, 0))
        await h.sync()
        ranges = [(s, e) for _, _, s, e in h.tree.starts]
        assert ranges == [(i * stride, (i + 1) * stride) for i in range(6 // pages_per_stride)]
        h.tell(OffloadFinish("a", 1, last))  # nothing whole left: no flush
        await h.sync()
        assert len(h.tree.starts) == 6 // pages_per_stride and h.tree.releases == []


async def test_a_jump_in_committed_length_is_one_chunk_and_finish_flushes_the_rest():
    async with harness(16, 64) as h:
        h.tell(OffloadCommit("a", 1, 150, 32))  # base: a 32-token cached prefix
        h.tell(OffloadCommit("a", 1, 150, 32))  # idempotent: the same length again
        h.tell(OffloadCommit("a", 1, 200, 32))  # +50 < stride: wait
        await h.sync()
        assert h.tree.starts == [("a", 1, 32, 144)]
        h.tell(OffloadFinish("a", 1, 200, 32))  # finish flushes the whole pages left, any length
        await h.sync()
        assert h.tree.starts[-1] == ("a", 1, 144, 192)


# -- release exactly once -------------------------------------------------------------------------------


async def test_finish_before_last_ack():
    async with harness() as h:
        h.tell(OffloadCommit("a", 1, 8, 0))
        h.tell(OffloadCommit("a", 1, 12, 0))
        await h.sync()
        first, second = h.ops_of("a", 1)
        h.tell(OffloadFinish("a", 1, 12))
        h.tell(OffloadAck("a", 1, first, True))
        await h.sync()
        assert h.tree.releases == []  # one copy still in flight
        h.tell(OffloadAck("a", 1, second, True))
        stats = await h.sync()
        assert h.tree.releases == [("a", 1)] and stats["offload_tracked_requests"] == 0


async def test_ack_before_finish():
    async with harness() as h:
        h.tell(OffloadCommit("a", 1, 8, 0))
        await h.sync()
        (op,) = h.ops_of("a", 1)
        h.tell(OffloadAck("a", 1, op, True))
        await h.sync()
        assert h.tree.releases == []  # still running
        h.tell(OffloadFinish("a", 1, 8))
        await h.sync()
        assert h.tree.releases == [("a", 1)] and len(h.tree.starts) == 1


async def test_double_finish_releases_once():
    async with harness() as h:
        h.tell(OffloadCommit("a", 1, 8, 0))
        await h.sync()
        (op,) = h.ops_of("a", 1)
        h.tell(OffloadFinish("a", 1, 8))
        h.tell(OffloadFinish("a", 1, 8))
        await h.sync()
        assert h.tree.releases == []
        h.tell(OffloadAck("a", 1, op, True))
        stats = await h.sync()
        assert h.tree.releases == [("a", 1)] and stats["offload_releases_sent"] == 1


async def test_abort_mid_offload_waits_for_the_copy_and_flushes_nothing():
    async with harness() as h:
        h.tell(OffloadCommit("a", 1, 9, 0))
        await h.sync()
        (op,) = h.ops_of("a", 1)
        h.tell(OffloadFinish("a", 1, None))  # abort
        await h.sync()
        assert h.tree.releases == [] and len(h.tree.starts) == 1
        h.tell(OffloadAck("a", 1, op, False))  # and the copy failed, too
        stats = await h.sync()
        assert h.tree.releases == [("a", 1)] and stats["offloads_failed"] == 1


async def test_request_never_offloaded_is_released_at_finish():
    async with harness() as h:
        h.tell(OffloadCommit("a", 1, 3, 0))  # less than a page
        h.tell(OffloadFinish("a", 1, 3))
        await h.sync()
        assert h.tree.starts == [] and h.tree.releases == [("a", 1)]


async def test_host_pool_full_creates_no_state():
    async with harness() as h:
        h.tree.full = True
        h.tell(OffloadCommit("a", 1, 8, 0))
        stats = await h.sync()
        assert len(h.tree.starts) == 1 and stats["offload_tracked_requests"] == 0
        assert stats["offloads_not_started"] == 1
        h.tree.full = False
        h.tell(OffloadCommit("a", 1, 9, 0))  # retried from the start on the next commit
        await h.sync()
        assert h.tree.starts[-1] == ("a", 1, 0, 8) and h.ops_of("a", 1)


# -- generations ----------------------------------------------------------------------------------------


async def test_reused_rid_is_a_different_request():
    async with harness() as h:
        h.tell(OffloadCommit("x", 1, 8, 0))
        await h.sync()
        (old,) = h.ops_of("x", 1)
        h.tell(OffloadFinish("x", 1, 8))
        h.tell(OffloadCommit("x", 2, 4, 0))  # the rid admitted again while x#1's copy is in flight
        await h.sync()
        (new,) = h.ops_of("x", 2)
        assert h.tree.starts[-1] == ("x", 2, 0, 4) and h.tree.releases == []
        h.tell(OffloadAck("x", 1, old, True))
        await h.sync()
        assert h.tree.releases == [("x", 1)] and h.ops_of("x", 2) == [new]  # x#2 untouched
        h.tell(OffloadFinish("x", 2, 4))
        await h.sync()
        assert h.tree.releases == [("x", 1)]  # x#2 waits for its own copy
        h.tell(OffloadAck("x", 2, new, True))
        await h.sync()
        assert h.tree.releases == [("x", 1), ("x", 2)]


async def test_ack_of_an_unknown_copy_fails_the_runtime():
    with pytest.raises(RuntimeFailed):
        async with harness() as h:
            h.tell(OffloadAck("a", 1, 999, True))
            await h.sync()


# -- close ------------------------------------------------------------------------------------------------


async def test_drain_waits_for_copies_and_stops_new_offloads():
    async with harness() as h:
        h.tell(OffloadCommit("a", 1, 8, 0))
        await h.sync()
        (op,) = h.ops_of("a", 1)
        drained = Reply()
        h.tell(DrainOffload(drained))
        await h.sync()
        assert not drained.done()
        h.tell(OffloadCommit("a", 1, 16, 0))  # closing: no new offload
        h.tell(OffloadAck("a", 1, op, True))
        await h.sync()
        assert drained.done() and len(h.tree.starts) == 1

"""CompletionBridge and LayerReadiness: polled events, worker futures, timeouts, cancellation, close."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
import time

import numpy as np
import pytest
import torch

from runtime.completion import CompletionBridge, LayerReadiness
from runtime.errors import ArgumentError, InternalError, RuntimeClosed, TransferError
from runtime.memory.pools import DevicePool, HostPool, KVShape
from runtime.messages import Direction, PoolTransfer, TransferPlan
from runtime.transfer.cpu_engine import CpuCopyEngine
from runtime.transfer.engine import CopyHandle, FutureCompletion
from runtime.transfer.fake_engine import FakeCopyEngine


class Ev:
    """A CUDA-event-like completion finished by hand. synchronize() must never block the loop:
    it fails the test if called before query() is true."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self._done.is_set()

    def synchronize(self) -> None:
        assert self._done.is_set(), "synchronize() called on an unfinished completion (would block the loop)"
        if self.error is not None:
            raise self.error

    def set(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()


async def settle(fut: asyncio.Future, timeout: float = 2.0):
    return await asyncio.wait_for(asyncio.shield(fut), timeout)


async def test_polled_completions_out_of_order():
    async with CompletionBridge() as bridge:
        evs = [Ev() for _ in range(3)]
        futs = [bridge.watch(e) for e in evs]
        order: list[int] = []
        for i, f in enumerate(futs):
            f.add_done_callback(lambda _f, i=i: order.append(i))
        await asyncio.sleep(0.005)
        assert not any(f.done() for f in futs)
        evs[2].set()
        await settle(futs[2])
        assert order == [2] and not futs[0].done()
        evs[0].set()
        evs[1].set()
        await asyncio.gather(*futs)
        assert order == [2, 0, 1]
        assert bridge.in_flight == 0


async def test_polled_failure_becomes_transfer_error_with_cause():
    async with CompletionBridge() as bridge:
        e = Ev()
        f = bridge.watch(e)
        boom = RuntimeError("dma failed")
        e.set(boom)
        with pytest.raises(TransferError) as info:
            await settle(f)
        assert info.value.__cause__ is boom


async def test_query_raising_is_a_failure():
    class Bad:
        def query(self):
            raise RuntimeError("CUDA error: illegal address")

        def synchronize(self):
            raise AssertionError("not reached")

    async with CompletionBridge() as bridge:
        with pytest.raises(TransferError, match="illegal address"):
            await settle(bridge.watch(Bad()))


async def test_transfer_error_passes_through_unwrapped():
    async with CompletionBridge() as bridge:
        f = cf.Future()
        err = TransferError("storage write failed")
        f.set_exception(err)
        with pytest.raises(TransferError) as info:
            await settle(bridge.watch(f))
        assert info.value is err


async def test_worker_futures_resolve_without_blocking_the_loop():
    with cf.ThreadPoolExecutor(1) as pool:
        async with CompletionBridge() as bridge:
            gate = threading.Event()
            work = pool.submit(lambda: gate.wait(2) and 42)
            fut = bridge.watch(FutureCompletion(work))
            ticks = 0
            for _ in range(5):  # the loop keeps running while the worker is busy
                await asyncio.sleep(0.001)
                ticks += 1
            assert ticks == 5 and not fut.done()
            gate.set()
            assert await settle(fut) is None

            failing = pool.submit(lambda: 1 / 0)
            with pytest.raises(TransferError) as info:
                await settle(bridge.watch(failing))  # a bare concurrent Future works too
            assert isinstance(info.value.__cause__, ZeroDivisionError)


async def test_already_done_worker_future():
    async with CompletionBridge() as bridge:
        f = cf.Future()
        f.set_result(None)
        await settle(bridge.watch(f))


async def test_timeout_then_late_completion():
    async with CompletionBridge() as bridge:
        never = Ev()
        fut = bridge.watch(never, timeout=0.02)
        with pytest.raises(TimeoutError):
            await settle(fut)
        assert bridge.in_flight == 1  # the copy is still running and still tracked
        never.set()
        for _ in range(200):
            if bridge.in_flight == 0:
                break
            await asyncio.sleep(0.001)
        assert bridge.in_flight == 0


async def test_timeout_on_worker_future():
    gate = threading.Event()
    with cf.ThreadPoolExecutor(1) as pool:
        async with CompletionBridge() as bridge:
            work = pool.submit(gate.wait, 2)
            with pytest.raises(TimeoutError):
                await settle(bridge.watch(work, timeout=0.01))
            gate.set()
            await asyncio.wait_for(asyncio.wrap_future(work), 2)


async def test_cancelling_the_awaiter_does_not_touch_the_copy():
    async with CompletionBridge() as bridge:
        e = Ev()
        fut = bridge.watch(e)
        other = bridge.watch(e)  # a second awaiter of the same completion
        task = asyncio.ensure_future(fut)
        await asyncio.sleep(0.002)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert fut.cancelled()
        e.set()
        await settle(other)  # the other awaiter is unaffected
        for _ in range(200):
            if bridge.in_flight == 0:
                break
            await asyncio.sleep(0.001)
        assert bridge.in_flight == 0


async def test_cancelled_awaiter_of_cpu_copy_copy_still_completes():
    shape = KVShape(2, 2, 8, torch.float16)
    dev, host = DevicePool(shape, 64, 4), HostPool(shape, 64, 4)
    dev.buffer.copy_(torch.randn(dev.buffer.shape).to(shape.dtype))
    gate = threading.Event()
    # (a backup on its worker thread: one this small would be copied inline, in submit)
    engine = CpuCopyEngine({"kv": (dev, host)}, fault=lambda op, layer: gate.wait(2), inline_backup_bytes=0)
    try:
        async with CompletionBridge() as bridge:
            src = torch.arange(0, 32)
            dst = torch.arange(32, 64)
            h = engine.submit(TransferPlan(1, Direction.BACKUP, (PoolTransfer("kv", src, dst),)))
            task = asyncio.ensure_future(bridge.watch(h.done))
            await asyncio.sleep(0.002)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            gate.set()
            # aclose (via the context manager) waits for the copy itself
        assert h.done.query()
        assert torch.equal(host.read_slots(dst), dev.read_slots(src))
    finally:
        gate.set()
        engine.close()


async def test_aclose_waits_for_watched_completions():
    bridge = CompletionBridge().start()
    e = Ev()
    fut = bridge.watch(e)
    threading.Timer(0.02, e.set).start()
    t0 = time.monotonic()
    await bridge.aclose()
    assert time.monotonic() - t0 >= 0.015
    assert fut.done() and fut.exception() is None
    with pytest.raises(RuntimeClosed):
        bridge.watch(Ev())


async def test_aclose_without_wait_cancels_pending_and_stops_poller():
    bridge = CompletionBridge().start()
    e = Ev()
    fut = bridge.watch(e)
    with cf.ThreadPoolExecutor(1) as pool:
        gate = threading.Event()
        work = pool.submit(gate.wait, 2)
        wf = bridge.watch(work)
        await bridge.aclose(wait=False)
        assert fut.cancelled() and wf.cancelled()
        gate.set()
        e.set()
    await asyncio.sleep(0.01)  # a late worker callback finds a closed bridge: harmless


async def test_aclose_timeout():
    bridge = CompletionBridge().start()
    bridge.watch(Ev())
    with pytest.raises(TimeoutError):
        await bridge.aclose(timeout=0.01)
    await bridge.aclose(wait=False)


async def test_unwatchable_object():
    async with CompletionBridge() as bridge:
        with pytest.raises(TypeError):
            bridge.watch(object())
        assert bridge.in_flight == 0


async def test_poller_backs_off_when_idle():
    async with CompletionBridge(min_poll=1e-4, max_poll=4e-3) as bridge:
        e = Ev()
        fut = bridge.watch(e)
        await asyncio.sleep(0.1)
        assert e.queries < 80, f"poller spins: {e.queries} queries in 100 ms"
        e.set()
        await settle(fut)


# ---- LayerReadiness ------------------------------------------------------------------------


async def test_layer_readiness_shared_by_two_awaiters():
    evs = [Ev() for _ in range(3)]
    handle = CopyHandle(5, tuple(evs), evs[-1], ("e0", "e1", "e2"))
    async with CompletionBridge() as bridge:
        r = LayerReadiness.watch(bridge, handle)
        assert r.num_layers == 3 and r.op_id == 5 and r.event(1) == "e1"
        assert not r.ready(0)
        a = asyncio.ensure_future(r.wait(1))
        b = asyncio.ensure_future(r.wait_all())
        c = asyncio.ensure_future(r.wait(1))
        evs[0].set()
        await r.wait(0)
        assert r.ready(0) and not r.ready(1)
        c.cancel()  # one waiter gives up: the others are unaffected
        evs[1].set()
        await asyncio.wait_for(a, 2)
        assert not b.done()
        evs[2].set()
        await asyncio.wait_for(b, 2)
        assert r.all_ready() and r.done()
        with pytest.raises(asyncio.CancelledError):
            await c


async def test_layer_readiness_failure_and_shared_completion():
    ev = Ev()
    handle = CopyHandle(1, (ev, ev, ev), ev, None)  # a BACKUP shares one completion
    async with CompletionBridge() as bridge:
        r = LayerReadiness.watch(bridge, handle)
        assert bridge.in_flight == 1  # watched once
        assert r.event(0) is None
        ev.set(RuntimeError("lost"))
        with pytest.raises(TransferError):
            await r.wait(2)
        assert r.done() and not r.ready(0)


async def test_per_rank_readiness_follows_each_ranks_own_copy():
    """A load under one control plane over 2 ranks: rank r's readiness is ready when rank r's
    copy is; the instance's when every rank's is (its layers: the ranks' AND). A failure of one
    rank fails that rank's and the instance's, not the other rank's."""
    ranks = [(Ev(), Ev()), (Ev(), Ev())]
    rank_handles = tuple(CopyHandle(1, layers, layers[-1], None) for layers in ranks)
    both = [Ev(), Ev()]  # the instance's layers (what ShardedCopyEngine's AllRanks gives)
    handle = CopyHandle(1, tuple(both), both[-1], None, rank_handles)
    async with CompletionBridge() as bridge:
        r = LayerReadiness.pending(2, 1, ranks=2)
        assert r.num_ranks == 2 and r.rank(0) is not r.rank(1)
        r.bind(bridge, handle)
        for ev in ranks[1]:
            ev.set()
        await r.rank(1).wait_all()
        assert not r.rank(0).ready(0) and not r.ready(0)
        ranks[0][0].set()
        both[0].set()
        await r.rank(0).wait(0)
        await r.wait(0)
        ranks[0][1].set(RuntimeError("rank 0 lost layer 1"))
        both[1].set(RuntimeError("rank 0: lost"))
        with pytest.raises(TransferError):
            await r.rank(0).wait(1)
        with pytest.raises(TransferError):
            await r.wait_all()
        assert r.rank(1).all_ready()
        for bad in (2, -1, 1.0, None):
            with pytest.raises(ArgumentError):
                r.rank(bad)
        with pytest.raises(InternalError):  # a copy of another rank count never binds
            LayerReadiness.pending(2, 2, ranks=3).bind(bridge, handle)


async def test_one_rank_readiness_is_its_own_rank_0():
    r = LayerReadiness.pending(2, 1)
    assert r.num_ranks == 1 and r.rank(0) is r
    with pytest.raises(ArgumentError):
        r.rank(1)
    r.fail_all(TransferError("gone"))
    assert r.done() and not r.all_ready()


async def test_layer_readiness_completed():
    r = LayerReadiness.completed(4)
    assert r.all_ready()
    await r.wait_all()


async def test_layerwise_load_with_fake_engine():
    """Layer 0 is awaited and read while later layers are in flight; each layer's data is
    right exactly when its readiness resolves."""
    shape = KVShape(4, 2, 8, torch.float16)
    ps = 4
    dev, host = DevicePool(shape, 64, ps), HostPool(shape, 64, ps, "page_first")
    host.buffer.copy_(torch.randn(host.buffer.shape).to(shape.dtype))
    engine = FakeCopyEngine({"kv": (dev, host)})
    rng = np.random.default_rng(0)
    hp, dp = rng.permutation(16)[:6], rng.permutation(16)[:6]
    src = torch.from_numpy((hp[:, None] * ps + np.arange(ps)).reshape(-1))
    dst = torch.from_numpy((dp[:, None] * ps + np.arange(ps)).reshape(-1))
    want = host.read_slots(src)
    async with CompletionBridge() as bridge:
        h = engine.submit(TransferPlan(3, Direction.LOAD, (PoolTransfer("kv", src, dst),)))
        r = LayerReadiness.watch(bridge, h)
        second = LayerReadiness.watch(bridge, h)  # a second request hitting the same loading node

        checked = [asyncio.Event() for _ in range(shape.num_layers)]

        async def model():
            seen = []
            for layer in range(shape.num_layers):
                await r.wait(layer)
                got = dev.read_slots(dst)
                assert torch.equal(got[layer], want[layer]), f"layer {layer} not right when ready"
                if layer + 1 < shape.num_layers:
                    assert not got[layer + 1].any(), "later layer copied before it was released"
                    assert not r.ready(layer + 1)
                seen.append(layer)
                checked[layer].set()
            return seen

        m = asyncio.ensure_future(model())
        for layer in range(shape.num_layers):
            if layer:  # the model has read layer - 1 (an event, not a sleep: under load it may be late)
                await asyncio.wait_for(checked[layer - 1].wait(), 2)
            assert engine.pending() == [3]
            engine.release(3, layers=layer)
        assert await asyncio.wait_for(m, 2) == [0, 1, 2, 3]
        await asyncio.wait_for(second.wait_all(), 2)
        assert engine.pending() == []
        assert torch.equal(dev.read_slots(dst), want)


async def test_readiness_with_fewer_layers_than_the_copy_waits_for_its_last_layer():
    """A plan over pool groups reports as many layers as its deepest pool (a hybrid model's state
    layers beside its KV layers); a load's readiness made for the KV layers must not say "all
    ready" before the copy's last layer is (found by tests/integration/test_recurrent_state.py:
    a resumed state read before the copy wrote it)."""
    async with CompletionBridge() as bridge:
        evs = [Ev(), Ev(), Ev()]
        handle = CopyHandle(7, tuple(evs), evs[-1])
        readiness = LayerReadiness.pending(2, 7)
        readiness.bind(bridge, handle)
        evs[0].set()
        evs[1].set()
        await asyncio.sleep(0.02)
        assert readiness.ready(0) and not readiness.all_ready()
        evs[2].set()
        await settle(asyncio.ensure_future(readiness.wait_all()))
        assert readiness.all_ready()


async def test_readiness_with_fewer_layers_than_the_copy_gives_the_last_layer_the_copy_last_event():
    """The CUDA route of the test above: `event(layer)` is what a model stream waits on instead of
    `wait(layer)`, so the last layer's event must be the copy's last one, as its future is."""
    async with CompletionBridge() as bridge:
        evs = [Ev(), Ev(), Ev()]
        handle = CopyHandle(7, tuple(evs), evs[-1], ("e0", "e1", "e2"))
        readiness = LayerReadiness.pending(2, 7)
        readiness.bind(bridge, handle)
        for ev in evs:
            ev.set()
        await settle(asyncio.ensure_future(readiness.wait_all()))
    assert readiness.event(0) == "e0"
    assert readiness.event(1) == "e2"  # the event after the state's last layer, not after KV layer 1


async def test_readiness_with_more_layers_than_the_copy_waits_for_its_last_layer():
    """The other way round: a model whose sliding layers have a pool of their own copies
    max(full, sliding) layers, fewer than the model's (its readiness): readiness layers past the
    copy's wait for, and carry the event of, the copy's last layer (none is left unbound)."""
    async with CompletionBridge() as bridge:
        evs = [Ev(), Ev()]
        handle = CopyHandle(7, tuple(evs), evs[-1], ("e0", "e1"))
        readiness = LayerReadiness.pending(4, 7)
        readiness.bind(bridge, handle)
        evs[0].set()
        await asyncio.sleep(0.02)
        assert readiness.ready(0) and not readiness.ready(1) and not readiness.ready(3)
        evs[1].set()
        await settle(asyncio.ensure_future(readiness.wait_all()))
    assert readiness.all_ready() and [readiness.event(i) for i in range(4)] == ["e0", "e1", "e1", "e1"]

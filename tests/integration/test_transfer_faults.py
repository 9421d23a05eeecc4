"""Copy failures through CacheRuntime: a failed load or backup rolls back and is reported.

A failing host->device load: the admit's readiness raises `TransferError`, `finish` raises
`TransferError` and releases the request, the load's device slots are freed and nothing is
marked as loaded. A failing device->host backup: its host slots are freed and the node is not
backed up. Every runtime runs with debug_invariants=True (the checker runs after every
message) and ends with the quiescent check.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from runtime.errors import TransferError
from runtime.messages import Direction, TransferPlan
from runtime.runtime import CacheRuntime
from runtime.transfer.cpu_engine import CpuCopyEngine
from runtime.transfer.fake_engine import FakeCopyEngine
from tests.integration.support import (
    bad_positions,
    compute,
    fake_runtime,
    quiescent_check,
    release_all,
    settle,
    small_config,
    toks,
    until,
)


async def serve(rt: CacheRuntime, rid: str, tokens: np.ndarray) -> dict[str, int]:
    res = await rt.admit(rid, tokens)
    for r in res.readiness:
        await r.wait_all()
    assert bad_positions(rt.device_pool, res.slots[: res.cached], tokens) == []
    compute(rt, res.slots, tokens, start=res.cached)
    await rt.finish(rid, tokens)
    return {"cached_device": res.cached_device, "loaded_host": res.loaded_host}


async def push_to_host(rt: CacheRuntime, engine: FakeCopyEngine | None, prompt: np.ndarray, seed: int) -> None:
    """Serve `prompt`, back it up, then serve others until it is on host only."""
    async def done() -> None:
        if engine is not None:
            await release_all(rt, engine)
        else:
            await settle(rt)

    await serve(rt, "warm", prompt)
    await done()
    for i in range(3):
        await serve(rt, f"filler{i}", toks(28, seed + i))
        await done()
    look = await rt.match_prefix(prompt)
    assert look["device"] == 0 and look["host"] > 0, look


def last_plan(engine: FakeCopyEngine, direction: Direction) -> TransferPlan:
    return [p for p in engine.submitted if p.direction is direction][-1]


def device_owners(rt: CacheRuntime, slots: np.ndarray):
    return rt.inspect(lambda core: core.residency.device.owners_of(slots))


def host_owners(rt: CacheRuntime, slots: np.ndarray):
    return rt.inspect(lambda core: core.residency.host.owners_of(slots))


async def test_failed_load_fails_readiness_and_finish_and_rolls_back():
    cfg = small_config(device_slots=64, host_tokens=256)
    async with fake_runtime(cfg) as (rt, engine):
        p0 = toks(28, 20)
        await push_to_host(rt, engine, p0, seed=21)
        host_before = (await rt.match_prefix(p0))["host"]

        res = await rt.admit("b", p0)
        assert res.loaded_host > 0
        await until(lambda: bool(engine.pending()))
        plan = last_plan(engine, Direction.LOAD)
        load_dst = plan.transfers[0].dst.numpy().copy()
        assert set(load_dst.tolist()) <= set(res.slots[: res.cached].tolist())
        engine.fail(plan.op_id, RuntimeError("dma error"))

        with pytest.raises(TransferError) as info:
            await res.readiness[-1].wait_all()
        assert isinstance(info.value.__cause__, RuntimeError)
        await settle(rt)  # the ack (and its rollback) is applied
        # the failed load's device slots are freed, nothing is marked as loaded
        assert set(await device_owners(rt, load_dst)) == {None}
        assert await rt.match_prefix(p0) == {"device": 0, "host": host_before}
        assert await rt.inspect(lambda core: dict(core.copies.loading)) == {}

        with pytest.raises(TransferError):
            await rt.finish("b", p0)
        st = await rt.stats()
        assert st["requests"]["live"] == 0 and st["copies"]["failures"] == 1 and st["requests"]["aborted"] == 1
        await quiescent_check(rt)

        # the host copy is intact: the next request loads it and reads the right KV
        res2 = await rt.admit("c", p0)
        assert res2.loaded_host == res.loaded_host
        await release_all(rt, engine)
        for r in res2.readiness:
            await r.wait_all()
        assert bad_positions(rt.device_pool, res2.slots[: res2.cached], p0) == []
        await rt.abort("c")
        await quiescent_check(rt)


async def test_finish_right_after_readiness_fails_raises_transfer_error():
    """A serving loop that sees the readiness error and finishes at once must get
    `TransferError`, even when the failed load's ack is not applied yet: here it waits
    behind an earlier load still in flight (acks are applied in issue order)."""
    cfg = small_config(device_slots=64, host_tokens=256)
    async with fake_runtime(cfg) as (rt, engine):
        p0, p1 = toks(28, 30), toks(28, 31)
        await serve(rt, "w0", p0)
        await serve(rt, "w1", p1)
        await release_all(rt, engine)
        for i in range(4):
            await serve(rt, f"filler{i}", toks(16, 32 + i))
            await release_all(rt, engine)
        for p in (p0, p1):
            look = await rt.match_prefix(p)
            assert look["device"] == 0 and look["host"] > 0, look

        first = await rt.admit("a", p1)  # its load stays in flight
        await until(lambda: len(engine.pending()) == 1)
        res = await rt.admit("b", p0)
        await until(lambda: len(engine.pending()) == 2)
        plan = last_plan(engine, Direction.LOAD)
        engine.fail(plan.op_id, RuntimeError("dma error"))
        with pytest.raises(TransferError):
            await res.readiness[-1].wait(0)
        with pytest.raises(TransferError):
            await rt.finish("b", p0)
        assert (await rt.stats())["requests"]["live"] == 1

        await release_all(rt, engine)
        for r in first.readiness:
            await r.wait_all()
        assert bad_positions(rt.device_pool, first.slots[: first.cached], p1) == []
        await rt.abort("a")
        await quiescent_check(rt)


async def test_failed_backup_frees_host_slots_and_leaves_node_unbacked():
    async with fake_runtime(small_config(write_policy="write_through")) as (rt, engine):
        p = toks(24, 40)
        await serve(rt, "a", p)
        await until(lambda: bool(engine.pending()))
        plan = last_plan(engine, Direction.BACKUP)
        host_dst = plan.transfers[0].dst.numpy().copy()
        assert (await rt.available())["host_free"] == cfg_host(rt) - len(host_dst)
        engine.fail(plan.op_id, OSError("host write failed"))
        await settle(rt)

        assert set(await host_owners(rt, host_dst)) == {None}
        assert (await rt.available())["host_free"] == cfg_host(rt)
        assert await rt.inspect(lambda core: [n.host for n in core.residency.tree.nodes() if n.host is not None]) == []
        assert await rt.inspect(lambda core: dict(core.copies.backup_pending)) == {}
        assert await rt.match_prefix(p) == {"device": 24, "host": 0}
        assert (await rt.stats())["copies"]["failures"] == 1
        await quiescent_check(rt)

        # the device copy is still good and still serves hits
        again = await serve(rt, "b", np.concatenate((p, toks(5, 41))))
        assert again["cached_device"] == 24
        await release_all(rt, engine)
        await quiescent_check(rt)


def cfg_host(rt: CacheRuntime) -> int:
    return rt.config.host_slots


async def test_cpu_engine_fault_mid_load_keeps_early_layers_and_rolls_back():
    """A real copy engine whose worker raises while copying layer 2 of a load."""
    armed = threading.Event()
    faults: list[tuple[int, int]] = []

    def fault(op_id: int, layer: int) -> None:
        if armed.is_set() and layer == 2:  # backups report layer 0 only: this hits loads
            faults.append((op_id, layer))
            raise RuntimeError("ecc error in layer 2")

    def factory(pools):
        return CpuCopyEngine(pools, fault=fault, load_groups="layer")

    cfg = small_config(num_layers=4, device_slots=64, host_tokens=256)
    async with CacheRuntime.open(cfg, engine_factory=factory) as rt:
        p0 = toks(28, 50)
        await push_to_host(rt, None, p0, seed=51)
        armed.set()
        res = await rt.admit("b", p0)
        assert res.loaded_host > 0
        load = res.readiness[-1]
        await load.wait(0)
        await load.wait(1)  # layers before the fault landed
        for layer in (2, 3):
            with pytest.raises(TransferError) as info:
                await load.wait(layer)
            assert "ecc error" in repr(info.value.__cause__)
        assert len(faults) == 1
        await settle(rt)
        with pytest.raises(TransferError):
            await rt.finish("b", p0)
        st = await rt.stats()
        assert st["copies"]["failures"] == 1 and st["requests"]["live"] == 0 and st["transfer"]["ops_failed"] == 1
        assert (await rt.match_prefix(p0))["device"] == 0
        await quiescent_check(rt)

        armed.clear()
        again = await serve(rt, "c", p0)  # checks every position's KV after the load
        assert again["loaded_host"] > 0
        await settle(rt)
        await quiescent_check(rt)

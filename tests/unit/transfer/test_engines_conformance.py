"""One conformance suite for every copy engine: cpu, fake (auto-released), cuda (GPU only).

Every engine must: copy the right data for every page size and host layout, scattered or
contiguous pages, in both directions, visible as soon as the completion says done; report
LOAD layers in order; surface a failing copy through its completions; validate plans before
copying anything; wait for in-flight copies on close and refuse work afterwards.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from runtime.errors import LengthError, RuntimeClosed, ValidationError
from runtime.memory.pools import DevicePool, HostPool, KVShape
from runtime.memory.state_pool import StateComponent, StatePool, StateShape
from runtime.messages import Direction, PoolTransfer, TransferPlan
from runtime.transfer.cpu_engine import CpuCopyEngine
from runtime.transfer.engine import CopyHandle
from runtime.transfer.fake_engine import FakeCopyEngine

SHAPE = KVShape(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float16)
ENGINES = ["cpu", "fake", pytest.param("cuda", marks=pytest.mark.gpu)]


def make_engine(kind: str, pools, **kw):
    if kind == "cpu":
        return CpuCopyEngine(pools, **kw)
    if kind == "fake":
        return FakeCopyEngine(pools, auto_release=True, **kw)
    from runtime.transfer.cuda_engine import CudaCopyEngine

    return CudaCopyEngine(pools, **kw)


def make_pools(kind: str, ps: int, layout: str, dev_pages: int = 8, host_pages: int = 12, shape: KVShape = SHAPE):
    device = torch.device("cuda") if kind == "cuda" else torch.device("cpu")
    dev = DevicePool(shape, dev_pages * ps, ps, device)
    gen = torch.Generator().manual_seed(ps * 7 + len(layout))
    dev.buffer.copy_(torch.randn(dev.buffer.shape, generator=gen).to(shape.dtype))
    host = HostPool(shape, host_pages * ps, ps, layout, pin_memory=kind == "cuda")
    return dev, host


def slots(pages, ps: int) -> torch.Tensor:
    pages = np.asarray(pages, dtype=np.int64)
    return torch.from_numpy((pages[:, None] * ps + np.arange(ps)).reshape(-1))


def plan(op: int, direction: Direction, src: torch.Tensor, dst: torch.Tensor, pool: str = "kv") -> TransferPlan:
    return TransferPlan(op, direction, (PoolTransfer(pool, src, dst),))


def wait(handle: CopyHandle) -> None:
    handle.done.synchronize()


PATTERNS = {
    # (device pages, host pages)
    "scattered": ([5, 0, 3, 7, 1], [2, 9, 4, 11, 6]),
    "contiguous": ([2, 3, 4, 5], [6, 7, 8, 9]),
    "mixed_runs": ([0, 1, 2, 6, 4, 5], [3, 4, 5, 0, 10, 11]),
}


@pytest.fixture(params=ENGINES)
def kind(request):
    return request.param


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("ps", [1, 16, 64])
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_backup_then_load_roundtrip(kind, ps, layout, pattern):
    dev, host = make_pools(kind, ps, layout)
    dev_pages, host_pages = PATTERNS[pattern]
    engine = make_engine(kind, {"kv": (dev, host)})
    try:
        d_slots, h_slots = slots(dev_pages, ps), slots(host_pages, ps)
        wait(engine.submit(plan(1, Direction.BACKUP, d_slots, h_slots)))
        assert torch.equal(host.read_slots(h_slots), dev.read_slots(d_slots))
        untouched = np.setdiff1d(np.arange(host.num_slots), h_slots.numpy())
        assert not host.read_slots(untouched).any(), "backup wrote outside its destination"

        expect = dev.read_slots(d_slots)
        dev.buffer.zero_()
        # load back into different device pages, in another order
        back = slots(list(reversed(range(len(dev_pages)))), ps)
        h = engine.submit(plan(2, Direction.LOAD, h_slots, back))
        for c in h.layers:
            c.synchronize()
        wait(h)
        assert torch.equal(dev.read_slots(back), expect)
        rest = np.setdiff1d(np.arange(dev.num_slots), back.numpy())
        assert not dev.read_slots(rest).any(), "load wrote outside its destination"
    finally:
        engine.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_runs_and_scattered_pages(kind, layout):
    """Runs of adjacent pages next to single scattered pages, both directions."""
    ps = 4
    dev, host = make_pools(kind, ps, layout, dev_pages=16, host_pages=16)
    engine = make_engine(kind, {"kv": (dev, host)})
    try:
        # sorted by device page: runs 0-2 -> 10-12, 4 -> 6, 7 -> 3, 9 -> 1, 12-13 -> 14-15
        dp = [7, 0, 1, 2, 9, 4, 12, 13]
        hp = [3, 10, 11, 12, 1, 6, 14, 15]
        wait(engine.submit(plan(1, Direction.BACKUP, slots(dp, ps), slots(hp, ps))))
        assert torch.equal(host.read_slots(slots(hp, ps)), dev.read_slots(slots(dp, ps)))
        expect = dev.read_slots(slots(dp, ps))
        dev.buffer.zero_()
        wait(engine.submit(plan(2, Direction.LOAD, slots(hp, ps), slots(dp, ps))))
        assert torch.equal(dev.read_slots(slots(dp, ps)), expect)
    finally:
        engine.close()


def test_large_copy_layers_in_order(kind):
    """LOAD layers finish in order: whenever layer i is done, every earlier layer is done."""
    shape = KVShape(num_layers=8, num_kv_heads=4, head_dim=64, dtype=torch.float16)
    ps = 16
    dev, host = make_pools(kind, ps, "layer_first", dev_pages=64, host_pages=64, shape=shape)
    host.buffer.copy_(torch.randn(host.buffer.shape).to(shape.dtype))
    # the CPU engine is slowed per layer so that partial states are observable
    kw = {"fault": lambda op, layer: time.sleep(0.003)} if kind == "cpu" else {}
    engine = make_engine(kind, {"kv": (dev, host)}, **kw)
    try:
        rng = np.random.default_rng(3)
        src, dst = slots(rng.permutation(64), ps), slots(rng.permutation(64), ps)
        h = engine.submit(plan(1, Direction.LOAD, src, dst))
        assert len(h.layers) == shape.num_layers
        deadline = time.monotonic() + 10
        seen = set()
        while not h.done.query():
            # read last layer first: a layer seen done implies every earlier one (read later) is done
            states = [c.query() for c in reversed(h.layers)][::-1]
            assert states == sorted(states, reverse=True), f"layer completions out of order: {states}"
            seen.add(sum(states))
            assert time.monotonic() < deadline
        if kind == "cpu":
            assert len(seen) > 2, f"no partial progress observed: {seen}"
        assert all(c.query() for c in h.layers)
        assert torch.equal(dev.read_slots(dst), host.read_slots(src))
    finally:
        engine.close()


def test_layer_events(kind):
    dev, host = make_pools(kind, 4, "layer_first")
    engine = make_engine(kind, {"kv": (dev, host)})
    try:
        h = engine.submit(plan(1, Direction.LOAD, slots([0], 4), slots([1], 4)))
        wait(h)
        if kind == "cuda":
            assert h.layer_events is not None and len(h.layer_events) == SHAPE.num_layers
        else:
            assert h.layer_events is None
        assert h.op_id == 1 and len(h.layers) == SHAPE.num_layers
    finally:
        engine.close()


@pytest.mark.parametrize("direction", [Direction.LOAD, Direction.BACKUP])
def test_failing_copy_surfaces(kind, direction):
    class Boom(RuntimeError):
        pass

    def fault(op_id, layer):
        if op_id == 7 and layer == (1 if direction is Direction.LOAD else 0):
            raise Boom("copy failed")

    dev, host = make_pools(kind, 4, "layer_first")
    engine = make_engine(kind, {"kv": (dev, host)}, fault=fault)
    try:
        src, dst = (slots([0, 1], 4), slots([2, 3], 4))
        h = engine.submit(plan(7, direction, src, dst))
        with pytest.raises(Boom):
            h.done.synchronize()
        assert h.done.query()
        if direction is Direction.LOAD:
            h.layers[0].synchronize()  # layer 0 was copied
            for c in h.layers[1:]:
                assert c.query()
                with pytest.raises(Boom):
                    c.synchronize()
        # the engine lives on
        ok = engine.submit(plan(8, direction, src, dst))
        wait(ok)
    finally:
        engine.close()


def test_plan_validation_rejects_before_copying(kind):
    dev, host = make_pools(kind, 4, "layer_first")
    engine = make_engine(kind, {"kv": (dev, host)})
    before = host.buffer.clone()
    try:
        bad = [
            (LengthError, plan(1, Direction.BACKUP, slots([0], 4)[:3], slots([1], 4)[:3])),  # partial page
            (LengthError, plan(1, Direction.BACKUP, slots([0, 1], 4), slots([1], 4))),  # unequal
            (LengthError, plan(1, Direction.BACKUP, torch.tensor([1, 2, 3, 4]), slots([1], 4))),  # misaligned
            (ValidationError, plan(1, Direction.BACKUP, slots([0, 1], 4), slots([2, 2], 4))),  # dst twice
            (ValidationError, plan(1, Direction.BACKUP, slots([0], 4), slots([99], 4))),  # out of range
            (ValidationError, plan(1, Direction.BACKUP, slots([0], 4), slots([1], 4), pool="nope")),
            (ValidationError, plan(1, Direction.BACKUP, slots([0], 4).float(), slots([1], 4))),
        ]
        for exc, p in bad:
            with pytest.raises(exc):
                engine.submit(p)
        assert torch.equal(host.buffer.cpu(), before.cpu())
    finally:
        engine.close()


def test_empty_plan(kind):
    dev, host = make_pools(kind, 4, "layer_first")
    engine = make_engine(kind, {"kv": (dev, host)})
    try:
        e = torch.empty(0, dtype=torch.int64)
        h = engine.submit(plan(1, Direction.LOAD, e, e))
        wait(h)
        assert all(c.query() for c in h.layers)
    finally:
        engine.close()


def test_two_pools_in_one_plan(kind):
    extra_shape = KVShape(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    dev, host = make_pools(kind, 4, "layer_first")
    edev, ehost = make_pools(kind, 4, "page_first", shape=extra_shape)
    engine = make_engine(kind, {"kv": (dev, host), "state": (edev, ehost)})
    try:
        p = TransferPlan(
            3,
            Direction.BACKUP,
            (
                PoolTransfer("kv", slots([1, 2], 4), slots([5, 0], 4)),
                PoolTransfer("state", slots([3], 4), slots([4], 4)),
            ),
        )
        h = engine.submit(p)
        assert len(h.layers) == SHAPE.num_layers
        wait(h)
        assert torch.equal(host.read_slots(slots([5, 0], 4)), dev.read_slots(slots([1, 2], 4)))
        assert torch.equal(ehost.read_slots(slots([4], 4)), edev.read_slots(slots([3], 4)))
    finally:
        engine.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_pool_groups_in_one_plan(kind, layout):
    """One plan over real pool groups: an MLA-style latent pool (one part per token) and a
    recurrent-state pool's components (one-slot pages, a component dtype each), both directions."""
    latent = KVShape(num_layers=2, num_kv_heads=1, head_dim=12, dtype=torch.bfloat16, parts=1)
    dev, host = make_pools(kind, 4, layout, shape=latent)
    state = StateShape(2, (StateComponent("conv", (6, 3), torch.float16), StateComponent("ssm", (2, 4, 5))))
    device = torch.device("cuda") if kind == "cuda" else torch.device("cpu")
    sdev, shost = StatePool(state, 6, device), StatePool(state, 9, pin_memory=kind == "cuda")
    gen = torch.Generator().manual_seed(3)
    for b in sdev.buffers.values():
        b.copy_(torch.randn(b.shape, generator=gen).to(b.dtype))
    pools = {"kv": (dev, host), **{name: (d, h) for (name, d), (_, h) in zip(sdev.component_pools(),
                                                                               shost.component_pools())}}
    engine = make_engine(kind, pools)
    try:
        state_moves = lambda direction, src, dst: tuple(  # noqa: E731
            PoolTransfer(name, torch.tensor(src), torch.tensor(dst)) for name, _ in sdev.component_pools())
        h = engine.submit(TransferPlan(1, Direction.BACKUP, (PoolTransfer("kv", slots([1, 6], 4), slots([5, 0], 4)),
                                                             *state_moves(Direction.BACKUP, [4, 1], [8, 2]))))
        wait(h)
        assert torch.equal(host.read_slots(slots([5, 0], 4)), dev.read_slots(slots([1, 6], 4)))
        for s, d in ((4, 8), (1, 2)):
            assert torch.equal(shost.read_slot(d), sdev.read_slot(s))
        h = engine.submit(TransferPlan(2, Direction.LOAD, (PoolTransfer("kv", slots([5], 4), slots([2], 4)),
                                                           *state_moves(Direction.LOAD, [8], [0]))))
        wait(h)
        assert torch.equal(dev.read_slots(slots([2], 4)), dev.read_slots(slots([1], 4)))
        assert torch.equal(sdev.read_slot(0), sdev.read_slot(4))
        assert not torch.equal(sdev.read_slot(0), sdev.read_slot(1))
    finally:
        engine.close()


def test_close_waits_for_in_flight_and_refuses_new_work(kind):
    shape = KVShape(num_layers=16, num_kv_heads=4, head_dim=64, dtype=torch.float16)
    dev, host = make_pools(kind, 16, "layer_first", dev_pages=64, host_pages=64, shape=shape)
    engine = make_engine(kind, {"kv": (dev, host)})
    rng = np.random.default_rng(5)
    handles = [
        engine.submit(plan(i, Direction.BACKUP, slots(rng.permutation(64), 16), slots(rng.permutation(64), 16)))
        for i in range(3)
    ]
    engine.close()
    for h in handles:
        assert h.done.query()
        assert all(c.query() for c in h.layers)
    with pytest.raises(RuntimeClosed):
        engine.submit(plan(9, Direction.BACKUP, slots([0], 16), slots([0], 16)))
    engine.close()  # idempotent


def test_duplicate_op_id_in_flight_rejected():
    """An op id names one in-flight copy (fake engine: deterministic in-flight state)."""
    dev, host = make_pools("fake", 4, "layer_first")
    engine = FakeCopyEngine({"kv": (dev, host)})
    engine.submit(plan(1, Direction.BACKUP, slots([0], 4), slots([0], 4)))
    with pytest.raises(ValidationError):
        engine.submit(plan(1, Direction.BACKUP, slots([1], 4), slots([1], 4)))
    engine.release(1)
    engine.submit(plan(1, Direction.BACKUP, slots([1], 4), slots([1], 4)))  # free again once done
    engine.release(1)
    engine.close(timeout=1)


def test_cpu_load_does_not_wait_behind_backup():
    """Loads and backups run on separate workers: a load is not queued behind a long backup."""
    gate = threading.Event()

    def fault(op_id, layer):
        if op_id == 1:
            gate.wait(5)

    dev, host = make_pools("cpu", 4, "layer_first")
    engine = CpuCopyEngine({"kv": (dev, host)}, fault=fault, inline_backup_bytes=0)  # (a worker's backup)
    try:
        backup = engine.submit(plan(1, Direction.BACKUP, slots([0], 4), slots([0], 4)))
        load = engine.submit(plan(2, Direction.LOAD, slots([1], 4), slots([2], 4)))
        load.done.synchronize()
        assert not backup.done.query()
        assert engine.inflight() == [1]
        gate.set()
        backup.done.synchronize()
    finally:
        gate.set()
        engine.close()


def test_fake_release_layers_and_fail():
    dev, host = make_pools("fake", 4, "layer_first")
    host.buffer.copy_(torch.randn(host.buffer.shape).to(SHAPE.dtype))
    dev.buffer.zero_()
    engine = FakeCopyEngine({"kv": (dev, host)})
    src, dst = slots([1, 2], 4), slots([3, 0], 4)
    h = engine.submit(plan(1, Direction.LOAD, src, dst))
    assert engine.pending() == [1]
    assert not any(c.query() for c in h.layers) and not dev.buffer.any()
    engine.release(1, layers=0)
    assert [c.query() for c in h.layers] == [True, False, False]
    got = dev.read_slots(dst)
    want = host.read_slots(src)
    assert torch.equal(got[0], want[0]) and not got[1:].any()
    with pytest.raises(TimeoutError):
        h.layers[1].synchronize(timeout=0.01)
    engine.fail(1, RuntimeError("gone"))
    assert engine.pending() == []
    with pytest.raises(RuntimeError, match="gone"):
        h.layers[2].synchronize()
    with pytest.raises(RuntimeError, match="gone"):
        h.done.synchronize()
    h.layers[0].synchronize()  # released before the failure: fine


def test_fake_synchronize_from_waiter_thread():
    """synchronize() blocks (threading.Event) until the test releases from another thread."""
    dev, host = make_pools("fake", 4, "layer_first")
    engine = FakeCopyEngine({"kv": (dev, host)})
    h = engine.submit(plan(1, Direction.BACKUP, slots([0], 4), slots([0], 4)))
    result = []
    t = threading.Thread(target=lambda: (h.done.synchronize(), result.append("done")))
    t.start()
    time.sleep(0.01)
    assert result == []
    engine.release(1)
    t.join(2)
    assert result == ["done"]
    engine.close(timeout=1)


def test_fake_close_waits_for_release_from_other_thread():
    dev, host = make_pools("fake", 4, "layer_first")
    engine = FakeCopyEngine({"kv": (dev, host)})
    engine.submit(plan(1, Direction.BACKUP, slots([0], 4), slots([0], 4)))
    with pytest.raises(TimeoutError):
        engine.close(timeout=0.01)
    threading.Timer(0.02, engine.release, args=(1,)).start()
    engine.close(timeout=2)
    assert engine.pending() == []


@pytest.mark.gpu
def test_cuda_layer_events_order_a_consumer_stream():
    from runtime.transfer.cuda_engine import CudaCopyEngine

    dev, host = make_pools("cuda", 16, "layer_first", dev_pages=32, host_pages=32)
    host.buffer.copy_(torch.randn(host.buffer.shape).to(SHAPE.dtype))
    engine = CudaCopyEngine({"kv": (dev, host)})
    try:
        src, dst = slots(np.arange(32), 16), slots(np.arange(32)[::-1].copy(), 16)
        h = engine.submit(plan(1, Direction.LOAD, src, dst))
        consumer = torch.cuda.Stream()
        with torch.cuda.stream(consumer):
            consumer.wait_event(h.layer_events[-1])
            out = dev.buffer[:, -1].clone()
        consumer.synchronize()
        assert torch.equal(out.cpu()[:, dst], host.read_slots(src)[-1])
    finally:
        engine.close()


@pytest.mark.parametrize("copy_threads", [1, 2, 3])
@pytest.mark.parametrize("load_groups", ["layer", "geometric"])
def test_cpu_engine_options_roundtrip(copy_threads, load_groups):
    shape = KVShape(num_layers=5, num_kv_heads=2, head_dim=8, dtype=torch.float16)
    ps = 4
    dev, host = make_pools("cpu", ps, "page_first", dev_pages=24, host_pages=24, shape=shape)
    engine = CpuCopyEngine({"kv": (dev, host)}, copy_threads=copy_threads, load_groups=load_groups)
    try:
        rng = np.random.default_rng(copy_threads)
        # a long run (device 0-5 -> host 10-15) next to scattered pages
        dp = np.concatenate([np.arange(6), rng.permutation(np.arange(6, 24))[:11]])
        hp = np.concatenate([np.arange(10, 16), rng.permutation(np.setdiff1d(np.arange(24), np.arange(10, 16)))[:11]])
        wait(engine.submit(plan(1, Direction.BACKUP, slots(dp, ps), slots(hp, ps))))
        assert torch.equal(host.read_slots(slots(hp, ps)), dev.read_slots(slots(dp, ps)))
        expect = dev.read_slots(slots(dp, ps))
        dev.buffer.zero_()
        h = engine.submit(plan(2, Direction.LOAD, slots(hp, ps), slots(dp, ps)))
        for c in h.layers:
            c.synchronize()
        assert torch.equal(dev.read_slots(slots(dp, ps)), expect)
    finally:
        engine.close()


def test_shard_pages_cover_every_pair_once():
    from runtime.transfer.engine import shard_pages

    src = np.arange(10, 27, dtype=np.int64)
    dst = np.arange(40, 57, dtype=np.int64)
    for k, min_pages, want_parts in [(1, 1, 1), (2, 1, 2), (3, 1, 3), (5, 4, 4), (2, 9, 1), (2, 100, 1)]:
        parts = shard_pages(src, dst, k, min_pages)
        assert len(parts) == want_parts
        assert np.array_equal(np.concatenate([p[0] for p in parts]), src)
        assert np.array_equal(np.concatenate([p[1] for p in parts]), dst)
        sizes = [p[0].size for p in parts]
        assert max(sizes) - min(sizes) <= 1
    empty = np.empty(0, dtype=np.int64)
    assert shard_pages(empty, empty, 2) == []


def test_cpu_engine_rejects_bad_options():
    from runtime.errors import ConfigError

    dev, host = make_pools("cpu", 4, "layer_first")
    for kw in (dict(copy_threads=0), dict(workers_per_direction=0), dict(load_groups="half")):
        with pytest.raises(ConfigError):
            CpuCopyEngine({"kv": (dev, host)}, **kw)
    other = HostPool(SHAPE, 32, 8)
    with pytest.raises(ConfigError):
        CpuCopyEngine({"kv": (dev, other)})  # page sizes differ
    with pytest.raises(ConfigError):
        CpuCopyEngine({})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("ps", [1, 16])
def test_every_kv_dtype_roundtrip(kind, dtype, layout, ps):
    """Engines move bytes: 1-byte fp8 rows (16 bytes at page size 1 here) copy like any other."""
    shape = KVShape(num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype)
    dev, host = make_pools(kind, ps, layout, shape=shape)
    engine = make_engine(kind, {"kv": (dev, host)})
    as_bytes = lambda t: t.cpu().contiguous().view(torch.uint8)  # noqa: E731 - no fp8 equality kernel on CPU
    try:
        dp, hp = slots([5, 0, 3], ps), slots([9, 2, 4], ps)
        wait(engine.submit(plan(1, Direction.BACKUP, dp, hp)))
        expect = as_bytes(dev.read_slots(dp))
        assert torch.equal(as_bytes(host.read_slots(hp)), expect)
        dev.buffer.zero_()
        back = slots([7, 1, 6], ps)
        wait(engine.submit(plan(2, Direction.LOAD, hp, back)))
        assert torch.equal(as_bytes(dev.read_slots(back)), expect)
        assert not as_bytes(dev.read_slots(np.setdiff1d(np.arange(dev.num_slots), back.numpy()))).any()
    finally:
        engine.close()


def test_cpu_small_backup_is_copied_inline_and_a_large_one_by_its_worker():
    """A backup of at most `inline_backup_bytes` is done when `submit` returns (no thread hand-off),
    with its fault still reported through its completion; a larger one goes to the worker."""
    dev, host = make_pools("cpu", 4, "layer_first")
    faults = []

    def page(pool, p):  # (layer_first: [C, L, slots, H, D])
        return pool.buffer[:, :, p * 4: (p + 1) * 4]

    def fault(op_id, layer):
        if op_id == 2:
            faults.append(op_id)
            raise RuntimeError("injected")

    page_bytes = dev.shape.parts * dev.shape.num_layers * dev.page_size * dev.shape.token_elems * dev.shape.itemsize
    engine = CpuCopyEngine({"kv": (dev, host)}, fault=fault, inline_backup_bytes=page_bytes)
    try:
        small = engine.submit(plan(1, Direction.BACKUP, slots([1], 4), slots([3], 4)))
        assert small.done.query() and engine.inflight() == []
        assert torch.equal(page(host, 3), page(dev, 1))
        failed = engine.submit(plan(2, Direction.BACKUP, slots([2], 4), slots([0], 4)))
        assert failed.done.query() and faults == [2]
        with pytest.raises(RuntimeError, match="injected"):
            failed.done.synchronize()
        large = engine.submit(plan(3, Direction.BACKUP, slots([0, 2], 4), slots([1, 2], 4)))
        large.done.synchronize()
        assert torch.equal(page(host, 2), page(dev, 2))
    finally:
        engine.close()


def test_cpu_load_submitted_behind_queued_backups_completes_first():
    """Loads first: backups queued (and one started) before a load wait while it is in flight, so
    that the load, slowed here to 30 ms, finishes before any of them, even the one that was
    already running (it yields before its first step)."""
    gate = threading.Event()

    def fault(op_id, layer):
        if op_id == 1:
            gate.wait(5)  # the first backup is running (on its worker) when the load comes
        if op_id == 4 and layer == 0:
            time.sleep(0.03)

    dev, host = make_pools("cpu", 4, "layer_first")
    engine = CpuCopyEngine({"kv": (dev, host)}, fault=fault, inline_backup_bytes=0)
    order: list[int] = []
    try:
        wait(engine.submit(plan(9, Direction.LOAD, slots([7], 4), slots([7], 4))))  # (the kernel compiled)
        handles = [engine.submit(plan(i, Direction.BACKUP, slots([i], 4), slots([i], 4))) for i in (1, 2, 3)]
        load = engine.submit(plan(4, Direction.LOAD, slots([5], 4), slots([6], 4)))
        for h in (*handles, load):
            h.done.future.add_done_callback(lambda _f, op=h.op_id: order.append(op))
        gate.set()
        for h in (load, *handles):
            h.done.synchronize()
        assert order == [4, 1, 2, 3]
        assert torch.equal(dev.read_slots(slots([6], 4)), host.read_slots(slots([5], 4)))
        assert torch.equal(host.read_slots(slots([3], 4)), dev.read_slots(slots([3], 4)))
    finally:
        gate.set()
        engine.close()

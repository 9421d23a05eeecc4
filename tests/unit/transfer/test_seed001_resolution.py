"""Seed 001: the transfer side derives what it needs into new objects and never mutates a plan.

Regression scenario: a transfer whose plan is resolved by the transfer side (indices
converted, sorted, merged) leaves the node's recorded host/device indices bit-identical, and
a later host eviction frees exactly the original host slots. The check is shown to fail
against deliberately broken resolvers (in-place sort, in-place conversion, shared storage).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.errors import ValidationError
from runtime.memory.ledger import SlotLedger
from runtime.memory.owners import Owner, Tier
from runtime.memory.pools import DevicePool, HostPool, KVShape
from runtime.memory.state_pool import StateComponent, StatePool, StateShape
from runtime.messages import Direction, PoolTransfer, TransferPlan
from runtime.transfer.cpu_engine import CpuCopyEngine
from runtime.transfer.engine import ResolvedPlan, resolve
from runtime.transfer.fake_engine import FakeCopyEngine
from runtime.tree.groups.recurrent import RecurrentStates

PS = 4
SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16)


# ---- the check ------------------------------------------------------------------------------


def _ranges_of(obj, out: list) -> list:
    """Memory ranges [lo, hi) of every array / tensor reachable from a resolved object."""
    if isinstance(obj, np.ndarray):
        if obj.size:
            lo, hi = np.lib.array_utils.byte_bounds(obj)
            out.append((lo, hi, obj))
    elif isinstance(obj, torch.Tensor):
        st = obj.untyped_storage()
        out.append((st.data_ptr(), st.data_ptr() + max(st.nbytes(), 1), obj))
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _ranges_of(getattr(obj, f.name), out)
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            _ranges_of(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            _ranges_of(x, out)
    return out


def assert_resolution_pure(resolver, plan: TransferPlan, *args) -> object:
    """Run ``resolver(plan, *args)``; fail if it changed the plan's tensors or if anything it
    derived shares storage with them."""
    before = [(t.src, t.dst, t.src.clone(), t.dst.clone(), t.src.device, t.dst.device) for t in plan.transfers]
    storages = [(t.src.untyped_storage(), t.dst.untyped_storage()) for t in plan.transfers]
    derived = resolver(plan, *args)
    for t, (src, dst, src0, dst0, sdev, ddev) in zip(plan.transfers, before):
        assert t.src is src and t.dst is dst, "plan tensors were replaced"
        assert t.src.device == sdev and t.dst.device == ddev, "plan tensors were moved"
        assert torch.equal(t.src, src0) and torch.equal(t.dst, dst0), "plan tensors were modified in place"
    plan_ranges = []
    for s_st, d_st in storages:
        for st in (s_st, d_st):
            plan_ranges.append((st.data_ptr(), st.data_ptr() + max(st.nbytes(), 1)))
    for lo, hi, obj in _ranges_of(derived, []):
        if isinstance(obj, torch.Tensor):
            assert obj.untyped_storage().data_ptr() not in [p for p, _ in plan_ranges], "derived tensor shares storage"
        for plo, phi in plan_ranges:
            assert hi <= plo or lo >= phi, f"derived {type(obj).__name__} shares memory with the plan"
    return derived


# ---- broken variants (each must be caught) ---------------------------------------------------


def broken_sort_in_place(plan: TransferPlan, ps: int):
    """Sorts the plan's own index tensors (by src) in place, then derives from them."""
    for t in plan.transfers:
        order = torch.argsort(t.src)
        t.dst.copy_(t.dst[order])
        t.src.copy_(t.src[order])
    return resolve(plan, ps)


def broken_convert_in_place(plan: TransferPlan, ps: int):
    """Converts slot indices to page indices inside the plan's tensors (the seed-001 shape)."""
    for t in plan.transfers:
        t.src.div_(ps, rounding_mode="floor")
        t.dst.div_(ps, rounding_mode="floor")
    return [(t.src, t.dst) for t in plan.transfers]


def broken_shared_view(plan: TransferPlan, ps: int):
    """Mutates nothing yet, but hands out views of the plan's storage (a later in-place
    step on them would write into the tree's indices)."""
    return [(t.src.numpy()[::ps], t.dst[::ps]) for t in plan.transfers]


def scattered_plan(op_id: int = 1) -> TransferPlan:
    src = torch.tensor([pg * PS + i for pg in (5, 1, 3) for i in range(PS)], dtype=torch.int64)
    dst = torch.tensor([pg * PS + i for pg in (0, 7, 2) for i in range(PS)], dtype=torch.int64)
    return TransferPlan(op_id, Direction.BACKUP, (PoolTransfer("kv", src, dst),))


def test_resolve_is_pure_and_read_only():
    plan = scattered_plan()
    r = assert_resolution_pure(resolve, plan, PS)
    assert isinstance(r, ResolvedPlan) and r.op_id == 1 and r.direction is Direction.BACKUP
    (t,) = r.transfers
    assert t.src_pages.tolist() == [1, 3, 5] and t.dst_pages.tolist() == [7, 2, 0]
    assert t.runs.tolist() == [[1, 7, 1], [3, 2, 1], [5, 0, 1]]
    for a in (t.src_pages, t.dst_pages, t.runs):
        assert not a.flags.writeable
        with pytest.raises(ValueError):
            a[0] = 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.op_id = 2  # type: ignore[misc]


def test_resolve_merges_runs_without_touching_plan():
    src = torch.arange(8 * PS, dtype=torch.int64).flip(0).reshape(8, PS).flip(1).reshape(-1)  # pages 7..0
    dst = torch.arange(8 * PS, 16 * PS, dtype=torch.int64).reshape(8, PS).flip(0).reshape(-1)  # pages 15..8
    plan = TransferPlan(1, Direction.LOAD, (PoolTransfer("kv", src, dst),))
    r = assert_resolution_pure(resolve, plan, {"kv": PS})
    assert r.transfers[0].runs.tolist() == [[0, 8, 8]]  # one run after sorting by src


@pytest.mark.parametrize("broken", [broken_sort_in_place, broken_convert_in_place, broken_shared_view])
def test_check_detects_broken_resolvers(broken):
    with pytest.raises(AssertionError):
        assert_resolution_pure(broken, scattered_plan(), PS)


@pytest.mark.parametrize("engine_kind", ["cpu", "fake"])
def test_engines_leave_plan_bit_identical(engine_kind):
    dev, host = DevicePool(SHAPE, 8 * PS, PS), HostPool(SHAPE, 8 * PS, PS)
    pools = {"kv": (dev, host)}
    engine = CpuCopyEngine(pools) if engine_kind == "cpu" else FakeCopyEngine(pools, auto_release=True)
    try:

        def submit_and_wait(plan):
            h = engine.submit(plan)
            h.done.synchronize()
            return h

        for direction in Direction:
            p = scattered_plan()
            p = TransferPlan(int(direction is Direction.LOAD), direction, p.transfers)
            assert_resolution_pure(submit_and_wait, p)
    finally:
        engine.close()


class _Node:
    """What the tree records for a node: its own device and host slot tensors."""

    def __init__(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        self.device_slots = device_slots
        self.host_slots = host_slots


def _scenario(resolver_engine_submit):
    """Back a node's pages up to host through ``resolver_engine_submit(plan)``; the tree then
    unpins by the node's recorded host slots. Returns the node, copies of its indices taken
    before, the host ledger and the node's owner."""
    host_ledger = SlotLedger(8 * PS, PS, Tier.HOST)
    node_owner = Owner.node(1)
    filler = Owner.node(99)
    taken = host_ledger.alloc(8, filler)
    # free pages 6, 1, 4 so that the node gets scattered, unsorted host pages
    for pg in (6, 1, 4):
        host_ledger.free(taken[pg * PS : (pg + 1) * PS], filler)
    node_host = host_ledger.alloc(3, node_owner)
    node = _Node(torch.tensor([pg * PS + i for pg in (2, 7, 0) for i in range(PS)]), torch.from_numpy(node_host))
    dev_before, host_before = node.device_slots.clone(), node.host_slots.clone()
    # worst case: the plan references the node's own tensors (what the seed bug had)
    plan = TransferPlan(11, Direction.BACKUP, (PoolTransfer("kv", node.device_slots, node.host_slots),))
    host_ledger.pin(node.host_slots.numpy(), plan.op_id)
    resolver_engine_submit(plan)
    host_ledger.unpin(node.host_slots.numpy(), plan.op_id)
    return node, dev_before, host_before, host_ledger, node_owner


def test_seed001_regression_scenario_engine_resolution():
    dev, host = DevicePool(SHAPE, 8 * PS, PS), HostPool(SHAPE, 8 * PS, PS)
    dev.buffer.copy_(torch.randn(dev.buffer.shape).to(SHAPE.dtype))
    engine = CpuCopyEngine({"kv": (dev, host)})
    try:
        node, dev_before, host_before, ledger, owner = _scenario(lambda p: engine.submit(p).done.synchronize())
    finally:
        engine.close()
    assert torch.equal(node.device_slots, dev_before) and torch.equal(node.host_slots, host_before)
    assert node.host_slots.device.type == "cpu"
    assert torch.equal(host.read_slots(node.host_slots), dev.read_slots(node.device_slots))
    free_before = ledger.num_free_pages()
    ledger.free(node.host_slots.numpy(), owner)  # host eviction by the recorded slots
    assert ledger.num_free_pages() == free_before + 3
    assert ledger.pages_owned_by(owner) == 0
    freed = set(host_before.numpy()[::PS] // PS)
    assert all(ledger.owner_of(int(p) * PS) is None for p in freed)


@pytest.mark.parametrize("broken", [broken_sort_in_place, broken_convert_in_place])
def test_seed001_regression_scenario_fails_with_broken_resolver(broken):
    holder = {}

    def run(plan):
        holder["node_tensors"] = (plan.transfers[0].src, plan.transfers[0].dst, plan.transfers[0].src.clone(), plan.transfers[0].dst.clone())
        broken(plan, PS)

    try:
        node, dev_before, host_before, ledger, owner = _scenario(run)
    except Exception:
        # the tree's own unpin by the node's recorded slots was refused: state polluted
        src, dst, src0, dst0 = holder["node_tensors"]
        assert not (torch.equal(src, src0) and torch.equal(dst, dst0))
        return
    # the node's recorded indices are no longer bit-identical (sorting also scrambles the
    # node's device<->host page pairing)
    assert not (torch.equal(node.device_slots, dev_before) and torch.equal(node.host_slots, host_before))
    # and a later host eviction does not free exactly the original host slots, or refuses
    original = {int(p) for p in host_before.numpy()[::PS] // PS}
    try:
        ledger.free(node.host_slots.numpy(), owner)
    except Exception:
        return
    if broken is broken_convert_in_place:
        assert not all(ledger.owner_of(p * PS) is None for p in original)


@pytest.mark.gpu
def test_cuda_engine_leaves_cpu_indices_on_cpu():
    from runtime.transfer.cuda_engine import CudaCopyEngine

    dev = DevicePool(SHAPE, 8 * PS, PS, "cuda")
    host = HostPool(SHAPE, 8 * PS, PS, pin_memory=True)
    engine = CudaCopyEngine({"kv": (dev, host)})
    try:
        assert_resolution_pure(lambda p: engine.submit(p).done.synchronize(), scattered_plan())
    finally:
        engine.close()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=24), st.sampled_from([1, 2, 4]))
def test_resolved_runs_are_exactly_the_page_pairs(pairs, ps):
    """The runs (src start, dst start, length) expand to the plan's page pairs in source order,
    whatever the order given; a destination page twice is refused. (The run computation was
    rewritten for speed; checked failing with a run length off by one.)"""
    src = np.array([p for p, _ in pairs], dtype=np.int64)
    dst = np.array([q for _, q in pairs], dtype=np.int64)
    expand = lambda pages: (pages[:, None] * ps + np.arange(ps)).reshape(-1)  # noqa: E731
    plan = TransferPlan(1, Direction.BACKUP, (PoolTransfer("kv", torch.from_numpy(expand(src)),
                                                           torch.from_numpy(expand(dst))),))
    if len(set(dst.tolist())) < len(dst):
        with pytest.raises(ValidationError):
            resolve(plan, ps)
        return
    t = resolve(plan, ps).transfers[0]
    order = np.argsort(src, kind="stable")
    want = list(zip(src[order].tolist(), dst[order].tolist()))
    got = [(s + k, d + k) for s, d, n in t.runs.tolist() for k in range(n)]
    assert got == want and list(zip(t.src_pages.tolist(), t.dst_pages.tolist())) == want
    assert all(n >= 1 for _, _, n in t.runs.tolist())


# ---- seed 001 over real pool groups: a hybrid model's KV and recurrent state --------------------


def _hybrid_backup(resolve_plan):
    """A hybrid model's core (KV pool + a recurrent state of two components) backs a node up:
    one plan with a `PoolTransfer` for the KV and one per state component, resolved by
    `resolve_plan(plan)` (the engine's side). Returns the core, the node and what it recorded."""
    from runtime.config import RuntimeConfig
    from runtime.invariants import check_invariants
    from runtime.tree.cache import CacheCore
    from tests.tokens import toks

    core = CacheCore(RuntimeConfig(num_layers=2, num_kv_heads=1, head_dim=2, page_size=PS, device_slots=64,
                                   host_tokens=64, write_policy="write_through", state_layers=2,
                                   state_components="conv:3x2:float32,ssm:2x2:float32", state_slots=8))
    prompt = toks(13, 7)
    core.admit("a", prompt)
    core.snapshot("a", 12)
    core.finish("a", prompt)
    (plan, _), = core.take_effects().copies
    assert [t.pool for t in plan.transfers] == ["kv", "state.conv", "state.ssm"]
    states = core.residency.group(RecurrentStates)
    (node, slot), = states.node_state.items()
    op = core.copies.ops[plan.op_id]
    recorded = (node.device.copy(), slot)
    host_recorded = (op.host.copy(), int(states.copies[op.op_id].dst[0]))  # what the ack hands to the node
    resolve_plan(plan)
    core.apply_ack(plan.op_id, None)
    check_invariants(core)
    return core, node, recorded, host_recorded


_STATE = StateShape(2, (StateComponent("conv", (3, 2)), StateComponent("ssm", (2, 2))))


def _engine_resolution(plan: TransferPlan) -> None:
    engine = FakeCopyEngine({"kv": (DevicePool(KVShape(2, 1, 2, torch.float32), 64, PS),
                                    HostPool(KVShape(2, 1, 2, torch.float32), 64, PS)),
                             **{name: (dev, host) for (name, dev), (_, host) in zip(StatePool(_STATE, 8).component_pools(),
                                                                                  StatePool(_STATE, 16).component_pools())}}, auto_release=True)
    try:
        assert_resolution_pure(lambda p: engine.submit(p).done.synchronize(), plan)
    finally:
        engine.close()


@pytest.mark.parametrize("broken", [None, broken_sort_in_place, broken_convert_in_place])
def test_seed001_over_pool_groups(broken):
    """Resolving a plan over every group (in place, even, for the broken resolvers) leaves the
    node's recorded KV and state indices bit-identical (the plan owns fresh copies), and a later
    host eviction frees exactly the recorded host slots of every group. Checked failing by hand:
    with the state transfers made as views of the copy's own slot arrays (`RecurrentStates.transfers`
    without `.copy()`), the in-place conversion leaves the node a wrong host state slot."""
    sizes = {"kv": PS, "state.conv": 1, "state.ssm": 1} if broken is broken_sort_in_place else PS
    resolve_plan = _engine_resolution if broken is None else (lambda plan: broken(plan, sizes))
    core, node, (device, slot), (host, host_slot) = _hybrid_backup(resolve_plan)
    states = core.residency.group(RecurrentStates)
    assert np.array_equal(node.device, device) and states.node_state[node] == slot
    assert np.array_equal(node.host, host) and states.host_state[node] == host_slot
    kv_free, state_free = core.residency.host.num_free_pages(), states.host_ledger.num_free_pages()
    core.residency.drop_device(node)  # host-only now; then the host eviction deletes it
    core.residency.evict_host(node.num_tokens // PS)
    assert core.residency.host.num_free_pages() == kv_free + len(host) // PS
    assert states.host_ledger.num_free_pages() == state_free + 1
    assert all(core.residency.host.owner_of(int(s)) is None for s in host)
    assert states.host_ledger.owner_of(host_slot) is None

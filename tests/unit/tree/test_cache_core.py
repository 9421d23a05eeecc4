"""The tree core driven by hand, with no event loop.

`CacheCore` is built directly, as vLLM's tests build its `KVCacheManager`; copies are "done" by
applying their acks (`apply_ack`), loads' readiness is a `ManualReadiness` settled by the test.
The invariant checker runs after every step. These tests are plain functions: were the core to
touch asyncio (a future needs a running loop), they would fail.
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime.config import RuntimeConfig
from runtime.errors import ArgumentError, CapacityError, InternalError, LengthError, StateError, UnknownRequestError
from runtime.invariants import check_invariants
from runtime.messages import Direction
from runtime.tree.cache import CacheCore
from runtime.tree.readiness import ManualReadiness
from tests.tokens import toks


def make_core(**changes) -> CacheCore:
    base = dict(num_layers=2, num_kv_heads=1, head_dim=2, page_size=4, device_slots=64, host_tokens=256,
                write_policy="write_through", debug_invariants=True)
    base.update(changes)
    return CacheCore(RuntimeConfig(**base))


def ack_all(core: CacheCore, direction: Direction | None = None, error: str | None = None) -> list[int]:
    """Apply the acks of every copy in flight (of `direction`), in issue order; returns their ids."""
    done = [op_id for op_id, op in sorted(core.copies.ops.items()) if direction is None or op.direction is direction]
    for op_id in done:
        if op_id in core.copies.ops:  # (a batch's backups are acked with its first)
            core.apply_ack(op_id, error)
            check_invariants(core)
    core.take_effects()
    return done


def cached_host_only(core: CacheCore, *prefixes: np.ndarray) -> None:
    """Cache each prefix (backed up to host), then push them all off device with one large
    request (aborted): the tree holds them host-only."""
    for i, p in enumerate(prefixes):
        t = np.concatenate((p, toks(1, 900 + i)))
        core.admit(f"w{i}", t)
        core.finish(f"w{i}", p)
        check_invariants(core)
    ack_all(core)
    av = core.available()
    core.admit("big", toks(av["device_free"] + av["device_evictable"], 999))
    core.abort("big")
    check_invariants(core)
    assert core.match_prefix(np.concatenate((prefixes[-1], toks(1, 1)))) == {"device": 0, "host": len(prefixes[-1])}


def test_admit_cache_finish_without_a_loop():
    core = make_core()
    p = toks(21, 1)
    res = core.admit("a", p)
    assert res.cached == 0 and len(res.slots) == 21
    assert core.cache("a", p[:16]) == 16
    assert core.finish("a", p) == 20
    check_invariants(core)
    assert core.match_prefix(p) == {"device": 20, "host": 0}
    ack_all(core)  # the write-through backups
    check_invariants(core, quiescent=True)


def test_cache_and_finish_wait_for_the_load_of_their_prefix():
    core = make_core()
    x = toks(16, 2)
    cached_host_only(core, x)
    c = np.concatenate((x, toks(3, 3)))
    res = core.admit("c", c)
    assert res.loaded_host == 16 and len(res.readiness) == 1
    ready = res.readiness[0]
    assert isinstance(ready, ManualReadiness)
    with pytest.raises(StateError):
        core.cache("c", c)
    with pytest.raises(StateError):
        core.finish("c", c)
    check_invariants(core)
    ready.complete()
    assert core.finish("c", c) == 16
    ack_all(core)
    check_invariants(core, quiescent=True)


def test_a_failed_load_orphans_the_load_started_under_it():
    """X then X+Y cached and host-only; `c` loads X, `d` loads Y under X's load; X's load fails:
    Y's device copy goes with it and its slots stay with Y's load until that one's ack."""
    core = make_core()
    x, y = toks(16, 4), toks(8, 5)
    cached_host_only(core, x, np.concatenate((x, y)))
    rc = core.admit("c", np.concatenate((x, toks(3, 6))))
    rd = core.admit("d", np.concatenate((x, y, toks(3, 7))))
    assert (rc.loaded_host, rd.cached_device, rd.loaded_host) == (16, 16, 8)
    load_x, load_y = sorted(op_id for op_id, op in core.copies.ops.items() if op.direction is Direction.LOAD)
    core.apply_ack(load_x, "injected")
    check_invariants(core)
    assert core.copies.ops[load_y].orphaned
    assert core.match_prefix(np.concatenate((x, y, toks(1, 8)))) == {"device": 0, "host": 24}
    # X and Y load again (for `e`) before the orphaned load's ack: that ack must leave the new
    # load's marks alone (a node still loading is where inserts stop)
    re_ = core.admit("e", np.concatenate((x, y, toks(3, 17))))
    assert re_.loaded_host == 24
    marks = dict(core.copies.loading)
    assert len(marks) == 2 and all(r is re_.readiness[0] for r in marks.values())
    core.apply_ack(load_y, None)
    check_invariants(core)
    assert core.copies.loading == marks
    for rid in ("c", "d"):
        assert core.requests[rid].failed is not None
        core.abort(rid)
    re_.readiness[0].complete()
    ack_all(core)
    core.abort("e")
    check_invariants(core, quiescent=True)


def test_a_locked_node_without_a_device_copy_is_not_a_host_leaf():
    """After a failed load, its user still locks the node (now host-only) until it is released:
    host eviction must pass it over, and take it once the user is gone."""
    core = make_core(host_tokens=16)
    x = toks(16, 9)
    cached_host_only(core, x)
    res = core.admit("c", np.concatenate((x, toks(3, 10))))
    (load,) = [op_id for op_id, op in core.copies.ops.items() if op.direction is Direction.LOAD]
    res.readiness[0].fail(RuntimeError("injected"))
    core.apply_ack(load, "injected")
    node = core.requests["c"].last_node
    assert node.device is None and node.host is not None and node.lock_ref == 1
    assert node not in core.residency.tree.host_leaves
    assert core.flush() == 0  # nothing unlocked to drop
    check_invariants(core)
    core.abort("c")
    assert node in core.residency.tree.host_leaves
    assert core.flush() == 16
    check_invariants(core, quiescent=True)


def test_can_admit_and_admit_agree_when_eviction_deletes_a_parents_only_child():
    """The dry run counts the children it deleted: a parent whose only child (no host copy) goes
    is a leaf it can delete too (write_through_selective: nothing backed up). Checked failing with
    the dry run testing `node.children` as before (can_admit said no, admit said yes)."""
    core = make_core(device_slots=32, host_tokens=64, write_policy="write_through_selective",
                     write_through_threshold=99)
    a = toks(8, 11)
    ab = np.concatenate((a, toks(8, 12)))
    core.admit("p", np.concatenate((ab, toks(1, 13))))
    core.finish("p", ab)  # one node of 16 (no split: a single insert)
    core.admit("q", np.concatenate((a, toks(1, 14))))
    core.finish("q", a)  # a match that splits it: parent a (8) -> child b (8)
    check_invariants(core)
    big = toks(32 - 1, 15)
    assert core.can_admit(big) is True
    core.admit("big", big)
    check_invariants(core)
    with pytest.raises(CapacityError):  # the pool is the request's now: both answers are no
        core.admit("more", toks(5, 16))
    assert core.can_admit(toks(5, 16)) is False
    with pytest.raises(LengthError):
        core.extend("big", 8)
    core.abort("big")
    check_invariants(core, quiescent=True)


def test_decode_step_is_commit_then_extend_by_one_for_each_request():
    """The batched step gives exactly the slots, lengths and ledger state that per-request
    commit + extend(1) give, page boundaries included (page 4: every fourth step allocates)."""
    a, b = make_core(write_policy="write_through"), make_core(write_policy="write_through")
    rids = ["x", "y", "z"]
    for core in (a, b):
        for i, rid in enumerate(rids):
            core.admit(rid, toks(5 + 3 * i, 50 + i))
    for _ in range(9):
        got = a.decode_step(tuple(rids)).tolist()
        want = []
        for rid in rids:
            b.commit(rid, b.requests[rid].seq_len)
            want.extend(b.extend(rid, 1).tolist())
        assert got == want
        check_invariants(a)
        for rid in rids:
            ra, rb = a.requests[rid], b.requests[rid]
            assert (ra.seq_len, ra.committed_len) == (rb.seq_len, rb.committed_len)
            assert ra.slots.tolist() == rb.slots.tolist()
    assert a.residency.device.snapshot() == b.residency.device.snapshot()


@pytest.mark.parametrize("rids", [("x", "nope"), ("x", "x"), ("x", ["unhashable"])])
def test_a_refused_decode_step_changes_nothing(rids):
    core = make_core()
    core.admit("x", toks(8, 60))
    before = (core.requests["x"].seq_len, core.requests["x"].committed_len, core.residency.device.snapshot())
    with pytest.raises((UnknownRequestError, ArgumentError)):
        core.decode_step(rids)
    assert (core.requests["x"].seq_len, core.requests["x"].committed_len, core.residency.device.snapshot()) == before


def test_a_decode_step_short_of_pages_changes_nothing():
    core = make_core(device_slots=16, host_tokens=0)
    core.admit("x", toks(8, 61))  # 2 pages, next token starts a third
    core.admit("y", toks(8, 62))  # 2 pages: the pool is full
    before = core.residency.device.snapshot()
    with pytest.raises(CapacityError):
        core.decode_step(("x", "y"))
    assert core.residency.device.snapshot() == before
    assert [core.requests[r].seq_len for r in ("x", "y")] == [8, 8]
    core.abort("y")
    assert core.decode_step(("x",)).tolist() == [int(core.requests["x"].slots[8])]
    check_invariants(core)


def test_an_ack_for_no_copy_in_flight_is_an_internal_error_and_changes_nothing():
    """Acks come from the runtime's own transfer actor: one for an op the core never issued (or
    already applied) is a bug of the runtime (InternalError, which fails it), not a KeyError."""
    core = make_core()
    core.admit("x", toks(8, 70))
    core.cache("x", toks(8, 70)[:8])
    (op_id,) = ack_all(core)
    before = core.residency.device.snapshot(), core.residency.host.snapshot()
    with pytest.raises(InternalError, match="not in flight"):
        core.apply_ack(op_id, None)
    with pytest.raises(InternalError, match="not in flight"):
        core.apply_storage_ack(12345, 0, None)
    assert (core.residency.device.snapshot(), core.residency.host.snapshot()) == before


@pytest.mark.parametrize("policy", ["write_through_selective", "write_back"])
def test_a_refused_admission_keeps_its_own_cached_prefix(policy):
    """A no from `can_admit` (or a refused `admit`) starts the evictions and backups that make
    room, but never at the cost of the prefix the request would reuse: its admission would lock
    it. Checked failing without the lock in `Admission.start_writeback` (the prefix, least recently used,
    was deleted under write_through_selective and backed up then dropped under write_back)."""
    core = make_core(device_slots=64, write_policy=policy)
    prefix = toks(8, 1)
    core.admit("a", np.concatenate((prefix, toks(1, 2))))
    core.finish("a", np.concatenate((prefix, toks(1, 2))))
    core.admit("hold", toks(48, 3))  # 12 of the 16 pages: 2 stay free, the prefix holds 2
    ask = np.concatenate((prefix, toks(12, 4)))  # 3 pages beyond the prefix
    assert not core.can_admit(ask)
    with pytest.raises(CapacityError):
        core.admit("b", ask)
    ack_all(core)
    check_invariants(core)
    assert core.match_prefix(ask)["device"] == 8


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete"])
def test_an_admit_refused_for_capacity_leaves_its_prefetch_prepared(policy):
    """An admit refused at the capacity check changed nothing: the rid's prefetch is still the
    caller's, so a later abort finds it (and cancels it) instead of calling the rid unknown."""
    core = make_core(prefetch_policy=policy, device_slots=32)
    core.enable_storage()
    tokens = toks(17, 5)
    assert core.prepare("r", tokens) > 0
    core.take_effects()
    core.admit("hog", toks(29, 77))  # device pages held by a live request: no room for "r"
    with pytest.raises(CapacityError):
        core.admit_or_wait("r", tokens, waiter=None)
    check_invariants(core)
    assert core.abort("r") == []  # its prefetch, cancelled
    with pytest.raises(UnknownRequestError):
        core.abort("r")
    check_invariants(core)

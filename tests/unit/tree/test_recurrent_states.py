"""The recurrent-state rule of a hybrid model (Mamba / linear attention), on the loop-free core.

A hit restores KV and state of the same prefix, or nothing: a match is cut back to the deepest
node holding a snapshot; snapshots pass from the request to the node ending at their position
(split there if needed), go with the node's device KV, and are evicted least recently used when a
state slot is needed. The invariant checker (state slots: running, pending, node snapshots; the
ledger) runs after every step.

Broken variants checked by hand: with `RecurrentStates.usable_end` returning `look.device_len`
(the match not cut back), `test_a_hit_ends_at_the_deepest_snapshot` fails (a hit of 16 tokens
resumes from the snapshot at 8). A real bug this file found while it was written: a request's
own leaf grew in place at its next insert, so the snapshot at the leaf's old end (24) then sat
at its new end (32) and a hit at 32 would have resumed from the state at 24; leaves holding a
snapshot no longer grow in place, and the invariant checker compares each snapshot's position
with its node's end (`test_snapshots_pass_to_the_nodes_ending_at_them...` fails with the old
growth: "node 1 ends at 32 but holds the state snapshot taken at 24").
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime.config import RuntimeConfig
from runtime.errors import CapacityError, ConfigError, LengthError, StateError
from runtime.invariants import check_invariants
from runtime.tree.cache import CacheCore
from runtime.tree.groups.recurrent import RecurrentStates
from tests.tokens import toks

PS = 4


def make_core(**changes) -> CacheCore:
    base = dict(num_layers=2, num_kv_heads=1, head_dim=2, page_size=PS, device_slots=64, host_tokens=0,
                state_layers=2, state_components="conv:3x2:float32,ssm:2x2:float32", state_slots=8)
    base.update(changes)
    return CacheCore(RuntimeConfig(**base))


def run(core: CacheCore, rid: str, tokens: np.ndarray, snaps: tuple[int, ...] = (), keep: int | None = None):
    """Admit `tokens`, ask snapshots at `snaps`, finish keeping `keep` tokens (all): the result."""
    res = core.admit(rid, tokens)
    check_invariants(core)
    for p in snaps:
        core.snapshot(rid, p)
        check_invariants(core)
    core.finish(rid, tokens[: keep or len(tokens)])
    check_invariants(core)
    return res


def test_no_snapshot_no_hit():
    core = make_core()
    p = toks(17, 1)
    run(core, "a", p)  # KV of 16 tokens cached, no state snapshot
    res = core.admit("b", p)
    assert res.cached == 0 and res.state_from is None and res.state_slot is not None
    check_invariants(core)


def test_a_hit_ends_at_the_deepest_snapshot():
    core = make_core()
    p = toks(17, 2)
    run(core, "a", p, snaps=(8,))  # KV of 16 tokens, a snapshot at 8: the node splits there
    snap = core.residency.group(RecurrentStates).node_state
    assert len(snap) == 1 and [n.num_tokens for n in snap] == [8]
    assert core.match_prefix(p) == {"device": 8, "host": 0}  # what an admit may use
    res = core.admit("b", p)
    assert res.cached_device == 8  # not 16: the KV past 8 has no state to go with it
    assert res.state_from == next(iter(snap.values())) and res.state_from != res.state_slot
    check_invariants(core)
    assert core.stats["state_hits"] == 1


def test_snapshots_pass_to_the_nodes_ending_at_them_and_duplicates_are_freed():
    core = make_core()
    p = toks(25, 3)
    run(core, "a", p, snaps=(8, 16, 24))
    ends = sorted(len(core.residency.tree.path_tokens(n)) for n in core.residency.group(RecurrentStates).node_state)
    assert ends == [8, 16, 24]
    free = core.residency.group(RecurrentStates).ledger.num_free_pages()
    run(core, "b", p)  # a hit at 24: nothing new
    res = core.admit("c", np.concatenate((p[:24], toks(9, 4))))
    assert res.cached_device == 24
    core.snapshot("c", 32)
    core.finish("c", np.concatenate((p[:24], toks(9, 4)))[:32])
    check_invariants(core)
    assert core.residency.group(RecurrentStates).ledger.num_free_pages() == free - 1  # the new node at 32 keeps one
    # a second request snapshotting a position the tree already has: its slot is freed
    res = core.admit("d", p)
    assert res.cached_device == 24
    run_free = core.residency.group(RecurrentStates).ledger.num_free_pages()
    core.finish("d", p)
    assert core.residency.group(RecurrentStates).ledger.num_free_pages() == run_free + 1  # only its running slot back
    check_invariants(core)


def test_hit_never_pairs_kv_with_another_prefix_state():
    """Two prompts share 8 tokens and differ after: each one's snapshot at 16 stays with its own
    node; a third prompt sharing 12 tokens with the first resumes at 8 (the shared node's state),
    never at 16 of either."""
    core = make_core()
    shared = toks(8, 5)
    a = np.concatenate((shared, toks(9, 6)))
    b = np.concatenate((shared, toks(9, 7)))
    run(core, "a", a, snaps=(8, 16))
    run(core, "b", b, snaps=(16,))
    states = core.residency.group(RecurrentStates)
    by_end = {len(core.residency.tree.path_tokens(n)): (n, s) for n, s in states.node_state.items()}
    assert set(by_end) == {8, 16} and len(states.node_state) == 3
    for prompt in (a, b):
        res = core.admit("x", prompt)
        node = core.requests["x"].last_node
        assert res.cached_device == 16 and states.node_state[node] == res.state_from
        assert np.array_equal(core.residency.tree.path_tokens(node), prompt[:16])
        core.abort("x")
    c = np.concatenate((a[:12], toks(9, 8)))
    res = core.admit("y", c)
    assert res.cached_device == 8 and res.state_from == by_end[8][1]
    check_invariants(core)


def test_snapshot_goes_with_the_node_device_kv():
    core = make_core(device_slots=32)
    p = toks(17, 9)
    run(core, "a", p, snaps=(16,))
    assert len(core.residency.group(RecurrentStates).node_state) == 1
    core.admit("big", toks(32, 10))  # evicts every cached page
    check_invariants(core)
    assert not core.residency.group(RecurrentStates).node_state
    core.abort("big")
    assert core.flush() == 0
    check_invariants(core, quiescent=True)
    assert core.residency.group(RecurrentStates).ledger.num_free_pages() == 8


def test_state_slots_evict_lru_snapshots_never_locked_ones():
    core = make_core(state_slots=3)
    a, b = toks(9, 11), toks(9, 12)
    run(core, "a", a, snaps=(8,))
    run(core, "b", b, snaps=(8,))
    # one state slot free; "c" takes it; its snapshot needs one: the LRU snapshot (a's) goes
    core.admit("hold", a)  # locks a's node (hit at 8): a is now the most recent and locked
    check_invariants(core)
    core.admit("c", toks(9, 13))
    check_invariants(core)
    states = core.residency.group(RecurrentStates)
    kept = [len(core.residency.tree.path_tokens(n)) for n in states.node_state]
    assert kept == [8] and core.requests["hold"].last_node in states.node_state  # b's was evicted
    assert core.stats["state_snapshots_evicted"] == 1
    with pytest.raises(CapacityError):
        core.snapshot("c", 8)  # every slot: two running, one locked snapshot
    check_invariants(core)
    core.abort("hold")
    core.abort("c")
    check_invariants(core, quiescent=True)


def test_admit_without_a_state_slot_changes_nothing():
    core = make_core(state_slots=1)
    core.admit("a", toks(9, 14))
    before = (core.residency.device.num_free_pages(), dict(core.counts()))
    with pytest.raises(CapacityError):
        core.admit("b", toks(9, 15))
    assert (core.residency.device.num_free_pages(), dict(core.counts())) == before
    check_invariants(core)


def test_can_admit_agrees_with_admit_on_state_slots():
    """Found by the API fuzzer: can_admit said yes while every state slot was taken, and admit then
    raised CapacityError. The only evictable snapshot being the hit's own (locked by the admission)
    is no room either."""
    core = make_core(state_slots=2)
    p = toks(9, 18)
    run(core, "a", p, snaps=(8,))  # one node snapshot, one slot free
    core.admit("x", toks(9, 19))  # takes the free slot: the snapshot is the only evictable one
    assert core.can_admit(p) is False  # its hit would lock the snapshot it would have to evict
    with pytest.raises(CapacityError):
        core.admit("b", p)
    assert core.can_admit(toks(9, 20)) is True  # no hit: evicting the snapshot makes room
    core.admit("c", toks(9, 20))
    check_invariants(core)


def test_rewind_forgets_snapshots_past_it():
    core = make_core()
    p = toks(20, 16)
    core.admit("a", p)
    core.snapshot("a", 8)
    core.snapshot("a", 16)
    core.rewind("a", 12)
    check_invariants(core)
    assert core.residency.group(RecurrentStates).pending["a"] == {8: core.residency.group(RecurrentStates).pending["a"][8]}
    core.finish("a", p[:12])
    assert [len(core.residency.tree.path_tokens(n)) for n in core.residency.group(RecurrentStates).node_state] == [8]
    check_invariants(core, quiescent=True)


def test_bad_snapshot_calls_change_nothing():
    core = make_core()
    p = toks(17, 17)
    run(core, "a", p, snaps=(8,))
    core.admit("b", p)  # cached 8
    for bad in (7, 8, 20, 0, -4, True, 8.0):
        with pytest.raises(LengthError):
            core.snapshot("b", bad)
    core.snapshot("b", 16)
    with pytest.raises(StateError):
        core.snapshot("b", 16)
    check_invariants(core)
    with pytest.raises(StateError):
        make_core(state_layers=0, state_components="", state_slots=0).snapshot("b", 4)
    with pytest.raises(StateError):
        core.open_session("s")


def test_config_refuses_what_states_do_not_cover_yet():
    with pytest.raises(ConfigError, match="host_state_slots"):  # (a storage tier needs host snapshots)
        make_core(storage_backend="file", storage_dir="x", host_tokens=64, host_state_slots=0)
    with pytest.raises(ConfigError):
        make_core(decode_offload=True, host_tokens=64)
    with pytest.raises(ConfigError):
        make_core(state_components="conv:3x2")
    with pytest.raises(ConfigError):
        make_core(state_slots=0)


# -- host tier: snapshots are backed up and loaded with their node ------------------------------

STATE_POOLS = ("state.conv", "state.ssm")


def host_core(**changes) -> CacheCore:
    return make_core(host_tokens=64, write_policy="write_through", host_state_slots=4, **changes)


def take_plans(core: CacheCore):
    return [plan for plan, _ in core.take_effects().copies]


def ack(core: CacheCore, error: str | None = None) -> None:
    for op_id in sorted(core.copies.ops):
        if op_id in core.copies.ops:  # (a batch's backups are acked with its first)
            core.apply_ack(op_id, error)
            check_invariants(core)


def test_backup_copies_the_snapshot_with_its_node():
    core = host_core()
    p = toks(17, 20)
    run(core, "a", p, snaps=(8, 16))
    (plan,) = take_plans(core)  # write_through: both nodes, each with its snapshot, in one batch
    assert [t.pool for t in plan.transfers] == ["kv", *STATE_POOLS]
    src = plan.transfers[1].src
    assert plan.transfers[2].src.tolist() == src.tolist() and len(set(src.tolist())) == 2
    states = core.residency.group(RecurrentStates)
    assert not states.host_state and states.ledger.pin_count(next(iter(states.node_state.values()))) == 1
    ack(core)
    assert set(states.host_state) == set(states.node_state)
    assert {states.host_position[s] for s in states.host_state.values()} == {8, 16}


def push_off_device(core: CacheCore) -> None:
    av = core.available()
    core.admit("big", toks(av["device_free"] + av["device_evictable"], 999))
    core.abort("big")
    check_invariants(core)


def cache_on_host_only(core: CacheCore, p, snaps: tuple[int, ...]) -> None:
    """`p` cached with snapshots at `snaps`, backed up with them, then pushed off device."""
    run(core, "a", p, snaps=snaps)
    ack(core)
    take_plans(core)
    push_off_device(core)


def test_host_hit_loads_the_snapshot_back_and_resumes_from_it():
    core = host_core()
    p = toks(17, 21)
    cache_on_host_only(core, p, (8, 16))
    states = core.residency.group(RecurrentStates)
    assert not states.node_state and len(states.host_state) == 2
    res = core.admit("b", p)
    assert (res.cached_device, res.loaded_host) == (0, 16)
    (plan,) = take_plans(core)
    node = core.requests["b"].last_node
    host_slot = states.host_state[node]
    assert [t.pool for t in plan.transfers] == ["kv", *STATE_POOLS]
    # the deepest node's snapshot (required), and the one at 8 (a slot was free): both come back
    upper = node.parent
    assert plan.transfers[1].src.tolist() == [host_slot, states.host_state[upper]]
    assert plan.transfers[1].dst.tolist() == [res.state_from, states.node_state[upper]]
    assert states.node_state[node] == res.state_from != res.state_slot
    ack(core)
    core.abort("b")
    check_invariants(core, quiescent=True)


def test_failed_load_takes_the_loaded_snapshot_back():
    core = host_core()
    p = toks(17, 22)
    cache_on_host_only(core, p, (16,))
    free = core.residency.group(RecurrentStates).ledger.num_free_pages()
    core.admit("b", p)
    take_plans(core)
    ack(core, error="injected")
    states = core.residency.group(RecurrentStates)
    assert not states.node_state and len(states.host_state) == 1
    assert states.ledger.num_free_pages() == free - 1  # only b's running slot
    core.abort("b")
    check_invariants(core, quiescent=True)


def test_host_nodes_without_a_host_snapshot_are_no_hit():
    """The backup ran before the snapshot reached the node: its host copy has KV only, so a hit
    through it is cut back (never KV without the state after it)."""
    core = host_core()
    p = toks(17, 23)
    run(core, "a", p)  # the node at 16 and its backup, no snapshot
    ack(core)
    take_plans(core)
    run(core, "c", p, snaps=(16,))  # no hit (no snapshot); its snapshot joins the backed-up node
    states = core.residency.group(RecurrentStates)
    assert len(states.node_state) == 1 and not states.host_state and not take_plans(core)
    res = core.admit("d", p)
    assert res.cached_device == 16  # on device: KV and state
    core.abort("d")
    push_off_device(core)
    assert not states.node_state
    res = core.admit("b", p)
    assert res.cached == 0 and res.state_from is None  # host KV without its state: no hit
    check_invariants(core)


def test_write_back_eviction_keeps_the_host_snapshot():
    core = make_core(host_tokens=64, write_policy="write_back", device_slots=32)
    p = toks(17, 24)
    run(core, "a", p, snaps=(16,))
    assert not take_plans(core)  # write-back: nothing copied yet
    with pytest.raises(CapacityError):
        core.admit("big", toks(28, 25))  # room only once the node is backed up: that starts
    take_plans(core)
    ack(core)
    core.admit("big", toks(28, 25))
    states = core.residency.group(RecurrentStates)
    assert not states.node_state and len(states.host_state) == 1
    core.abort("big")
    check_invariants(core, quiescent=True)
    res = core.admit("c", p)
    assert res.loaded_host == 16 and res.state_from is not None


def test_checker_catches_a_load_copying_another_nodes_host_snapshot(monkeypatch):
    """Broken variant: the load of a host-only chain copies the snapshots of its two nodes crosswise
    (the deepest node's device slot gets the snapshot at 8, the node at 8 the one at 16), while
    every recorded position, owner and pin stays right. Once the load lands, a hit at 16 resumes
    from the state at 8: the invariant checker must see it while the load is in flight."""
    from runtime.errors import InvariantViolation
    from runtime.tree.groups.recurrent import RecurrentStates, StateCopy

    core = host_core()
    p = toks(17, 26)
    cache_on_host_only(core, p, (8, 16))
    load_copy = RecurrentStates._load_copy

    def crosswise(self, host_nodes, slot, op_id):
        copy = load_copy(self, host_nodes, slot, op_id)
        return StateCopy(copy.src[::-1].copy(), copy.dst, copy.nodes)

    monkeypatch.setattr(RecurrentStates, "_load_copy", crosswise)
    res = core.admit("b", p)
    assert res.loaded_host == 16 and len(core.copies.ops) == 1
    (op,) = core.copies.ops.values()
    assert len(core.residency.group(RecurrentStates).copies[op.op_id].nodes) == 2  # both snapshots come back, from each other's host slot
    with pytest.raises(InvariantViolation, match="snapshot"):
        check_invariants(core)


def test_checker_catches_a_state_slot_held_twice_by_one_request(monkeypatch):
    """Broken variant: `snapshot` hands out the request's running slot (the ledger allocates nothing
    new). The engine's later computation then overwrites the snapshot, and the node that keeps it
    holds the state of a longer prefix than its own."""
    from runtime.errors import InvariantViolation
    from runtime.tree.groups.recurrent import RecurrentStates

    def aliased(self, rid, owner, position):
        slot = self.running[rid]
        self.pending.setdefault(rid, {})[position] = slot
        self.position[slot] = position
        return slot

    core = make_core()
    core.admit("a", toks(17, 27))
    monkeypatch.setattr(RecurrentStates, "snapshot", aliased)
    core.snapshot("a", 8)
    with pytest.raises(InvariantViolation, match="state slot"):
        check_invariants(core)

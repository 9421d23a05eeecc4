"""A node with a backup in flight grows in place (`CopyTracker`): the growth's backup is chained
after it, the node gets its host copy whole at the last ack, splits while they run change nothing
(seed 002), a failed part fails the rest, and with nothing chained (no host room for it) the node
is split at the ack.
Every step is followed by the invariant checker."""

from __future__ import annotations

import numpy as np

from runtime.config import RuntimeConfig
from runtime.invariants import check_invariants
from runtime.messages import Direction
from runtime.tree.cache import CacheCore
from tests.tokens import toks


def make_core(**changes) -> CacheCore:
    base = dict(num_layers=2, num_kv_heads=1, head_dim=2, page_size=4, device_slots=64, host_tokens=256,
                write_policy="write_through", debug_invariants=True)
    base.update(changes)
    return CacheCore(RuntimeConfig(**base))


def issue(core: CacheCore) -> list[int]:
    """End the turn: the backups recorded leave; returns the plans' op ids."""
    return [plan.op_id for plan, _ in core.take_effects().copies]


def ack(core: CacheCore, op_id: int, error: str | None = None) -> None:
    core.apply_ack(op_id, error)
    check_invariants(core)


def nodes(core: CacheCore) -> list:
    return list(core.residency.tree.nodes())


def test_a_leaf_grows_with_its_backups_in_flight_and_gets_its_host_copy_whole():
    core = make_core()
    p = toks(21, 1)
    core.admit("a", p)
    core.cache("a", p[:8])
    first = issue(core)
    core.cache("a", p[:16])  # grows the leaf its backup is copying
    check_invariants(core)
    second = issue(core)
    assert len(nodes(core)) == 1 and nodes(core)[0].num_tokens == 16
    assert len(core.copies.ops) == 2 and core.copies.stats["backups_issued"] == 2
    ack(core, first[0])
    (node,) = nodes(core)
    assert node.host is None and core.copies.busy(node)  # its head waits for the growth's backup
    ack(core, second[0])
    assert node.host is not None and len(node.host) == 16 and not core.copies.busy(node)
    core.finish("a", p)
    check_invariants(core)
    for op_id in issue(core):
        ack(core, op_id)
    assert len(nodes(core)) == 2  # (the finish came after the copy landed: a node of its own)
    check_invariants(core, quiescent=True)


def test_growth_in_the_turn_its_backup_was_recorded_widens_that_backup():
    core = make_core()
    p = toks(21, 2)
    core.admit("a", p)
    core.cache("a", p[:8])
    core.cache("a", p[:16])
    (op_id,) = issue(core)
    assert core.copies.ops[op_id].length == 16 and core.copies.stats["backups_issued"] == 1
    ack(core, op_id)
    (node,) = nodes(core)
    assert len(node.host) == 16


def test_splits_while_the_chained_backups_run_change_nothing():
    """Seed 002: other requests split the growing node inside the first backup's range and inside
    the growth's; every part still gets its host copy at the acks."""
    core = make_core()
    p = toks(24, 3)
    core.admit("a", p)
    core.cache("a", p[:8])
    first = issue(core)
    core.cache("a", p[:20])
    second = issue(core)
    for rid, cut in (("b", 4), ("c", 12)):  # diverge after `cut` tokens: a split there
        q = np.concatenate((p[:cut], toks(8, 40 + cut)))
        core.admit(rid, q)
        core.finish(rid, q)
        check_invariants(core)
    more = issue(core)
    ack(core, first[0])
    ack(core, second[0])
    for op_id in more:
        ack(core, op_id)
    core.finish("a", p[:20])
    check_invariants(core)
    for op_id in issue(core):
        ack(core, op_id)
    assert all(n.host is not None for n in nodes(core))
    check_invariants(core, quiescent=True)


def test_a_failed_backup_fails_the_one_chained_after_it():
    core = make_core()
    p = toks(21, 4)
    core.admit("a", p)
    core.cache("a", p[:8])
    first = issue(core)
    core.cache("a", p[:16])
    second = issue(core)
    ack(core, first[0], "copy failed")
    ack(core, second[0])
    (node,) = nodes(core)
    assert node.host is None and not core.copies.busy(node) and not core.copies.ops
    assert core.copies.stats["copy_failures"] == 2
    core.finish("a", p)
    for op_id in issue(core):
        ack(core, op_id)
    check_invariants(core, quiescent=True)


def test_with_no_backup_of_the_growth_the_node_is_split_at_the_ack():
    """No host room for the growth's backup: the first backup's part is split off at its ack and
    takes the host copy; the growth stays a node of its own, on device only."""
    core = make_core(host_tokens=8)
    p = toks(21, 5)
    core.admit("a", p)
    core.cache("a", p[:8])
    (op_id,) = issue(core)
    core.cache("a", p[:16])  # grows it in flight; its 8 host slots are all the first backup's
    assert issue(core) == [] and len(nodes(core)) == 1
    ack(core, op_id)
    (upper,) = [n for n in nodes(core) if n.parent.parent is None]
    (lower,) = upper.children.values()
    assert [upper.num_tokens, lower.num_tokens] == [8, 8]
    assert upper.host is not None and lower.host is None and not core.copies.busy(lower)
    core.finish("a", p)
    check_invariants(core, quiescent=True)

"""The invariant checks of each pool group's own rule (docs/ARCHITECTURE.md, "Pool groups"), by the
name of its rule's class (`GROUP_CHECKS`; full attention's rule is the tree's, checked by
`check_invariants` itself). Recomputed from raw fields, as every check."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from runtime.invariants.common import _chain, _check_ledger, _claim, _fail, _path
from runtime.memory.owners import Owner
from runtime.messages import Direction

if TYPE_CHECKING:
    from runtime.tree.cache import CacheCore
    from runtime.tree.groups.base import PoolGroup
    from runtime.tree.groups.recurrent import RecurrentStates, StateCopy
    from runtime.tree.groups.sliding import SlidingWindow
    from runtime.tree.radix import Node
    from runtime.tree.records import CopyOp, RequestRecord


def check_group(core: "CacheCore", group: "PoolGroup", nodes: list["Node"]) -> None:
    """The checks of `group`'s rule, if it has any (looked up by name when called: a planted-bug
    test switches one off)."""
    name = GROUP_CHECKS.get(type(group).__name__)
    if name:
        globals()[name](core, group, nodes)


def _check_states(core: "CacheCore", states: "RecurrentStates", nodes: list["Node"]) -> None:
    """Recurrent state (docs/ARCHITECTURE.md, "Recurrent state"): every state slot is a live
    request's running slot, one of its pending snapshots (past its cached prefix), or the snapshot
    of a live node that holds device KV, each slot held once; the ledger agrees, nothing leaks, pins
    are the copies' and each copy's state slots are its nodes' snapshots."""
    table: dict[int, Owner] = {}
    holders: dict[str, dict[int, str]] = {"state": {}, "host state": {}}

    def hold(want: dict[int, Owner], tier: str, slot: int, owner: Owner, what: str) -> None:
        """A state slot has one holder: one request's running state or one of its snapshots, or one
        node's snapshot (by owner alone, a request's slot held twice would pass)."""
        seen = holders[tier]
        if slot in seen:
            _fail(f"{tier} slot {slot} held twice: as the {seen[slot]} and as the {what}")
        seen[slot] = what
        _claim(want, tier, 1, np.array([slot]), owner, what)

    if set(states.running) != set(core.requests):
        _fail(f"running state slots {sorted(map(repr, states.running))[:5]} != live requests "
              f"{sorted(map(repr, core.requests))[:5]}")
    for rid, slot in states.running.items():
        hold(table, "state", slot, core.requests[rid].owner, f"running state of {rid!r}")
    for rid, mine in states.pending.items():
        rec = core.requests.get(rid)
        if rec is None:
            _fail(f"pending snapshots of {rid!r}, which is not live")
        for position, slot in mine.items():
            if position % core.page_size or not rec.cached_len < position <= rec.seq_len:
                _fail(f"{rid!r}: pending snapshot at {position} outside ({rec.cached_len}, {rec.seq_len}] or unaligned")
            hold(table, "state", slot, rec.owner, f"snapshot of {rid!r} at {position}")
    host_table: dict[int, Owner] = {}
    pins: Counter[int] = Counter()
    host_pins: Counter[int] = Counter()
    _hold_copies(core, states, hold, table, host_table, pins, host_pins)
    live = set(nodes)
    for held, positions, tier, want, kv in ((states.node_state, states.position, "state", table, "device"),
                                            (states.host_state, states.host_position, "host state", host_table, "host")):
        for node, slot in held.items():
            if node not in live:
                _fail(f"{tier} snapshot {slot} held by node {node.id}, which is not in the tree")
            if getattr(node, kv) is None:
                _fail(f"node {node.id} holds a {tier} snapshot but no {kv} KV (a hit would restore state alone)")
            end = sum(n.num_tokens for n in _path(node))
            if positions.get(slot) != end:
                _fail(f"node {node.id} ends at {end} but holds the {tier} snapshot taken at {positions.get(slot)}")
            hold(want, tier, slot, Owner.node(node.id), f"{tier} snapshot of node {node.id}")
    _check_ledger("state", states.ledger, table, pins)
    _check_ledger("host state", states.host_ledger, host_table, host_pins)


def _hold_copies(core: "CacheCore", states: "RecurrentStates", hold: Callable[..., None], table: dict[int, Owner],
                 host_table: dict[int, Owner], pins: Counter[int], host_pins: Counter[int]) -> None:
    """The state slots copies and storage ops in flight pin, and those they hold until their ack."""
    if not set(states.copies) <= set(core.copies.ops):
        _fail(f"state copies of ops {sorted(set(states.copies) - set(core.copies.ops))} not in flight")
    for op in core.copies.ops.values():  # a copy's state slots: pinned, the orphaned load's still owned
        copy = states.copies.get(op.op_id)
        if copy is not None:
            backup = op.direction is Direction.BACKUP
            devs, hosts = (copy.src, copy.dst) if backup else (copy.dst, copy.src)
            for node, dev, host in zip(copy.nodes, devs.tolist(), hosts.tolist(), strict=True):
                pins[dev] += 1
                host_pins[host] += 1
                if op.orphaned:
                    hold(table, "state", dev, Owner.node(node.id), f"orphaned load {op.op_id}")
                if backup:  # the host copy joins the node at the ack
                    hold(host_table, "host state", host, Owner.node(node.id), f"backup {op.op_id}")
            if not op.orphaned:
                _check_state_copy(states, op, copy, backup)
    for sop in core.storage.ops.values():
        # a storage write reads its chain's host snapshots (held by their nodes, pinned by it); a
        # storage read fills a host slot its prefetch holds (pinned) until a node adopts it at the ack
        for blob in sop.states:
            if blob.slot < 0:
                continue
            host_pins[blob.slot] += 1
            if sop.write:
                if sop.node is None or blob.slot not in _chain_host_states(states, sop.node, sop.length):
                    _fail(f"storage write {sop.op_id} reads host state slot {blob.slot}, not a snapshot of its chain")
            else:
                assert sop.prefetch is not None
                hold(host_table, "host state", blob.slot, sop.prefetch.owner, f"storage read {sop.op_id}")


def _check_sliding(core: "CacheCore", sliding: "SlidingWindow", nodes: list["Node"]) -> None:
    """Sliding-window layers (docs/ARCHITECTURE.md, "Pool groups"): the sliding ledger and the
    full -> sliding map agree (each sliding page held by exactly one allocated full page); only
    tree nodes' pages and live requests' pages before their read start lack sliding KV, in each
    node a prefix of its pages (what the drop rule drops and a split hands on), of a request's
    own pages a leading run; no live request's window reads a dropped page: from
    `committed_len - W + 1` on, everything it maps has sliding KV; host copies' missing prefixes
    belong to live host copies, and every backup in flight has its record."""
    swa, ps, window = sliding.swa, core.page_size, sliding.window
    allocated = core.residency.device.allocated()  # type: ignore[attr-defined]
    swa.check(allocated)
    # every slot array below was checked whole, aligned pages by the claims: page ids by slicing
    present = swa.map[::ps] >= 0
    in_nodes = np.zeros(len(present), dtype=bool)
    for node in nodes:
        if node.device is None:
            continue
        pages = node.device[::ps] // ps
        in_nodes[pages] = True
        _check_leading(present[pages], f"node {node.id}: its pages")
    for op in core.copies.ops.values():  # (an orphaned load's pages left their nodes)
        in_nodes[op.device[::ps] // ps] = True
    for rec in core.requests.values():  # pages a request reads no more (duplicates included)
        if rec.failed is None:
            in_nodes[rec.slot_range(0, _read_start(rec, window, ps))[::ps] // ps] = True
    lost = np.flatnonzero(allocated & ~present & ~in_nodes)
    if len(lost):
        _fail(f"swa: full pages {lost[:8].tolist()} held outside the tree lack sliding KV")
    for node, k in sliding.host_missing.items():
        if node.host is None or node not in nodes or not 0 < k <= len(node.host) // ps:
            _fail(f"swa: node {node.id} records {k} host pages without sliding KV but holds "
                  f"{None if node.host is None else len(node.host) // ps} host pages")
    backups = {op.op_id for op in core.copies.ops.values() if op.direction is Direction.BACKUP}
    if set(sliding.backups) != backups:
        _fail(f"swa: backups recorded {sorted(sliding.backups)} != in flight {sorted(backups)}")
    for rec in core.requests.values():
        if rec.failed is not None:
            continue  # its load failed and was rolled back: its cached pages are freed, it reads none
        lo = _read_start(rec, window, ps)
        pages = rec.slot_range(lo, rec.num_slots)[::ps] // ps
        if len(pages) and not present[pages].all():
            at = lo + int(np.flatnonzero(~present[pages])[0]) * ps
            _fail(f"request {rec.rid!r} (committed {rec.committed_len}) reads positions {at}..{at + ps - 1} in "
                  f"its sliding window, whose sliding KV was dropped")
        own = rec.slot_range(rec.own_start, rec.num_slots)[::ps] // ps
        _check_leading(present[own], f"request {rec.rid!r}: its own pages")


def _check_leading(flags: np.ndarray, what: str) -> None:
    """Pages without sliding KV (`flags` False) come first: the drop rules drop leading runs."""
    dropped = int(np.count_nonzero(~flags))
    if dropped and flags[:dropped].any():
        _fail(f"{what} without sliding KV are not a prefix of them ({(~flags).astype(int).tolist()})")


def _read_start(rec: "RequestRecord", window: int, ps: int) -> int:
    """The page boundary a live request's next read starts at or after: its forwards compute from
    `committed_len` on (a rewind below refuses a dropped window), reading W - 1 positions back."""
    return max(0, rec.committed_len - window + 1) // ps * ps


def _chain_host_states(states: "RecurrentStates", node: "Node", length: int) -> set[int]:
    """The host snapshots of the nodes covering the last `length` tokens of `node`'s path."""
    return {states.host_state[n] for n in _chain(node, length) if n in states.host_state}


def _check_state_copy(states: "RecurrentStates", op: "CopyOp", copy: "StateCopy", backup: bool) -> None:
    """An in-flight copy's state slots are the snapshots of the nodes it copies for, nodes of its own
    chain (deepest first): a backup reads its node's device snapshot into a host slot taken at that
    position, a load reads each node's host snapshot into that node's device snapshot. Positions alone
    do not show a load that brings back another node's snapshot."""
    chain = _chain(op.node, op.length)
    if not copy.nodes or copy.nodes[0] is not op.node or any(n not in chain for n in copy.nodes):
        _fail(f"copy {op.op_id} carries state for nodes {[n.id for n in copy.nodes]}, not its chain's "
              f"{[n.id for n in chain]} from its node {op.node.id}")
    for node, src, dst in zip(copy.nodes, copy.src.tolist(), copy.dst.tolist(), strict=True):
        if backup:
            ok = states.node_state.get(node) == src and states.host_position.get(dst) == states.position.get(src)
        else:
            ok = states.host_state.get(node) == src and states.node_state.get(node) == dst
        if not ok:
            _fail(f"copy {op.op_id} copies state slot {src} -> {dst} for node {node.id}, which is not that "
                  f"node's snapshot (device {states.node_state.get(node)}, host {states.host_state.get(node)})")


# each group's checks, by the name of its rule's class (a group with none: its rule is the tree's)
GROUP_CHECKS = {"RecurrentStates": "_check_states", "SlidingWindow": "_check_sliding"}

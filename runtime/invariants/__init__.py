"""The invariant checker, run over a `CacheCore` (docs/ARCHITECTURE.md, "Rules").

It recomputes every expected owner, pin count, lock count and derived set from raw fields
(node slots and counters, request records, in-flight copy snapshots, ledger arrays) with
its own code, never with the functions the tree or the ledgers use to maintain them, so a
wrong rule there cannot be mirrored here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from runtime.invariants.common import (
    _all_nodes,
    _check_cached_prefix,
    _check_host_leaves,
    _check_host_protects,
    _check_ledger,
    _check_locks,
    _check_storage_ops,
    _claim,
    _fail,
    _pages,
)
from runtime.invariants.groups import check_group
from runtime.invariants.offload import _check_offload
from runtime.memory.owners import Owner
from runtime.messages import Direction

if TYPE_CHECKING:
    from runtime.tree.cache import CacheCore
    from runtime.tree.radix import Node


def _check_request_table(core: "CacheCore") -> None:
    """Each live request has its own row, filed under its rid, naming its owner by a code the
    device ledger holds for it; free rows map nothing."""
    table = core.table
    rows = table.live_rows()
    if set(rows) != set(core.requests):
        _fail(f"request table rows {sorted(map(repr, rows))[:5]} != live requests {sorted(map(repr, core.requests))[:5]}")
    if len(set(rows.values())) != len(rows):
        _fail("two live requests share a request table row")
    free = table.free_rows()
    if set(free) & set(rows.values()) or len(set(free)) != len(free):
        _fail("a live request's row is on the free list, or a free row is listed twice")
    if len(free) + len(rows) != len(table.seq_len):
        _fail(f"request table rows leaked: {len(free)} free + {len(rows)} live of {len(table.seq_len)}")
    if free and table.num_slots[free].any():
        _fail("a free request table row still maps pages")
    device = core.residency.device
    for rid, row in rows.items():
        rec = core.requests[rid]
        if rec.table is not table or rec.row != row:
            _fail(f"request {rid!r} reads row {rec.row} of {'another' if rec.table is not table else 'its'} "
                  f"table, filed under row {row}")
        code = int(table.codes[row])
        if code and device.held_code(rec.owner) != code:
            _fail(f"request {rid!r}'s row names owner code {code}, the device ledger holds "
                  f"{device.held_code(rec.owner)} for it")
        if table.record_at[row] is not rec:
            _fail(f"request table row {row} does not point back at request {rid!r}")
    # a hold outlives no row: the device ledger holds exactly the owners of rows that name a code
    named = {core.requests[rid].owner for rid, row in rows.items() if table.codes[row]}
    if device.held_owners() != named:
        _fail(f"device ledger holds {sorted(map(str, device.held_owners()))[:5]}, request table rows name "
              f"{sorted(map(str, named))[:5]}")


def check_invariants(core: "CacheCore", *, quiescent: bool = False) -> None:
    """Raise `InvariantViolation` when any of invariants 1-5 (and 7 when `quiescent`) fails."""
    ps = core.page_size
    tree = core.residency.tree
    roots = set(tree.roots())
    nodes = [n for n in _all_nodes(core) if n not in roots]
    expected: dict[str, dict[int, Owner]] = {"device": {}, "host": {}}  # page -> owner expected by the structures
    pins: dict[str, Counter[int]] = {"device": Counter(), "host": Counter()}

    def claim(tier: str, slots: np.ndarray, owner: Owner, what: str) -> None:
        _claim(expected[tier], tier, ps, slots, owner, what)

    # 1-2: what the tree holds, what requests map, what copies write, each with one owner
    _claim_nodes(nodes, roots, claim)
    _check_request_table(core)
    _claim_requests(core, roots, claim)
    _check_offload(core, claim, roots, quiescent)
    _claim_copies(core, claim, pins)
    for tier, ledger in (("device", core.residency.device), ("host", core.residency.host)):
        _check_ledger(tier, ledger, expected[tier], pins[tier])
    for group in core.residency.groups:  # each group's own rule (full attention's is the tree's, above)
        check_group(core, group, nodes)
    # 4: lock and host protection counts from who holds them
    _check_holders(core, nodes, roots)
    # 5: derived eviction sets equal their definitions
    device_leaves = {
        n for n in nodes
        if n.device is not None and n.lock_ref == 0 and not any(c.device is not None for c in n.children.values())
    }
    if set(tree.device_leaves) != device_leaves:
        _fail(f"evictable device leaves differ from their definition: tree {sorted(n.id for n in tree.device_leaves)} "
              f"vs {sorted(n.id for n in device_leaves)}")
    _check_host_leaves(tree, nodes)
    # 7: at quiescence nothing is in flight and only tree nodes own slots
    if quiescent:
        if core.copies.ops:
            _fail(f"{len(core.copies.ops)} copies still in flight at quiescence")
        if core.storage.ops or core.storage.prefetches:
            _fail("storage ops or prefetches still in flight at quiescence")
        if core.requests:
            _fail(f"requests still live at quiescence: {list(core.requests)[:5]}")
        for tier in ("device", "host"):
            if pins[tier]:
                _fail(f"{tier} pins left at quiescence")


def _claim_nodes(nodes: list["Node"], roots: set, claim: Callable[..., None]) -> None:
    """Each node's copies are its own, of its length; device residency is prefix-closed and every
    node holds a copy somewhere (tier closure, seed 004 class)."""
    for node in nodes:
        owner = Owner.node(node.id)
        if node.device is not None:
            if len(node.device) != len(node.key) // 4:
                _fail(f"node {node.id} device slots do not match its tokens")
            claim("device", node.device, owner, f"node {node.id} device")
        if node.host is not None:
            if len(node.host) != len(node.key) // 4:
                _fail(f"node {node.id} host slots do not match its tokens")
            claim("host", node.host, owner, f"node {node.id} host")
        parent = node.parent
        if node.device is not None and parent is not None and parent not in roots and parent.device is None:
            _fail(f"node {node.id} is on device but its parent {parent.id} is not (residency not prefix-closed)")
        # a node never loses its last copy while it is in the tree, so every node a match can walk
        # through holds its KV in some tier
        if node.device is None and node.host is None:
            _fail(f"node {node.id} holds no copy ({len(node.children)} children)")


def _claim_requests(core: "CacheCore", roots: set, claim: Callable[..., None]) -> None:
    """Live requests' lengths agree, their own pages and duplicates are theirs, a turn maps its
    session's slots, and a cached prefix is exactly the slots of its locked path; sessions hold
    exactly the whole pages their tokens need (seed 003)."""
    ps = core.page_size
    for rec in core.requests.values():
        if not (rec.cached_len <= rec.seq_len <= rec.num_slots) or rec.cached_len % ps or rec.num_slots % ps:
            _fail(f"request {rec.rid!r} lengths inconsistent: cached {rec.cached_len}, seq {rec.seq_len}, "
                  f"slots {rec.num_slots}")
        if not (rec.cached_len <= rec.committed_len <= rec.seq_len) and rec.committed_len > rec.seq_len:
            _fail(f"request {rec.rid!r} committed {rec.committed_len} beyond seq {rec.seq_len}")
        claim("device", rec.slots[rec.own_start:], rec.owner, f"request {rec.rid!r}")
        claim("device", rec.dups, rec.owner, f"request {rec.rid!r} duplicates")
        if rec.session is not None:
            sess = core.sessions.get(rec.session)
            if sess is None or sess.turn != rec.rid:
                _fail(f"turn {rec.rid!r} names session {rec.session!r} that does not run it")
            if not np.array_equal(rec.slots[: rec.session_len], sess.slots):
                _fail(f"turn {rec.rid!r} does not map its session's slots")
        if rec.failed is not None:
            continue  # its load failed and was rolled back: it maps nothing valid until released
        parts = [n.device for n in _path_to(rec.last_node, roots) if n.device is not None]
        _check_cached_prefix(rec, np.concatenate(parts) if parts else np.zeros(0, np.int64), f"request {rec.rid!r}")
    for sess in core.sessions.values():
        if len(sess.slots) != -(-sess.kv_len // ps) * ps:
            _fail(f"session {sess.sid!r} holds {len(sess.slots)} slots for {sess.kv_len} tokens")
        claim("device", sess.slots, sess.owner, f"session {sess.sid!r}")


def _path_to(node: "Node | None", roots: set) -> list["Node"]:
    path: list[Node] = []
    while node is not None and node not in roots:
        path.append(node)
        node = node.parent
    path.reverse()
    return path


def _claim_copies(core: "CacheCore", claim: Callable[..., None], pins: dict[str, Counter[int]]) -> None:
    """Copies in flight (device <-> host, decode offload, storage ops) own their destinations and
    pin their pages (this turn's backups: pinned when their batch leaves)."""
    ps = core.page_size
    unissued = core.copies.unissued()
    for op in core.copies.ops.values():
        if op.direction is Direction.BACKUP:
            claim("host", op.host, op.host_owner, f"backup op {op.op_id} destination")
        elif op.orphaned:  # its nodes were rolled back: its slots wait for its ack
            claim("device", op.device, Owner.node(op.node.id), f"orphaned load {op.op_id}")
        if op.op_id in unissued:
            continue
        for page in _pages(op.device, ps):
            pins["device"][page] += 1
        for page in _pages(op.host, ps):
            pins["host"][page] += 1
    for op in core.offload.ops.values():  # decode offload copies
        claim("host", op.host, op.host_owner, f"offload op {op.op_id} destination")
        for page in _pages(op.device, ps):
            pins["device"][page] += 1
        for page in _pages(op.host, ps):
            pins["host"][page] += 1
    _check_storage_ops(core.storage, lambda slots, owner, what: claim("host", slots, owner, what), pins["host"])


def _check_holders(core: "CacheCore", nodes: list["Node"], roots: set) -> None:
    """Lock counts from who holds locks (requests' last nodes, in-flight copies' nodes, retired
    requests, prefetch anchors); host protection counts from storage writes (the chain they write)
    and prefetch anchors (their host-only part), each over the length recorded when taken."""
    storage_ops = core.storage.ops
    holders = [rec.last_node for rec in core.requests.values()] + [op.node for op in core.copies.ops.values()]
    holders += [z.rec.last_node for z in core.offload.retired.values()]
    prefetches = [sop.prefetch for sop in storage_ops.values() if sop.prefetch is not None]
    holders += [pf.anchor_lock for pf in prefetches]
    _check_locks(nodes, holders, roots)
    spans = [(sop.node, sop.length) for sop in storage_ops.values() if sop.write]
    spans += [(pf.anchor_host, pf.anchor_host_len) for pf in prefetches if pf.anchor_host is not None]
    _check_host_protects(nodes, roots, spans)


# -- tiers-only mode ----------------------------------------------------------------------------

"""The tiers-only core's invariants (`runtime.integrations.vllm.core.TiersOnlyCore`), over the
same raw-field checks as full mode's (`runtime.invariants`): recomputed from node slots, copy
snapshots, holds and ledger arrays, never with the functions the core maintains them with."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from runtime.invariants import (
    _all_nodes,
    _check_host_leaves,
    _check_host_protects,
    _check_ledger,
    _check_locks,
    _check_storage_ops,
    _claim,
    _fail,
    _pages,
)
from runtime.memory.owners import Owner
from runtime.messages import Direction

if TYPE_CHECKING:
    from runtime.integrations.vllm.core import TiersOnlyCore

__all__ = ["check_tiers_only"]


def check_tiers_only(core: "TiersOnlyCore", *, quiescent: bool = False) -> None:
    """Invariants 1-5 (and 7 when `quiescent`) of the tiers-only core: every tree node holds a
    host copy (no device copy: the engine's blocks are not the tree's) owned by the node, a
    backup's pages are its own until its ack, a reported hit's hold owns the pages it took, pins
    equal the copies in flight and locks the copies and holds."""
    ps = core.page_size
    tree = core.residency.tree
    roots = set(tree.roots())
    nodes = [n for n in _all_nodes(core) if n not in roots]
    table: dict[int, Owner] = {}
    pins: Counter[int] = Counter()

    def claim(slots: np.ndarray, owner: Owner, what: str) -> None:
        _claim(table, "host", ps, slots, owner, what)

    for node in nodes:
        if node.device is not None:
            _fail(f"node {node.id} holds device slots in tiers-only mode")
        if node.host is None or len(node.host) != len(node.key) // 4:
            _fail(f"node {node.id} holds no host copy of its tokens")
        claim(node.host, Owner.node(node.id), f"node {node.id}")
    for op in core.copies.values():
        if op.direction is Direction.BACKUP:
            claim(op.host, op.owner, f"backup {op.op_id} destination")
        for page in _pages(op.host, ps):
            pins[page] += 1
        rec = core.requests.get(op.rid)
        if rec is None or op.op_id not in rec.copies:
            _fail(f"copy {op.op_id} is not filed under its request {op.rid!r}")
    for rid, hold in core.holds.items():
        if hold.rid != rid:
            _fail(f"hold of {hold.rid!r} filed under {rid!r}")
        if len(hold.host):
            claim(hold.host, hold.owner, f"hold of {rid!r}")
        rec = core.requests.get(rid)
        if rec is not None and rec.finished:
            _fail(f"finished request {rid!r} still holds a hit")
    for rec in core.requests.values():
        if not rec.copies and rec.finished:
            _fail(f"finished request {rec.rid!r} is kept with no copy in flight")
        if rec.copies - set(core.copies):
            _fail(f"request {rec.rid!r} names copies that are not in flight")
    storage_ops = core.storage.ops if core.storage is not None else {}
    if core.storage is not None:
        _check_storage_ops(core.storage, claim, pins)
        for op in core.copies.values():
            if op.read and (op.read not in storage_ops or op.direction is not Direction.LOAD):
                _fail(f"copy {op.op_id} waits on storage read {op.read}, which is not in flight")
    for op_id, stage in core.stage_reads.items():
        if stage.read != op_id or op_id not in storage_ops or storage_ops[op_id].write:
            _fail(f"staging read {op_id} of {stage.rid!r} is not a storage read in flight")
        if not stage.detached and core.stages.get(stage.rid) is not stage:
            _fail(f"staging read {op_id} of {stage.rid!r} is neither waited for nor detached")
    for rid, stage in core.stages.items():
        if stage.rid != rid or stage.detached or (stage.read and core.stage_reads.get(stage.read) is not stage):
            _fail(f"staging of {stage.rid!r} filed under {rid!r} is not in flight, landed, or is detached")
        rec = core.requests.get(rid)
        if rec is not None and rec.finished:
            _fail(f"finished request {rid!r} still stages a hit")
    stage_locks = [st.node for st in core.stage_reads.values()] + [st.node for st in core.stages.values() if not st.read]
    assert core.residency.host is not None
    _check_ledger("host", core.residency.host, table, pins)
    _check_locks(nodes, [op.node for op in core.copies.values()] + [h.node for h in core.holds.values()]
                 + stage_locks, roots)
    _check_host_protects(nodes, roots, [(sop.node, sop.length) for sop in storage_ops.values() if sop.write])
    _check_host_leaves(tree, nodes)
    if quiescent and (core.copies or core.requests or storage_ops or core.holds or core.stages or core.stage_reads):
        _fail(f"{len(core.copies)} copies, {len(storage_ops)} storage ops, {len(core.requests)} requests, "
              f"{len(core.holds)} holds and {len(core.stages)} stagings left at quiescence")

"""CopyTracker: the device <-> host copies in flight (backups and loads).

It owns their records (`ops`, snapshots: deepest node + length + slot copies), the in-flight
marks on tree nodes (`backup_pending`, `loading`: node id -> op) and the plans not yet handed
to the transfer actor. Every copy pins its source and destination pages and locks the deepest
node it covers until its ack (seed 000); at the ack its nodes are recovered by walking up from
that node (`split_chain`), so a split while it ran changes nothing (seed 002). A failed load is
rolled back, with the loads started under it; the requests that used them are named in the
ack's outcome for the request table to fail.

A node with a backup in flight may grow in place (a request extending its own leaf): the growth
is noted on each of its backups (`grew`: they now end that many tokens before the node's end), and
a backup of it then covers only the growth, chained after the one before it. At an ack, a backup
whose range ends inside a node hands that node's covered head (its pages, pinned anew) to the
backup chained after it, so the node gets its host copy whole at the last one's ack; with none
chained after it, the node is split there and its upper half takes the copy.

Backups are batched per turn: `backup` records the op, locks its node and takes its host pages
at once (so the rest of the turn sees it in flight), and the turn's backups leave together at
`take_plans` as one plan under the first one's op id (the carrier): one pin and one unpin per
ledger, one plan, one ack for the batch, each op still applied alone at that ack. Until then
they are `unissued` (their pages not pinned yet).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from runtime.errors import InternalError
from runtime.memory.owners import Owner, Tier
from runtime.messages import Direction, PoolTransfer, TransferPlan
from runtime.trace import get_logger
from runtime.tree.radix import Node
from runtime.tree.readiness import LoadReadiness, ReadinessFactory
from runtime.tree.records import CopyOp, make_plan
from runtime.tree.residency import Residency, node_owner

_log = get_logger("hicache.tree")


@dataclass(slots=True)
class AckOutcome:
    """What an applied ack means above the copy tracker."""

    op: CopyOp
    backed_up: bool = False  # a backup landed: its host copies can be written to storage
    failed: str | None = None  # a load failed: these requests lost their cached prefix...
    failed_users: set[Hashable] = field(default_factory=set)


class CopyTracker:
    # -- state -------------------------------------------------------------------
    def __init__(self, residency: Residency, op_ids: Iterator[int], num_layers: int,
                 readiness_factory: ReadinessFactory) -> None:
        self.residency = residency
        self._op_ids = op_ids  # shared with decode offload and storage: one id space for pins
        # a load's readiness, by op id (the actor's: per-layer futures)
        self._new_readiness = functools.partial(readiness_factory, num_layers)
        self.ops: dict[int, CopyOp] = {}
        self.backup_pending: dict[int, int] = {}  # node id -> op id of its in-flight backup
        self.loading: dict[int, LoadReadiness] = {}  # node id -> readiness of its in-flight load
        self._plans: list[tuple[TransferPlan, LoadReadiness | None]] = []
        # this turn's backups, not issued yet (with their other pools' transfers), and the issued
        # batches in flight: carrier op id -> its backups, in issue order
        self._open: list[tuple[CopyOp, tuple[PoolTransfer, ...]]] = []
        self.batches: dict[int, _Batch] = {}
        # backups of nodes that grew in place: op id -> tokens its node grew past its range, the
        # backup chained after it (covering that growth) and before it, and pages handed over from
        # the one before (pinned under it, beyond its batch's arrays)
        self._grown: dict[int, int] = {}
        self._next: dict[int, int] = {}
        self._prev: dict[int, int] = {}
        self._handed: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        self._poisoned: set[int] = set()  # chained after a backup that failed: fails too
        self.stats: dict[str, int] = {"backups_issued": 0, "loads_issued": 0, "copy_failures": 0,
                                      "writeback_deferred": 0}
        residency.listen_splits(self.on_split)

    # -- issuing -------------------------------------------------------------------
    def backup(self, node: Node, evict_after: bool = False, growth: bool = False) -> bool:
        """Copy `node`'s device pages to fresh host pages (false: no need, or no host room).
        `growth` (write-through): with backups of `node` in flight, back up what it grew since."""
        res = self.residency
        if node.host is not None or node.device is None or node.id in self.loading:
            return False
        pending = self.backup_pending.get(node.id)
        if pending is not None:
            return growth and self._backup_growth(node, pending)
        pages = node.num_tokens // res.page_size
        host = res.alloc_host(pages, node_owner(node), node=node.id)
        if host is None:
            return False
        op_id = next(self._op_ids)
        device = node.device.copy()
        res.tree.lock(node)
        op = CopyOp(op_id, Direction.BACKUP, node, node.num_tokens, device, host,
                    node_owner(node), evict_after=evict_after)
        self.ops[op_id] = op
        self.backup_pending[node.id] = op_id
        more: tuple[PoolTransfer, ...] = ()
        for g in res.hooked.start_backup:  # (each group's pools: a snapshot, sliding rows)
            more += g.start_backup(op_id, node, device, host)
        self._open.append((op, more))
        self.stats["backups_issued"] += 1
        return True

    def _backup_growth(self, node: Node, last: int) -> bool:
        """Back up what `node` grew past its last backup `last`: that backup takes it while it has
        not left yet, else a backup of the growth alone is chained after it."""
        grown = self._grown.get(last, 0)
        if not grown:
            return False
        res = self.residency
        host = res.alloc_host(grown // res.page_size, node_owner(node), node=node.id)
        if host is None:
            return False
        device = node.device[len(node.device) - grown:]
        op = self.ops[last]
        if last in self.unissued():  # (a widened record in its place: it covers the growth now)
            del self._grown[last]
            wide = replace(op, device=np.concatenate((op.device, device)), host=np.concatenate((op.host, host)),
                           length=op.length + grown)
            self.ops[last] = wide
            self._open = [(wide, more) if o is op else (o, more) for o, more in self._open]
            return True
        op_id = next(self._op_ids)
        res.tree.lock(node)
        new = CopyOp(op_id, Direction.BACKUP, node, grown, device.copy(), host, node_owner(node))
        self.ops[op_id] = new
        self.backup_pending[node.id] = op_id
        self._next[last], self._prev[op_id] = op_id, last
        self._open.append((new, ()))
        self.stats["backups_issued"] += 1
        return True

    def grew(self, node: Node, tokens: int) -> None:
        """`node` grew in place by `tokens` with its backups in flight: they end that much earlier."""
        op_id = self.backup_pending.get(node.id)
        while op_id is not None:
            self._grown[op_id] = self._grown.get(op_id, 0) + tokens
            op_id = self._prev.get(op_id)

    def growth_locks(self, node: Node) -> int:
        """The locks on `node` a request that holds it may grow it with (`RadixTree.insert`'s
        `extend_leaf`): its own and those of its backups in flight; 0 while a load is in flight,
        or a backup of a model whose groups copy other pools with it (recurrent state, sliding
        layers: their transfers are not handed over)."""
        if node.id in self.loading:
            return 0
        op_id = self.backup_pending.get(node.id)
        if op_id is not None and self.residency.hooked.start_backup:
            return 0
        locks = 1
        while op_id is not None:
            op = self.ops.get(op_id)
            if op is None:
                return 0
            if op.node is node:
                locks += 1
            op_id = self._prev.get(op_id)
        return locks

    def unissued(self) -> set[int]:
        """Op ids of the backups recorded this turn whose batch has not left yet (pages unpinned)."""
        return {op.op_id for op, _ in self._open}

    def _issue_backups(self) -> None:
        """The turn's backups leave as one batch: their pages pinned at once, one plan under the
        first one's op id (every page of every backup, per pool in order)."""
        if not self._open:
            return
        batch, self._open = self._open, []
        ops = [op for op, _ in batch]
        carrier = ops[0].op_id
        if len(ops) == 1:
            device, host = ops[0].device, ops[0].host
            more = batch[0][1]
        else:
            device = np.concatenate([op.device for op in ops])
            host = np.concatenate([op.host for op in ops])
            more = _merged_transfers([t for _, ts in batch for t in ts])
        res = self.residency
        res.device.pin(device, carrier, trusted=True)
        res.host.pin(host, carrier, trusted=True)
        if res.tracer is not None and res.tracer.active:  # (the copy that pins them: the carrier)
            for op in ops:
                res.emit("backup", Tier.HOST, op.host, node=op.node.id, op=carrier)
        self.batches[carrier] = _Batch(carrier, [op.op_id for op in ops], device, host)
        self._plans.append((make_plan(carrier, Direction.BACKUP, device, host, more), None))

    def write_back(self, nodes: list[Node]) -> None:
        """Start the backups an eviction needs first (`Residency.evict_device`); their nodes'
        device pages are freed at the acks."""
        for node in nodes:
            if self.backup(node, evict_after=True):
                self.stats["writeback_deferred"] += node.num_tokens

    def start_load(self, host_nodes: list[Node], host_len: int, device: np.ndarray, owner: Owner,
                   reserved: Mapping[Any, Any] = MappingProxyType({})) -> CopyOp:
        """Load the host-only chain into `device` slots (allocated by `owner`, handed to the nodes);
        each group's part with what its admission reserved (`reserved`, by group: with
        recurrent state, the slot the deepest node's host snapshot comes back to)."""
        res = self.residency
        device = device.copy()  # the op's snapshot owns its arrays
        op_id = next(self._op_ids)
        readiness = self._new_readiness(op_id)
        res.attach_load(host_nodes, device, owner)
        for node in host_nodes:
            self.loading[node.id] = readiness
        host = np.concatenate([n.host for n in host_nodes])
        deepest = host_nodes[-1]
        res.tree.lock(deepest)
        res.device.pin(device, op_id, trusted=True)
        res.host.pin(host, op_id, trusted=True)
        op = CopyOp(op_id, Direction.LOAD, deepest, host_len, device, host, node_owner(deepest), readiness=readiness,
                    issued_at=time.perf_counter())
        self.ops[op_id] = op
        res.emit("load", Tier.DEVICE, device, node=deepest.id, op=op_id)
        more: tuple[PoolTransfer, ...] = ()
        for g in res.hooked.start_load:
            more += g.start_load(op_id, host_nodes, reserved.get(g))
        self._plans.append((make_plan(op_id, Direction.LOAD, host, device, more), readiness))
        self.stats["loads_issued"] += 1
        return op

    def take_plans(self) -> list[tuple[TransferPlan, LoadReadiness | None]]:
        """The plans issued since the last call, for the transfer actor (each with its readiness);
        the turn's backups leave here, as one batch."""
        self._issue_backups()
        plans, self._plans = self._plans, []
        return plans

    # -- loads' users -----------------------------------------------------------------
    def loads_under(self, nodes: list[Node]) -> list[LoadReadiness]:
        """The readiness of each load in flight into any of `nodes` (once each, in order)."""
        out: list[LoadReadiness] = []
        if self.loading:
            for node in nodes:
                r = self.loading.get(node.id)
                if r is not None and r not in out:
                    out.append(r)
        return out

    def add_user(self, readiness: LoadReadiness, user: tuple[Hashable, int]) -> None:
        """Request `user` (rid, generation) waits on the load: a failure fails it."""
        self._load_op_of(readiness).users.add(user)

    def drop_user(self, readiness: LoadReadiness, user: tuple[Hashable, int]) -> None:
        op = self._load_op_of(readiness, missing_ok=True)
        if op is not None:
            op.users.discard(user)

    def insert_cap(self, tokens: np.ndarray, n: int, extra_key: Hashable) -> int:
        """How much of tokens[:n] an insert may cover: it stops at a node whose load is in flight
        (a layer not ready yet), so that nothing new hangs below KV that a failed load takes back
        (a request waiting on that load cannot insert at all: `CacheCore._check_loaded`)."""
        if not self.loading:
            return n
        m = self.residency.tree.match(tokens[:n], extra_key, split=False, touch=False)
        pos = 0
        for node in m.nodes:
            r = self.loading.get(node.id)
            if r is not None and not r.all_ready():
                return pos
            pos += node.num_tokens
        return n

    def busy(self, node: Node) -> bool:
        """A copy into or out of `node` is in flight."""
        return node.id in self.backup_pending or node.id in self.loading

    # -- acks ---------------------------------------------------------------------
    def apply_ack(self, op_id: int, error: str | None) -> list[AckOutcome]:
        """Apply the ack of plan `op_id`: a load, or a batch of backups (each applied alone, in
        issue order). A sync caller may ack before taking the plans: the turn's backups leave first."""
        self._issue_backups()
        batch = self.batches.pop(op_id, None)
        res = self.residency
        if batch is None:
            op = self.ops[op_id]
            if op.direction is Direction.BACKUP:
                raise InternalError(f"ack of backup {op_id}, which travels in the batch of another op")
            res.device.unpin(op.device, op_id, trusted=True)
            res.host.unpin(op.host, op_id, trusted=True)
            if error is None and res.reuse.weighs:  # the load-cost model learns what a load costs, issue to ack
                res.reuse.observe_load(op.length, time.perf_counter() - op.issued_at, Tier.HOST)
            return [self._apply_one(op, error)]
        res.device.unpin(batch.device, op_id, trusted=True)  # (unpinned first: a write-back frees them)
        res.host.unpin(batch.host, op_id, trusted=True)
        if self._handed:
            for each in batch.op_ids:
                for device, host in self._handed.pop(each, ()):
                    res.device.unpin(device, each, trusted=True)
                    res.host.unpin(host, each, trusted=True)
        return [self._apply_one(self.ops[each], error) for each in batch.op_ids]

    def _apply_one(self, op: CopyOp, error: str | None) -> AckOutcome:
        res = self.residency
        op_id = op.op_id
        del self.ops[op_id]
        node = op.node
        if op.direction is Direction.BACKUP:
            if op_id in self._poisoned:
                self._poisoned.discard(op_id)
                error = error or "an earlier part of its node's backup failed"
            chain, op = self._backed_up_chain(op, error)
            for g in res.hooked.end_backup:  # (before a write-back eviction frees the pages)
                g.end_backup(op_id, chain, error is None)
            out = AckOutcome(op)
            self._finish_backup(op, chain, error)
            out.backed_up = error is None and bool(chain)
        else:
            for g in res.hooked.end_load:  # (unpinned first: a rollback frees them)
                g.end_load(op_id, op.orphaned)
            out = AckOutcome(op)
            chain = res.tree.split_chain(op.node, op.length)
            self._finish_load(op, chain, error, out)
        res.tree.unlock(node)
        if error is not None:
            self.stats["copy_failures"] += 1
        if op.direction is Direction.BACKUP and op.evict_after and error is None:
            for node in reversed(chain):
                if node in res.tree.device_leaves:
                    res.drop_device(node)
        return out

    def on_split(self, lower: Node, upper: Node) -> None:
        """In-flight marks cover both halves of a split."""
        if lower.id in self.backup_pending:
            self.backup_pending[upper.id] = self.backup_pending[lower.id]
        if lower.id in self.loading:
            self.loading[upper.id] = self.loading[lower.id]

    # -- helpers -------------------------------------------------------------------
    def _backed_up_chain(self, op: CopyOp, error: str | None) -> tuple[list[Node], CopyOp]:
        """The nodes a landed backup covers whole, top-down (seed 002: found from its deepest node
        and lengths, whatever split since); none when it failed. When its node grew past it, its
        range ends inside a node: that node's covered head goes to the backup chained after it
        (or, with none, is split off to take it here). Returns the chain and `op` narrowed to it."""
        op_id = op.op_id
        grown = self._grown.pop(op_id, 0)
        after = self._next.pop(op_id, None)
        before = self._prev.pop(op_id, None)
        if before is not None:
            self._next.pop(before, None)
        if after is not None:
            self._prev.pop(after, None)
        node = op.node
        if grown or before is not None or error is not None:
            self._unmark(op, grown + op.length)
        if error is not None:
            if after is not None:
                self._poisoned.add(after)
            return [], op
        tree = self.residency.tree
        while grown >= node.num_tokens > 0:  # the growth may have been split into nodes of its own
            grown -= node.num_tokens
            node = node.parent  # type: ignore[assignment]
        if grown:  # its range ends inside `node`, `head` tokens into it
            head = node.num_tokens - grown
            if after is not None:
                op = self._hand_over(op, head, self.ops[after])
                self.backup_pending[node.id] = after
                if op.length == 0:
                    return [], op
                node = node.parent  # type: ignore[assignment]
            else:
                node = tree.split(node, head)
        return tree.split_chain(node, op.length), replace(op, node=node)

    def _unmark(self, op: CopyOp, span: int) -> None:
        """Drop the in-flight marks of `op` from the nodes of the last `span` tokens ending at its node."""
        pending, op_id = self.backup_pending, op.op_id
        node = op.node
        while span > 0 and node.parent is not None:
            if pending.get(node.id) == op_id:
                del pending[node.id]
            span -= node.num_tokens
            node = node.parent  # type: ignore[assignment]

    def _hand_over(self, op: CopyOp, head: int, after: CopyOp) -> CopyOp:
        """The last `head` tokens of landed backup `op` go to `after`, the backup of what follows
        them in the same node (a widened record in its place, the pages pinned under it until its
        ack); returns `op` without them."""
        res = self.residency
        cut = len(op.device) - head
        device, host = op.device[cut:], op.host[cut:]
        res.device.pin(device, after.op_id, trusted=True)
        res.host.pin(host, after.op_id, trusted=True)  # type: ignore[union-attr]
        self._handed.setdefault(after.op_id, []).append((device, host))
        self.ops[after.op_id] = replace(after, device=np.concatenate((device, after.device)),
                                        host=np.concatenate((host, after.host)), length=after.length + head)
        return replace(op, device=op.device[:cut], host=op.host[:cut], length=op.length - head)

    def _finish_backup(self, op: CopyOp, chain: list[Node], error: str | None) -> None:
        res = self.residency
        op_id = op.op_id
        for node in chain:
            self.backup_pending.pop(node.id, None)
        if error is not None:
            res.free_host(op.host, op.host_owner, op=op_id, reason="copy_failed")
            return
        if chain:
            res.attach_backup(chain, op.host, op.host_owner)

    def _finish_load(self, op: CopyOp, chain: list[Node], error: str | None, out: AckOutcome) -> None:
        for node in chain:
            if self.loading.get(node.id) is op.readiness:  # (an orphaned op's nodes may load again)
                del self.loading[node.id]
        if op.orphaned:  # its nodes were rolled back with a failed load above them
            self.residency.free_device(op.device, node_owner(op.node), node=op.node.id, reason="load_orphaned")
            return
        if error is not None and op.readiness is not None and op.readiness.all_ready():
            # every layer was reported on device: its users computed on it, and KV below it
            # may be in the tree already (`insert_cap`), so the load stands
            _log.warning("load_error_after_all_layers_ready", op=op.op_id, error=error)
            error = None
        if error is None:
            return
        # roll back: the device copies never became valid, nor did those of the loads started
        # under them (their users are this one's too); requests that used them are failed
        out.failed = error
        self._orphan_loads_below(op, chain[0], out.failed_users)
        self.residency.roll_back_load(chain)
        out.failed_users |= op.users

    def _orphan_loads_below(self, failed: CopyOp, top: Node, users: set[Hashable]) -> None:
        """Before the chain of `failed` (from `top` down) loses its device copies: take them from
        the nodes of every other load in flight below `top` (deepest first), each load keeping its
        slots until its own ack. Nothing else can be on device below a load in flight
        (`insert_cap`; acks come in issue order)."""
        def depth(node: Node) -> int | None:
            d = 0
            while node is not top:
                if node.parent is None:
                    return None
                node, d = node.parent, d + 1
            return d

        below = []
        for op in self.ops.values():
            if op.direction is Direction.LOAD and not op.orphaned and op is not failed:
                d = depth(op.node)
                if d is not None:
                    below.append((d, op))
        for _, op in sorted(below, key=lambda x: -x[0]):
            chain = self.residency.tree.split_chain(op.node, op.length)
            for node in chain:
                self.loading.pop(node.id, None)
            self.residency.orphan_load(chain)
            op.orphaned = True
            users |= op.users

    def _load_op_of(self, readiness: LoadReadiness, missing_ok: bool = False) -> CopyOp | None:
        # a load's readiness is made for its op id (`ReadinessFactory`): one lookup, not a scan
        op = self.ops.get(readiness.op_id) if readiness.op_id is not None else None
        if op is not None and op.readiness is readiness:
            return op
        if missing_ok:
            return None
        raise InternalError(f"no load in flight has readiness of op {readiness.op_id}")


@dataclass(slots=True)
class _Batch:
    """Backups that left together: one plan and one ack under the first one's op id, their pages
    pinned once (`device`, `host`: every backup's, in order)."""

    op_id: int
    op_ids: list[int]
    device: np.ndarray
    host: np.ndarray


def _merged_transfers(transfers: list[PoolTransfer]) -> tuple[PoolTransfer, ...]:
    """The batch's other pools' transfers (recurrent state, sliding window), one per pool."""
    if not transfers:
        return ()
    by_pool: dict[str, list[PoolTransfer]] = {}
    for t in transfers:
        by_pool.setdefault(t.pool, []).append(t)
    return tuple(PoolTransfer(pool, torch.cat([t.src for t in ts]), torch.cat([t.dst for t in ts]))
                 for pool, ts in by_pool.items())

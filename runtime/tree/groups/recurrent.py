"""RecurrentStates: the state slots of a hybrid model's recurrent layers (Mamba, linear attention).

A recurrent layer's cache is not per token: it is one fixed-size state that summarises the
whole prefix. A prefix hit is usable only where a *snapshot* of that state exists, the state
after exactly that prefix; KV of one prefix with the state of another gives wrong output with no
error. The rule, by construction:

- a snapshot belongs to the tree node whose last token it follows (held in `node_state`, owned
  by the node in the state ledger); a split keeps it on the lower half, which keeps the node's
  identity and end;
- a match is cut back to the deepest matched node that holds a snapshot (`usable_end`): a hit
  restores KV and state of the same prefix, or nothing;
- every live request has a running state slot of its own (`running`); a hit gives it the
  node's snapshot to copy from (the node stays locked by the request, so the snapshot stays);
- the engine asks for snapshots at page-aligned positions of a request (`snapshot`); they stay
  the request's (`pending`) until an insert reaches their position, when they pass to the node
  ending there (split if needed), or are freed when the node has one already;
- a snapshot is freed with its node's device KV (evicted or deleted with it), and snapshots of
  unlocked nodes are evicted, in the tree's eviction order, when a state slot is needed;
- with a host tier, a node's backup copies its snapshot too (`host_state`, freed with the node's
  host copy), and a hit through host-only nodes ends at the deepest one whose snapshot is on host:
  its load brings the snapshot back to a device slot of that node, the hit resumes from it.

Owns the device and host state ledgers (`SlotLedger`s, one slot a page), `running`, `pending`,
`node_state` and `host_state`, and the state copies of the backups and loads in flight (`copies`,
by op id). It is the recurrent state's `PoolGroup` (`runtime/tree/groups/base.py`): `Residency`
calls `drop_device` / `drop_host` where it drops a node's device / host KV, `CopyTracker` the
copy hooks, `CacheCore` the admission and request hooks; the storage tier writes and reads host
snapshots through `take_host` / `pin_host` / `adopt_host`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Container, Hashable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

import torch

from runtime.errors import CapacityError
from runtime.memory.groups import GroupSpec
from runtime.memory.ledger import SlotLedger
from runtime.memory.owners import Owner, Tier
from runtime.messages import PoolTransfer, StateBlob
from runtime.storage.state_blobs import StateBlobFormat
from runtime.tree.groups.base import PoolGroup
from runtime.tree.nodes import MatchResult, Node, node_owner
from runtime.tree.policies import EvictionPolicy
from runtime.tree.records import RequestRecord

__all__ = ["RecurrentStates", "NoSnapshots", "StateCopy", "COUNTERS"]

COUNTERS = ("state_snapshots_taken", "state_snapshots_kept", "state_snapshots_evicted", "state_hits")


@dataclass(frozen=True, eq=False)
class StateCopy:
    """The state slots a backup or load copies with its KV: `src[i]` -> `dst[i]` (device -> host for
    a backup, host -> device for a load), for `nodes[i]`; pinned by the copy until its ack."""

    src: np.ndarray
    dst: np.ndarray
    nodes: tuple[Node, ...]


class NoSnapshots:
    """The storage tier's snapshot store of a model without recurrent state (or without host state
    slots): no snapshot to write, look up or read."""

    def blobs_to_write(self, chain: list[Node], every: list[bytes], known: Container[bytes]) -> tuple[StateBlob, ...]:
        return ()

    def blobs_to_look_up(self, keys: list[bytes]) -> tuple[StateBlob, ...]:
        return ()


def _slots(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.int64)


class RecurrentStates(PoolGroup):
    COUNTERS = COUNTERS
    COUNTS = ("state_free_slots",)

    # -- state -------------------------------------------------------------------
    def __init__(self, spec: GroupSpec, num_slots: int, host_slots: int, policy: EvictionPolicy,
                 page_size: int = 1, blob_format: StateBlobFormat | None = None) -> None:
        """`spec.pools`: the plan pool names of the state's components (`state.<name>`); `policy`:
        the tree's eviction order, which snapshot evictions follow too; `blob_format`: how a
        snapshot is stored (with a storage tier)."""
        self.spec = spec
        self.page_size = page_size
        self.blob_format = blob_format
        # not traced: the slot tracer's tiers are KV tiers (the trace auditor replays them)
        self.ledger = SlotLedger(num_slots, 1, Tier.DEVICE)
        self.host_ledger = SlotLedger(host_slots, 1, Tier.HOST)  # (no pages: no host tier)
        self.pools = spec.pools
        self.copies: dict[int, StateCopy] = {}  # op id -> the state slots a backup or load in flight copies
        self.policy = policy
        self.host_state: dict[Node, int] = {}  # node -> host copy of its snapshot
        self.host_position: dict[int, int] = {}  # host snapshot slot -> its prefix length
        self.running: dict[Hashable, int] = {}  # rid -> its running state slot
        self.pending: dict[Hashable, dict[int, int]] = {}  # rid -> {position: snapshot slot}
        self.node_state: dict[Node, int] = {}  # node -> snapshot of the state after its last token
        self.position: dict[int, int] = {}  # snapshot slot -> the prefix length it was taken at
        self.stats: dict[str, int] = dict.fromkeys(COUNTERS, 0)

    # -- matching ----------------------------------------------------------------
    def usable_end(self, look: MatchResult, host_len: int) -> int:
        """Tokens of `look`'s device part and `host_len` tokens of host-only part after it that a
        hit may use: up to the end of the deepest fully matched node holding its snapshot in the
        same tier as its KV (device nodes: on device; host-only nodes: on host). 0: none."""
        end = usable = 0
        nodes = look.device_nodes
        if host_len:
            nodes = nodes + look.host_nodes
        last = len(nodes) - 1 if look.partial and len(nodes) == len(look.nodes) else len(nodes)
        state, host_state = self.node_state, self.host_state
        for i in range(last):  # (a partly matched last node's end lies beyond the match)
            node = nodes[i]
            end += node.num_tokens
            if node in state if node.device is not None else node in host_state:
                usable = end
        return usable

    def hit_state(self, node: Node | None) -> int | None:
        """The snapshot a hit ending at `node` copies from (None: no hit)."""
        if node is None:
            return None
        self.stats["state_hits"] += 1
        return self.node_state[node]

    # -- admission (PoolGroup hooks) ---------------------------------------------------
    def admission_room(self, look: MatchResult, host_len: int) -> bool:
        """A running slot, and one for the hit's snapshot when it comes back from host."""
        return self.room_for(1 + (host_len > 0), look.nodes)

    def reserve(self, rid: Hashable, owner: Owner, host_nodes: list[Node]) -> tuple[int, int | None]:
        """The request's running slot and, for a load, the slot its snapshot comes back to (all
        or nothing; may evict unlocked snapshots, never the hit's: the caller locked it)."""
        running = self.admit(rid, owner)
        try:
            return running, self.reserve_load(host_nodes[-1]) if host_nodes else None
        except CapacityError:
            self.release(rid, owner)
            raise

    def cancel(self, rid: Hashable, owner: Owner, host_nodes: list[Node], reserved: Any) -> None:
        _, load = reserved
        self.release(rid, owner)
        if load is not None:
            self.free_node_slot(host_nodes[-1], load)

    def grant(self, lock_node: Node | None, reserved: Any) -> Mapping[str, Any]:
        return {"state_slot": reserved[0], "state_from": self.hit_state(lock_node)}

    # -- requests ----------------------------------------------------------------
    def grows_in_place(self, node: Node, first_slot: int) -> bool:
        """A leaf holding a snapshot does not grow: it is the state after its last token."""
        return node not in self.node_state

    def after_insert(self, rec: RequestRecord, split: Callable[[Node, int], Node]) -> list[Node]:
        """The request's snapshots at positions its insert reached pass to the nodes ending there
        (a node is split at a snapshot's position when it spans it); returns the split-off upper
        halves (new nodes: the write-through backs them up too)."""
        node, end = rec.last_node, rec.cached_len
        uppers = []
        for position, slot in self.pending_upto(rec.rid, rec.cached_len):  # deepest first
            assert node is not None
            while end - node.num_tokens >= position:  # walk up to the node spanning the position
                end -= node.num_tokens
                node = node.parent  # type: ignore[assignment]
            if end > position:  # inside: the upper half of a split ends there
                node = split(node, position - (end - node.num_tokens))
                uppers.append(node)
                end = position
            self.attach(node, slot, rec.owner)
        return uppers

    def rewind(self, rec: RequestRecord, new_len: int) -> None:
        """A snapshot of retracted tokens describes no prefix."""
        self.forget_after(rec.rid, rec.owner, new_len)

    def counts(self) -> dict[str, int]:
        return {"state_free_slots": self.ledger.num_free_slots()}

    def room_for(self, slots: int, keep: Collection[Node]) -> bool:
        """Whether `slots` state slots can be had, free or by evicting snapshots of unlocked nodes
        not in `keep` (the path an admission is about to lock): `can_admit` and `admit` agree."""
        free = self.ledger.num_free_pages()
        if free >= slots:
            return True
        keep = set(keep)
        return free + sum(1 for n in self._evictable(self.node_state, self.ledger) if n not in keep) >= slots

    def admit(self, rid: Hashable, owner: Owner) -> int:
        """The running state slot of a new request (CapacityError: none free or evictable)."""
        slot = self._alloc(owner, rid=rid)
        self.running[rid] = slot
        return slot

    def snapshot(self, rid: Hashable, owner: Owner, position: int) -> int:
        """A slot for the state after `position` tokens of `rid` (the engine copies it there);
        the caller checked `position`."""
        slot = self._alloc(owner, rid=rid, position=position)
        self.pending.setdefault(rid, {})[position] = slot
        self.position[slot] = position
        self.stats["state_snapshots_taken"] += 1
        return slot

    def has_pending(self, rid: Hashable, position: int) -> bool:
        return position in self.pending.get(rid, ())

    def pending_upto(self, rid: Hashable, end: int) -> list[tuple[int, int]]:
        """The pending snapshots of `rid` at positions <= `end`, taken out, deepest first."""
        mine = self.pending.get(rid)
        if not mine:
            return []
        out = sorted(((p, s) for p, s in mine.items() if p <= end), reverse=True)
        for p, _ in out:
            del mine[p]
        return out

    def attach(self, node: Node, slot: int, owner: Owner) -> None:
        """A request's snapshot `slot` after `node`'s last token passes to `node`, or is freed when
        `node` has one already."""
        if node in self.node_state:
            self._free([slot], owner, reason="duplicate")
            return
        self.ledger.assign(np.array([slot]), owner, node_owner(node), node=node.id)
        self.node_state[node] = slot
        self.stats["state_snapshots_kept"] += 1

    def forget_after(self, rid: Hashable, owner: Owner, length: int) -> None:
        """A rewind to `length` tokens: snapshots past it describe tokens the request no longer has."""
        mine = self.pending.get(rid, {})
        gone = [p for p in mine if p > length]
        if gone:
            self._free([mine.pop(p) for p in gone], owner, rid=rid, reason="rewind")

    def release(self, rid: Hashable, owner: Owner) -> None:
        """Free a request's running slot and the snapshots no insert took."""
        slots = [self.running.pop(rid)]
        slots.extend(self.pending.pop(rid, {}).values())
        self._free(slots, owner, rid=rid)

    # -- nodes -------------------------------------------------------------------
    def drop_device(self, node: Node) -> None:
        """`node` loses its device KV: its snapshot goes with it."""
        slot = self.node_state.pop(node, None)
        if slot is not None:
            self._free([slot], node_owner(node), node=node.id, reason="evict")

    def drop_host(self, node: Node) -> None:
        """`node` loses its host KV: the host copy of its snapshot goes with it."""
        slot = self.host_state.pop(node, None)
        if slot is not None:
            self.host_ledger.free(np.array([slot]), node_owner(node), node=node.id, reason="evict")
            del self.host_position[slot]

    # -- copies (CopyTracker) -------------------------------------------------------
    def start_backup(self, op_id: int, node: Node, device: np.ndarray, host: np.ndarray) -> tuple[PoolTransfer, ...]:
        copy = self._backup_copy(node, op_id)
        if copy is None:
            return ()
        self.copies[op_id] = copy
        return self.transfers(copy)

    def end_backup(self, op_id: int, chain: list[Node], ok: bool) -> None:
        copy = self.copies.pop(op_id, None)
        if copy is not None:
            self._end_backup(copy, op_id, ok)

    def start_load(self, op_id: int, host_nodes: list[Node], reserved: Any) -> tuple[PoolTransfer, ...]:
        slot = reserved[1]
        if slot is None:  # (a hit on device alone loads no snapshot)
            return ()
        copy = self._load_copy(host_nodes, slot, op_id)
        self.copies[op_id] = copy
        return self.transfers(copy)

    def end_load(self, op_id: int, orphaned: bool) -> None:
        copy = self.copies.pop(op_id, None)
        if copy is not None:
            self.host_ledger.unpin(copy.src, op_id)
            self.ledger.unpin(copy.dst, op_id)
            if orphaned:  # its nodes lost their device copies: the slots are freed with the load
                self.free_orphaned(copy)

    def _backup_copy(self, node: Node, op_id: int) -> StateCopy | None:
        """A backup of `node` copies its snapshot too (both slots pinned by `op_id`); None when it
        has none on device or no host state slot can be had (the backup then copies KV alone:
        hits through its host copy end higher up)."""
        src = self.node_state.get(node)
        if src is None or node in self.host_state:
            return None
        dst = self.take_host(node_owner(node), node=node.id)
        if dst is None:
            return None
        self.host_position[dst] = self.position[src]
        copy = StateCopy(_slots([src]), _slots([dst]), (node,))
        self.ledger.pin(copy.src, op_id)
        self.host_ledger.pin(copy.dst, op_id)
        return copy

    def _end_backup(self, copy: StateCopy, op_id: int, ok: bool) -> None:
        """The backup's ack: its host snapshot joins its node, or is freed."""
        self.ledger.unpin(copy.src, op_id)
        self.host_ledger.unpin(copy.dst, op_id)
        (node,), dst = copy.nodes, int(copy.dst[0])
        if ok:
            self.host_state[node] = dst
        else:
            self.host_ledger.free(copy.dst, node_owner(node), node=node.id, reason="copy_failed")
            del self.host_position[dst]

    # -- storage (StorageTier): a host snapshot written with its node's KV, or read for a prefetch --
    def blobs_to_write(self, chain: list[Node], every: list[bytes], known: Container[bytes]) -> tuple[StateBlob, ...]:
        """The host snapshots at the ends of `chain` (its path's page hashes `every`) not known
        stored: one blob each, keyed by the page ending at the snapshot's position (snapshots are
        only ever taken at page-aligned node ends)."""
        fmt = self.blob_format
        assert fmt is not None
        out = []
        for n in chain:
            slot = self.host_state.get(n)
            if slot is not None:
                page = every[self.host_position[slot] // self.page_size - 1]
                if page not in known:
                    out.append(StateBlob(slot, fmt.keys(page), page=page))
        return tuple(out)

    def blobs_to_look_up(self, keys: list[bytes]) -> tuple[StateBlob, ...]:
        """A hit ends at a stored snapshot: one asked for after each of the pages `keys` (a
        lookup's), deepest first, each named by the page it follows (the worker derives the chunk
        keys of those it checks: hashing every boundary's here would cost O(pages x chunks))."""
        return tuple(StateBlob(-1, (), j, page=keys[j - 1]) for j in range(len(keys), 0, -1))

    def blob_keys(self, page: bytes) -> tuple[bytes, ...]:
        assert self.blob_format is not None
        return self.blob_format.keys(page)

    def take_host(self, owner: Owner, **ctx: object) -> int | None:
        """A host state slot for `owner`, evicting the first unlocked, unpinned host snapshot in the
        eviction order if none is free; None when none can be had."""
        host = self.host_ledger
        if host.num_free_pages() == 0:
            victim = min(self._evictable(self.host_state, host), key=self.policy.key, default=None)
            if victim is None:
                return None
            self.drop_host(victim)
            self.stats["state_snapshots_evicted"] += 1
        return int(host.alloc(1, owner, **ctx)[0])

    def pin_host(self, slot: int, op_id: int) -> None:
        """A storage op reads (a write) or fills (a read) host state `slot` until its ack."""
        self.host_ledger.pin(_slots([slot]), op_id)

    def unpin_host(self, slot: int, op_id: int) -> None:
        self.host_ledger.unpin(_slots([slot]), op_id)

    def free_host(self, slot: int, owner: Owner, **ctx: object) -> None:
        """Free host state `slot`, held by `owner` and no node (a storage read's that did not land)."""
        self.host_ledger.free(_slots([slot]), owner, **ctx)

    def adopt_host(self, node: Node | None, slot: int, owner: Owner, position: int) -> bool:
        """A storage read's host state `slot` (owned by `owner`), the state after `position` tokens,
        becomes the host snapshot of `node`, which ends there: True; False (freed) when `node` is
        gone, holds no host KV (a hit would restore state alone) or has a host snapshot already."""
        if node is None or node.host is None or node in self.host_state:
            self.free_host(slot, owner, reason="unused" if node is None or node.host is None else "duplicate")
            return False
        self.host_ledger.assign(_slots([slot]), owner, node_owner(node), node=node.id)
        self.host_state[node] = slot
        self.host_position[slot] = position
        return True

    def reserve_load(self, node: Node) -> int:
        """A device state slot for the snapshot a load through host-only `node` brings back
        (owned by `node`; CapacityError: none free or evictable). `start_load` attaches it."""
        return self._alloc(node_owner(node), node=node.id)

    def _load_copy(self, host_nodes: list[Node], slot: int, op_id: int) -> StateCopy:
        """A load of the host-only chain `host_nodes` brings back the deepest node's host snapshot
        into `slot` (reserved), and those of the others while device state slots are free: each
        becomes its node's device snapshot now (a hit resumes from the deepest once the load is
        ready). Every slot is pinned by `op_id`."""
        deepest = host_nodes[-1]
        nodes = [deepest]
        dst = [slot]
        for node in host_nodes[:-1]:  # best effort, without evicting: later hits may end there
            if node in self.host_state and self.ledger.num_free_pages():
                nodes.append(node)
                dst.append(int(self.ledger.alloc(1, node_owner(node), node=node.id)[0]))
        src = [self.host_state[node] for node in nodes]
        for node, s, d in zip(nodes, src, dst, strict=True):
            self.node_state[node] = d
            self.position[d] = self.host_position[s]
        copy = StateCopy(_slots(src), _slots(dst), tuple(nodes))
        self.host_ledger.pin(copy.src, op_id)
        self.ledger.pin(copy.dst, op_id)
        return copy

    def orphan_load(self, chain: list[Node]) -> None:
        """A load under a failed load loses its nodes' device copies: their device snapshots leave
        them and stay owned by them until the load's ack (`free_orphaned`)."""
        for node in chain:
            self.node_state.pop(node, None)

    def free_orphaned(self, copy: StateCopy) -> None:
        for node, slot in zip(copy.nodes, copy.dst.tolist(), strict=True):
            self._free([slot], node_owner(node), node=node.id, reason="load_orphaned")

    def free_node_slot(self, node: Node, slot: int) -> None:
        """Free a device state slot `node` owns but does not hold (a reserved load's, unused)."""
        self._free([slot], node_owner(node), node=node.id, reason="unused")

    def transfers(self, copy: StateCopy) -> tuple[PoolTransfer, ...]:
        """One `PoolTransfer` per state component copying `copy`'s slots (fresh tensors)."""
        return tuple(PoolTransfer(name, torch.from_numpy(copy.src.copy()), torch.from_numpy(copy.dst.copy()))
                     for name in self.pools)

    # -- helpers -----------------------------------------------------------------
    @staticmethod
    def _evictable(held: dict[Node, int], ledger: SlotLedger) -> Iterator[Node]:
        """Nodes whose snapshot in `held` may be evicted: unlocked, and no copy reads or writes it."""
        return (n for n, slot in held.items() if n.lock_ref == 0 and ledger.pin_count(slot) == 0)

    def _free(self, slots: list[int], owner: Owner, **ctx: object) -> None:
        self.ledger.free(np.array(slots, dtype=np.int64), owner, **ctx)
        for slot in slots:
            self.position.pop(slot, None)

    def _alloc(self, owner: Owner, **ctx: object) -> int:
        if self.ledger.num_free_pages() == 0:
            # the first unlocked snapshot in the eviction order: its node keeps its KV (a hit there just
            # reaches less far); O(snapshots), a state slot is large and they are few
            victim = min(self._evictable(self.node_state, self.ledger), key=self.policy.key, default=None)
            if victim is None:
                raise CapacityError(f"no state slot free: {self.ledger.num_pages} held by running requests, "
                                    "their snapshots and locked nodes")
            self.drop_device(victim)
            self.stats["state_snapshots_evicted"] += 1
        return int(self.ledger.alloc(1, owner, **ctx)[0])

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
  unlocked nodes are evicted, least recently used first, when a state slot is needed.

Owns the device state ledger (`SlotLedger`, one slot a page), `running`, `pending` and
`node_state`; `Residency` calls `drop` where it drops a node's device KV.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from runtime.errors import CapacityError
from runtime.memory.ledger import SlotLedger
from runtime.memory.owners import Owner, Tier
from runtime.tree.nodes import MatchResult, Node

__all__ = ["RecurrentStates", "COUNTERS"]

COUNTERS = ("state_snapshots_taken", "state_snapshots_kept", "state_snapshots_evicted", "state_hits")


def _owner_of(node: Node) -> Owner:
    owner = node.owner
    if owner is None:
        owner = node.owner = Owner.node(node.id)
    return owner


class RecurrentStates:
    # -- state -------------------------------------------------------------------
    def __init__(self, num_slots: int) -> None:
        # not traced: the slot tracer's tiers are KV tiers (the trace auditor replays them)
        self.ledger = SlotLedger(num_slots, 1, Tier.DEVICE)
        self.running: dict[Hashable, int] = {}  # rid -> its running state slot
        self.pending: dict[Hashable, dict[int, int]] = {}  # rid -> {position: snapshot slot}
        self.node_state: dict[Node, int] = {}  # node -> snapshot of the state after its last token
        self.position: dict[int, int] = {}  # snapshot slot -> the prefix length it was taken at
        self.stats: dict[str, int] = dict.fromkeys(COUNTERS, 0)

    # -- matching ----------------------------------------------------------------
    def usable_end(self, look: MatchResult) -> int:
        """Tokens of `look`'s device part that a hit may use: up to the end of its deepest fully
        matched device node holding a snapshot (0: none)."""
        end = usable = 0
        nodes = look.device_nodes
        last = len(nodes) - 1 if look.partial else len(nodes)  # a partly matched node's end is beyond
        state = self.node_state
        for i in range(last):
            node = nodes[i]
            end += node.num_tokens
            if node in state:
                usable = end
        return usable

    def hit_state(self, node: Node | None) -> int | None:
        """The snapshot a hit ending at `node` copies from (None: no hit)."""
        if node is None:
            return None
        self.stats["state_hits"] += 1
        return self.node_state[node]

    # -- requests ----------------------------------------------------------------
    def can_admit(self) -> bool:
        return self.ledger.num_free_pages() > 0 or self._evictable() > 0

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
        self.ledger.assign(np.array([slot]), owner, _owner_of(node), node=node.id)
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
    def drop(self, node: Node) -> None:
        """`node` loses its device KV: its snapshot goes with it."""
        slot = self.node_state.pop(node, None)
        if slot is not None:
            self._free([slot], _owner_of(node), node=node.id, reason="evict")

    # -- helpers -----------------------------------------------------------------
    def _free(self, slots: list[int], owner: Owner, **ctx: object) -> None:
        self.ledger.free(np.array(slots, dtype=np.int64), owner, **ctx)
        for slot in slots:
            self.position.pop(slot, None)

    def _evictable(self) -> int:
        return sum(1 for node in self.node_state if node.lock_ref == 0)

    def _alloc(self, owner: Owner, **ctx: object) -> int:
        if self.ledger.num_free_pages() == 0:
            # least recently used unlocked snapshot: its node keeps its KV (a hit there just
            # reaches less far); O(snapshots), a state slot is large and they are few
            victims = [n for n in self.node_state if n.lock_ref == 0]
            if not victims:
                raise CapacityError(f"no state slot free: {self.ledger.num_pages} held by running requests, "
                                    "their snapshots and locked nodes")
            victim = min(victims, key=lambda n: n.last_access)
            self.drop(victim)
            self.stats["state_snapshots_evicted"] += 1
        return int(self.ledger.alloc(1, owner, **ctx)[0])

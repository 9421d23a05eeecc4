"""Residency: which token prefixes are cached, and in which slots of which tier.

It owns the radix tree, the device and host slot ledgers and the tracer, and is the only code
that pairs a tree change with its ledger change: allocate, evict, drop, delete, insert, attach a
copy's slots, adopt a host run, move ownership on a split, and give a part's own pages back or
hand them over (`free_device`, `assign_device`...). Every other part of the core changes the tree
or a ledger only through these methods (locks, pins and host protections excepted: they change
no ownership; `tests/unit/test_architecture.py` checks the ledgers' side). Eviction that needs a
backup first (write-back, or a node whose host-only children need it to keep a copy) is not
issued here: `evict_device` returns those nodes, and the copy tracker starts their backups.

It holds the model's pool groups (`groups`, built from the config's declarations) and calls each
group's hooks where the group has a say (`hooked`: only the groups whose rule overrides a hook);
a tier or feature that is off is a null object here too (no KV events: `NoEvents`; no host tier:
a host ledger of no pages).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Hashable, Mapping
from typing import Any, TypeVar

import numpy as np

from runtime.config import RuntimeConfig
from runtime.errors import CapacityError, InternalError, StateError
from runtime.events.recorder import CPU, GPU, KVEventRecorder
from runtime.memory.groups import FULL, RECURRENT, SLIDING, Feature, GroupSpec
from runtime.memory.ledger import SlotLedger
from runtime.memory.owners import Owner, Tier
from runtime.memory.swa import PairedLedger, SwaSlots
from runtime.storage.hashing import KVIdentity
from runtime.storage.state_blobs import StateBlobFormat
from runtime.trace import SlotTracer
from runtime.transfer.load_cost import AlwaysLoad, MeasuredReuseCost, ReuseCost
from runtime.tree.policies import policy_by_name
from runtime.tree.nodes import node_owner  # noqa: F401 - re-exported (copies, tests)
from runtime.tree.page_hasher import PageHasher
from runtime.tree.radix import InsertResult, MatchResult, Node, RadixTree
from runtime.tree.groups.base import Hooked, PoolGroup
from runtime.tree.groups.full import FullAttention
from runtime.tree.groups.recurrent import NoSnapshots, RecurrentStates
from runtime.tree.groups.sliding import SlidingWindow
from runtime.tree.records import EMPTY, RequestRecord, aligned
from runtime.tree.tiers.off import NoEvents

G = TypeVar("G", bound=PoolGroup)


class Residency:
    # -- state -------------------------------------------------------------------
    def __init__(self, page_size: int, device_slots: int, host_slots: int, *, eviction_policy: str = "lru",
                 write_back: bool = False, tracer: SlotTracer | None = None, state_slots: int = 0,
                 host_state_slots: int = 0, sliding_window: int = 0, swa_slots: int = 0,
                 specs: tuple[GroupSpec, ...] = (), requests: Mapping[Hashable, RequestRecord] | None = None,
                 state_format: StateBlobFormat | None = None, reuse: ReuseCost | None = None) -> None:
        """`device_slots` 0: no device tier of its own (tiers-only mode, where the engine owns
        device memory): a tree of host copies over the host ledger. `specs`: the model's pool
        groups (`RuntimeConfig.group_specs`; none: full attention alone), each a rule object in
        `groups`: with recurrent state (`state_slots` > 0, `RecurrentStates`) node snapshots go
        with the node's device KV and a match is cut back to the deepest snapshot; with sliding
        layers (`sliding_window` > 0, a pool of `swa_slots`, `SlidingWindow`) pages outside
        every node end's window drop their sliding KV and a match is cut back to the deepest end
        whose window is present. `requests`: the live request records (read by groups whose
        rule depends on what running requests still read). `reuse`: how much of a host hit an
        admission loads (default: all of it, `AlwaysLoad`)."""
        self.page_size = page_size
        self.write_back = host_slots > 0 and write_back
        self.tracer = tracer
        self.tree = RadixTree(page_size, policy_by_name(eviction_policy), on_split=self.on_split)
        self._split_listeners: list[Callable[[Node, Node], None]] = []
        spec = {s.kind: s for s in specs}
        # the host tier off is a host ledger of no pages: nothing is backed up or kept on host
        self.host = SlotLedger(host_slots, page_size, Tier.HOST, tracer)
        # the groups, as the config declares them (the token pool's own first)
        full = spec.get(FULL) or GroupSpec.of(FULL, "kv_layout", "token", (), 0)
        groups: list[PoolGroup] = []
        if sliding_window > 0:  # the sliding pool is paired with the token pool: one device ledger over both
            swa = SwaSlots(device_slots, swa_slots, page_size)
            paired = PairedLedger(device_slots, page_size, Tier.DEVICE, tracer, swa)
            self.device: SlotLedger = paired
            groups.append(FullAttention(full, paired.full_free_pages, self.evictable_device_pages))
            groups.append(SlidingWindow(spec[SLIDING], sliding_window, swa, paired, self.tree,
                                        {} if requests is None else requests))
        else:
            self.device = SlotLedger(device_slots, page_size, Tier.DEVICE, tracer)
            groups.append(FullAttention(full, self.device.num_free_pages, self.evictable_device_pages))
        # the storage tier's snapshot store: host snapshots, if the model keeps any (`state_format`:
        # how they are stored)
        self.snapshots: RecurrentStates | NoSnapshots = NoSnapshots()
        if state_slots > 0:
            states = RecurrentStates(spec[RECURRENT], state_slots, host_state_slots, self.tree.policy, page_size,
                                     state_format)
            groups.append(states)
            if host_state_slots > 0:
                self.snapshots = states
        self.groups: tuple[PoolGroup, ...] = tuple(groups)
        self.hooked = Hooked.of(self.groups)  # per hook, the groups that have a say
        self.stats: dict[str, int] = {"device_evicted_tokens": 0, "host_evicted_tokens": 0,
                                      "tokens_host_hit_recomputed": 0}
        # the load-cost model: fed the loads' and prefills' times, asked at every admission's look
        self.reuse: ReuseCost = AlwaysLoad(page_size) if reuse is None else reuse
        self._cost_cut = 0  # host hit tokens the current admission's look chose to recompute
        # KV cache events (`enable_events`): every tier change below is reported to it
        self.events: KVEventRecorder | NoEvents = NoEvents()
        # the nodes' page hashes, shared by KV events and storage writes (`use_hasher`)
        self.hasher: PageHasher | None = None

    def group(self, kind: type[G]) -> G:
        """The model's group of rule `kind` (StateError: the model has none)."""
        for g in self.groups:
            if isinstance(g, kind):
                return g
        raise StateError(f"the model has no {kind.__name__} group")

    def supports(self, feature: Feature) -> bool:
        """Whether every group of the model supports `feature` (their declarations)."""
        return all(feature in g.spec.supports for g in self.groups)

    def listen_splits(self, hook: Callable[[Node, Node], None]) -> None:
        """Call `hook(lower, upper)` after every split, once the groups and ledgers followed it."""
        self._split_listeners.append(hook)

    @property
    def has_host(self) -> bool:
        """Whether there is a host tier (its ledger has pages)."""
        return self.host.num_pages > 0

    def records_events(self) -> bool:
        """Whether KV events are on (a recorder was given)."""
        return not isinstance(self.events, NoEvents)

    def enable_events(self, recorder: KVEventRecorder) -> None:
        self.events = recorder

    def use_hasher(self, identity: KVIdentity) -> PageHasher:
        """The tree's page hasher (made at the first call): one identity per tree, since a node
        keeps one set of page hashes."""
        if self.hasher is None:
            self.hasher = PageHasher(self.page_size, identity)
        elif self.hasher.identity != identity:
            raise InternalError(f"page hashes of identity {identity} asked for; the tree's are of {self.hasher.identity}")
        return self.hasher

    @classmethod
    def from_config(cls, config: RuntimeConfig, tracer: SlotTracer | None = None,
                    requests: Mapping[Hashable, RequestRecord] | None = None) -> "Residency":
        return cls(config.page_size, config.device_slots, config.host_slots, eviction_policy=config.eviction_policy,
                   write_back=config.write_policy == "write_back", tracer=tracer, state_slots=config.state_slots,
                   host_state_slots=config.host_state_slot_count,
                   sliding_window=config.sliding_window if config.swa_slots else 0, swa_slots=config.swa_slots,
                   specs=config.group_specs, requests=requests,
                   state_format=StateBlobFormat.of(shape, config.page_size * config.bytes_per_token)
                   if (shape := config.state_shape) else None,
                   reuse=MeasuredReuseCost(config.page_size, config.num_layers)
                   if config.reuse_cost == "measured" else None)

    # -- allocation --------------------------------------------------------------
    def alloc_device(self, pages: int, owner: Owner, **ctx: Any) -> np.ndarray:
        """Free pages only (the caller evicted first: `evict_device`)."""
        if pages == 0:
            return EMPTY
        if pages > self.device.num_free_pages():
            raise CapacityError(f"{pages} device pages needed, {self.device.num_free_pages()} free after eviction")
        return self.device.alloc(pages, owner, **ctx)

    def alloc_host(self, pages: int, owner: Owner, **ctx: Any) -> np.ndarray | None:
        """Host pages, evicting host-only copies for them; None when they cannot be had."""
        short = pages - self.host.num_free_pages()
        if short > 0:
            self.evict_host(short)
        if pages > self.host.num_free_pages():
            return None
        return self.host.alloc(pages, owner, **ctx)

    # -- slots outside the tree: every owner change of the token ledgers goes through here ----
    def free_device(self, slots: np.ndarray, owner: Owner, **ctx: Any) -> None:
        """Device pages `owner` (a request, session or node) gives back (not the tree's)."""
        self.device.free(slots, owner, **ctx)

    def free_host(self, slots: np.ndarray, owner: Owner, **ctx: Any) -> None:
        self.host.free(slots, owner, **ctx)

    def assign_device(self, slots: np.ndarray, owner: Owner, to: Owner, **ctx: Any) -> None:
        """Device pages handed from `owner` to `to` (a finished turn's to its session)."""
        self.device.assign(slots, owner, to, **ctx)

    def assign_host(self, slots: np.ndarray, owner: Owner, to: Owner, **ctx: Any) -> None:
        self.host.assign(slots, owner, to, **ctx)

    def hold(self, owner: Owner) -> int:
        """`owner`'s ledger code, held while a request is filed (`SlotLedger.hold`)."""
        return self.device.hold(owner)

    def unhold(self, owner: Owner) -> None:
        self.device.unhold(owner)

    def alloc_held(self, codes: np.ndarray, **ctx: Any) -> np.ndarray:
        """One free device page for each held owner code (a decode step's)."""
        return self.device.alloc_held(codes, **ctx)

    # -- eviction and deletion ---------------------------------------------------
    def evict_device(self, pages: int) -> list[Node]:
        """Free `pages` device pages in eviction order (as `freeable_now` predicts): each group
        gives back what it can first (`before_evict`), then device copies backed up on host are
        dropped and childless nodes with no host copy deleted. Returns the nodes passed over
        because their eviction needs a backup first (their device pages are freed at its ack):
        the caller starts those backups."""
        device = self.device
        target = device.num_free_pages() + pages
        for g in self.hooked.before_evict:
            g.before_evict(target)
        backup_first: list[Node] = []
        for node in self.tree.device_victims():
            if device.num_free_pages() >= target:
                break
            if not self._evict_node(node):
                backup_first.append(node)
        return backup_first

    def _evict_node(self, node: Node) -> bool:
        """Drop a victim's device copy (backed up) or delete it; False: it needs a backup first."""
        if node.host is not None:
            self.drop_device(node)
        elif self.write_back or node.children:  # (host-only children: none without a host tier)
            return False
        else:
            self.delete(node)
        return True

    def evict_host(self, pages: int) -> None:
        freed = 0
        for node in self.tree.host_victims():
            if freed >= pages:
                break
            freed += node.num_tokens // self.page_size
            self.delete(node)

    def drop_device(self, node: Node) -> None:
        for g in self.hooked.drop_device:
            g.drop_device(node)
        slots = self.tree.detach_device(node)
        self.device.free(slots, node_owner(node), trusted=True, node=node.id, reason="evict")
        self.events.removed(node, GPU)
        self.emit("evict", Tier.DEVICE, slots, node=node.id)
        self.stats["device_evicted_tokens"] += len(slots)

    def delete(self, node: Node) -> None:
        """Delete a childless unlocked node, then any ancestors left with no copy and no child."""
        while True:
            parent = node.parent
            if node.device is not None:  # (events while the node still has its path)
                self.events.removed(node, GPU)
            if node.host is not None:
                self.events.removed(node, CPU)
            for g in self.hooked.drop_device:
                g.drop_device(node)
            for g in self.hooked.drop_host:
                g.drop_host(node)
            device, host = self.tree.delete_leaf(node)
            if device is not None:
                self.device.free(device, node_owner(node), trusted=True, node=node.id, reason="evict")
                self.stats["device_evicted_tokens"] += len(device)
            if host is not None:
                self.host.free(host, node_owner(node), trusted=True, node=node.id, reason="evict")
                self.stats["host_evicted_tokens"] += len(host)
            if (parent is None or parent.parent is None or parent.children or parent.device is not None
                    or parent.host is not None or parent.lock_ref > 0):
                return
            node = parent

    def delete_subtree(self, top: Node) -> int:
        """Delete `top` (unlocked) and every node below it, deepest first; returns the tokens
        dropped. Nothing changes (0) when a node below holds a protected host copy (a storage
        write reads it): a node never loses its last copy while nodes below it keep theirs."""
        below: list[Node] = []
        stack = list(top.children.values())
        while stack:
            node = stack.pop()
            if node.host_protect or node.lock_ref:
                return 0
            below.append(node)
            stack.extend(node.children.values())
        dropped = top.num_tokens
        for node in reversed(below):  # children before parents
            dropped += node.num_tokens
            self.delete(node)
        self.delete(top)
        return dropped

    def flush(self) -> int:
        """Drop every unlocked cached prefix from device and host; returns tokens dropped. A flush
        that leaves both tiers empty is one `AllBlocksCleared` event instead of its removals."""
        mark = self.events.mark()
        dropped = self._flush()
        if self.tree.total_device_tokens == 0 and self.tree.total_host_tokens == 0:
            self.events.cleared_since(mark)
        return dropped

    def _flush(self) -> int:
        dropped = 0
        changed = True
        while changed:
            changed = False
            for node in self.tree.device_victims():
                if node.host is not None:
                    dropped += node.num_tokens
                    self.drop_device(node)
                elif not node.children:
                    dropped += node.num_tokens
                    self.delete(node)
                else:  # its last copy: the host-only nodes below it go with it (tier closure)
                    gone = self.delete_subtree(node)
                    if not gone:
                        continue
                    dropped += gone
                changed = True
            for node in self.tree.host_victims():
                dropped += node.num_tokens
                changed = True
                self.delete(node)
        return dropped

    # -- insertion and copies' slots ----------------------------------------------
    def insert(self, tokens: np.ndarray, extra_key: Hashable, slots: np.ndarray, owner: Owner,
               start: Node | None = None, extend_leaf: int = 0, trusted: bool = False,
               rid: Hashable = None, priority: int = 0) -> InsertResult:
        """Insert `tokens` with their device `slots` (owned by `owner`; `trusted`: its own alloc'd
        pages, cut at page boundaries by the tree): the slots of new nodes become theirs;
        duplicates of pages the tree had stay with `owner` (the result says which). `priority`
        is raised onto every node of the path."""
        res = self.tree.insert(tokens, extra_key, slots, priority=priority, start=start, extend_leaf=extend_leaf)
        assign = self.device.assign
        events = self.events
        for node, part in res.adopted:
            assign(part, owner, node_owner(node), trusted=trusted, rid=rid, node=node.id)
            events.stored(node, GPU, len(part))
        return res

    def attach_load(self, host_nodes: list[Node], device: np.ndarray, owner: Owner) -> None:
        """A load's destination pages (allocated by `owner`) become the host-only nodes' device copies."""
        offset = 0
        for node in host_nodes:
            part = device[offset: offset + node.num_tokens]
            offset += node.num_tokens
            self.device.assign(part, owner, node_owner(node), node=node.id)
            self.tree.attach_device(node, part)
            self.events.stored(node, GPU)

    def attach_backup(self, chain: list[Node], host: np.ndarray, host_owner: Owner) -> None:
        """A landed backup's host pages (owned by `host_owner`: the node it was issued for) go to
        the chain."""
        offset = 0
        for node in chain:
            part = host[offset: offset + node.num_tokens].copy()
            offset += node.num_tokens
            if node_owner(node) is not host_owner:  # (the same object for the node it was issued for)
                self.host.assign(part, host_owner, node_owner(node), trusted=True, node=node.id)  # type: ignore[union-attr]
            self.tree.attach_host(node, part)
            self.events.stored(node, CPU)

    def roll_back_load(self, chain: list[Node]) -> None:
        """A failed load's device copies never became valid: detach and free them."""
        for node in reversed(chain):
            for g in self.hooked.drop_device:
                g.drop_device(node)
            slots = self.tree.detach_device(node, force=True)
            self.device.free(slots, node_owner(node), node=node.id, reason="load_failed")
            self.events.removed(node, GPU)

    def orphan_load(self, chain: list[Node]) -> None:
        """Detach a load's device copies from its chain: its deepest node's owner keeps them all
        until the load's ack frees them (the load was started under a load that failed)."""
        owner = node_owner(chain[-1])
        for g in self.hooked.orphan_load:
            g.orphan_load(chain)
        for node in reversed(chain):
            slots = self.tree.detach_device(node, force=True)
            self.events.removed(node, GPU)
            if node is not chain[-1]:
                self.device.assign(slots, node_owner(node), owner, node=chain[-1].id, reason="load_orphaned")

    def adopt_host_run(self, tokens: np.ndarray, extra_key: Hashable, start: int, host: np.ndarray,
                       owner: Owner, rid: Hashable, busy: Container[int]) -> tuple[int, Node | None]:
        """Hand host pages holding tokens[start:] (owned by `owner`) to the tree: nodes on the path
        without a host copy (and no backup in flight: `busy` node ids) adopt theirs, the rest
        becomes a host-only child; pages the tree cannot take are freed. Used by decode offload
        and by storage prefetch. Returns the tokens kept and the node the path ends at (it ends
        exactly at `len(tokens)`; None if the prefix was gone). `host` is built from the host
        ledger's own `alloc` results, cut at page boundaries (every caller's is): the ledger
        calls take their trusted path."""
        host_ledger = self.host
        end = len(tokens)

        def drop(part: np.ndarray, reason: str) -> None:
            if len(part):
                host_ledger.free(part, owner, trusted=True, rid=rid, reason=reason)

        if start:
            # a node boundary at `start` (the path to it is the caller's locked or matched prefix)
            m0 = self.tree.match(tokens[:start], extra_key, split=True, touch=False)
            if m0.matched_len < start:
                drop(host, "prefix_gone")
                return 0, None
        m = self.tree.match(tokens, extra_key, split=True, touch=False)
        kept = 0
        offset = 0
        parent = self.tree.root(extra_key)
        for node in m.nodes:
            lo, offset = offset, offset + node.num_tokens
            if offset > start:
                part = host[lo - start: offset - start]
                if node.host is None and node.id not in busy:
                    self.tree.attach_host(node, part)
                    host_ledger.assign(part, owner, node_owner(node), trusted=True, rid=rid, node=node.id)
                    self.events.stored(node, CPU)
                    kept += len(part)
                else:
                    drop(part, "duplicate")
            parent = node
        if m.matched_len < end:
            rest = host[m.matched_len - start:]
            parent = self.tree.add_host_child(parent, tokens[m.matched_len:], rest)
            host_ledger.assign(rest, owner, node_owner(parent), trusted=True, rid=rid, node=parent.id)
            self.events.stored(parent, CPU)
            kept += len(rest)
        return kept, parent

    def on_split(self, lower: Node, upper: Node) -> None:
        """A split hands the upper part's slots (and page hashes, and each group's records) to the
        new node, then tells the listeners (copies in flight)."""
        if self.hasher is not None:
            self.hasher.on_split(lower, upper)
        for g in self.hooked.on_split:
            g.on_split(lower, upper)
        if upper.device is not None:
            self.device.assign(upper.device, node_owner(lower), node_owner(upper), node=upper.id, reason="split")
        if upper.host is not None:
            self.host.assign(upper.host, node_owner(lower), node_owner(upper), node=upper.id, reason="split")
        for hook in self._split_listeners:
            hook(lower, upper)

    # -- questions (change nothing) ---------------------------------------------------
    def admission(self, tokens: np.ndarray, extra_key: Hashable, *,
                  admitting: bool = False) -> tuple[MatchResult, int, int]:
        """The read-only look an admission starts from: (look, host tokens to load, device pages
        needed for them and the uncached rest). The last token is always computed (the model
        needs its logits), so at most len - 1 tokens match. `admitting`: an admit's (the cut is
        noted by each group, counted when it is admitted)."""
        ps = self.page_size
        look, host_len = self.usable_match(tokens[:aligned(len(tokens) - 1, ps)], extra_key, admitting=admitting,
                                           by_cost=True)
        return look, host_len, host_len // ps + -(-(len(tokens) - look.device_len - host_len) // ps)

    def usable_match(self, tokens: np.ndarray, extra_key: Hashable, *,
                     admitting: bool = False, by_cost: bool = False) -> tuple[MatchResult, int]:
        """The read-only match of `tokens` a hit may use, and its host tokens: cut back to where
        every group's state is whole (`PoolGroup.usable_end`; with recurrent state, the deepest
        snapshot; with sliding layers, the deepest end whose window's sliding KV is present). This
        is the one place a hit is cut short. `by_cost`: an admission's look, whose host hit is first
        cut to what the load-cost model says is worth loading (`reuse`). `admitting`: an admit's
        look (the cuts are noted, counted once it is admitted)."""
        look = self.tree.match(tokens, extra_key, split=False, touch=False)
        host_len = look.host_len
        if by_cost and host_len and self.reuse.weighs:  # an admission's look loads a host hit only where it beats recomputing it
            load = self.reuse.loadable(look.device_len, host_len, 0)[0]
            if load < host_len:
                if admitting:  # counted once admitted (`cost_cut_admitted`), as the groups' cuts are
                    self._cost_cut = host_len - load
                look = self.tree.match(tokens[:look.device_len + load], extra_key, split=False, touch=False)
                host_len = look.host_len
        matched = look.device_len + host_len
        usable = matched
        for g in self.hooked.usable_end if matched else ():
            usable = min(usable, g.usable_end(look, host_len))
        if admitting:  # every admission's look notes it (0: not cut)
            for g in self.hooked.note_cut:
                g.note_cut(matched - usable)
        if usable < matched:
            look = self.tree.match(tokens[:usable], extra_key, split=False, touch=False)
            host_len = look.host_len
        return look, host_len

    def cost_cut_admitted(self) -> None:
        """The admission whose look was cut by the load-cost model was admitted: count the cut."""
        self.stats["tokens_host_hit_recomputed"] += self._cost_cut
        self._cost_cut = 0

    def evictable_device_pages(self) -> int:
        return self.tree.evictable_device_tokens // self.page_size

    def evictable_host_tokens(self) -> int:
        # O(nodes): informational (available()), not on the hot path
        return sum(len(n.host) for n in self.tree.nodes()
                   if n.host is not None and n.device is None and n.host_protect == 0 and n.lock_ref == 0)

    def room_for(self, pages: int, look: MatchResult | None = None) -> bool:
        """Whether `pages` device pages can be had now, free or by an eviction that frees them at
        once, in every group's pool (`PoolGroup.room`). `can_admit`, `admit` and `extend` all
        decide by this one answer, so they agree. A request's own matched prefix (`look`) is
        evictable until its admission locks it, so it is no room for it."""
        if pages <= self.device.num_free_pages():
            return True
        keep, tail = self._kept_by(look)

        def dry_run(need: int, weigh: Callable[[Node, int], int] | None = None) -> int:
            return self.freeable_now(need, keep, tail, weigh)

        return all(g.room(pages, look, dry_run) for g in self.hooked.room)

    @staticmethod
    def _kept_by(look: MatchResult | None) -> tuple[set[Node], tuple[Node, int] | None]:
        """The nodes an admission of `look` keeps from the eviction, and its tail (below)."""
        keep: set[Node] = set()
        tail: tuple[Node, int] | None = None
        if look is not None:
            keep.update(look.device_nodes)
            if look.partial and look.num_device_nodes == len(look.nodes):
                # the admission splits the partly matched last node: its unmatched part becomes a
                # leaf of its own that the eviction may take
                node = look.nodes[-1]
                keep.discard(node)
                tail = node, len(node.device) - look.partial
        return keep, tail

    def freeable_now(self, need: int, keep: set[Node], tail: tuple[Node, int] | None = None,
                     weigh: Callable[[Node, int], int] | None = None) -> int:
        """Device pages that `evict_device` would free at once (at least `need` of them, if there
        are), without changing anything: a dry run over the evictable device leaves, parents
        becoming leaves as their device children go. A leaf whose eviction needs a backup
        (write-back, or a node whose host-only children need it to keep a copy) frees nothing
        now, and its ancestors stay. Nodes in `keep` stay; `tail` = (node, tokens) counts only the
        node's last `tokens`, as if split off (its first part is kept). Stops as soon as `need`
        pages are found. `weigh(node, tail tokens or 0)`: the pages a node counts for (default:
        its device pages; the sliding pool's dry run counts its sliding pages)."""
        ps = self.page_size
        left: dict[Node, int] = {}  # device children a parent still has in the dry run
        deleted: dict[Node, int] = {}  # children the dry run deleted (no host copy): gone for good
        leaves = iter(self.tree.device_leaves)
        ready: list[Node] = []
        got = 0
        while got < need:
            if ready:
                node = ready.pop()
            else:
                node = next(leaves, None)
                if node is None:
                    break
                if node in keep:
                    continue
            if node.host is None and (self.write_back or len(node.children) > deleted.get(node, 0)):
                continue
            if tail is not None and node is tail[0]:
                got += tail[1] // ps if weigh is None else weigh(node, tail[1])
                continue
            got += len(node.device) // ps if weigh is None else weigh(node, 0)
            parent = node.parent
            if node.host is None:
                deleted[parent] = deleted.get(parent, 0) + 1
            if parent.parent is None or parent.lock_ref or parent in keep:
                continue
            n = left.get(parent, parent.n_dev_children) - 1
            left[parent] = n
            if n == 0:
                ready.append(parent)
        return got

    # -- tracing -------------------------------------------------------------------
    def emit(self, event: str, tier: Tier, slots: np.ndarray, **fields: Any) -> None:
        if self.tracer is not None and self.tracer.active:
            self.tracer.emit(event, tier.value, slots=slots, **fields)

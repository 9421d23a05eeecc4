"""Admission: how a request gets its cached prefix and device pages, and device room in general.

`CacheCore` calls it for every admission (and its device room for `extend`, decode steps and
session turns). An admission is two steps:

1. `look` (changes nothing a caller holds): the match a hit may use, cut back once where a
   group's state is not whole (`Residency.usable_match`: the one place a host or storage hit is
   cut short; a load-cost policy would cut it there too), then the room check of every pool
   group. A refusal starts the write-backs that will make room.
2. `admit` (after the caller's `phase.change()`): the settled match is locked, the groups
   reserve their slots, the device pages are taken (a shortfall undoes all of it: a refusal), a
   host hit's load starts, and the request is filed in the table.

Tree and ledger changes go through `Residency` and the copy tracker; the request records are the
table's (`RequestTable`).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Any, NamedTuple

import numpy as np

from runtime.config import RuntimeConfig
from runtime.errors import CapacityError
from runtime.memory.owners import Owner
from runtime.phase import Phase
from runtime.tree.groups.base import PoolGroup
from runtime.tree.nodes import MatchResult, Node
from runtime.tree.readiness import LoadReadiness
from runtime.tree.records import RequestRecord
from runtime.tree.request_table import RequestTable
from runtime.tree.residency import Residency
from runtime.tree.tiers.copies import CopyTracker

__all__ = ["Admission", "Look", "Admitted", "COUNTERS"]

COUNTERS = ("requests_admitted", "tokens_device_hit", "tokens_host_hit", "tokens_recomputed")


class Look(NamedTuple):
    """What an admission starts from: the (cut) match, its host tokens to load, device pages needed."""

    match: MatchResult
    host_len: int
    pages: int


class Admitted(NamedTuple):
    """An admission's outcome, for the core's reply."""

    rec: RequestRecord
    slots: np.ndarray  # the call's own array (the table copied it into its row)
    device_hit: int
    readiness: tuple[LoadReadiness, ...]
    granted: dict[str, Any]  # the groups' `AdmitResult` fields


class Admission:
    def __init__(self, config: RuntimeConfig, residency: Residency, copies: CopyTracker, table: RequestTable,
                 phase: Phase, generations: Iterator[int]) -> None:
        """`generations`: the core's one counter ((rid, generation) is never reused)."""
        self.residency = residency
        self.copies = copies
        self.table = table
        self.phase = phase
        self.generations = generations
        self.stats: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.page_size = config.page_size
        # selective write-through: a hit this often backs its nodes up (0: never)
        self.hit_threshold = config.write_through_threshold if (
            config.host_slots > 0 and config.write_policy == "write_through_selective") else 0

    # -- an admission ------------------------------------------------------------------
    def look(self, rid: Hashable, tokens: np.ndarray, extra_key: Hashable) -> Look:
        """The look an admission of `rid` (not live) starts from, or its refusal (CapacityError).
        Nothing a caller holds changes."""
        res = self.residency
        match, host_len, pages = res.admission(tokens, extra_key, admitting=True)
        if not res.room_for(pages, match):
            self.start_writeback(pages, match)
            raise self.phase.refuse(CapacityError(
                f"request {rid!r} needs {pages} device pages; {res.device.num_free_pages()} free, "
                f"{res.evictable_device_pages()} evictable"))
        for g in res.hooked.admission_room:
            if not g.admission_room(match, host_len):
                raise CapacityError(f"request {rid!r} needs slots of a pool group (state slots); too few are free "
                                    "or evictable")
        return Look(match, host_len, pages)

    def run(self, rid: Hashable, tokens: np.ndarray, extra_key: Hashable, priority: int) -> tuple[Look, Admitted]:
        """`look`, then (the phase marked changing) `admit`: a whole admission of `rid` (not live)."""
        look = self.look(rid, tokens, extra_key)
        self.phase.change()
        return look, self.admit(rid, tokens, extra_key, priority, look)

    def admit(self, rid: Hashable, tokens: np.ndarray, extra_key: Hashable, priority: int, look: Look) -> Admitted:
        """Admit `rid` from `look` (the caller marked `phase.change()`): lock, reserve, allocate,
        load, file."""
        res = self.residency
        host_len = look.host_len
        cached = look.match.device_len + host_len
        m = res.tree.settle(look.match)  # = match(split=True, touch=True), without a second walk
        owner = Owner.request(rid, next(self.generations))
        device_nodes = m.device_nodes  # device residency is prefix-closed
        # (device residency is prefix-closed: the host-only nodes follow the device ones)
        host_nodes = m.nodes[len(device_nodes):] if host_len else []
        lock_node = host_nodes[-1] if host_nodes else (device_nodes[-1] if device_nodes else None)
        if lock_node is not None:
            res.tree.lock(lock_node)
        # held for as long as the request is filed: its pages move to the tree and new ones come
        # (extend, decode steps) without the ledger dropping and re-issuing its code each time
        code = res.hold(owner)
        pages = host_len // self.page_size + -(-(len(tokens) - cached) // self.page_size)
        fresh, reserved = self._reserve(rid, owner, host_nodes, pages, lock_node)
        readiness = self._loads(rid, owner, device_nodes, host_nodes, host_len, fresh, reserved)
        if host_nodes:
            parts = list(m.device_parts)
            for node in host_nodes:  # (their device copies: the load's destination, attached)
                parts.append(node.device)
            parts.append(fresh[host_len:])
            slots = np.concatenate(parts)
        else:  # one copy: the cached prefix's per-node slots and the fresh pages together
            slots = np.concatenate((*m.device_parts, fresh[host_len:]))
        rec = RequestRecord(
            rid=rid, generation=owner.generation, owner=owner, extra_key=extra_key, tokens=tokens,
            cached_len=cached, last_node=lock_node, prompt_len=len(tokens), readiness=readiness, priority=priority)
        self.table.add(rec, slots, len(tokens), cached, code)
        self.count(m.device_len, host_len, len(tokens) - cached)
        for g in res.hooked.admitted:
            g.admitted()
        if res.reuse.weighs:
            res.cost_cut_admitted()
        if self.hit_threshold:
            for node in device_nodes:
                if node.hit_count >= self.hit_threshold:
                    self.copies.backup(node)
        granted: dict[str, Any] = {}
        for g in res.hooked.grant:
            granted.update(g.grant(lock_node, reserved.get(g)))
        return Admitted(rec, slots, m.device_len, readiness, granted)

    def _reserve(self, rid: Hashable, owner: Owner, host_nodes: list[Node], pages: int,
                 lock_node: Node | None) -> tuple[np.ndarray, dict[PoolGroup, Any]]:
        """An admission's device pages, and what each group reserves for it (by group); a
        shortfall (write-back evictions still copying) undoes the admission's changes and refuses it."""
        res = self.residency
        reserved: dict[PoolGroup, Any] = {}
        try:
            # (a group's slots may evict unlocked snapshots: never the hit's, locked by the caller)
            for g in res.hooked.reserve:
                reserved[g] = g.reserve(rid, owner, host_nodes)
            return self.alloc(pages, owner, rid=rid), reserved
        except CapacityError as exc:
            for g, r in reserved.items():
                g.cancel(rid, owner, host_nodes, r)
            res.unhold(owner)
            if lock_node is not None:
                res.tree.unlock(lock_node)
            raise self.phase.refuse(exc)

    def _loads(self, rid: Hashable, owner: Owner, device_nodes: list[Node], host_nodes: list[Node], host_len: int,
               fresh: np.ndarray, reserved: dict[PoolGroup, Any]) -> tuple[LoadReadiness, ...]:
        """The loads the request waits on: those in flight into its device prefix, and its host
        hit's own (into the first `host_len` fresh slots)."""
        copies = self.copies
        readiness = copies.loads_under(device_nodes) if copies.loading else []
        if host_nodes:
            load = copies.start_load(host_nodes, host_len, fresh[:host_len], owner, reserved)
            assert load.readiness is not None
            readiness.append(load.readiness)
        for r in readiness:
            copies.add_user(r, (rid, owner.generation))
        return tuple(readiness)

    def count(self, device_hit: int, host_hit: int, recomputed: int) -> None:
        """An admission's counters (a session turn's too: its session's KV is its device hit)."""
        stats = self.stats
        stats["requests_admitted"] += 1
        stats["tokens_device_hit"] += device_hit
        stats["tokens_host_hit"] += host_hit
        stats["tokens_recomputed"] += recomputed

    # -- device room -----------------------------------------------------------------------
    def alloc(self, pages: int, owner: Owner, **ctx: Any) -> np.ndarray:
        """Free device pages, evicting for them (the backups an eviction needs first start)."""
        res = self.residency
        short = pages - res.device.num_free_pages()
        if short > 0:
            self.copies.write_back(res.evict_device(short))
        return res.alloc_device(pages, owner, **ctx)

    def alloc_or_refuse(self, pages: int, owner: Owner, **ctx: Any) -> np.ndarray:
        """`alloc` for a call that changed nothing a caller sees before it: too few pages
        (write-back evictions still copying) is a refusal; the ledger allocated nothing."""
        try:
            return self.alloc(pages, owner, **ctx)
        except CapacityError as exc:
            raise self.phase.refuse(exc)

    def start_writeback(self, pages: int, look: MatchResult | None = None) -> None:
        """A capacity shortfall (`room_for` said no): start the write-backs that will free
        device pages at their acks, so that the caller's retry can succeed. Changes nothing a
        caller holds; only when the pages could be had at all. An admission's own cached prefix
        (`look`) is kept out of the eviction, as its admission will lock it. A change all the same:
        the caller's refusal after it goes through `phase.refuse`."""
        self.phase.change()
        res = self.residency
        free = res.device.num_free_pages()
        if not res.has_host or pages > free + res.evictable_device_pages():
            return
        keep = look.last_device_node if look is not None and look.num_device_nodes else None
        if keep is not None:
            res.tree.lock(keep)
        try:
            self.copies.write_back(res.evict_device(pages - free))
        finally:
            if keep is not None:
                res.tree.unlock(keep)

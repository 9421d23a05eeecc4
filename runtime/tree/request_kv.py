"""RequestKV: what a live request's KV does when it is cached, trimmed, released or retired.

`CacheCore` checks each call and marks its phase, then calls this part: `insert` hands the
request's computed pages to the tree (`Residency.insert`, growing its own leaf in place when
every pool group agrees) and moves its lock down; `release` is the one release path (finish,
abort, a cancelled caller): unlock, free its own pages, each group's slots, leave the table;
with decode offload the request is retired instead (its device slots freed once its offloads
land, seed 000). It owns no state: the records are the request table's, the tree and ledgers
`Residency`'s, the sessions `Sessions`'.
"""

from __future__ import annotations

import numpy as np

from runtime.config import RuntimeConfig
from runtime.errors import StateError
from runtime.tree.nodes import Node
from runtime.tree.records import RequestRecord, aligned
from runtime.tree.request_table import RequestTable
from runtime.tree.residency import Residency
from runtime.tree.sessions import Sessions
from runtime.tree.tiers.copies import CopyTracker
from runtime.tree.tiers.decode_offload import DecodeOffload
from runtime.tree.tiers.off import NoOffload

__all__ = ["RequestKV"]


class RequestKV:
    def __init__(self, config: RuntimeConfig, residency: Residency, copies: CopyTracker, table: RequestTable,
                 offload: DecodeOffload | NoOffload, sessions: Sessions) -> None:
        self.residency = residency
        self.copies = copies
        self.table = table
        self.offload = offload
        self.sessions = sessions
        self.page_size = config.page_size
        # write-through: every node an insert adds is backed up at once
        self.write_through_all = config.host_slots > 0 and config.write_policy == "write_through"

    def insert(self, rec: RequestRecord, tokens: np.ndarray) -> None:
        n = aligned(len(tokens), self.page_size)
        if len(tokens) > len(rec.tokens):
            rec.grow(tokens)
        copies = self.copies
        if n > rec.cached_len and copies.loading:
            n = copies.insert_cap(tokens, n, rec.extra_key)
        if n <= rec.cached_len:
            return
        # the walk starts at the request's locked cached prefix (its slots are the tree's)
        start = rec.last_node if rec.last_node is not None and rec.last_node.device is not None else None
        # a request's own leaf (no lock but its own and its backups', no load in flight) grows in
        # place, unless a group says no (a leaf holding a state snapshot; own pages whose sliding KV
        # dropped); with backups in flight only under write-through, where a backup of the growth
        # follows them (without one, their ack splits the node there, and its hit count makes the
        # growth look hot). `extend`: the locks on the leaf that may be there (0: no growth)
        hooked = self.residency.hooked
        extend = 0
        if start is not None:
            extend = copies.growth_locks(start) if self.write_through_all else int(not copies.busy(start))
        if extend and hooked.grows_in_place:
            first = int(rec.slot_view(rec.cached_len, n)[0])
            if not all(g.grows_in_place(start, first) for g in hooked.grows_in_place):  # type: ignore[arg-type]
                extend = 0
        res = self.residency.insert(tokens[:n], rec.extra_key, rec.slot_view(0, n), rec.owner, start, extend, True, rec.rid,
                                    rec.priority)
        if extend > 1 and res.adopted and res.adopted[-1][0] is start:  # it grew with its backups in flight
            copies.grew(start, len(res.adopted[-1][1]))  # type: ignore[arg-type]
        duplicates = res.duplicate_slots
        if len(duplicates):
            # the slot contract: a live request's slots never change under its caller, so its
            # duplicates of tree pages stay its own (and hold its KV) until it is released
            rec.keep_duplicates(duplicates)
        new_last = res.last_node  # the insert ends exactly at n (it splits where needed)
        self.residency.tree.relock(rec.last_node, new_last)
        rec.inserted(new_last, n, len(tokens))
        adopted = res.adopted
        for g in hooked.after_insert:
            adopted = adopted + [(upper, upper.device) for upper in g.after_insert(rec, self.residency.tree.split)]
        self.write_through(adopted)

    def write_through(self, adopted: list[tuple[Node, np.ndarray]]) -> None:
        if self.write_through_all:
            for node, _ in adopted:
                self.copies.backup(node, growth=True)

    def release(self, rec: RequestRecord) -> None:
        """The one release path (finish, abort, cancelled caller): unlock, free owned pages.
        A session turn's session keeps exactly its KV from before the turn. With decode offload
        the request is retired instead: its device slots are freed once its offloads land (seed 000)."""
        if self.offload.retires and rec.session is None:
            self.retire(rec, None)
            return
        res = self.residency
        own = rec.slot_range(rec.own_start, rec.num_slots)
        if rec.session is not None:
            self.sessions.drop_turn(rec)
        if len(own):
            res.free_device(own, rec.owner, trusted=True, rid=rec.rid)  # its own alloc'd pages
        if len(rec.dups):
            res.free_device(rec.dups, rec.owner, rid=rec.rid, reason="duplicate")
        if rec.last_node is not None:
            self.residency.tree.unlock(rec.last_node)
        for g in self.residency.hooked.release:
            g.release(rec.rid, rec.owner)
        for r in rec.readiness:
            self.copies.drop_user(r, (rec.rid, rec.generation))
        self.unfile(rec)

    def retire(self, rec: RequestRecord, final_len: int | None) -> None:
        """(It stays a user of its loads: one that fails still fails it, retired, since its
        locked path no longer holds its cached prefix.)"""
        self.unfile(rec, keep_reading=True)
        self.offload.retire(rec, final_len)

    def free_tail(self, rec: RequestRecord, keep: int) -> None:
        """Free the request's own pages past `keep` tokens. The start is aligned up to the next
        page boundary: a page that still holds kept tokens is never freed."""
        start = max(rec.own_start, -(-keep // self.page_size) * self.page_size)
        if start < rec.num_slots:
            self.residency.free_device(rec.slot_range(start, rec.num_slots), rec.owner, rid=rec.rid, reason="trim")
            rec.truncate_slots(start)

    def unfile(self, rec: RequestRecord, keep_reading: bool = False) -> None:
        """The request leaves the table: released or its turn ended, or retired (`keep_reading`:
        the offloads still read its slots from a private copy of its row)."""
        code = self.table.detach(rec) if keep_reading else self.table.remove(rec)
        if code:
            self.residency.unhold(rec.owner)

    def note_failed_load(self, rec: RequestRecord) -> None:
        """A load can fail before its ack reaches us (acks go in issue order): its readiness
        already says so, and a request must not insert KV that never arrived."""
        if rec.failed is None:
            for r in rec.readiness:
                err = r.error()
                if err is not None:
                    rec.fail(repr(err))
                    return

    def check_loaded(self, rec: RequestRecord) -> None:
        """KV computed past a prefix that is still loading may rest on data that never arrives:
        it enters the tree (cache, finish) only once every load the request waits on is done."""
        for r in rec.readiness:
            if not r.done():
                raise StateError(f"request {rec.rid!r} still waits for a load of its cached prefix (op "
                                 f"{r.op_id}): await its readiness before cache or finish")

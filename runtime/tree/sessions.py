"""Sessions: streaming sessions, whose turns append to the session's KV without matching the tree.

A session holds exactly the whole pages its tokens need (seed 003) as their owner; a turn is a
live request (in the request table, `CacheCore`'s) that maps the session's slots first
(`session_len` of them) and pages of its own after; its finish hands the session exactly the KV
it keeps, and a release leaves the session as it was before the turn. This part owns the
session records; their pages change owner and are freed through the residency's device ledger,
and a closing session's KV enters the tree through `Residency.insert`.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from runtime.errors import DuplicateRequestError, StateError, UnknownRequestError
from runtime.memory.groups import Feature
from runtime.memory.owners import Owner
from runtime.tree.nodes import Node
from runtime.tree.records import EMPTY, RequestRecord, SessionRecord, aligned
from runtime.tree.residency import Residency
from runtime.tree.tiers.copies import CopyTracker

__all__ = ["Sessions"]


class Sessions:
    def __init__(self, residency: Residency, copies: CopyTracker) -> None:
        self.residency = residency
        self.copies = copies
        self.records: dict[Hashable, SessionRecord] = {}

    def get(self, sid: Hashable) -> SessionRecord:
        sess = self.records.get(sid)
        if sess is None:
            raise UnknownRequestError(f"unknown session {sid!r}")
        return sess

    def kv_len(self, rec: RequestRecord) -> int:
        """The session KV a turn keeps whatever it does (0: not a turn)."""
        return self.records[rec.session].kv_len if rec.session is not None else 0

    # -- opening and closing ------------------------------------------------------------
    def check_open(self, sid: Hashable) -> None:
        if not self.residency.supports(Feature.SESSIONS):
            raise StateError("streaming sessions do not keep recurrent state yet (state_layers > 0)")
        if sid in self.records:
            raise DuplicateRequestError(f"session {sid!r} is already open")

    def open(self, sid: Hashable, extra_key: Hashable) -> None:
        self.records[sid] = SessionRecord(sid, Owner.session(sid), extra_key, np.zeros(0, np.int32), EMPTY)

    def check_close(self, sid: Hashable) -> SessionRecord:
        sess = self.get(sid)
        if sess.turn is not None:
            raise StateError(f"session {sid!r} has turn {sess.turn!r} running")
        return sess

    def close(self, sess: SessionRecord, insert: bool) -> tuple[int, list[tuple[Node, np.ndarray]]]:
        """Free what the session holds; with `insert`, its page-aligned KV goes into the tree
        first (as far as no load in flight is below it). Returns the tokens inserted and the
        nodes the insert added (for the write policy)."""
        res = self.residency
        adopted: list[tuple[Node, np.ndarray]] = []
        keep = aligned(sess.kv_len, res.page_size) if insert else 0
        if keep:
            keep = self.copies.insert_cap(sess.tokens, keep, sess.extra_key)
        if keep:
            ins = res.insert(sess.tokens[:keep], sess.extra_key, sess.slots[:keep], sess.owner)
            if len(ins.duplicate_slots):
                res.free_device(ins.duplicate_slots, sess.owner, reason="duplicate")
            adopted = ins.adopted
        rest = sess.slots[keep:]
        if len(rest):
            res.free_device(rest, sess.owner)
        del self.records[sess.sid]
        return keep, adopted

    # -- turns ------------------------------------------------------------------------------
    def check_turn(self, sess: SessionRecord, rid: Hashable, tokens: np.ndarray) -> int:
        """The device pages turn `rid` of `sess` needs beyond the session's (StateError: the
        session runs a turn, or `tokens` do not extend its KV)."""
        if sess.turn is not None:
            raise StateError(f"session {sess.sid!r} already runs turn {sess.turn!r}")
        kv = sess.kv_len
        if len(tokens) <= kv or not np.array_equal(tokens[:kv], sess.tokens):
            raise StateError(f"turn {rid!r} must extend session {sess.sid!r}'s {kv} tokens")
        return -(-max(0, len(tokens) - len(sess.slots)) // self.residency.page_size)

    def begin_turn(self, sess: SessionRecord, rid: Hashable) -> None:
        sess.run(rid)

    def end_turn(self, rec: RequestRecord, tokens: np.ndarray) -> None:
        """The session keeps exactly `tokens` of KV (the turn freed its pages past them): the
        turn's pages up to them are handed over."""
        sess = self.records[rec.session]
        slots = rec.slots
        kept = slots[rec.session_len:]
        if len(kept):
            self.residency.assign_device(kept, rec.owner, sess.owner, rid=rec.rid, session=sess.sid)
        sess.keep(slots, tokens)

    def drop_turn(self, rec: RequestRecord) -> None:
        """A turn released without finishing: the session keeps its KV from before it."""
        self.records[rec.session].run(None)

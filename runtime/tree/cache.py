"""CacheCore: the tree actor's synchronous core.

It owns the radix tree, both slot ledgers, the request records and the in-flight copy
records, and is the only writer of all of them. No event loop, no streams: the tree actor
turns messages into calls on it and sends the transfer plans it leaves in `outbox`.

Ownership rules it keeps (DESIGN.md, "Invariants"):
- a request's slots are `slots[:cached_len]` (held by tree nodes, locked through
  `last_node`) followed by pages it owns itself;
- every in-flight copy pins its source and destination slots and holds a lock on the
  deepest node it covers, so nothing it touches can be evicted, freed or reused;
- an in-flight copy is described by a snapshot (deepest node + length + slot copies),
  so a split of its nodes never changes what it means (seed 002): at ack time the nodes
  are recovered by walking up the parent chain from the deepest node.

Token arrays passed in are kept, not copied: the tree actor's messages own theirs (the
façade copies what the caller gives it), and a direct caller must not change an array
after passing it. (Tree keys are bytes encoded at insert time either way.)
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from runtime.config import RuntimeConfig
from runtime.errors import (
    CapacityError,
    DuplicateRequestError,
    LengthError,
    StateError,
    TransferError,
    UnknownRequestError,
)
from runtime.memory.ledger import SlotLedger
from runtime.memory.owners import Owner, Tier
from runtime.messages import AdmitResult, Direction, PoolTransfer, TransferPlan
from runtime.messages import OffloadAck, OffloadCommit, OffloadFinish, OffloadStarted  # decode offload
from runtime.trace import SlotTracer, get_logger
from runtime.tree.policies import policy_by_name
from runtime.tree.radix import MatchResult, Node, RadixTree
from runtime.tree.readiness import LoadReadiness, ManualReadiness, ReadinessFactory

EMPTY = np.zeros(0, dtype=np.int64)
_log = get_logger("hicache.tree")


@dataclass(slots=True)
class RequestRecord:
    """The one record of a live request: its tokens, slots and lengths change together."""

    rid: Hashable
    generation: int
    owner: Owner
    extra_key: Hashable
    tokens: np.ndarray  # int32 token ids the request has so far
    slots: np.ndarray  # int64 device slots of its allocated pages
    seq_len: int  # token positions in use (prompt + extended), <= len(slots)
    committed_len: int
    cached_len: int  # prefix held by tree nodes, locked through last_node
    last_node: Node | None
    prompt_len: int
    readiness: tuple[LoadReadiness, ...] = ()
    failed: str | None = None
    session: Hashable = None  # the streaming session this turn belongs to
    session_len: int = 0  # leading slots the session owns (its whole pages)
    # slots of its own inside the cached prefix that duplicate tree pages (another request
    # cached the same prefix first): still the caller's until release (the slot contract)
    dups: np.ndarray = field(default_factory=lambda: EMPTY)
    slot_buf: np.ndarray | None = None  # the buffer `slots` is a prefix view of, once it grew (extend)

    @property
    def own_start(self) -> int:
        """Slots before this index belong to the tree (cached prefix) or to the session."""
        return self.session_len if self.session is not None else self.cached_len


@dataclass(slots=True)
class SessionRecord:
    """A streaming session's KV across turns: `kv_len` tokens in whole pages it owns."""

    sid: Hashable
    owner: Owner
    extra_key: Hashable
    tokens: np.ndarray
    slots: np.ndarray
    turn: Hashable = None  # rid of the running turn, if any

    @property
    def kv_len(self) -> int:
        return len(self.tokens)


@dataclass(slots=True)
class CopyOp:
    """An in-flight backup or load: a snapshot of what it covers, taken when issued."""

    op_id: int
    direction: Direction
    node: Node  # deepest node covered (the lower half after any split)
    length: int  # tokens covered, ending at `node`'s end
    device: np.ndarray
    host: np.ndarray
    host_owner: Owner  # owner of `host` until the ack hands it to the nodes
    readiness: LoadReadiness | None = None
    evict_after: bool = False
    users: set[Hashable] = field(default_factory=set)
    # a load issued under another load that failed first: its nodes lost their device copies, and
    # its device slots stay with it (owner: its deepest node's id) until its ack frees them
    orphaned: bool = False


def _aligned(n: int, page_size: int) -> int:
    return n - n % page_size


def _append_slots(rec: RequestRecord, new: np.ndarray) -> None:
    """rec.slots += new, amortised O(len(new)): the slots are a prefix view of a buffer with room
    to grow (a decode step adds a page at a time; re-concatenating cost O(context) per page).
    Only positions past the old end are written, so no view taken before changes."""
    n, k = len(rec.slots), len(new)
    buf = rec.slot_buf
    if buf is None or rec.slots.base is not buf or len(buf) < n + k:
        buf = rec.slot_buf = np.empty(max(2 * (n + k), 64), dtype=np.int64)
        buf[:n] = rec.slots
    buf[n:n + k] = new
    rec.slots = buf[:n + k]


class CacheCore:
    # -- state -------------------------------------------------------------------
    def __init__(self, config: RuntimeConfig, tracer: SlotTracer | None = None, *,
                 readiness_factory: ReadinessFactory = ManualReadiness) -> None:
        self.config = config
        self.new_readiness = readiness_factory  # a load's readiness (the actor's: per-layer futures)
        self.page_size = config.page_size
        self.tracer = tracer
        self.tree = RadixTree(config.page_size, policy_by_name(config.eviction_policy))
        self.tree.on_split = self._on_split
        self.device = SlotLedger(config.device_slots, config.page_size, Tier.DEVICE, tracer)
        host_slots = config.host_slots
        self.host: SlotLedger | None = (
            SlotLedger(host_slots, config.page_size, Tier.HOST, tracer) if host_slots > 0 else None
        )
        self.requests: dict[Hashable, RequestRecord] = {}
        self.sessions: dict[Hashable, SessionRecord] = {}
        self._generations = itertools.count(1)  # one counter: (rid, generation) is never reused
        self.ops: dict[int, CopyOp] = {}
        self.backup_pending: dict[int, int] = {}  # node id -> op id of its in-flight backup
        self.loading: dict[int, LoadReadiness] = {}  # node id -> readiness of its in-flight load
        self.outbox: list[tuple[TransferPlan, LoadReadiness | None]] = []
        self._op_ids = itertools.count(1)
        self.num_layers = config.num_layers
        self.stats: dict[str, int] = {
            "requests_admitted": 0, "requests_finished": 0, "requests_aborted": 0,
            "tokens_device_hit": 0, "tokens_host_hit": 0, "tokens_recomputed": 0,
            "backups_issued": 0, "loads_issued": 0, "copy_failures": 0,
            "device_evicted_tokens": 0, "host_evicted_tokens": 0, "writeback_deferred": 0,
        }
        self._init_offload()  # decode offload state (section at the end of the class)
        self._init_storage()  # storage tier state (section at the end of the class)

    # -- request lifecycle -------------------------------------------------------
    def admit(self, rid: Hashable, tokens: np.ndarray, extra_key: Hashable = None,
              session: Hashable = None) -> AdmitResult:
        tokens = self._check_tokens(tokens)
        if rid in self.requests:
            raise DuplicateRequestError(f"request {rid!r} is still live")
        if session is not None:
            return self._admit_turn(rid, tokens, self._session(session))
        ps = self.page_size
        look, host_len, need_pages = self._admission(tokens, extra_key)
        cached = look.device_len + host_len
        if not self._device_room_for(need_pages, look):
            self._start_writeback(need_pages)
            raise CapacityError(
                f"request {rid!r} needs {need_pages} device pages; {self.device.num_free_pages()} free, "
                f"{self._evictable_device_pages()} evictable")

        m = self.tree.settle(look)  # = match(split=True, touch=True), without a second walk
        generation = next(self._generations)
        owner = Owner.request(rid, generation)
        device_nodes = m.device_nodes  # device residency is prefix-closed
        host_nodes = [n for n in m.nodes if n.device is None] if host_len else []
        lock_node = host_nodes[-1] if host_nodes else (device_nodes[-1] if device_nodes else None)
        if lock_node is not None:
            self.tree.lock(lock_node)
        own_pages = -(-(len(tokens) - cached) // ps)
        try:
            fresh = self._alloc_device(host_len // ps + own_pages, owner, rid=rid)
        except CapacityError:
            # write-back evictions may still be copying: nothing of this request stays behind
            if lock_node is not None:
                self.tree.unlock(lock_node)
            raise
        readiness: list[LoadReadiness] = []
        if self.loading:
            for node in device_nodes:
                r = self.loading.get(node.id)
                if r is not None and r not in readiness:
                    readiness.append(r)
        if host_nodes:
            load = self._start_load(host_nodes, host_len, fresh[:host_len], owner)
            assert load.readiness is not None
            readiness.append(load.readiness)
        for r in readiness:
            self._load_op_of(r).users.add(rid)
        if host_nodes:
            prefix = np.concatenate([n.device for n in m.nodes[: len(device_nodes) + len(host_nodes)]])
            slots = np.concatenate((prefix, fresh[host_len:]))
        else:  # one copy: the cached prefix's per-node slots and the fresh pages together
            slots = np.concatenate((*m.device_parts, fresh[host_len:]))
        rec = RequestRecord(
            rid=rid, generation=generation, owner=owner, extra_key=extra_key, tokens=tokens,
            slots=slots, seq_len=len(tokens), committed_len=cached, cached_len=cached,
            last_node=lock_node, prompt_len=len(tokens), readiness=tuple(readiness))
        self.requests[rid] = rec
        if self.storage_on:  # a lookup that landed while this admit waited marked it prepared
            self.prefetched.discard(rid)
        self.stats["requests_admitted"] += 1
        self.stats["tokens_device_hit"] += m.device_len
        self.stats["tokens_host_hit"] += host_len
        self.stats["tokens_recomputed"] += len(tokens) - cached
        if self.host is not None and self.config.write_policy == "write_through_selective":
            for node in device_nodes:
                if node.hit_count >= self.config.write_through_threshold:
                    self._maybe_backup(node)
        from_storage = min(self.prefetch_landed.pop(rid, 0), host_len)
        return AdmitResult(rid, generation, torch.from_numpy(slots[: len(tokens)].copy()), m.device_len, host_len,
                           tuple(readiness), from_storage)

    def extend(self, rid: Hashable, n: int) -> torch.Tensor:
        rec = self._record(rid)
        if not isinstance(n, int) or n <= 0:
            raise LengthError(f"extend needs a positive token count, got {n!r}")
        total = rec.seq_len + n
        if total > self.config.device_slots:
            raise LengthError(f"request {rid!r} would hold {total} tokens, more than the device pool")
        missing = total - len(rec.slots)
        if missing > 0:
            pages = -(-missing // self.page_size)
            if not self._device_room_for(pages):
                self._start_writeback(pages)
                raise CapacityError(f"extend of {rid!r} needs {pages} device pages")
            _append_slots(rec, self._alloc_device(pages, rec.owner, rid=rid))
        start, rec.seq_len = rec.seq_len, total
        return torch.from_numpy(rec.slots[start:total].copy())

    def commit(self, rid: Hashable, committed_len: int) -> int:
        rec = self._record(rid)
        if not isinstance(committed_len, int) or committed_len < rec.committed_len or committed_len > rec.seq_len:
            raise LengthError(
                f"commit of {rid!r} must lie in [{rec.committed_len}, {rec.seq_len}], got {committed_len!r}")
        rec.committed_len = committed_len
        if self.config.decode_offload:
            self._offload_note_commit(rec)
        return committed_len

    def cache(self, rid: Hashable, tokens: np.ndarray) -> int:
        """Insert the page-aligned part of `tokens` (whose KV is computed) and keep going."""
        rec = self._record(rid)
        if rec.session is not None:
            raise StateError(f"{rid!r} is a session turn: its KV stays in the session, not the tree")
        self._note_failed_load(rec)
        if rec.failed is not None:
            raise TransferError(f"request {rid!r} lost its cached prefix ({rec.failed}); abort it")
        tokens = self._check_kv_tokens(rec, tokens)
        self._check_loaded(rec)
        self._insert(rec, tokens)
        return rec.cached_len

    def finish(self, rid: Hashable, tokens: np.ndarray, finished_len: int | None = None) -> int:
        """Keep exactly prompt + `finished_len` tokens (speculative overshoot trimmed, seed 003),
        insert their page-aligned part (or hand them to the session), unlock, free the rest."""
        rec = self._record(rid)
        self._note_failed_load(rec)
        if rec.failed is not None:
            self._release(rec)
            self.stats["requests_aborted"] += 1
            raise TransferError(f"request {rid!r} lost its cached prefix ({rec.failed}); it was released")
        tokens = self._trimmed(rec, tokens, finished_len)
        self._check_loaded(rec)
        if rec.session is not None:
            self._finish_turn(rec, tokens)
            self.stats["requests_finished"] += 1
            return len(tokens)
        if self.config.decode_offload:
            return self._offload_finish(rec, tokens)
        self._insert(rec, tokens)
        cached = rec.cached_len
        self._release(rec)
        self.stats["requests_finished"] += 1
        return cached

    def abort(self, rid: Hashable) -> None:
        if self.storage_on and (self._prefetch_cancel(rid) or self._prefetch_landed(rid)) and rid not in self.requests:
            return  # only a prefetch (prepare without admit): cancelled (slots freed at its ack) or landed
        rec = self._record(rid)
        self._release(rec)
        self.stats["requests_aborted"] += 1

    def rewind(self, rid: Hashable, new_len: int) -> int:
        """Forget the request's tokens past `new_len` (a retraction): frees whole pages past it."""
        rec = self._record(rid)
        floor = max(rec.cached_len, self.sessions[rec.session].kv_len if rec.session is not None else 0)
        if not isinstance(new_len, int) or not floor <= new_len <= rec.seq_len:
            raise LengthError(f"rewind of {rid!r} must lie in [{floor}, {rec.seq_len}], got {new_len!r}")
        if self.config.decode_offload:
            self._offload_rewind(rec, new_len)
        self._free_tail(rec, new_len)
        rec.seq_len = new_len
        rec.committed_len = min(rec.committed_len, new_len)
        rec.tokens = rec.tokens[:new_len].copy()
        return new_len

    # -- streaming sessions ----------------------------------------------------------------
    def open_session(self, sid: Hashable, extra_key: Hashable = None) -> None:
        if sid in self.sessions:
            raise DuplicateRequestError(f"session {sid!r} is already open")
        self.sessions[sid] = SessionRecord(sid, Owner.session(sid), extra_key, np.zeros(0, np.int32), EMPTY)

    def close_session(self, sid: Hashable, insert: bool = False) -> int:
        """Free what the session holds; with `insert`, its page-aligned KV goes into the tree first."""
        sess = self._session(sid)
        if sess.turn is not None:
            raise StateError(f"session {sid!r} has turn {sess.turn!r} running")
        keep = _aligned(sess.kv_len, self.page_size) if insert else 0
        if keep and self.loading:
            keep = self._loading_cap(sess.tokens, keep, sess.extra_key)
        if keep:
            res = self.tree.insert(sess.tokens[:keep], sess.extra_key, sess.slots[:keep])
            for node, slots in res.adopted:
                self.device.assign(slots, sess.owner, Owner.node(node.id), node=node.id)
            if len(res.duplicate_slots):
                self.device.free(res.duplicate_slots, sess.owner, reason="duplicate")
            if self.host is not None and self.config.write_policy == "write_through":
                for node, _ in res.adopted:
                    self._maybe_backup(node)
        rest = sess.slots[keep:]
        if len(rest):
            self.device.free(rest, sess.owner)
        del self.sessions[sid]
        return keep

    def _admit_turn(self, rid: Hashable, tokens: np.ndarray, sess: SessionRecord) -> AdmitResult:
        """A turn appends to the session's KV without matching the tree."""
        if sess.turn is not None:
            raise StateError(f"session {sess.sid!r} already runs turn {sess.turn!r}")
        kv = sess.kv_len
        if len(tokens) <= kv or not np.array_equal(tokens[:kv], sess.tokens):
            raise StateError(f"turn {rid!r} must extend session {sess.sid!r}'s {kv} tokens")
        session_len = len(sess.slots)
        pages = -(-max(0, len(tokens) - session_len) // self.page_size)
        if not self._device_room_for(pages):
            raise CapacityError(f"turn {rid!r} needs {pages} device pages")
        generation = next(self._generations)
        owner = Owner.request(rid, generation)
        own = self._alloc_device(pages, owner, rid=rid)
        slots = np.concatenate((sess.slots, own))
        self.requests[rid] = RequestRecord(
            rid=rid, generation=generation, owner=owner, extra_key=sess.extra_key, tokens=tokens,
            slots=slots, seq_len=len(tokens), committed_len=kv, cached_len=0, last_node=None,
            prompt_len=len(tokens), session=sess.sid, session_len=session_len)
        sess.turn = rid
        self.stats["requests_admitted"] += 1
        self.stats["tokens_device_hit"] += kv
        self.stats["tokens_recomputed"] += len(tokens) - kv
        return AdmitResult(rid, generation, torch.from_numpy(slots[: len(tokens)].copy()), kv, 0, ())

    def _finish_turn(self, rec: RequestRecord, tokens: np.ndarray) -> None:
        """The session keeps exactly `tokens` of KV: the turn's pages up to them are handed over,
        whole pages past them freed (a page holding kept tokens is never freed)."""
        sess = self.sessions[rec.session]
        self._free_tail(rec, len(tokens))
        kept = rec.slots[rec.session_len:]
        if len(kept):
            self.device.assign(kept, rec.owner, sess.owner, rid=rec.rid, session=sess.sid)
        sess.slots = rec.slots.copy()
        sess.tokens = tokens
        sess.turn = None
        del self.requests[rec.rid]

    def _note_failed_load(self, rec: RequestRecord) -> None:
        """A load can fail before its ack reaches us (acks go in issue order): its readiness
        already says so, and a request must not insert KV that never arrived."""
        if rec.failed is None:
            for r in rec.readiness:
                err = r.error()
                if err is not None:
                    rec.failed = repr(err)
                    return

    def _check_loaded(self, rec: RequestRecord) -> None:
        """KV computed past a prefix that is still loading may rest on data that never arrives:
        it enters the tree (cache, finish) only once every load the request waits on is done."""
        for r in rec.readiness:
            if not r.done():
                raise StateError(f"request {rec.rid!r} still waits for a load of its cached prefix (op "
                                 f"{r.op_id}): await its readiness before cache or finish")

    def _session(self, sid: Hashable) -> SessionRecord:
        sess = self.sessions.get(sid)
        if sess is None:
            raise UnknownRequestError(f"unknown session {sid!r}")
        return sess

    def abort_if_live(self, rid: Hashable, generation: int) -> None:
        """The cancelled-caller path: release the request only if it is the same admission."""
        rec = self.requests.get(rid)
        if rec is not None and rec.generation == generation:
            self._release(rec)
            self.stats["requests_aborted"] += 1

    # -- read-only questions -----------------------------------------------------------
    def match_prefix(self, tokens: np.ndarray, extra_key: Hashable = None) -> dict[str, int]:
        tokens = self._check_tokens(tokens)
        look = self.tree.match(tokens, extra_key, split=False, touch=False)
        host_len = look.host_len if self.host is not None else 0
        return {"device": look.device_len, "host": host_len}

    def available(self) -> dict[str, int]:
        out = {
            "device_free": self.device.num_free_slots(),
            "device_evictable": self._evictable_device_pages() * self.page_size,
        }
        if self.host is not None:
            out["host_free"] = self.host.num_free_slots()
            out["host_evictable"] = self._evictable_host_tokens()
        return out

    def can_admit(self, tokens: np.ndarray, extra_key: Hashable = None) -> bool:
        """The answer `admit` would give now. A no starts the write-backs that would make room (as
        `admit` does; a scheduler that polls `can_admit` must see the room come): that changes
        no request's state, only which cached pages are being copied to host."""
        look, _, need = self._admission(self._check_tokens(tokens), extra_key)
        if self._device_room_for(need, look):
            return True
        self._start_writeback(need)
        return False

    # -- acks ----------------------------------------------------------------------
    def apply_ack(self, op_id: int, error: str | None) -> None:
        if self.config.decode_offload and isinstance(self.ops.get(op_id), OffloadOp):
            return self._offload_apply_ack(op_id, error)
        op = self.ops.pop(op_id)
        self.device.unpin(op.device, op_id)
        assert self.host is not None
        self.host.unpin(op.host, op_id)
        chain = self.tree.split_chain(op.node, op.length)
        if op.direction is Direction.BACKUP:
            self._finish_backup(op, chain, error)
        else:
            self._finish_load(op, chain, error)
        self.tree.unlock(op.node)
        if error is not None:
            self.stats["copy_failures"] += 1
        if op.direction is Direction.BACKUP and op.evict_after and error is None:
            for node in reversed(chain):
                if node in self.tree.device_leaves:
                    self._drop_device(node)

    # -- flush ---------------------------------------------------------------------
    def flush(self) -> int:
        """Drop every unlocked cached prefix from device and host; returns tokens dropped."""
        dropped = 0
        changed = True
        while changed:
            changed = False
            for node in self.tree.device_victims():
                if node.host is not None:
                    dropped += node.num_tokens
                    self._drop_device(node)
                elif not node.children:
                    dropped += node.num_tokens
                    self._delete(node)
                else:  # its last copy: the host-only nodes below it go with it (tier closure)
                    gone = self._delete_subtree(node)
                    if not gone:
                        continue
                    dropped += gone
                changed = True
            for node in self.tree.host_victims():
                dropped += node.num_tokens
                changed = True
                self._delete(node)
        return dropped

    # -- helpers: insertion and release -------------------------------------------------
    def _insert(self, rec: RequestRecord, tokens: np.ndarray) -> None:
        n = _aligned(len(tokens), self.page_size)
        if len(tokens) > len(rec.tokens):  # the record only grows (the caller checked they agree)
            rec.tokens = tokens
        if self.loading and n > rec.cached_len:
            n = self._loading_cap(tokens, n, rec.extra_key)
        if n <= rec.cached_len:
            return
        # the walk starts at the request's locked cached prefix (its slots are the tree's)
        start = rec.last_node if rec.last_node is not None and rec.last_node.device is not None else None
        # a request's own leaf (its lock the only one, no copy in flight) grows in place
        extend = start is not None and start.id not in self.backup_pending and start.id not in self.loading
        res = self.tree.insert(tokens[:n], rec.extra_key, rec.slots[:n], start=start, extend_leaf=extend)
        for node, slots in res.adopted:
            # trusted: the request's own alloc'd slots, cut at page boundaries by the tree
            to = node.owner
            if to is None:
                to = node.owner = Owner.node(node.id)
            self.device.assign(slots, rec.owner, to, trusted=True, rid=rec.rid, node=node.id)
        duplicates = res.duplicate_slots
        if len(duplicates):
            # the slot contract: a live request's slots never change under its caller, so its
            # duplicates of tree pages stay its own (and hold its KV) until it is released
            if len(rec.dups):
                duplicates = duplicates[~np.isin(duplicates, rec.dups)]
            rec.dups = np.concatenate((rec.dups, duplicates))
        new_last = res.last_node  # the insert ends exactly at n (it splits where needed)
        self.tree.relock(rec.last_node, new_last)
        rec.last_node = new_last
        rec.cached_len = n
        rec.committed_len = max(rec.committed_len, min(len(tokens), rec.seq_len))
        if self.host is not None and self.config.write_policy == "write_through":
            for node, _ in res.adopted:
                self._maybe_backup(node)

    def _loading_cap(self, tokens: np.ndarray, n: int, extra_key: Hashable) -> int:
        """How much of tokens[:n] an insert may cover: it stops at a node whose load is in flight
        (a layer not ready yet), so that nothing new hangs below KV that a failed load takes back
        (a request waiting on that load cannot get here: `_check_loaded`)."""
        m = self.tree.match(tokens[:n], extra_key, split=False, touch=False)
        pos = 0
        for node in m.nodes:
            r = self.loading.get(node.id)
            if r is not None and not r.all_ready():
                return pos
            pos += node.num_tokens
        return n

    def _release(self, rec: RequestRecord) -> None:
        """The one release path (finish, abort, cancelled caller): unlock, free owned pages.
        A session turn's session keeps exactly its KV from before the turn."""
        if self.config.decode_offload and rec.session is None:
            self._offload_retire(rec, None)  # device slots freed once its offloads land (seed 000)
            return
        own = rec.slots[rec.own_start:]
        if rec.session is not None:
            self.sessions[rec.session].turn = None
        if len(own):
            self.device.free(own, rec.owner, trusted=True, rid=rec.rid)  # its own alloc'd pages
        if len(rec.dups):
            self.device.free(rec.dups, rec.owner, rid=rec.rid, reason="duplicate")
        if rec.last_node is not None:
            self.tree.unlock(rec.last_node)
        for r in rec.readiness:
            op = self._load_op_of(r, missing_ok=True)
            if op is not None:
                op.users.discard(rec.rid)
        del self.requests[rec.rid]

    # -- helpers: copies ---------------------------------------------------------------
    def _maybe_backup(self, node: Node, evict_after: bool = False) -> bool:
        if node.host is not None or node.device is None or node.id in self.backup_pending or self.host is None:
            return False
        if node.id in self.loading:
            return False
        pages = node.num_tokens // self.page_size
        host = self._alloc_host(pages, Owner.node(node.id), node=node.id)
        if host is None:
            return False
        op_id = next(self._op_ids)
        device = node.device.copy()
        self.tree.lock(node)
        self.device.pin(device, op_id)
        self.host.pin(host, op_id)
        self.ops[op_id] = CopyOp(op_id, Direction.BACKUP, node, node.num_tokens, device, host,
                                 Owner.node(node.id), evict_after=evict_after)
        self.backup_pending[node.id] = op_id
        self._emit("backup", Tier.HOST, host, node=node.id, op=op_id)
        self.outbox.append((self._plan(op_id, Direction.BACKUP, device, host), None))
        self.stats["backups_issued"] += 1
        return True

    def _start_load(self, host_nodes: list[Node], host_len: int, device: np.ndarray, owner: Owner) -> CopyOp:
        """Load the host-only chain into `device` slots (allocated by `owner`, handed to the nodes)."""
        assert self.host is not None
        device = device.copy()  # the op's snapshot owns its arrays
        op_id = next(self._op_ids)
        readiness = self.new_readiness(self.num_layers, op_id)
        offset = 0
        for node in host_nodes:
            part = device[offset: offset + node.num_tokens]
            offset += node.num_tokens
            self.device.assign(part, owner, Owner.node(node.id), node=node.id)
            self.tree.attach_device(node, part)
            self.loading[node.id] = readiness
        host = np.concatenate([n.host for n in host_nodes])
        deepest = host_nodes[-1]
        self.tree.lock(deepest)
        self.device.pin(device, op_id)
        self.host.pin(host, op_id)
        op = CopyOp(op_id, Direction.LOAD, deepest, host_len, device, host, Owner.node(deepest.id),
                    readiness=readiness)
        self.ops[op_id] = op
        self._emit("load", Tier.DEVICE, device, node=deepest.id, op=op_id)
        self.outbox.append((self._plan(op_id, Direction.LOAD, host, device), readiness))
        self.stats["loads_issued"] += 1
        return op

    def _plan(self, op_id: int, direction: Direction, src: np.ndarray, dst: np.ndarray) -> TransferPlan:
        # the plan owns fresh copies of the indices (seed 001): never views of tree state
        return TransferPlan(op_id, direction, (PoolTransfer("kv", torch.from_numpy(np.array(src, dtype=np.int64)),
                                                            torch.from_numpy(np.array(dst, dtype=np.int64))),))

    def _finish_backup(self, op: CopyOp, chain: list[Node], error: str | None) -> None:
        assert self.host is not None
        for node in chain:
            self.backup_pending.pop(node.id, None)
        if error is not None:
            self.host.free(op.host, op.host_owner, op=op.op_id, reason="copy_failed")
            return
        offset = 0
        for node in chain:
            part = op.host[offset: offset + node.num_tokens].copy()
            offset += node.num_tokens
            if node is not op.node:
                self.host.assign(part, op.host_owner, Owner.node(node.id), node=node.id)
            self.tree.attach_host(node, part)
        if self.storage_on:
            self._storage_write(op.node, op.length, op.host)

    def _finish_load(self, op: CopyOp, chain: list[Node], error: str | None) -> None:
        for node in chain:
            if self.loading.get(node.id) is op.readiness:  # (an orphaned op's nodes may load again)
                del self.loading[node.id]
        if op.orphaned:  # its nodes were rolled back with a failed load above them
            self.device.free(op.device, Owner.node(op.node.id), node=op.node.id, reason="load_orphaned")
            return
        if error is not None and op.readiness is not None and op.readiness.all_ready():
            # every layer was reported on device: its users computed on it, and KV below it
            # may be in the tree already (`_loading_cap`), so the load stands
            _log.warning("load_error_after_all_layers_ready", op=op.op_id, error=error)
            error = None
        if error is None:
            return
        # roll back: the device copies never became valid, nor did those of the loads started
        # under them (their users are this one's too); requests that used them are failed
        self._orphan_loads_below(op, chain[0], error)
        for node in reversed(chain):
            slots = self.tree.detach_device(node, force=True)
            self.device.free(slots, Owner.node(node.id), node=node.id, reason="load_failed")
        for rid in op.users:
            rec = self.requests.get(rid)
            if rec is not None:
                rec.failed = error

    def _orphan_loads_below(self, failed: CopyOp, top: Node, error: str) -> None:
        """Before the chain of `failed` (from `top` down) loses its device copies: take them from
        the nodes of every other load in flight below `top` (deepest first), each load keeping its
        slots until its own ack. Nothing else can be on device below a load in flight
        (`_loading_cap`; acks come in issue order)."""
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
            owner = Owner.node(op.node.id)
            for node in reversed(self.tree.split_chain(op.node, op.length)):
                self.loading.pop(node.id, None)
                slots = self.tree.detach_device(node, force=True)
                if node is not op.node:
                    self.device.assign(slots, Owner.node(node.id), owner, node=op.node.id, reason="load_orphaned")
            op.orphaned = True
            for rid in op.users:
                rec = self.requests.get(rid)
                if rec is not None:
                    rec.failed = error

    def _load_op_of(self, readiness: LoadReadiness, missing_ok: bool = False) -> CopyOp | None:
        for op in self.ops.values():
            if op.readiness is readiness:
                return op
        if missing_ok:
            return None
        raise KeyError("load op not found")

    def _on_split(self, lower: Node, upper: Node) -> None:
        """A split hands the upper part's slots to the new node; in-flight marks cover both halves."""
        if upper.device is not None:
            self.device.assign(upper.device, Owner.node(lower.id), Owner.node(upper.id), node=upper.id, reason="split")
        if upper.host is not None and self.host is not None:
            self.host.assign(upper.host, Owner.node(lower.id), Owner.node(upper.id), node=upper.id, reason="split")
        if lower.id in self.backup_pending:
            self.backup_pending[upper.id] = self.backup_pending[lower.id]
        if lower.id in self.loading:
            self.loading[upper.id] = self.loading[lower.id]

    # -- helpers: allocation and eviction ----------------------------------------------------
    def _alloc_device(self, pages: int, owner: Owner, **ctx: Any) -> np.ndarray:
        if pages == 0:
            return EMPTY
        short = pages - self.device.num_free_pages()
        if short > 0:
            self._evict_device(short)
        short = pages - self.device.num_free_pages()
        if short > 0:
            raise CapacityError(f"{pages} device pages needed, {self.device.num_free_pages()} free after eviction")
        return self.device.alloc(pages, owner, **ctx)

    def _alloc_host(self, pages: int, owner: Owner, **ctx: Any) -> np.ndarray | None:
        assert self.host is not None
        short = pages - self.host.num_free_pages()
        if short > 0:
            self._evict_host(short)
        if pages > self.host.num_free_pages():
            return None
        return self.host.alloc(pages, owner, **ctx)

    def _start_writeback(self, pages: int) -> None:
        """A capacity shortfall (`_device_room_for` said no): start the write-backs that will free
        device pages at their acks, so that the caller's retry can succeed. Changes nothing a
        caller holds; only when the pages could be had at all."""
        if self.host is not None and pages <= self.device.num_free_pages() + self._evictable_device_pages():
            self._evict_device(pages - self.device.num_free_pages())

    def _evict_device(self, pages: int) -> None:
        """Free `pages` device pages in eviction order (as `_freeable_now` predicts): drop device
        copies backed up on host, delete childless nodes with no host copy; a node whose eviction
        needs a backup first (write-back, or host-only children below it) gets it started and its
        device pages are freed at the ack."""
        freed = 0
        for node in self.tree.device_victims():
            if freed >= pages:
                break
            if node.host is not None:
                freed += node.num_tokens // self.page_size
                self._drop_device(node)
            elif self.host is not None and (self.config.write_policy == "write_back" or node.children):
                # the copy runs first; the device pages are freed at its ack
                if self._maybe_backup(node, evict_after=True):
                    self.stats["writeback_deferred"] += node.num_tokens
            else:
                freed += node.num_tokens // self.page_size
                self._delete(node)

    def _evict_host(self, pages: int) -> None:
        freed = 0
        for node in self.tree.host_victims():
            if freed >= pages:
                break
            freed += node.num_tokens // self.page_size
            self._delete(node)

    def _drop_device(self, node: Node) -> None:
        slots = self.tree.detach_device(node)
        self.device.free(slots, Owner.node(node.id), node=node.id, reason="evict")
        self._emit("evict", Tier.DEVICE, slots, node=node.id)
        self.stats["device_evicted_tokens"] += len(slots)

    def _delete(self, node: Node) -> None:
        """Delete a childless unlocked node, then any ancestors left with no copy and no child."""
        while True:
            parent = node.parent
            device, host = self.tree.delete_leaf(node)
            if device is not None:
                self.device.free(device, Owner.node(node.id), node=node.id, reason="evict")
                self.stats["device_evicted_tokens"] += len(device)
            if host is not None and self.host is not None:
                self.host.free(host, Owner.node(node.id), node=node.id, reason="evict")
                self.stats["host_evicted_tokens"] += len(host)
            if (parent is None or parent.parent is None or parent.children or parent.device is not None
                    or parent.host is not None or parent.lock_ref > 0):
                return
            node = parent

    def _delete_subtree(self, top: Node) -> int:
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
            self._delete(node)
        self._delete(top)
        return dropped

    def _evictable_device_pages(self) -> int:
        return self.tree.evictable_device_tokens // self.page_size

    def _admission(self, tokens: np.ndarray, extra_key: Hashable) -> tuple[MatchResult, int, int]:
        """The read-only look an admission starts from: (look, host tokens to load, device pages
        needed for them and the uncached rest). The last token is always computed (the model
        needs its logits), so at most len - 1 tokens match."""
        ps = self.page_size
        look = self.tree.match(tokens[:_aligned(len(tokens) - 1, ps)], extra_key, split=False, touch=False)
        host_len = look.host_len if self.host is not None else 0
        return look, host_len, host_len // ps + -(-(len(tokens) - look.device_len - host_len) // ps)

    def _device_room_for(self, pages: int, look: MatchResult | None = None) -> bool:
        """Whether `pages` device pages can be had now, free or by an eviction that frees them at
        once. `can_admit`, `admit` and `extend` all decide by this one answer, so they agree. A
        request's own matched prefix (`look`) is evictable until its admission locks it, so it is
        no room for it."""
        free = self.device.num_free_pages()
        if pages <= free:
            return True
        keep = set(look.device_nodes) if look is not None else set()
        if pages > free + self._evictable_device_pages():  # not even eventually
            return False
        return free + self._freeable_now(pages - free, keep) >= pages

    def _freeable_now(self, need: int, keep: set[Node]) -> int:
        """Device pages that `_evict_device` would free at once (at least `need` of them, if there
        are), without changing anything: a dry run over the evictable device leaves, parents
        becoming leaves as their device children go. A leaf whose eviction starts a backup
        (write-back, or a node whose host-only children need it to keep a copy) frees nothing now,
        and its ancestors stay. Stops as soon as `need` pages are found."""
        ps = self.page_size
        backup_first = self.host is not None and self.config.write_policy == "write_back"
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
            if node.host is None and self.host is not None and (
                    backup_first or len(node.children) > deleted.get(node, 0)):
                continue
            got += len(node.device) // ps
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

    def _evictable_host_tokens(self) -> int:
        # O(nodes): informational (available()), not on the hot path
        return sum(len(n.host) for n in self.tree.nodes()
                   if n.host is not None and n.device is None and n.host_protect == 0 and n.lock_ref == 0)

    # -- helpers: validation -------------------------------------------------------------
    def _record(self, rid: Hashable) -> RequestRecord:
        rec = self.requests.get(rid)
        if rec is None:
            raise UnknownRequestError(f"unknown request {rid!r}")
        return rec

    def _check_tokens(self, tokens: Any) -> np.ndarray:
        arr = np.asarray(tokens, dtype=np.int32)
        if arr.ndim != 1 or len(arr) == 0:
            raise LengthError("tokens must be a non-empty 1-D sequence of token ids")
        if len(arr) > self.config.device_slots:
            raise LengthError(f"{len(arr)} tokens exceed the device pool ({self.config.device_slots} slots)")
        return arr

    def _trimmed(self, rec: RequestRecord, tokens: Any, finished_len: int | None) -> np.ndarray:
        """The tokens a finishing request keeps: prompt + `finished_len` (all when None)."""
        arr = self._check_kv_tokens(rec, tokens)
        if finished_len is not None:
            keep = rec.prompt_len + finished_len if isinstance(finished_len, int) and finished_len >= 0 else -1
            if not rec.prompt_len <= keep <= len(arr):
                raise LengthError(f"finished_len {finished_len!r} of {rec.rid!r} must keep between "
                                  f"{rec.prompt_len} and {len(arr)} tokens")
            arr = arr[:keep]
        if rec.session is not None and len(arr) < self.sessions[rec.session].kv_len:
            raise LengthError(f"turn {rec.rid!r} must keep at least the {self.sessions[rec.session].kv_len} "
                              f"tokens its session {rec.session!r} had, got {len(arr)}")
        return arr

    def _free_tail(self, rec: RequestRecord, keep: int) -> None:
        """Free the request's own pages past `keep` tokens. The start is aligned up to the next
        page boundary: a page that still holds kept tokens is never freed."""
        start = max(rec.own_start, -(-keep // self.page_size) * self.page_size)
        tail = rec.slots[start:]
        if len(tail):
            self.device.free(tail, rec.owner, rid=rec.rid, reason="trim")
            rec.slots = rec.slots[:start].copy()

    def _check_kv_tokens(self, rec: RequestRecord, tokens: Any) -> np.ndarray:
        arr = self._check_tokens(tokens)
        if len(arr) > rec.seq_len:
            raise LengthError(f"{len(arr)} tokens given but request {rec.rid!r} has KV slots for {rec.seq_len}")
        keep = min(len(arr), len(rec.tokens))
        if keep and arr[:keep].tobytes() != rec.tokens[:keep].tobytes():
            raise StateError(f"tokens of {rec.rid!r} do not extend the tokens it was admitted or cached with")
        return arr

    def _emit(self, event: str, tier: Tier, slots: np.ndarray, **fields: Any) -> None:
        if self.tracer is not None and self.tracer.active:
            self.tracer.emit(event, tier.value, slots=slots, **fields)

    # -- introspection for the invariant checker and stats --------------------------------------
    def live_requests(self) -> Iterator[RequestRecord]:
        return iter(self.requests.values())

    # -- decode offload --------------------------------------------------------------------
    # With `config.decode_offload` (the decode node of a disaggregated setup) the offload
    # actor asks for each running request's newly committed pages to be copied to host
    # (`offload_start`). A finishing or aborted request is *retired*: it leaves `requests`
    # (its rid may be admitted again, under a new generation) but keeps its device slots and
    # its prefix lock in `offload_retired` until the offload actor, seeing it finished with
    # no offload in flight, sends ReleaseOffloaded (`offload_release`, idempotent). Only then
    # are its device slots freed, once (seed 000); its landed host chunks become host-only
    # tree nodes under its prefix (finish) or are freed (abort). Offload copies are
    # `OffloadOp`s in `self.ops` (node None: they lock no node), keyed by (rid, generation);
    # their host slots belong to the request (its generation's owner) until that release.

    def _init_offload(self) -> None:
        self.offload_retired: dict[tuple[Hashable, int], RetiredRequest] = {}
        self.offload_landed: dict[tuple[Hashable, int], list[tuple[int, int, np.ndarray]]] = {}
        self.offload_inflight: dict[tuple[Hashable, int], set[int]] = {}
        self.offload_outbox: list[Any] = []  # messages for the offload actor (tree actor sends them)
        for name in ("offloads_issued", "offloads_skipped", "offloaded_tokens", "offload_releases",
                     "offload_host_tokens_kept"):
            self.stats.setdefault(name, 0)

    def _offload_note_commit(self, rec: RequestRecord) -> None:
        if rec.session is None:
            self.offload_outbox.append(OffloadCommit(rec.rid, rec.generation, rec.committed_len, rec.cached_len))

    def _offload_finish(self, rec: RequestRecord, tokens: np.ndarray) -> int:
        """finish() with decode offload: nothing goes to the tree on device; the request is
        retired until its offloads land (then released by the offload actor)."""
        if len(tokens) > len(rec.tokens):  # the record only grows
            rec.tokens = tokens
        self._offload_retire(rec, len(tokens))
        self.stats["requests_finished"] += 1
        return rec.cached_len

    def _offload_retire(self, rec: RequestRecord, final_len: int | None) -> None:
        """The request ends (finish: `final_len` tokens of valid KV; abort: None); its device
        slots and prefix lock stay until `offload_release`."""
        del self.requests[rec.rid]
        for r in rec.readiness:
            op = self._load_op_of(r, missing_ok=True)
            if op is not None:
                op.users.discard(rec.rid)
        self.offload_retired[(rec.rid, rec.generation)] = RetiredRequest(rec, final_len)
        self.offload_outbox.append(OffloadFinish(rec.rid, rec.generation, final_len, rec.cached_len))

    def _offload_record(self, rid: Hashable, generation: int) -> tuple[RequestRecord | None, int]:
        """The record of (rid, generation), live or retired, and how far it may be offloaded."""
        rec = self.requests.get(rid)
        if rec is not None and rec.generation == generation:
            return rec, min(rec.committed_len, rec.seq_len)
        z = self.offload_retired.get((rid, generation))
        if z is None:
            return None, 0
        return z.rec, min(z.final_len or 0, z.rec.seq_len)

    def offload_start(self, rid: Hashable, generation: int, start: int, end: int) -> OffloadStarted | None:
        """Copy tokens [start, end) of the request to fresh host slots (owned by the request).
        None, with nothing changed, when the request is gone or cannot offload that far any
        more (abort, trim), or the host pool is full after host eviction."""
        ps = self.page_size
        if start % ps or end % ps or not 0 <= start < end:
            raise RuntimeError(f"offload range [{start}, {end}) of {rid!r}#{generation} is not whole pages")
        rec, limit = self._offload_record(rid, generation)
        reason = None
        if rec is None:
            reason = "request released"
        elif end > limit:
            reason = f"only {limit} tokens may be offloaded"
        elif self.host is None:
            reason = "no host tier"
        if reason is None:
            assert rec is not None and self.host is not None
            host = self._alloc_host((end - start) // ps, rec.owner, rid=rid, reason="offload")
            if host is None:
                reason = "host pool full"
        if reason is not None:
            self.stats["offloads_skipped"] += 1
            _offload_log.info("offload_skipped", rid=str(rid), generation=generation, start=start, end=end,
                              reason=reason)
            return None
        assert rec is not None and self.host is not None
        op_id = next(self._op_ids)
        device = rec.slots[start:end].copy()
        self.device.pin(device, op_id)
        self.host.pin(host, op_id)
        self.ops[op_id] = OffloadOp(op_id, Direction.BACKUP, None, end - start, device, host, rec.owner,  # type: ignore[arg-type]
                                    rid=rid, generation=generation, start=start)
        self.offload_inflight.setdefault((rid, generation), set()).add(op_id)
        self._emit("offload", Tier.HOST, host, rid=rid, op=op_id)
        self.outbox.append((self._plan(op_id, Direction.BACKUP, device, host), None))
        self.stats["offloads_issued"] += 1
        self.stats["offloaded_tokens"] += end - start
        return OffloadStarted(op_id, start, end)

    def _offload_apply_ack(self, op_id: int, error: str | None) -> None:
        op = self.ops.pop(op_id)
        assert isinstance(op, OffloadOp) and self.host is not None
        key = (op.rid, op.generation)
        self.device.unpin(op.device, op_id)
        self.host.unpin(op.host, op_id)
        inflight = self.offload_inflight[key]
        inflight.discard(op_id)
        if not inflight:
            del self.offload_inflight[key]
        if error is None:
            self.offload_landed.setdefault(key, []).append((op.start, op.start + op.length, op.host))
        else:
            self.host.free(op.host, op.host_owner, op=op_id, rid=op.rid, reason="offload_failed")
            self.stats["copy_failures"] += 1
        self.offload_outbox.append(OffloadAck(op.rid, op.generation, op_id, error is None))

    def offload_release(self, rid: Hashable, generation: int) -> bool:
        """Release a retired request once: its landed host chunks become tree nodes (finish) or
        are freed (abort), its own device slots are freed and its prefix unlocked. A second
        call changes nothing (returns False). Called with an offload in flight it raises:
        that is a bug of the caller, and the runtime fails rather than free a slot a copy reads."""
        key = (rid, generation)
        z = self.offload_retired.get(key)
        if z is None:
            return False
        self._offload_check_idle(key)
        del self.offload_retired[key]
        rec = z.rec
        landed = sorted(self.offload_landed.pop(key, []), key=lambda chunk: chunk[0])
        if z.final_len is not None:
            self.stats["offload_host_tokens_kept"] += self._offload_insert_host(rec, z.final_len, landed)
        else:
            for _, _, host in landed:
                self._free_request_host(host, rec, "aborted")
        own = rec.slots[rec.own_start:]
        if len(own):
            self.device.free(own, rec.owner, rid=rid, reason="offload_release")
        if len(rec.dups):
            self.device.free(rec.dups, rec.owner, rid=rid, reason="duplicate")
        if rec.last_node is not None:
            self.tree.unlock(rec.last_node)
        self._emit("release", Tier.DEVICE, own, rid=rid, generation=generation)
        self.stats["offload_releases"] += 1
        return True

    def _offload_check_idle(self, key: tuple[Hashable, int]) -> None:
        if self.offload_inflight.get(key):
            raise RuntimeError(f"release of {key[0]!r}#{key[1]} with offloads {sorted(self.offload_inflight[key])} "
                               "in flight")

    def _offload_rewind(self, rec: RequestRecord, new_len: int) -> None:
        """Before a rewind: refuse one that would cut an offload in flight; drop landed chunks
        that reach past the kept whole pages (their tokens will be regenerated)."""
        key = (rec.rid, rec.generation)
        keep = _aligned(new_len, self.page_size)
        for op_id in self.offload_inflight.get(key, ()):
            op = self.ops[op_id]
            if op.start + op.length > keep:  # type: ignore[attr-defined]
                raise StateError(f"rewind of {rec.rid!r} to {new_len}: its offload of tokens "
                                 f"[{op.start}, {op.start + op.length}) is in flight")  # type: ignore[attr-defined]
        landed = self.offload_landed.get(key)
        if landed:
            for chunk in [c for c in landed if c[1] > keep]:
                landed.remove(chunk)
                self._free_request_host(chunk[2], rec, "rewound")

    def _free_request_host(self, host: np.ndarray, rec: RequestRecord, reason: str) -> None:
        if len(host):
            assert self.host is not None
            self.host.free(host, rec.owner, rid=rec.rid, reason=reason)

    def _offload_insert_host(self, rec: RequestRecord, final_len: int,
                             landed: list[tuple[int, int, np.ndarray]]) -> int:
        """Hand the contiguous run of landed chunks (up to the whole pages of `final_len`) to
        the tree as host copies: nodes on the path without one adopt theirs, the rest becomes
        a new host-only node under the request's prefix. Everything else is freed. Returns
        the tokens the tree took."""
        assert self.host is not None
        end_all = _aligned(final_len, self.page_size)
        parts: list[np.ndarray] = []
        start = pos = landed[0][0] if landed else 0
        for s, e, host in landed:
            if s == pos and s < end_all:
                take = min(e, end_all) - s
                parts.append(host[:take])
                self._free_request_host(host[take:], rec, "beyond_finish")
                pos = s + take
            else:
                self._free_request_host(host, rec, "not_contiguous")
        if not parts:
            return 0
        host = np.concatenate(parts)
        kept, last = self._adopt_host_run(rec.tokens[:pos], rec.extra_key, start, host, rec.owner, rec.rid)
        if kept and self.storage_on:  # offloaded pages live on as host and storage copies
            self._storage_write_chain(last, pos - start)
        return kept

    def _adopt_host_run(self, tokens: np.ndarray, extra_key: Hashable, start: int, host: np.ndarray,
                        owner: Owner, rid: Hashable) -> tuple[int, Node | None]:
        """Hand host pages holding tokens[start:] (owned by `owner`) to the tree: nodes on the path
        without a host copy adopt theirs, the rest becomes a host-only child; pages the tree
        cannot take are freed. Used by decode offload and by storage prefetch. Returns the tokens
        kept and the node the path ends at (it ends exactly at `len(tokens)`; None if the prefix
        was gone)."""
        assert self.host is not None
        end = len(tokens)

        def drop(part: np.ndarray, reason: str) -> None:
            if len(part):
                self.host.free(part, owner, rid=rid, reason=reason)

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
                if node.host is None and node.id not in self.backup_pending:
                    self.tree.attach_host(node, part)
                    self.host.assign(part, owner, Owner.node(node.id), rid=rid, node=node.id)
                    kept += len(part)
                else:
                    drop(part, "duplicate")
            parent = node
        if m.matched_len < end:
            rest = host[m.matched_len - start:]
            parent = self.tree.add_host_child(parent, tokens[m.matched_len:], rest)
            self.host.assign(rest, owner, Owner.node(parent.id), rid=rid, node=parent.id)
            kept += len(rest)
        return kept, parent

    def offload_stats(self) -> dict[str, int]:
        return {
            "inflight_offloads": sum(len(s) for s in self.offload_inflight.values()),
            "offload_retired_requests": len(self.offload_retired),
        }


@dataclass(slots=True)
class OffloadOp(CopyOp):
    """An in-flight decode offload: tokens [start, start + length) of (rid, generation),
    device slots snapshotted at issue; `node` is None (it locks no node)."""

    rid: Hashable = None
    generation: int = 0
    start: int = 0


@dataclass(slots=True)
class RetiredRequest:
    """A finished (`final_len` tokens of valid KV) or aborted (None) request whose device
    slots wait for its offloads to land (decode offload)."""

    rec: RequestRecord
    final_len: int | None


_offload_log = get_logger("hicache.offload")


# -- storage tier --------------------------------------------------------------------------
# With a storage backend (`enable_storage`), every host backup that lands is written through
# to storage by page hash (`StorageOp`, write), and `prepare`/`admit` read what storage
# holds beyond the device + host hit into fresh host pages (`StorageOp`, read, owned by a
# `Prefetch` until it lands), which become host-only tree nodes; the normal host -> device
# load follows. Storage ops live in `storage_ops` (not `ops`): they pin their host pages
# (ledger pin keyed by the op id) and a write protects its chain's host copies
# (`protect_host` over the recorded length, so a split keeps both halves protected). A
# write's keys and host pages are a snapshot taken at issue: a split during the write
# never shrinks what is written (seed 002, storage variant). Page hashes are computed
# from the node's path tokens when an op is issued (the snapshot carries them).

_storage_log = get_logger("hicache.storage")
# Memory is bounded by live state: records of rids that were prepared but never admitted or
# aborted, and the hint of page hashes known stored, are capped (past the cap a prepared rid's
# abort is an unknown rid, and a known page may be written again: both harmless).
_PREPARED_CAP = 4096
_KNOWN_CAP = 1 << 16


@dataclass(slots=True)
class Prefetch:
    """A storage read for request `rid`: tokens [start, start + len(keys) * page_size)."""

    rid: Hashable
    owner: Owner  # Owner.prefetch(rid, generation): holds `host` until it lands
    extra_key: Hashable
    tokens: np.ndarray
    start: int
    op_id: int
    host: np.ndarray
    cancelled: bool = False
    detached: bool = False  # admitted without waiting for it: it lands into the tree for whoever comes next
    by_prepare: bool = True  # started by the caller's prepare (False: by an admit that waits for it)
    waiters: list[Any] = field(default_factory=list)  # admits deferred until it lands (tree actor)
    # the anchor: the cached prefix [0, start) the read pages will hang under, kept in the tree
    # until the prefetch ends (else making host room for the read could evict it)
    anchor_lock: Node | None = None  # deepest device node of it, locked
    anchor_host: Node | None = None  # deepest host-only node of it, host-protected over...
    anchor_host_len: int = 0  # ...this many tokens (its host-only part)


@dataclass(slots=True)
class StorageOp:
    op_id: int
    write: bool
    host: np.ndarray  # pinned host slots (whole pages), one page per key
    keys: list[bytes]
    node: Node | None = None  # a write: deepest node of the backed-up chain
    length: int = 0  # a write: tokens of that chain (its protect_host length)
    prefetch: Prefetch | None = None  # a read


def _storage_key_ok(extra_key: Hashable) -> bool:
    """Namespaces the page hash encodes (the façade accepts only these)."""
    if extra_key is None or type(extra_key) in (str, bytes, int):
        return True
    return type(extra_key) is tuple and all(_storage_key_ok(k) for k in extra_key)


def _init_storage(self: CacheCore) -> None:
    self.storage_on = False
    self.storage_ops: dict[int, StorageOp] = {}
    self.storage_outbox: list[tuple[int, bool, tuple[bytes, ...], tuple[int, ...]]] = []
    self.prefetches: dict[Hashable, Prefetch] = {}
    self.storage_known: set[bytes] = set()  # page hashes this process wrote (skip rewriting them)
    self._prefetch_gens = itertools.count(1)
    self.prefetched: set[Hashable] = set()  # rids whose prefetch landed, not yet admitted or aborted
    self.prefetch_landed: dict[Hashable, int] = {}  # rid -> tokens its prefetch brought to host
    for name in ("storage_writes_issued", "storage_pages_written", "storage_write_failures",
                 "storage_lookups_issued", "storage_reads_issued", "storage_pages_read", "storage_read_misses", "storage_read_failures",
                 "tokens_storage_hit", "prefetch_skipped", "prefetch_aborted"):
        self.stats.setdefault(name, 0)


def enable_storage(self: CacheCore) -> None:
    from runtime.storage.hashing import KVIdentity

    if self.host is None:
        raise StateError("a storage tier needs the host tier")
    self.identity = KVIdentity.from_config(self.config)
    self.storage_on = True


def _page_hashes(self: CacheCore, tokens: np.ndarray, extra_key: Hashable) -> list[bytes]:
    from runtime.storage.hashing import page_hashes

    return page_hashes(tokens, self.page_size, extra_key, self.identity)


def _host_pages(self: CacheCore, host: np.ndarray) -> tuple[int, ...]:
    ps = self.page_size
    return tuple(int(x) // ps for x in host[::ps])


def _storage_write(self: CacheCore, node: Node, length: int, host: np.ndarray) -> None:
    """Write the pages of the last `length` tokens of `node`'s path, held in host slots `host`
    (a landed backup's or offload's snapshot), to storage: those not known stored yet."""
    if not _storage_key_ok(node.extra_key) or self.host is None:
        return
    ps = self.page_size
    path = self.tree.path_tokens(node)
    first = (len(path) - length) // ps
    hashes = self._page_hashes(path, node.extra_key)[first:]
    pick = [i for i, h in enumerate(hashes) if h not in self.storage_known]
    if not pick:
        return
    keys = [hashes[i] for i in pick]
    host = np.concatenate([host[i * ps:(i + 1) * ps] for i in pick])
    op_id = next(self._op_ids)
    self.host.pin(host, op_id)
    self.tree.protect_host(node, length)
    self.storage_ops[op_id] = StorageOp(op_id, True, host, keys, node=node, length=length)
    self.storage_outbox.append((op_id, True, tuple(keys), self._host_pages(host)))
    self.stats["storage_writes_issued"] += 1


def _storage_write_chain(self: CacheCore, node: Node, length: int) -> None:
    """Write the last `length` tokens of `node`'s path, just handed to the tree as host copies, to
    storage (skipped while a node of it has no host copy yet: its backup's ack writes it)."""
    chain = self.tree.split_chain(node, length)
    if all(n.host is not None for n in chain):
        self._storage_write(node, length, np.concatenate([n.host for n in chain]))


def prepare(self: CacheCore, rid: Hashable, tokens: Any, extra_key: Hashable = None) -> int:
    """Start looking up in storage the pages of `tokens` beyond the device + host hit (the read of
    what it finds follows, `_prefetch_read`). Returns the tokens looked up (0: nothing started;
    bad tokens are left for `admit` to refuse)."""
    if not self.storage_on:
        return 0
    try:
        tokens = self._check_tokens(tokens)
    except LengthError:
        return 0
    if (not self.storage_on or self.host is None or rid in self.prefetches or rid in self.requests
            or not _storage_key_ok(extra_key)):
        return 0
    ps = self.page_size
    match_len = _aligned(len(tokens) - 1, ps)
    look = self.tree.match(tokens[:match_len], extra_key, split=False, touch=False)
    start = look.device_len + look.host_len
    if match_len - start < max(ps, self.config.prefetch_threshold):
        return 0
    keys = self._page_hashes(tokens[:match_len], extra_key)[start // ps:]
    # first a lookup (no host pages): host pages are taken, evicting host copies if need be,
    # only for what storage holds (`_prefetch_read`)
    op_id = next(self._op_ids)
    pf = Prefetch(rid, Owner.prefetch(rid, next(self._prefetch_gens)), extra_key, tokens[:match_len], start,
                  op_id, EMPTY)
    if start:
        self._hold_anchor(pf, self.tree.settle(look, touch=False))
    self.prefetches[rid] = pf
    self.storage_ops[op_id] = StorageOp(op_id, False, EMPTY, keys, prefetch=pf)
    self.storage_outbox.append((op_id, False, tuple(keys), ()))
    self.stats["storage_lookups_issued"] += 1
    return len(keys) * ps


def _prefetch_read(self: CacheCore, pf: Prefetch, keys: list[bytes]) -> bool:
    """After a lookup found `keys` (the leading ones it looked up): take host pages for them and
    read them. False when nothing was started (the prefetch ends)."""
    assert self.host is not None
    ps = self.page_size
    # a cap on host memory held by prefetches: half the host pool
    held = sum(len(p.host) for p in self.prefetches.values()) // ps
    keys = keys[:max(0, self.host.num_pages // 2 - held)]
    host = self._alloc_host(len(keys), pf.owner, rid=pf.rid, reason="prefetch") if keys else None
    if host is None:
        self.stats["prefetch_skipped"] += 1
        return False
    op_id = next(self._op_ids)
    self.host.pin(host, op_id)
    pf.op_id, pf.host = op_id, host
    pf.tokens = pf.tokens[:pf.start + len(keys) * ps]
    self.storage_ops[op_id] = StorageOp(op_id, False, host, keys, prefetch=pf)
    self.storage_outbox.append((op_id, False, tuple(keys), self._host_pages(host)))
    self.stats["storage_reads_issued"] += 1
    return True


def _hold_anchor(self: CacheCore, pf: Prefetch, m: MatchResult) -> None:
    """Keep the prefetch's anchor (the matched prefix `m`, ending exactly at `pf.start`) in the
    tree until the prefetch ends: its device part locked, its host-only part host-protected."""
    if m.num_device_nodes:
        pf.anchor_lock = m.last_device_node
        self.tree.lock(pf.anchor_lock)
    if m.host_len:
        pf.anchor_host, pf.anchor_host_len = m.last_node, m.host_len
        self.tree.protect_host(m.last_node, m.host_len)


def _release_anchor(self: CacheCore, pf: Prefetch) -> None:
    if pf.anchor_lock is not None:
        self.tree.unlock(pf.anchor_lock)
        pf.anchor_lock = None
    if pf.anchor_host is not None:
        self.tree.unprotect_host(pf.anchor_host, pf.anchor_host_len)
        pf.anchor_host = None


def _prefetch_cancel(self: CacheCore, rid: Hashable) -> bool:
    pf = self.prefetches.pop(rid, None)
    if pf is None:
        return False
    pf.cancelled = True
    self.stats["prefetch_aborted"] += 1
    return True


def _prefetch_detach(self: CacheCore, pf: Prefetch) -> None:
    """The request stops waiting (best_effort admit, timeout): the read goes on and lands into
    the tree; an abort of the request no longer cancels it."""
    if self.prefetches.get(pf.rid) is pf:
        del self.prefetches[pf.rid]
        pf.detached = True


def _prefetch_landed(self: CacheCore, rid: Hashable) -> bool:
    """Forget that `rid` was prepared (its landed pages are the tree's, nothing to release)."""
    self.prefetch_landed.pop(rid, None)
    if rid in self.prefetched:
        self.prefetched.discard(rid)
        return True
    return False


def apply_storage_ack(self: CacheCore, op_id: int, pages: int, error: str | None,
                      ok: tuple[bool, ...] = ()) -> Prefetch | None:
    """A storage op finished. A write marks its stored pages known; a lookup starts the read of
    what it found; a read's leading `pages` become host copies in the tree (the rest is freed).
    Returns the prefetch when it ended here (its waiting admits can run), else None."""
    sop = self.storage_ops.pop(op_id)
    assert self.host is not None
    if len(sop.host):  # a lookup pinned nothing
        self.host.unpin(sop.host, op_id)
    if sop.write:
        assert sop.node is not None
        self.tree.unprotect_host(sop.node, sop.length)
        if error is not None:
            ok = ()
            _storage_log.warning("storage_write_failed", op=op_id, pages=len(sop.keys), error=error)
        stored = [k for k, good in zip(sop.keys, ok) if good]
        if error is None and len(stored) < len(sop.keys):
            _storage_log.warning("storage_pages_not_written", op=op_id, failed=len(sop.keys) - len(stored))
        if len(self.storage_known) > _KNOWN_CAP:  # a hint only: bound its memory
            self.storage_known.clear()
        self.storage_known.update(stored)
        self.stats["storage_pages_written"] += len(stored)
        self.stats["storage_write_failures"] += len(sop.keys) - len(stored)
        return None
    pf = sop.prefetch
    assert pf is not None
    if not len(sop.host):  # a lookup: read what storage holds, or end here
        found = pages if error is None and not pf.cancelled else 0
        if error is not None:
            self.stats["storage_read_failures"] += 1
            _storage_log.warning("storage_lookup_failed", op=op_id, rid=str(pf.rid), error=error)
        elif not pf.cancelled:
            self.stats["storage_read_misses"] += len(sop.keys) - found
            self.storage_known.difference_update(sop.keys[found:])
        if found and self._prefetch_read(pf, sop.keys[:found]):
            return None  # its waiters wait for the read
        self._release_anchor(pf)
        if pf.by_prepare and not pf.cancelled and not pf.detached and len(self.prefetched) < _PREPARED_CAP:
            self.prefetched.add(pf.rid)  # prepared: a later abort of the rid is not an unknown rid
        if self.prefetches.get(pf.rid) is pf:
            del self.prefetches[pf.rid]
        return pf
    if self.prefetches.get(pf.rid) is pf:
        del self.prefetches[pf.rid]
    ps = self.page_size
    if error is not None:
        self.stats["storage_read_failures"] += 1
        _storage_log.warning("storage_read_failed", op=op_id, rid=str(pf.rid), error=error)
        pages = 0
    if pf.cancelled:
        pages = 0
    else:
        if pf.by_prepare and not pf.detached and len(self.prefetched) < _PREPARED_CAP:
            self.prefetched.add(pf.rid)
        self.storage_known.difference_update(sop.keys[pages:])  # gone (evicted elsewhere): rewrite it next time
        self.stats["storage_read_misses"] += len(sop.keys) - pages
        self.stats["storage_pages_read"] += pages
    rest = pf.host[pages * ps:]
    if len(rest):
        self.host.free(rest, pf.owner, rid=pf.rid, reason="prefetch_unused")
    if pages:
        # the read pages become host copies in the tree (the same hand-over as decode offload's)
        taken, _ = self._adopt_host_run(pf.tokens[:pf.start + pages * ps], pf.extra_key, pf.start,
                                        pf.host[:pages * ps], pf.owner, pf.rid)
        self.stats["tokens_storage_hit"] += taken
        if not pf.detached and not pf.cancelled and len(self.prefetch_landed) < _PREPARED_CAP:
            self.prefetch_landed[pf.rid] = taken
    self._release_anchor(pf)  # from here the landed pages keep their anchor in the tree
    return pf


for _fn in (_init_storage, enable_storage, _page_hashes, _host_pages, _storage_write, _storage_write_chain, prepare,
            _prefetch_read, _hold_anchor, _release_anchor, _prefetch_cancel,
            _prefetch_landed, _prefetch_detach, apply_storage_ack):
    setattr(CacheCore, _fn.__name__, _fn)
del _fn

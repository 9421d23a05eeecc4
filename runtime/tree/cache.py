"""CacheCore: the tree actor's synchronous core, and its one façade.

It owns the request table (live requests' records) and the streaming sessions, and composes
the parts that own the rest, each written only by itself (calls go one way: down):

    CacheCore ──► StorageTier (storage ops, prefetches)      ─┐
              ──► DecodeOffload (retired requests, offloads) ─┼─► Residency (tree, ledgers, tracer)
              ──► CopyTracker (device <-> host copies)       ─┘

No event loop, no streams: the tree actor turns messages into calls on it and sends what it
issued (`take_effects`): transfer plans, storage calls, notes for the offload actor.

Ownership rules it keeps (checked by `runtime.invariants`):
- a request's slots are `slots[:cached_len]` (held by tree nodes, locked through
  `last_node`) followed by pages it owns itself; every slot `admit`/`extend` gave a live
  request stays its own until it is released (the slot contract);
- a request's token record only grows, and every call's tokens must extend it (seed 003);
- KV enters the tree only once the loads it rests on are done (`_check_loaded`).

Token arrays passed in are kept, not copied: the tree actor's messages own theirs (the
façade copies what the caller gives it), and a direct caller must not change an array
after passing it. (Tree keys are bytes encoded at insert time either way.)
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable
from typing import Any, NamedTuple

import numpy as np
import torch

from runtime.config import RuntimeConfig
from runtime.errors import (
    InternalError,
    ArgumentError,
    CapacityError,
    DuplicateRequestError,
    LengthError,
    StateError,
    TransferError,
    UnknownRequestError,
)
from runtime.memory.owners import Owner
from runtime.messages import AdmitResult, OffloadStarted, TransferPlan
from runtime.phase import Phase
from runtime.events.recorder import KVEventRecorder
from runtime.storage.hashing import KVIdentity
from runtime.trace import SlotTracer
from runtime.tree.copies import CopyTracker
from runtime.tree.decode_offload import COUNTERS as OFFLOAD_COUNTERS
from runtime.tree.decode_offload import DecodeOffload
from runtime.tree.radix import MatchResult, Node
from runtime.tree.readiness import LoadReadiness, ManualReadiness, ReadinessFactory
from runtime.tree.records import EMPTY, Prefetch, PrefetchWait, RequestRecord, SessionRecord, StoredPages, aligned
from runtime.tree.request_table import RequestTable
from runtime.tree.residency import Residency
from runtime.tree.recurrent import COUNTERS as STATE_COUNTERS
from runtime.tree.sliding import COUNTERS as SWA_COUNTERS
from runtime.tree.storage_tier import COUNTERS as STORAGE_COUNTERS
from runtime.tree.storage_tier import StorageRequest, StorageTier
from runtime.tree.token_checks import checked_kv_tokens, checked_tokens, kept_tokens


class Effects(NamedTuple):
    """What the core issued since the last `take_effects`, for the tree actor to send."""

    copies: list[tuple[TransferPlan, LoadReadiness | None]]  # to the transfer actor
    storage: list[StorageRequest]  # to the transfer actor
    offload_notes: list[Any]  # to the offload actor


class CacheCore:
    # -- state -------------------------------------------------------------------
    def __init__(self, config: RuntimeConfig, tracer: SlotTracer | None = None, *,
                 readiness_factory: ReadinessFactory = ManualReadiness) -> None:
        self.config = config
        self.page_size = config.page_size
        # each public call checks its input, then marks `phase.change()` before its first change:
        # a ValidationError after the mark fails the runtime (the tree actor's loop reads it)
        self.phase = Phase()
        self.residency = Residency.from_config(config, tracer)
        self.residency.tree.on_split = self._on_split
        op_ids = itertools.count(1)  # one id space: ledger pins are keyed by op id
        self.copies = CopyTracker(self.residency, op_ids, config.num_layers, readiness_factory)
        self.offload: DecodeOffload | None = DecodeOffload(self.residency, op_ids) if config.decode_offload else None
        self.storage: StorageTier | None = None  # enable_storage()
        # the storage tier's counters: kept here, since detach/attach replaces the tier (they only grow)
        self._storage_stats: dict[str, int] = dict.fromkeys(STORAGE_COUNTERS, 0)
        self._op_ids = op_ids
        self.table = RequestTable(config.page_size)
        self.requests: dict[Hashable, RequestRecord] = self.table.records  # read-only here: rows change in the table
        if self.residency.sliding is not None:  # its running requests' drop reads them
            self.residency.sliding.requests = self.requests
        self.sessions: dict[Hashable, SessionRecord] = {}
        self._generations = itertools.count(1)  # one counter: (rid, generation) is never reused
        self._write_through_all = config.host_slots > 0 and config.write_policy == "write_through"
        self._selective = config.host_slots > 0 and config.write_policy == "write_through_selective"
        self._stats: dict[str, int] = {
            "requests_admitted": 0, "requests_finished": 0, "requests_aborted": 0,
            "tokens_device_hit": 0, "tokens_host_hit": 0, "tokens_recomputed": 0,
        }

    def enable_events(self) -> None:
        """Record KV cache events of every tier change (`take_events` hands them over)."""
        identity = KVIdentity.from_config(self.config)
        self.residency.enable_events(KVEventRecorder(self.page_size, identity, self.residency.use_hasher(identity)))

    def take_events(self) -> list[Any]:
        """The KV event records made since the last call (none while events are off; the wire
        events are `runtime.events.recorder.materialize` of them)."""
        events = self.residency.events
        return events.take() if events is not None and events.pending else []

    def enable_storage(self, kept: StoredPages | None = None) -> None:
        """A storage tier behind the host tier; `kept`: what this runtime knew of the backend's pages
        when it detached the same backend."""
        if self.residency.host is None:
            raise StateError("a storage tier needs the host tier")
        self.storage = StorageTier(self.config, self.residency, self._op_ids, KVIdentity.from_config(self.config),
                                   self._storage_stats)
        if kept is not None:
            self.storage.known, self.storage.doubtful, self.storage.rank_keys = kept.known, kept.doubtful, kept.rank_keys
            self.storage.known_states = kept.states

    def disable_storage(self) -> StoredPages:
        """`detach_storage`, once no storage op is in flight: the tier goes, and with it the records
        of rids prepared but not admitted (a later abort of one is an unknown rid). Returns the page
        hashes it knew stored or in doubt (kept by the caller with that backend, for a re-attach)."""
        if self.storage is None or self.storage.ops:
            raise InternalError("storage detached with storage ops in flight")
        kept = StoredPages(self.storage.known, self.storage.doubtful, rank_keys=self.storage.rank_keys,
                           states=self.storage.known_states)
        self.storage = None
        return kept

    def forget_storage(self) -> list[bytes]:
        """`clear_storage`, once no storage op is in flight: forget every page hash known stored and
        return them (the pages to remove; KV events report each one removed from STORAGE)."""
        if self.storage is None:
            raise InternalError("storage clear without a storage tier")
        return self.storage.forget_stored()

    # -- request lifecycle -------------------------------------------------------
    def admit(self, rid: Hashable, tokens: Any, extra_key: Hashable = None,
              session: Hashable = None, priority: int = 0) -> AdmitResult:
        """A direct caller's admit (loop-free tests and tools): its tokens checked here, then the
        admission itself; the tree actor's entry is `admit_or_wait` (tokens checked by the façade)."""
        return self._admit(rid, self._check_tokens(tokens), extra_key, session, priority)

    def _admit(self, rid: Hashable, tokens: np.ndarray, extra_key: Hashable, session: Hashable,
               priority: int) -> AdmitResult:
        if rid in self.requests:
            raise DuplicateRequestError(f"request {rid!r} is still live")
        if session is not None:
            return self._admit_turn(rid, tokens, self._session(session))
        res = self.residency
        tree = res.tree
        ps = self.page_size
        look, host_len, need_pages = res.admission(tokens, extra_key, admitting=True)
        cached = look.device_len + host_len
        if not res.room_for(need_pages, look):
            self._start_writeback(need_pages, look)
            raise self.phase.refuse(CapacityError(
                f"request {rid!r} needs {need_pages} device pages; {res.device.num_free_pages()} free, "
                f"{res.evictable_device_pages()} evictable"))
        states = res.states
        if states is not None and not states.room_for(1 + (host_len > 0), look.nodes):
            raise CapacityError(f"request {rid!r} needs state slots; too few are free or evictable")

        self.phase.change()
        m = tree.settle(look)  # = match(split=True, touch=True), without a second walk
        generation = next(self._generations)
        owner = Owner.request(rid, generation)
        device_nodes = m.device_nodes  # device residency is prefix-closed
        host_nodes = [n for n in m.nodes if n.device is None] if host_len else []
        lock_node = host_nodes[-1] if host_nodes else (device_nodes[-1] if device_nodes else None)
        if lock_node is not None:
            tree.lock(lock_node)
        own_pages = -(-(len(tokens) - cached) // ps)
        # held for as long as the request is filed: its pages move to the tree and new ones come
        # (extend, decode steps) without the ledger dropping and re-issuing its code each time
        code = res.device.hold(owner)
        state_slot = load_state = None
        try:
            # (a state slot may evict unlocked snapshots: never the hit's, locked above)
            if states is not None:
                state_slot = states.admit(rid, owner)
                if host_nodes:  # the hit's snapshot comes back from host with its KV
                    load_state = states.reserve_load(host_nodes[-1])
            fresh = self._alloc_device(host_len // ps + own_pages, owner, rid=rid)
        except CapacityError as exc:
            # write-back evictions may still be copying: nothing of this request stays behind, so
            # the shortfall is a refusal again
            if state_slot is not None:
                states.release(rid, owner)  # type: ignore[union-attr]
            if load_state is not None:
                states.free_node_slot(host_nodes[-1], load_state)  # type: ignore[union-attr]
            res.device.unhold(owner)
            if lock_node is not None:
                tree.unlock(lock_node)
            raise self.phase.refuse(exc)
        copies = self.copies
        readiness = copies.loads_under(device_nodes) if copies.loading else []
        if host_nodes:
            load = copies.start_load(host_nodes, host_len, fresh[:host_len], owner, load_state)
            assert load.readiness is not None
            readiness.append(load.readiness)
        for r in readiness:
            copies.add_user(r, rid)
        if host_nodes:
            prefix = np.concatenate([n.device for n in m.nodes[: len(device_nodes) + len(host_nodes)]])
            slots = np.concatenate((prefix, fresh[host_len:]))
        else:  # one copy: the cached prefix's per-node slots and the fresh pages together
            slots = np.concatenate((*m.device_parts, fresh[host_len:]))
        rec = RequestRecord(
            rid=rid, generation=generation, owner=owner, extra_key=extra_key, tokens=tokens,
            cached_len=cached, last_node=lock_node, prompt_len=len(tokens), readiness=tuple(readiness),
            priority=priority)
        self.table.add(rec, slots, len(tokens), cached, code)
        stats = self._stats
        stats["requests_admitted"] += 1
        stats["tokens_device_hit"] += m.device_len
        stats["tokens_host_hit"] += host_len
        stats["tokens_recomputed"] += len(tokens) - cached
        if res.sliding is not None:
            res.sliding.count_cut()
        if self._selective:
            for node in device_nodes:
                if node.hit_count >= self.config.write_through_threshold:
                    copies.backup(node)
        # a lookup that landed while this admit waited marked it prepared
        from_storage = self.storage.admitted(rid, host_len) if self.storage is not None else 0
        # `slots` is this call's own array (the table copied it into its row)
        state_from = states.hit_state(lock_node) if states is not None else None
        return AdmitResult(rid, generation, torch.from_numpy(slots[: len(tokens)]), m.device_len, host_len,
                           tuple(readiness), from_storage, state_slot, state_from)

    def admit_or_wait(self, rid: Hashable, tokens: np.ndarray, extra_key: Hashable = None,
                      session: Hashable = None, waiter: Any = None, priority: int = 0) -> AdmitResult | PrefetchWait:
        """The tree actor's one admit entry: `admit`, or, with a storage tier whose policy waits for
        the request's prefetch, the prefetch `waiter` (an opaque token of the caller's) now waits
        on: the caller admits it again, with no waiter, when the prefetch ends (`apply_storage_ack`,
        `storage_overdue`, `prefetch_deadline`). `waiter` None never waits (a batch item, or an
        admit whose prefetch ended). `tokens` were checked by the sender (the façade's
        `runtime.validation.tokens`: a new 1-D int32 array, non-empty, no longer than the pool)."""
        storage = self.storage
        if storage is not None:
            fresh = session is None and rid not in self.requests
            storage.prefetched.discard(rid)
            if fresh:
                wait = storage.wait_for(rid, tokens, extra_key, waiter)
                if wait is not None:
                    return wait
        return self._admit(rid, tokens, extra_key, session, priority)

    def extend(self, rid: Hashable, n: int) -> torch.Tensor:
        rec = self._record(rid)
        if not isinstance(n, int) or n <= 0:
            raise LengthError(f"extend needs a positive token count, got {n!r}")
        start = rec.seq_len
        total = start + n
        if total > self.config.device_slots:
            raise LengthError(f"request {rid!r} would hold {total} tokens, more than the device pool")
        missing = total - rec.num_slots
        if missing > 0:
            pages = -(-missing // self.page_size)
            if not self.residency.room_for(pages):
                self._start_writeback(pages)
                raise self.phase.refuse(CapacityError(f"extend of {rid!r} needs {pages} device pages"))
            self.phase.change()
            rec.append_slots(self._refusable_alloc(pages, rec.owner, rid=rid))
        self.phase.change()
        rec.seq_len = total
        return torch.from_numpy(rec.slot_range(start, total))

    def decode_step(self, rids: tuple[Hashable, ...]) -> torch.Tensor:
        """One decode step of the running requests `rids`: each commits every token it has (their
        KV was just computed) and gets the slot of its next token; those whose next token starts
        a page get a page each, in one ledger call. Returns the new slots, one per request, in
        order. All or nothing: an unknown or repeated rid, a request as long as the device pool,
        or too few pages (CapacityError; write-backs started, as for `extend`) changes nothing.
        The same as `commit(rid, seq_len)` then `extend(rid, 1)` for each, in order."""
        table = self.table
        try:
            rows = table.batch_rows(rids)
        except (KeyError, TypeError):  # an unhashable rid is never a live one
            bad = next((rid for rid in rids if not _is_live(table, rid)), rids)
            raise UnknownRequestError(f"decode step: unknown request {bad!r}") from None
        except ValueError:
            raise ArgumentError("decode step: a request appears twice") from None
        seq = table.seq_len[rows]
        at_page_end = seq >= table.num_slots[rows]  # their next token starts a page
        starting = rows[at_page_end]
        k = len(starting)
        if k:
            res = self.residency
            longest = seq[at_page_end]
            i = longest.argmax()
            if longest[i] >= self.config.device_slots:
                rec = table.record_at[int(starting[i])]
                raise LengthError(f"request {rec.rid!r} would hold {rec.seq_len + 1} tokens, more than the device "
                                  "pool")
            free = res.device.num_free_pages()
            if k > free:
                if not res.room_for(k):
                    self._start_writeback(k)
                    raise self.phase.refuse(CapacityError(f"decode step needs {k} device pages"))
                self.phase.change()
                self.copies.write_back(res.evict_device(k - free))
            self.phase.change()
            codes = table.codes[starting]
            if not codes.all():  # session turns: held from their first decode step
                for row in starting[codes == 0].tolist():
                    table.codes[row] = res.device.hold(table.record_at[row].owner)
                codes = table.codes[starting]
            try:
                pages = res.device.alloc_held(codes, reason="decode")
            except CapacityError as exc:  # write-backs still copying: nothing a caller holds changed
                raise self.phase.refuse(exc)
            table.append_page_each(starting, pages)
        self.phase.change()
        out = table.advance(rows, seq)
        if self.offload is not None:
            for rid in rids:
                self.offload.note_commit(self.requests[rid])
        return torch.from_numpy(out)

    def commit(self, rid: Hashable, committed_len: int) -> int:
        rec = self._record(rid)
        if not isinstance(committed_len, int) or committed_len < rec.committed_len or committed_len > rec.seq_len:
            raise LengthError(
                f"commit of {rid!r} must lie in [{rec.committed_len}, {rec.seq_len}], got {committed_len!r}")
        self.phase.change()
        rec.committed_len = committed_len
        if self.offload is not None:
            self.offload.note_commit(rec)
        return committed_len

    def snapshot(self, rid: Hashable, position: int) -> int:
        """A device state slot for the recurrent state of `rid` after its first `position` tokens
        (page-aligned, past its cached prefix, within its slots). The engine copies the state there
        when it has computed exactly `position` tokens; the slot is the request's until an insert
        reaches `position` (it then stays with the tree node ending there) or the request ends."""
        states = self.residency.states
        if states is None:
            raise StateError("snapshot needs recurrent state (state_layers > 0)")
        rec = self._record(rid)
        if (not isinstance(position, int) or isinstance(position, bool) or position % self.page_size
                or not rec.cached_len < position <= rec.seq_len):
            raise LengthError(f"snapshot of {rid!r} must be a multiple of page_size {self.page_size} in "
                              f"({rec.cached_len}, {rec.seq_len}], got {position!r}")
        if states.has_pending(rid, position):
            raise StateError(f"{rid!r} already has a snapshot at {position}")
        self.phase.change()
        try:
            return states.snapshot(rid, rec.owner, position)
        except CapacityError as exc:  # no state slot: nothing was taken
            raise self.phase.refuse(exc)

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
        self.phase.change()
        self._insert(rec, tokens)
        return rec.cached_len

    def finish(self, rid: Hashable, tokens: np.ndarray, finished_len: int | None = None) -> int:
        """Keep exactly prompt + `finished_len` tokens (speculative overshoot trimmed, seed 003),
        insert their page-aligned part (or hand them to the session), unlock, free the rest.
        With decode offload nothing goes to the tree on device: the request is retired until
        its offloads land."""
        rec = self._record(rid)
        self._note_failed_load(rec)
        if rec.failed is not None:
            self.phase.change()  # (a TransferError is the call's outcome, not a refusal)
            self._release(rec)
            self._stats["requests_aborted"] += 1
            raise TransferError(f"request {rid!r} lost its cached prefix ({rec.failed}); it was released")
        tokens = self._trimmed(rec, tokens, finished_len)
        self._check_loaded(rec)
        self.phase.change()
        self._stats["requests_finished"] += 1
        if rec.session is not None:
            self._finish_turn(rec, tokens)
            return len(tokens)
        if self.offload is not None:
            if len(tokens) > len(rec.tokens):  # the record only grows
                rec.tokens = tokens
            self._retire(rec, len(tokens))
            return rec.cached_len
        self._insert(rec, tokens)
        cached = rec.cached_len
        self._release(rec)
        return cached

    def abort(self, rid: Hashable) -> list[Any]:
        """Release a live request, or cancel a prepared rid's prefetch. Returns the waiters of the
        cancelled prefetch (admits waiting for it: they fail)."""
        waiters: list[Any] = []
        storage = self.storage
        if rid not in self.requests and (storage is None or (rid not in storage.prefetches
                                                             and rid not in storage.prefetched)):
            raise UnknownRequestError(f"unknown request {rid!r}")
        self.phase.change()
        if storage is not None:
            pf = storage.cancel(rid)
            if pf is not None:
                waiters = pf.take_waiters()
            if (pf is not None or storage.forget(rid)) and rid not in self.requests:
                return waiters  # only a prefetch (prepare without admit): cancelled (slots freed at its ack) or landed
        rec = self._record(rid)
        self._release(rec)
        self._stats["requests_aborted"] += 1
        return waiters

    def rewind(self, rid: Hashable, new_len: int) -> int:
        """Forget the request's tokens past `new_len` (a retraction): frees whole pages past it."""
        rec = self._record(rid)
        floor = max(rec.cached_len, self.sessions[rec.session].kv_len if rec.session is not None else 0)
        if not isinstance(new_len, int) or not floor <= new_len <= rec.seq_len:
            raise LengthError(f"rewind of {rid!r} must lie in [{floor}, {rec.seq_len}], got {new_len!r}")
        if self.residency.sliding is not None:
            self.residency.sliding.check_rewind(rec, new_len)
        if self.offload is not None:
            self.offload.check_rewind(rec, new_len)
        self.phase.change()
        self._free_tail(rec, new_len)
        if self.residency.states is not None:  # a snapshot of retracted tokens describes no prefix
            self.residency.states.forget_after(rid, rec.owner, new_len)
        rec.seq_len = new_len
        rec.committed_len = min(rec.committed_len, new_len)
        rec.tokens = rec.tokens[:new_len].copy()
        return new_len

    def abort_if_live(self, rid: Hashable, generation: int) -> None:
        """The cancelled-caller path: release the request only if it is the same admission."""
        rec = self.requests.get(rid)
        if rec is not None and rec.generation == generation:
            self.phase.change()
            self._release(rec)
            self._stats["requests_aborted"] += 1

    # -- streaming sessions ----------------------------------------------------------------
    def open_session(self, sid: Hashable, extra_key: Hashable = None) -> None:
        if self.residency.states is not None:
            raise StateError("streaming sessions do not keep recurrent state yet (state_layers > 0)")
        if sid in self.sessions:
            raise DuplicateRequestError(f"session {sid!r} is already open")
        self.phase.change()
        self.sessions[sid] = SessionRecord(sid, Owner.session(sid), extra_key, np.zeros(0, np.int32), EMPTY)

    def close_session(self, sid: Hashable, insert: bool = False) -> int:
        """Free what the session holds; with `insert`, its page-aligned KV goes into the tree first."""
        sess = self._session(sid)
        if sess.turn is not None:
            raise StateError(f"session {sid!r} has turn {sess.turn!r} running")
        self.phase.change()
        res = self.residency
        keep = aligned(sess.kv_len, self.page_size) if insert else 0
        if keep:
            keep = self.copies.insert_cap(sess.tokens, keep, sess.extra_key)
        if keep:
            ins = res.insert(sess.tokens[:keep], sess.extra_key, sess.slots[:keep], sess.owner)
            if len(ins.duplicate_slots):
                res.device.free(ins.duplicate_slots, sess.owner, reason="duplicate")
            self._write_through(ins.adopted)
        rest = sess.slots[keep:]
        if len(rest):
            res.device.free(rest, sess.owner)
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
        if not self.residency.room_for(pages):
            raise CapacityError(f"turn {rid!r} needs {pages} device pages")
        self.phase.change()
        generation = next(self._generations)
        owner = Owner.request(rid, generation)
        own = self._refusable_alloc(pages, owner, rid=rid)
        slots = np.concatenate((sess.slots, own))
        self.table.add(RequestRecord(
            rid=rid, generation=generation, owner=owner, extra_key=sess.extra_key, tokens=tokens,
            cached_len=0, last_node=None, prompt_len=len(tokens), session=sess.sid, session_len=session_len),
            slots, len(tokens), kv)
        sess.turn = rid
        self._stats["requests_admitted"] += 1
        self._stats["tokens_device_hit"] += kv
        self._stats["tokens_recomputed"] += len(tokens) - kv
        return AdmitResult(rid, generation, torch.from_numpy(slots[: len(tokens)].copy()), kv, 0, ())

    def _finish_turn(self, rec: RequestRecord, tokens: np.ndarray) -> None:
        """The session keeps exactly `tokens` of KV: the turn's pages up to them are handed over,
        whole pages past them freed (a page holding kept tokens is never freed)."""
        sess = self.sessions[rec.session]
        self._free_tail(rec, len(tokens))
        slots = rec.slots
        kept = slots[rec.session_len:]
        if len(kept):
            self.residency.device.assign(kept, rec.owner, sess.owner, rid=rec.rid, session=sess.sid)
        sess.slots = slots
        sess.tokens = tokens
        sess.turn = None
        self._unfile(rec)

    # -- read-only questions -----------------------------------------------------------
    def match_prefix(self, tokens: np.ndarray, extra_key: Hashable = None) -> dict[str, int]:
        look, host_len = self.residency.usable_match(self._check_tokens(tokens), extra_key)
        return {"device": look.device_len, "host": host_len}

    def available(self) -> dict[str, int]:
        res = self.residency
        out = {
            "device_free": res.device.num_free_slots(),
            "device_evictable": res.evictable_device_pages() * self.page_size,
        }
        if res.host is not None:
            out["host_free"] = res.host.num_free_slots()
            out["host_evictable"] = res.evictable_host_tokens()
        return out

    def can_admit(self, tokens: np.ndarray, extra_key: Hashable = None) -> bool:
        """The answer `admit` would give now. A no starts the write-backs that would make room (as
        `admit` does; a scheduler that polls `can_admit` must see the room come): that changes
        no request's state, only which cached pages are being copied to host."""
        res = self.residency
        look, host_len, need = res.admission(self._check_tokens(tokens), extra_key)
        if res.states is not None and not res.states.room_for(1 + (host_len > 0), look.nodes):
            return False  # (no write-back makes state slots free)
        if res.room_for(need, look):
            return True
        self._start_writeback(need, look)
        return False

    @property
    def stats(self) -> dict[str, int]:
        """Counters of the core and its parts, the same names whatever is enabled (a fresh dict; a
        counter two parts keep is summed)."""
        out = dict(self._stats)
        parts = [self.residency.stats, self.copies.stats]
        parts.append(self.offload.stats if self.offload is not None else dict.fromkeys(OFFLOAD_COUNTERS, 0))
        parts.append(self._storage_stats)
        states = self.residency.states
        parts.append(states.stats if states is not None else dict.fromkeys(STATE_COUNTERS, 0))
        sliding = self.residency.sliding
        parts.append(sliding.stats if sliding is not None else dict.fromkeys(SWA_COUNTERS, 0))
        for part in parts:
            for name, value in part.items():
                out[name] = out.get(name, 0) + value
        return out

    def counts(self) -> dict[str, int]:
        """Sizes of the live state (TreeStats)."""
        res = self.residency
        out = {
            "live_requests": len(self.requests),
            "inflight_copies": len(self.copies.ops) + (len(self.offload.ops) if self.offload is not None else 0),
            "inflight_storage_ops": len(self.storage.ops) if self.storage is not None else 0,
            "tree_nodes": res.tree.num_nodes,
            "device_free_slots": res.device.num_free_slots(),
            "host_free_slots": res.host.num_free_slots() if res.host is not None else 0,
            "state_free_slots": res.states.ledger.num_free_slots() if res.states is not None else 0,
            "swa_free_slots": res.sliding.swa.num_free_pages() * self.page_size if res.sliding is not None else 0,
        }
        out.update(self.offload.counts() if self.offload is not None
                   else {"inflight_offloads": 0, "offload_retired_requests": 0})
        return out

    def in_flight(self) -> int:
        """Copies (device <-> host, decode offload) and storage ops not acked yet."""
        return (len(self.copies.ops) + (len(self.offload.ops) if self.offload is not None else 0)
                + (len(self.storage.ops) if self.storage is not None else 0))

    def quiet(self) -> bool:
        """No copy in flight, and no storage op but those past their deadline (their calls may
        never return)."""
        if self.copies.ops or (self.offload is not None and self.offload.ops):
            return False
        return self.storage is None or self.storage.all_overdue()

    # -- acks and effects ----------------------------------------------------------------
    def apply_ack(self, op_id: int, error: str | None) -> None:
        if self.offload is not None and self.offload.owns(op_id):
            self.offload.apply_ack(op_id, error)
            return
        if op_id not in self.copies.ops:
            raise InternalError(f"ack of copy {op_id}, which is not in flight")
        for out in self.copies.apply_ack(op_id, error):  # (a batch of backups: each of them)
            if out.failed is not None:
                for rid in out.failed_users:
                    rec = self.requests.get(rid)
                    if rec is not None:
                        rec.failed = out.failed
            if out.backed_up and self.storage is not None:
                self.storage.write(out.op.node, out.op.length, out.op.host)

    def take_effects(self) -> Effects:
        copies = self.copies.take_plans()
        if self.offload is not None:
            copies += [(plan, None) for plan in self.offload.take_plans()]
            notes = self.offload.take_notes()
        else:
            notes = []
        storage = self.storage.take_requests() if self.storage is not None else []
        return Effects(copies, storage, notes)

    def flush(self) -> int:
        """Drop every unlocked cached prefix from device and host; returns tokens dropped."""
        self.phase.change()
        return self.residency.flush()

    # -- decode offload (the offload actor's calls) ----------------------------------------
    def offload_start(self, rid: Hashable, generation: int, start: int, end: int) -> OffloadStarted | None:
        if self.offload is None:
            raise InternalError("offload start without decode offload")
        return self.offload.start(rid, generation, start, end, self.requests.get(rid))

    def offload_release(self, rid: Hashable, generation: int) -> bool:
        """Release a retired request once (False: nothing to release; see DecodeOffload.release)."""
        if self.offload is None:
            raise InternalError("offload release without decode offload")
        taken = self.offload.release(rid, generation, self.copies.backup_pending)
        if taken is False:
            return False
        if taken and self.storage is not None:
            self.storage.write_chain(*taken)  # offloaded pages live on as host and storage copies
        return True

    # -- storage tier (the tree actor's calls) -----------------------------------------------
    def prepare(self, rid: Hashable, tokens: Any, extra_key: Hashable = None) -> int:
        """Start looking up in storage the pages of `tokens` beyond the device + host hit. Returns
        the tokens looked up (0: nothing started; bad tokens are left for `admit` to refuse)."""
        if self.storage is None or rid in self.requests:
            return 0
        try:
            tokens = self._check_tokens(tokens)
        except LengthError:
            return 0
        self.phase.change()
        return self.storage.prepare(rid, tokens, extra_key)

    def apply_storage_ack(self, op_id: int, pages: int, error: str | None,
                          ok: tuple[bool, ...] = (), states_ok: tuple[bool, ...] = ()) -> Prefetch | None:
        """A storage op finished; returns the prefetch that ended here (admit its waiters)."""
        if self.storage is None or op_id not in self.storage.ops:
            raise InternalError(f"ack of storage op {op_id}, which is not in flight")
        return self.storage.apply_ack(op_id, pages, error, ok, self.copies.backup_pending, states_ok)

    def storage_overdue(self, op_id: int) -> Prefetch | None:
        """A storage call ran past its deadline; returns the prefetch whose waiters go on now."""
        return self.storage.mark_overdue(op_id) if self.storage is not None else None

    def prefetch_deadline(self, pf: Prefetch) -> bool:
        """An admit's wait for `pf` timed out: True when admits still wait (admit them now)."""
        if not pf.waiters or self.storage is None:
            return False
        self.storage.detach(pf)
        return True

    # -- helpers: insertion and release -------------------------------------------------
    def _insert(self, rec: RequestRecord, tokens: np.ndarray) -> None:
        n = aligned(len(tokens), self.page_size)
        if len(tokens) > len(rec.tokens):  # the record only grows (the caller checked they agree)
            rec.tokens = tokens
        copies = self.copies
        if n > rec.cached_len and copies.loading:
            n = copies.insert_cap(tokens, n, rec.extra_key)
        if n <= rec.cached_len:
            return
        # the walk starts at the request's locked cached prefix (its slots are the tree's)
        start = rec.last_node if rec.last_node is not None and rec.last_node.device is not None else None
        # a request's own leaf (no lock but its own and its backups', no load in flight) grows in place, unless
        # it holds a state snapshot: that is the state after the leaf's last token, not a later one
        states = self.residency.states
        # (with backups in flight only under write-through, where a backup of the growth follows them:
        # without one, their ack splits the node there, and its hit count makes the growth look hot)
        extend = 0
        if start is not None and (states is None or start not in states.node_state):
            extend = copies.growth_locks(start) if self._write_through_all else int(not copies.busy(start))
        # (own pages whose sliding KV dropped must start a node: dropped pages are a node's prefix)
        sliding = self.residency.sliding
        if extend and sliding is not None and not sliding.present_at(int(rec.slot_view(rec.cached_len, n)[0])):
            extend = 0
        res = self.residency.insert(tokens[:n], rec.extra_key, rec.slot_view(0, n), rec.owner, start, extend, True, rec.rid,
                                    rec.priority)
        if extend > 1 and res.adopted and res.adopted[-1][0] is start:  # it grew with its backups in flight
            copies.grew(start, len(res.adopted[-1][1]))
        duplicates = res.duplicate_slots
        if len(duplicates):
            # the slot contract: a live request's slots never change under its caller, so its
            # duplicates of tree pages stay its own (and hold its KV) until it is released
            if len(rec.dups):
                duplicates = duplicates[~np.isin(duplicates, rec.dups)]
            rec.dups = np.concatenate((rec.dups, duplicates))
        new_last = res.last_node  # the insert ends exactly at n (it splits where needed)
        self.residency.tree.relock(rec.last_node, new_last)
        rec.last_node = new_last
        rec.cached_len = n
        adopted = res.adopted
        if self.residency.states is not None:
            adopted = adopted + [(upper, upper.device) for upper in self._keep_snapshots(rec)]
        rec.committed_len = max(rec.committed_len, min(len(tokens), rec.seq_len))
        self._write_through(adopted)

    def _write_through(self, adopted: list[tuple[Node, np.ndarray]]) -> None:
        if self._write_through_all:
            for node, _ in adopted:
                self.copies.backup(node, growth=True)

    def _release(self, rec: RequestRecord) -> None:
        """The one release path (finish, abort, cancelled caller): unlock, free owned pages.
        A session turn's session keeps exactly its KV from before the turn. With decode offload
        the request is retired instead: its device slots are freed once its offloads land (seed 000)."""
        if self.offload is not None and rec.session is None:
            self._retire(rec, None)
            return
        device = self.residency.device
        own = rec.slot_range(rec.own_start, rec.num_slots)
        if rec.session is not None:
            self.sessions[rec.session].turn = None
        if len(own):
            device.free(own, rec.owner, trusted=True, rid=rec.rid)  # its own alloc'd pages
        if len(rec.dups):
            device.free(rec.dups, rec.owner, rid=rec.rid, reason="duplicate")
        if rec.last_node is not None:
            self.residency.tree.unlock(rec.last_node)
        if self.residency.states is not None:
            self.residency.states.release(rec.rid, rec.owner)
        for r in rec.readiness:
            self.copies.drop_user(r, rec.rid)
        self._unfile(rec)

    def _keep_snapshots(self, rec: RequestRecord) -> list[Node]:
        """The request's snapshots at positions its insert reached pass to the nodes ending there
        (a node is split at a snapshot's position when it spans it); returns the split-off upper
        halves (new nodes: the write-through backs them up too)."""
        states = self.residency.states
        assert states is not None
        tree = self.residency.tree
        node, end = rec.last_node, rec.cached_len
        uppers = []
        for position, slot in states.pending_upto(rec.rid, rec.cached_len):  # deepest first
            while end - node.num_tokens >= position:  # walk up to the node spanning the position
                end -= node.num_tokens
                node = node.parent
            if end > position:  # inside: the upper half of a split ends there
                node = tree.split(node, position - (end - node.num_tokens))
                uppers.append(node)
                end = position
            states.attach(node, slot, rec.owner)
        return uppers

    def _retire(self, rec: RequestRecord, final_len: int | None) -> None:
        self._unfile(rec, keep_reading=True)
        for r in rec.readiness:
            self.copies.drop_user(r, rec.rid)
        assert self.offload is not None
        self.offload.retire(rec, final_len)

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

    def _on_split(self, lower: Node, upper: Node) -> None:
        self.residency.on_split(lower, upper)
        self.copies.on_split(lower, upper)

    # -- helpers: device room ---------------------------------------------------------
    def _alloc_device(self, pages: int, owner: Owner, **ctx: Any) -> np.ndarray:
        short = pages - self.residency.device.num_free_pages()
        if short > 0:
            self.copies.write_back(self.residency.evict_device(short))
        return self.residency.alloc_device(pages, owner, **ctx)

    def _refusable_alloc(self, pages: int, owner: Owner, **ctx: Any) -> np.ndarray:
        """`_alloc_device` for a call that changed nothing a caller sees before it: too few pages
        (write-back evictions still copying) is a refusal; the ledger allocated nothing."""
        try:
            return self._alloc_device(pages, owner, **ctx)
        except CapacityError as exc:
            raise self.phase.refuse(exc)

    def _start_writeback(self, pages: int, look: MatchResult | None = None) -> None:
        """A capacity shortfall (`room_for` said no): start the write-backs that will free
        device pages at their acks, so that the caller's retry can succeed. Changes nothing a
        caller holds; only when the pages could be had at all. An admission's own cached prefix
        (`look`) is kept out of the eviction, as its admission will lock it. A change all the same:
        the caller's refusal after it goes through `phase.refuse`."""
        self.phase.change()
        res = self.residency
        free = res.device.num_free_pages()
        if res.host is None or pages > free + res.evictable_device_pages():
            return
        keep = look.last_device_node if look is not None and look.num_device_nodes else None
        if keep is not None:
            res.tree.lock(keep)
        try:
            self.copies.write_back(res.evict_device(pages - free))
        finally:
            if keep is not None:
                res.tree.unlock(keep)

    # -- helpers: validation -------------------------------------------------------------
    def _record(self, rid: Hashable) -> RequestRecord:
        rec = self.requests.get(rid)
        if rec is None:
            raise UnknownRequestError(f"unknown request {rid!r}")
        return rec

    def _session(self, sid: Hashable) -> SessionRecord:
        sess = self.sessions.get(sid)
        if sess is None:
            raise UnknownRequestError(f"unknown session {sid!r}")
        return sess

    def _check_tokens(self, tokens: Any) -> np.ndarray:
        return checked_tokens(tokens, self.config.device_slots)

    def _check_kv_tokens(self, rec: RequestRecord, tokens: Any) -> np.ndarray:
        return checked_kv_tokens(rec, self._check_tokens(tokens))

    def _trimmed(self, rec: RequestRecord, tokens: Any, finished_len: int | None) -> np.ndarray:
        """The tokens a finishing request keeps: prompt + `finished_len` (all when None)."""
        session_kv = self.sessions[rec.session].kv_len if rec.session is not None else 0
        return kept_tokens(rec, self._check_kv_tokens(rec, tokens), finished_len, session_kv)

    def _free_tail(self, rec: RequestRecord, keep: int) -> None:
        """Free the request's own pages past `keep` tokens. The start is aligned up to the next
        page boundary: a page that still holds kept tokens is never freed."""
        start = max(rec.own_start, -(-keep // self.page_size) * self.page_size)
        if start < rec.num_slots:
            self.residency.device.free(rec.slot_range(start, rec.num_slots), rec.owner, rid=rec.rid, reason="trim")
            rec.truncate_slots(start)

    def _unfile(self, rec: RequestRecord, keep_reading: bool = False) -> None:
        """The request leaves the table: released or its turn ended, or retired (`keep_reading`:
        the offloads still read its slots from a private copy of its row)."""
        code = self.table.detach(rec) if keep_reading else self.table.remove(rec)
        if code:
            self.residency.device.unhold(rec.owner)


def _is_live(table: RequestTable, rid: Hashable) -> bool:
    try:
        return table.row_of(rid) is not None
    except TypeError:
        return False

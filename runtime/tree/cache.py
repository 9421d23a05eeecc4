"""CacheCore: the tree actor's synchronous core, and its one façade.

It checks every call, marks its phase and owns the request table (live requests' records); the
parts own the rest, each written only by itself (calls go one way: down): Admission (the look,
the room, what an admission takes), RequestKV (insert, release, retire), Sessions (streaming
sessions), StorageTier / DecodeOffload / CopyTracker (tiers/; a tier that is off is a null
object, tiers/off.py), and under them Residency (the tree, the ledgers, the pool groups).

No event loop, no streams: the tree actor turns messages into calls on it and sends what it
issued (`take_effects`): transfer plans, storage calls, notes for the offload actor.

Ownership rules it keeps (checked by `runtime.invariants`):
- a request's slots are `slots[:cached_len]` (held by tree nodes, locked through
  `last_node`) followed by pages it owns itself; every slot `admit`/`extend` gave a live
  request stays its own until it is released (the slot contract);
- a request's token record only grows, and every call's tokens must extend it (seed 003);
- KV enters the tree only once the loads it rests on are done (`RequestKV.check_loaded`).

Token arrays passed in are kept, not copied: the tree actor's messages own theirs (the
façade copies what the caller gives it), and a direct caller must not change an array
after passing it. (Tree keys are bytes encoded at insert time either way.)
"""

from __future__ import annotations

import itertools
from itertools import repeat
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
from runtime.tree.tiers.copies import CopyTracker
from runtime.tree.tiers.decode_offload import DecodeOffload
from runtime.tree.readiness import LoadReadiness, ManualReadiness, ReadinessFactory
from runtime.tree.records import Prefetch, PrefetchWait, RequestRecord, SessionRecord, StoredPages
from runtime.tree.request_table import RequestTable
from runtime.tree.residency import Residency
from runtime.tree.request_kv import RequestKV
from runtime.tree.sessions import Sessions
from runtime.tree.admission import Admission
from runtime.tree.groups.recurrent import RecurrentStates
from runtime.tree.groups.sliding import SlidingWindow
from runtime.tree.tiers.storage import COUNTERS as STORAGE_COUNTERS
from runtime.tree.tiers.decode_offload import COUNTERS as OFFLOAD_COUNTERS
from runtime.tree.tiers.off import NoOffload, NoStorage
from runtime.tree.tiers.storage import StorageRequest, StorageTier
from runtime.tree.token_checks import checked_kv_tokens, checked_tokens, kept_tokens


# every group kind's counter and size names: reported whichever groups the model has
GROUP_COUNTERS = (*RecurrentStates.COUNTERS, *SlidingWindow.COUNTERS)
GROUP_COUNTS = (*RecurrentStates.COUNTS, *SlidingWindow.COUNTS)


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
        # each public call checks its input, then marks `phase.change()` before its first change:
        # a ValidationError after the mark fails the runtime (the tree actor's loop reads it)
        self.phase = Phase()
        self.table = RequestTable(config.page_size)
        self.requests: dict[Hashable, RequestRecord] = self.table.records  # read-only here: rows change in the table
        self.residency = Residency.from_config(config, tracer, self.requests)
        op_ids = itertools.count(1)  # one id space: ledger pins are keyed by op id
        self.copies = CopyTracker(self.residency, op_ids, config.num_layers, readiness_factory)
        self.offload: DecodeOffload | NoOffload = DecodeOffload(self.residency, op_ids) if config.decode_offload \
            else NoOffload(OFFLOAD_COUNTERS)
        self.storage: StorageTier | NoStorage = NoStorage()  # enable_storage()
        # the storage tier's counters: kept here, since detach/attach replaces the tier (they only grow)
        self._storage_stats: dict[str, int] = dict.fromkeys(STORAGE_COUNTERS, 0)
        self._op_ids = op_ids
        self._sessions = Sessions(self.residency, self.copies)
        self._generations = itertools.count(1)  # one counter: (rid, generation) is never reused
        self._stats: dict[str, int] = {"requests_finished": 0, "requests_aborted": 0}
        self._kv = RequestKV(config, self.residency, self.copies, self.table, self.offload, self._sessions)
        self.admission = Admission(config, self.residency, self.copies, self.table, self.phase, self._generations)

    @property
    def sessions(self) -> dict[Hashable, SessionRecord]:
        """The open sessions' records (read-only here: `Sessions` writes them)."""
        return self._sessions.records

    @property
    def page_size(self) -> int:
        return self.config.page_size

    def enable_events(self) -> None:
        """Record KV cache events of every tier change (`take_events` hands them over)."""
        identity = KVIdentity.from_config(self.config)
        self.residency.enable_events(KVEventRecorder(self.page_size, identity, self.residency.use_hasher(identity)))

    def take_events(self) -> list[Any]:
        """The KV event records made since the last call (none while events are off; the wire
        events are `runtime.events.recorder.materialize` of them)."""
        events = self.residency.events
        return events.take() if events.pending else []

    def enable_storage(self, kept: StoredPages | None = None, read_only: bool = False) -> None:
        """A storage tier behind the host tier; `kept`: what this runtime knew of the backend's pages
        when it detached the same backend; `read_only`: the backend stores nothing (no write starts)."""
        if not self.residency.has_host:
            raise StateError("a storage tier needs the host tier")
        self.storage = StorageTier(self.config, self.residency, self._op_ids, KVIdentity.from_config(self.config),
                                   self._storage_stats, writes=not read_only)
        if kept is not None:
            self.storage.restore(kept)

    def disable_storage(self) -> StoredPages:
        """`detach_storage`, once no storage op is in flight: the tier goes, and with it the records
        of rids prepared but not admitted (a later abort of one is an unknown rid). Returns the page
        hashes it knew stored or in doubt (kept by the caller with that backend, for a re-attach)."""
        kept = self.storage.kept()
        self.storage = NoStorage()
        return kept

    def storage_attached(self) -> bool:
        return self.storage.attached

    def pause_storage(self, paused: bool) -> int:
        """A storage control (clear, detach) drains the storage ops (`paused`: none starts); returns
        how many are still in flight."""
        self.storage.pause(paused)
        return len(self.storage.ops)

    def forget_storage(self) -> list[bytes]:
        """`clear_storage`, once no storage op is in flight: forget every page hash known stored and
        return them (the pages to remove; KV events report each one removed from STORAGE)."""
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
            return self._admit_turn(rid, tokens, self._sessions.get(session))
        look, done = self.admission.run(rid, tokens, extra_key, priority)
        # a prefetch still running goes on without it (a lookup that landed while this admit
        # waited marked it prepared)
        storage = self.storage
        from_storage = storage.admitted(rid, look.host_len) if (
            rid in storage.prefetches or rid in storage.prefetched or rid in storage.prefetch_landed) else 0
        return AdmitResult(rid, done.rec.generation, torch.from_numpy(done.slots[: len(tokens)]), done.device_hit,
                           look.host_len, done.readiness, from_storage, **done.granted)

    def admit_or_wait(self, rid: Hashable, tokens: np.ndarray, extra_key: Hashable = None,
                      session: Hashable = None, waiter: Any = None, priority: int = 0) -> AdmitResult | PrefetchWait:
        """The tree actor's one admit entry: `admit`, or, with a storage tier whose policy waits for
        the request's prefetch, the prefetch `waiter` (an opaque token of the caller's) now waits
        on: the caller admits it again, with no waiter, when the prefetch ends (`apply_storage_ack`,
        `storage_overdue`, `prefetch_deadline`). `waiter` None never waits (a batch item, or an
        admit whose prefetch ended). `tokens` were checked by the sender (the façade's
        `runtime.validation.tokens`: a new 1-D int32 array, non-empty, no longer than the pool). An
        admit that does not wait detaches the rid's prefetch only once admitted: a refusal leaves
        it prepared (a later abort cancels it)."""
        if waiter is not None and self.storage.may_wait and session is None and rid not in self.requests:
            wait = self.storage.wait_for(rid, tokens, extra_key, waiter)
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
            pages = -(-missing // self.config.page_size)
            if not self.residency.room_for(pages):
                self.admission.start_writeback(pages)
                raise self.phase.refuse(CapacityError(f"extend of {rid!r} needs {pages} device pages"))
            self.phase.change()
            rec.append_slots(self.admission.alloc_or_refuse(pages, rec.owner, rid=rid))
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
                    self.admission.start_writeback(k)
                    raise self.phase.refuse(CapacityError(f"decode step needs {k} device pages"))
                self.phase.change()
                self.copies.write_back(res.evict_device(k - free))
            self.phase.change()
            codes = table.hold_codes(starting, lambda rec: res.hold(rec.owner))
            try:
                pages = res.alloc_held(codes, reason="decode")
            except CapacityError as exc:  # write-backs still copying: nothing a caller holds changed
                raise self.phase.refuse(exc)
            table.append_page_each(starting, pages)
        self.phase.change()
        out = table.advance(rows, seq)
        self.offload.note_commits(map(self.requests.__getitem__, rids))
        return torch.from_numpy(out)

    def commit(self, rid: Hashable, committed_len: int) -> int:
        rec = self._record(rid)
        if not isinstance(committed_len, int) or committed_len < rec.committed_len or committed_len > rec.seq_len:
            raise LengthError(
                f"commit of {rid!r} must lie in [{rec.committed_len}, {rec.seq_len}], got {committed_len!r}")
        self.phase.change()
        rec.committed_len = committed_len
        self.offload.note_commits((rec,))
        return committed_len

    def snapshot(self, rid: Hashable, position: int) -> int:
        """A device state slot for the recurrent state of `rid` after its first `position` tokens
        (page-aligned, past its cached prefix, within its slots). The engine copies the state there
        when it has computed exactly `position` tokens; the slot is the request's until an insert
        reaches `position` (it then stays with the tree node ending there) or the request ends."""
        try:
            states = self.residency.group(RecurrentStates)
        except StateError:
            raise StateError("snapshot needs recurrent state (state_layers > 0)") from None
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
        self._kv.note_failed_load(rec)
        if rec.failed is not None:
            raise TransferError(f"request {rid!r} lost its cached prefix ({rec.failed}); abort it")
        tokens = self._check_kv_tokens(rec, tokens)
        self._kv.check_loaded(rec)
        self.phase.change()
        self._kv.insert(rec, tokens)
        return rec.cached_len

    def finish(self, rid: Hashable, tokens: np.ndarray, finished_len: int | None = None) -> int:
        """Keep exactly prompt + `finished_len` tokens (speculative overshoot trimmed, seed 003),
        insert their page-aligned part (or hand them to the session), unlock, free the rest.
        With decode offload nothing goes to the tree on device: the request is retired until
        its offloads land."""
        rec = self._record(rid)
        self._kv.note_failed_load(rec)
        if rec.failed is not None:
            self.phase.change()  # (a TransferError is the call's outcome, not a refusal)
            self._kv.release(rec)
            self._stats["requests_aborted"] += 1
            raise TransferError(f"request {rid!r} lost its cached prefix ({rec.failed}); it was released")
        tokens = self._trimmed(rec, tokens, finished_len)
        self._kv.check_loaded(rec)
        self.phase.change()
        self._stats["requests_finished"] += 1
        if rec.session is not None:
            self._kv.free_tail(rec, len(tokens))
            self._sessions.end_turn(rec, tokens)
            self._kv.unfile(rec)
            return len(tokens)
        if self.offload.retires and rec.session is None:
            rec.grow(tokens)
            self._kv.retire(rec, len(tokens))
            return rec.cached_len
        self._kv.insert(rec, tokens)
        cached = rec.cached_len
        self._kv.release(rec)
        return cached

    def abort(self, rid: Hashable) -> list[Any]:
        """Release a live request, or cancel a prepared rid's prefetch. Returns the waiters of the
        cancelled prefetch (admits waiting for it: they fail)."""
        waiters: list[Any] = []
        storage = self.storage
        if rid not in self.requests and rid not in storage.prefetches and rid not in storage.prefetched:
            raise UnknownRequestError(f"unknown request {rid!r}")
        self.phase.change()
        pf = storage.cancel(rid)
        if pf is not None:
            waiters = pf.take_waiters()
        if (pf is not None or storage.forget(rid)) and rid not in self.requests:
            return waiters  # only a prefetch (prepare without admit): cancelled (slots freed at its ack) or landed
        rec = self._record(rid)
        self._kv.release(rec)
        self._stats["requests_aborted"] += 1
        return waiters

    def rewind(self, rid: Hashable, new_len: int) -> int:
        """Forget the request's tokens past `new_len` (a retraction): frees whole pages past it."""
        rec = self._record(rid)
        floor = max(rec.cached_len, self._sessions.kv_len(rec))
        if not isinstance(new_len, int) or not floor <= new_len <= rec.seq_len:
            raise LengthError(f"rewind of {rid!r} must lie in [{floor}, {rec.seq_len}], got {new_len!r}")
        for g in self.residency.hooked.check_rewind:
            g.check_rewind(rec, new_len)
        self.offload.check_rewind(rec, new_len)
        self.phase.change()
        self._kv.free_tail(rec, new_len)
        for g in self.residency.hooked.rewind:
            g.rewind(rec, new_len)
        rec.rewound(new_len)
        return new_len

    def abort_if_live(self, rid: Hashable, generation: int) -> None:
        """The cancelled-caller path: release the request only if it is the same admission."""
        rec = self.requests.get(rid)
        if rec is not None and rec.generation == generation:
            self.phase.change()
            self._kv.release(rec)
            self._stats["requests_aborted"] += 1

    # -- streaming sessions (`Sessions`) -------------------------------------------------------
    def open_session(self, sid: Hashable, extra_key: Hashable = None) -> None:
        self._sessions.check_open(sid)
        self.phase.change()
        self._sessions.open(sid, extra_key)

    def close_session(self, sid: Hashable, insert: bool = False) -> int:
        """Free what the session holds; with `insert`, its page-aligned KV goes into the tree first."""
        sess = self._sessions.check_close(sid)
        self.phase.change()
        keep, adopted = self._sessions.close(sess, insert)
        self._kv.write_through(adopted)
        return keep

    def _admit_turn(self, rid: Hashable, tokens: np.ndarray, sess: SessionRecord) -> AdmitResult:
        """A turn appends to the session's KV without matching the tree."""
        pages = self._sessions.check_turn(sess, rid, tokens)
        if not self.residency.room_for(pages):
            raise CapacityError(f"turn {rid!r} needs {pages} device pages")
        self.phase.change()
        owner = Owner.request(rid, next(self._generations))
        slots = np.concatenate((sess.slots, self.admission.alloc_or_refuse(pages, owner, rid=rid)))
        kv = sess.kv_len
        self.table.add(RequestRecord(
            rid=rid, generation=owner.generation, owner=owner, extra_key=sess.extra_key, tokens=tokens,
            cached_len=0, last_node=None, prompt_len=len(tokens), session=sess.sid, session_len=len(sess.slots)),
            slots, len(tokens), kv)
        self._sessions.begin_turn(sess, rid)
        self.admission.count(kv, 0, len(tokens) - kv)
        return AdmitResult(rid, owner.generation, torch.from_numpy(slots[: len(tokens)].copy()), kv, 0, ())

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
        if res.has_host:
            out["host_free"] = res.host.num_free_slots()
            out["host_evictable"] = res.evictable_host_tokens()
        return out

    def can_admit(self, tokens: np.ndarray, extra_key: Hashable = None) -> bool:
        """The answer `admit` would give now. A no starts the write-backs that would make room (as
        `admit` does; a scheduler that polls `can_admit` must see the room come): that changes
        no request's state, only which cached pages are being copied to host."""
        res = self.residency
        look, host_len, need = res.admission(self._check_tokens(tokens), extra_key)
        for g in res.hooked.admission_room:
            if not g.admission_room(look, host_len):
                return False  # (no write-back makes state slots free)
        if res.room_for(need, look):
            return True
        self.admission.start_writeback(need, look)
        return False

    @property
    def stats(self) -> dict[str, int]:
        """Counters of the core and its parts, the same names whatever is enabled (a fresh dict; a
        counter two parts keep is summed)."""
        out = dict(self._stats)
        parts = [self.admission.stats, self.residency.stats, self.copies.stats]
        parts.append(self.offload.stats)
        parts.append(self._storage_stats)
        parts.append(dict.fromkeys(GROUP_COUNTERS, 0))  # every group kind's, whichever the model has
        parts.extend(g.stats for g in self.residency.groups)
        for part in parts:
            for name, value in part.items():
                out[name] = out.get(name, 0) + value
        return out

    def counts(self) -> dict[str, int]:
        """Sizes of the live state (TreeStats)."""
        res = self.residency
        out = {
            "live_requests": len(self.requests),
            "inflight_copies": len(self.copies.ops) + len(self.offload.ops),
            "inflight_storage_ops": len(self.storage.ops),
            "tree_nodes": res.tree.num_nodes,
            "device_free_slots": res.device.num_free_slots(),
            "host_free_slots": res.host.num_free_slots(),
            **dict.fromkeys(GROUP_COUNTS, 0),
        }
        for g in res.groups:
            out.update(g.counts())
        out.update(self.offload.counts())
        return out

    def in_flight(self) -> int:
        """Copies (device <-> host, decode offload) and storage ops not acked yet."""
        return len(self.copies.ops) + len(self.offload.ops) + len(self.storage.ops)

    def quiet(self) -> bool:
        """No copy in flight, and no storage op but those past their deadline (their calls may
        never return)."""
        if self.copies.ops or self.offload.ops:
            return False
        return self.storage.all_overdue()

    # -- acks and effects ----------------------------------------------------------------
    def apply_ack(self, op_id: int, error: str | None) -> None:
        if op_id in self.offload.ops:
            self.offload.apply_ack(op_id, error)
            return
        if op_id not in self.copies.ops:
            raise InternalError(f"ack of copy {op_id}, which is not in flight")
        for out in self.copies.apply_ack(op_id, error):  # (a batch of backups: each of them)
            if out.failed is not None:
                for rid, generation in out.failed_users:  # (live, or retired by decode offload)
                    rec = self.requests.get(rid)
                    if rec is None or rec.generation != generation:
                        rec = self.offload.retired_record(rid, generation)
                    if rec is not None:
                        rec.fail(out.failed)
            if out.backed_up:
                self.storage.write(out.op.node, out.op.length, out.op.host)

    def take_effects(self) -> Effects:
        copies = self.copies.take_plans()
        copies.extend(zip(self.offload.take_plans(), repeat(None)))
        return Effects(copies, self.storage.take_requests(), self.offload.take_notes())

    def flush(self) -> int:
        """Drop every unlocked cached prefix from device and host; returns tokens dropped."""
        self.phase.change()
        return self.residency.flush()

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill the model ran (the load-cost model's sample; checked by the façade)."""
        self.phase.change()
        self.residency.reuse.observe_prefill(tokens, seconds)

    # -- decode offload (the offload actor's calls) ----------------------------------------
    def offload_start(self, rid: Hashable, generation: int, start: int, end: int) -> OffloadStarted | None:
        return self.offload.start(rid, generation, start, end, self.requests.get(rid))

    def offload_release(self, rid: Hashable, generation: int) -> bool:
        """Release a retired request once (False: nothing to release; see DecodeOffload.release)."""
        taken = self.offload.release(rid, generation, self.copies.backup_pending)
        if taken is False:
            return False
        if taken:
            self.storage.write_chain(*taken)  # offloaded pages live on as host and storage copies
        return True

    # -- storage tier (the tree actor's calls) -----------------------------------------------
    def prepare(self, rid: Hashable, tokens: Any, extra_key: Hashable = None) -> int:
        """Start looking up in storage the pages of `tokens` beyond the device + host hit. Returns
        the tokens looked up (0: nothing started; bad tokens are left for `admit` to refuse)."""
        if rid in self.requests or not self.storage.attached:
            return 0
        try:
            tokens = self._check_tokens(tokens)
        except LengthError:
            return 0
        self.phase.change()
        return self.storage.prepare(rid, tokens, extra_key)

    def apply_storage_ack(self, op_id: int, pages: int, error: str | None, ok: tuple[bool, ...] = (),
                          states_ok: tuple[bool, ...] = (), skipped: bool = False) -> Prefetch | None:
        """A storage op finished; returns the prefetch that ended here (admit its waiters)."""
        if op_id not in self.storage.ops:
            raise InternalError(f"ack of storage op {op_id}, which is not in flight")
        return self.storage.apply_ack(op_id, pages, error, ok, self.copies.backup_pending, states_ok, skipped)

    def storage_down(self, down: bool) -> None:
        """The backend is down (start no storage op) or back."""
        self.storage.mark_down(down)

    def storage_overdue(self, op_id: int) -> Prefetch | None:
        """A storage call ran past its deadline; returns the prefetch whose waiters go on now."""
        return self.storage.mark_overdue(op_id)

    def prefetch_deadline(self, pf: Prefetch) -> bool:
        """An admit's wait for `pf` timed out: True when admits still wait (admit them now)."""
        if not pf.waiters:
            return False
        self.storage.detach(pf)
        return True

    # -- helpers: insertion and release -------------------------------------------------
    # -- helpers: validation -------------------------------------------------------------
    def _record(self, rid: Hashable) -> RequestRecord:
        rec = self.requests.get(rid)
        if rec is None:
            raise UnknownRequestError(f"unknown request {rid!r}")
        return rec

    def _check_tokens(self, tokens: Any) -> np.ndarray:
        return checked_tokens(tokens, self.config.device_slots)

    def _check_kv_tokens(self, rec: RequestRecord, tokens: Any) -> np.ndarray:
        return checked_kv_tokens(rec, self._check_tokens(tokens))

    def _trimmed(self, rec: RequestRecord, tokens: Any, finished_len: int | None) -> np.ndarray:
        """The tokens a finishing request keeps: prompt + `finished_len` (all when None)."""
        return kept_tokens(rec, self._check_kv_tokens(rec, tokens), finished_len, self._sessions.kv_len(rec))


def _is_live(table: RequestTable, rid: Hashable) -> bool:
    try:
        return table.row_of(rid) is not None
    except TypeError:
        return False

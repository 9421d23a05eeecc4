"""TreeActor: the single writer of the radix tree, the slot ledgers and the request records.

Its state is a `CacheCore` (synchronous: tree, ledgers, request records, storage tier) and the
storage controls' queue (attach, detach, clear, one at a time). Most handlers are one call on
the core, which marks the actor's `Phase` when its checks passed (errors by origin:
`runtime.actors.base`). After every message the transfer plans the core issued are sent to the
transfer actor (an internal send: never blocks), and with `debug_invariants` the invariant
checker runs over the whole state and fails the runtime on a violation.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from typing import Any

from runtime.actors.base import DEFERRED, Actor, Mailbox, Reply
from runtime.invariants import check_invariants
from runtime.messages import (
    Abort,
    Admit,
    AdmitResult,
    ControlAction,
    StorageControl,
    RemoveStoragePages,
    SetStorageBackend,
    StorageCleared,
    PrefetchDeadline,
    SubmitCopy,
    SubmitStorage,
    Cache,
    CloseSession,
    Commit,
    DecodeStep,
    Extend,
    Finish,
    Flush,
    ObservePrefill,
    OpenSession,
    Query,
    DrainTree,
    ReleaseAbandoned,
    Prepare,
    Rewind,
    Snapshot,
    StorageAck,
    StorageHealthChanged,
    StorageOverdue,
    TransferAck,
    TransferMessage,
    TreeMessage,
    TreeStats,
)
from runtime.messages import OffloadMessage, OffloadStarted, ReleaseOffloaded, StartOffload  # decode offload
from runtime.errors import CallerError, InternalError, RuntimeClosed, StateError
from runtime.events.hub import EventHub
from runtime.storage.backend import can_remove
from runtime.tree.cache import CacheCore
from runtime.tree.records import PrefetchWait, StoredPages


class TreeActor(Actor[TreeMessage]):
    name = "tree"

    # -- state -------------------------------------------------------------------
    def __init__(self, core: CacheCore, transfer_mailbox: Mailbox[TransferMessage], *, mailbox_capacity: int,
                 debug_invariants: bool = False, offload_mailbox: Mailbox[OffloadMessage] | None = None,
                 mailbox: Mailbox[TreeMessage] | None = None, storage: Any = None,
                 events: EventHub | None = None) -> None:
        super().__init__(mailbox_capacity, mailbox, core.phase)
        self.core = core
        self.events = events  # KV cache events: one batch per turn that recorded any
        self.transfer_mailbox = transfer_mailbox
        self.debug_invariants = debug_invariants
        self.quiesce_waiters: list[Reply[None]] = []
        self.offload_mailbox = offload_mailbox  # decode offload: where OffloadCommit/Finish/Ack go
        # storage controls (attach, detach, clear), one at a time in arrival order; the head may wait
        # for the storage ops to drain, or (a clear) for its removal
        self.controls: deque[StorageControl] = deque()
        self.backend = storage  # the storage backend attached (a key only: the transfer actor calls it)
        # page hashes known stored in backends detached earlier: a re-attach (of the same object)
        # gets them back, so that its clear removes the pages written before the detach too
        self.detached_known: weakref.WeakKeyDictionary[Any, StoredPages] = weakref.WeakKeyDictionary()
        self._removing = False  # the head control is a clear whose removal runs
        self.handlers = {
            Admit: self.on_admit,
            Extend: self.on_extend,
            DecodeStep: self.on_decode_step,
            Commit: self.on_commit,
            Cache: self.on_cache,
            Finish: self.on_finish,
            Abort: self.on_abort,
            Rewind: self.on_rewind,
            Snapshot: self.on_snapshot,
            OpenSession: self.on_open_session,
            CloseSession: self.on_close_session,
            ReleaseAbandoned: self.on_release_abandoned,
            Query: self.on_query,
            Flush: self.on_flush,
            ObservePrefill: self.on_observe_prefill,
            TreeStats: self.on_stats,
            DrainTree: self.on_quiesce,
            TransferAck: self.on_transfer_ack,
        }
        self.handlers.update({StartOffload: self.on_start_offload, ReleaseOffloaded: self.on_release_offloaded})
        self.handlers.update({Prepare: self.on_prepare, StorageAck: self.on_storage_ack,
                              StorageOverdue: self.on_storage_overdue, PrefetchDeadline: self.on_prefetch_timeout,
                              StorageHealthChanged: self.on_storage_health})
        self.handlers.update({StorageControl: self.on_storage_control, StorageCleared: self.on_storage_cleared})

    # -- handlers ----------------------------------------------------------------
    def on_admit(self, msg: Admit) -> Any:
        # with a storage tier, an admit may wait for its request's prefetch (a batch item never waits)
        out = self.core.admit_or_wait(msg.rid, msg.tokens, msg.extra_key, msg.session,
                                      msg if msg.reply is not None else None, msg.priority)
        if isinstance(out, PrefetchWait):
            if out.timeout_s is not None:
                asyncio.get_running_loop().call_later(out.timeout_s, self._post_timeout, out.prefetch)
            return DEFERRED
        return out

    def on_extend(self, msg: Extend) -> Any:
        return self.core.extend(msg.rid, msg.num_tokens)

    def on_decode_step(self, msg: DecodeStep) -> Any:
        return self.core.decode_step(msg.rids)

    def on_commit(self, msg: Commit) -> int:
        return self.core.commit(msg.rid, msg.committed_len)

    def on_cache(self, msg: Cache) -> int:
        return self.core.cache(msg.rid, msg.tokens)

    def on_finish(self, msg: Finish) -> int:
        return self.core.finish(msg.rid, msg.tokens, msg.finished_len)

    def on_abort(self, msg: Abort) -> None:
        for w in self.core.abort(msg.rid):  # admits that waited for its prefetch
            w.reply.set_exception(StateError(f"request {msg.rid!r} was aborted while its prefetch ran"))

    def on_rewind(self, msg: Rewind) -> int:
        return self.core.rewind(msg.rid, msg.new_len)

    def on_snapshot(self, msg: Snapshot) -> int:
        return self.core.snapshot(msg.rid, msg.position)

    def on_open_session(self, msg: OpenSession) -> None:
        self.core.open_session(msg.sid, msg.extra_key)

    def on_close_session(self, msg: CloseSession) -> int:
        return self.core.close_session(msg.sid, msg.insert)

    def on_release_abandoned(self, msg: ReleaseAbandoned) -> None:
        self.core.abort_if_live(msg.rid, msg.generation)

    def on_query(self, msg: Query) -> Any:
        return msg.fn(self.core)

    def on_flush(self, msg: Flush) -> int:
        return self.core.flush()

    def on_observe_prefill(self, msg: ObservePrefill) -> None:
        self.core.observe_prefill(msg.tokens, msg.seconds)

    def on_stats(self, msg: TreeStats) -> dict[str, Any]:
        hub = self.events
        events = {"kv_events_recorded": 0, "kv_event_batches": 0, "kv_event_batches_dropped": 0} if hub is None else {
            "kv_events_recorded": hub.events_published, "kv_event_batches": hub.next_seq,
            "kv_event_batches_dropped": hub.publisher.dropped if hub.publisher is not None else 0}
        return {**self.core.stats, **self.core.counts(), "tree_mailbox_depth": self.mailbox.depth, **events}

    def on_quiesce(self, msg: DrainTree) -> Any:
        if self.core.quiet():
            return None
        if msg.reply is not None:
            self.quiesce_waiters.append(msg.reply)
        return DEFERRED

    def on_transfer_ack(self, msg: TransferAck) -> None:
        self.core.apply_ack(msg.op_id, msg.error)
        if self.quiesce_waiters:
            self._maybe_quiesced()

    def _maybe_quiesced(self) -> None:
        if self.quiesce_waiters and self.core.quiet():
            for reply in self.quiesce_waiters:
                reply.set_result(None)
            self.quiesce_waiters.clear()

    # -- helpers -----------------------------------------------------------------
    def after_message(self, msg: Any) -> None:
        copies, stores, notes = self.core.take_effects()
        for plan, readiness in copies:
            self.transfer_mailbox.put_internal(SubmitCopy(plan, self.mailbox, readiness))
        for op_id, write, keys, pages, rank_keys, states in stores:
            self.transfer_mailbox.put_internal(SubmitStorage(op_id, write, keys, pages, self.mailbox, states,
                                                             rank_keys=rank_keys))
        if notes:
            mailbox = self.offload_mailbox
            if mailbox is not None and not mailbox.closed:
                for note in notes:
                    mailbox.put_internal(note)
        if self.events is not None:
            events = self.core.take_events()
            if events:
                self.events.publish(events)
        if self.debug_invariants:
            check_invariants(self.core)

    # -- decode offload ------------------------------------------------------------
    # Messages from the offload actor are internal: a caller error there is a bug of
    # the runtime, never a caller's mistake, so it fails the runtime instead of vanishing.
    def on_start_offload(self, msg: StartOffload) -> OffloadStarted | None:
        try:
            return self.core.offload_start(msg.rid, msg.generation, msg.start, msg.end)
        except CallerError as exc:
            raise InternalError(f"offload start refused: {exc}") from exc

    def on_release_offloaded(self, msg: ReleaseOffloaded) -> None:
        try:
            self.core.offload_release(msg.rid, msg.generation)
        except CallerError as exc:
            raise InternalError(f"offload release failed: {exc}") from exc

    # -- storage tier ----------------------------------------------------------------
    def on_prepare(self, msg: Prepare) -> int:
        return self.core.prepare(msg.rid, msg.tokens, msg.extra_key)

    def on_storage_ack(self, msg: StorageAck) -> None:
        pf = self.core.apply_storage_ack(msg.op_id, msg.pages, msg.error, msg.ok, msg.states_ok, msg.skipped)
        if pf is not None:
            self._release_waiters(pf)
        if self.controls:
            self._advance_controls()
        if self.quiesce_waiters:
            self._maybe_quiesced()

    def on_storage_overdue(self, msg: StorageOverdue) -> None:
        """A storage call ran past its deadline: a prefetch's waiting admits go on without it (it
        still lands into the tree if its call ever returns); DrainTree stops waiting for the op."""
        pf = self.core.storage_overdue(msg.op_id)
        if pf is not None:
            self._release_waiters(pf)
        self._maybe_quiesced()

    def on_storage_health(self, msg: StorageHealthChanged) -> None:
        self.core.storage_down(msg.down)

    def on_prefetch_timeout(self, msg: PrefetchDeadline) -> None:
        if self.core.prefetch_deadline(msg.prefetch):
            self._release_waiters(msg.prefetch)

    def _post_timeout(self, pf: Any) -> None:
        if pf.waiters and not self.mailbox.closed:
            try:
                self.mailbox.put_internal(PrefetchDeadline(pf))
            except Exception:  # noqa: BLE001 - stopping: nobody waits any more
                pass

    def _release_waiters(self, pf: Any) -> None:
        """Admit the requests that waited on `pf` (landed, failed or timed out). A waiter whose
        caller was cancelled is dropped, not admitted: its retry may be waiting behind it."""
        waiters = pf.take_waiters()
        phase = self.phase
        for w in waiters:
            if w.reply.future.done():
                continue
            phase.begin()  # each admit is checked on its own, as if it were the message
            try:
                # the one admit entry, waiting no more (the prefetch ended)
                result = self.core.admit_or_wait(w.rid, w.tokens, w.extra_key, w.session, None, w.priority)
            except CallerError as exc:
                if phase.internal(exc):
                    raise
                w.reply.set_exception(exc)
            else:
                w.reply.set_result(result)

    # -- storage controls --------------------------------------------------------------
    # Clear and detach pause the tier (no storage op starts: backups landing meanwhile are not
    # written through, prepares fetch nothing) and wait until every storage op in flight, overdue
    # ones included, is acked: writes land or fail, prefetches end, their pins and host pages are
    # released by the same acks as always. Only then does the tier change.
    def on_storage_control(self, msg: StorageControl) -> Any:
        self.controls.append(msg)
        if len(self.controls) == 1:
            self._advance_controls()
        return DEFERRED

    def on_storage_cleared(self, msg: StorageCleared) -> None:
        self._removing = False
        self.controls.popleft()
        self.core.pause_storage(False)
        if msg.error is not None:
            msg.caller.set_exception(msg.error)
        else:
            msg.caller.set_result(msg.removed)
        self._advance_controls()

    def _advance_controls(self) -> None:
        """Run the queued storage controls that can run now, in order; the head may wait."""
        controls = self.controls
        while controls and not self._removing:
            msg = controls[0]
            core = self.core
            reply = msg.reply
            assert reply is not None
            if msg.action is ControlAction.ATTACH:
                controls.popleft()
                if core.storage_attached():
                    reply.set_exception(StateError("a storage tier is attached already: detach it first"))
                    continue
                self.core.enable_storage(self._take_known(msg.backend),
                                        read_only=getattr(msg.backend, "read_only", False) is True)
                self.backend = msg.backend
                # before any storage op the tier issues from now on (the transfer mailbox is FIFO)
                self._to_transfer(SetStorageBackend(msg.backend, reply), reply)
                continue
            if not core.storage_attached():
                controls.popleft()
                reply.set_exception(StateError("no storage tier is attached"))
                continue
            if msg.action is ControlAction.CLEAR and not can_remove(self.backend):
                controls.popleft()
                reply.set_exception(StateError("the storage backend cannot remove pages (it has no remove(keys))"))
                continue
            if core.pause_storage(True):
                return  # on_storage_ack comes back here as the ops drain
            if msg.action is ControlAction.DETACH:
                controls.popleft()
                kept = self.core.disable_storage()
                try:
                    self.detached_known[self.backend] = kept
                except TypeError:  # not weak-referenceable: forgotten (a re-attach rewrites, clears less)
                    pass
                self.backend = None
                self._to_transfer(SetStorageBackend(None, reply), reply)
                continue
            keys = self.core.forget_storage()  # (the core reports them removed from STORAGE)
            self._removing = True  # the head until its removal is acked (on_storage_cleared)
            if not self._to_transfer(RemoveStoragePages(tuple(keys), self.mailbox, reply), reply):
                self._removing = False
                controls.popleft()

    def _take_known(self, backend: Any) -> StoredPages | None:
        try:
            return self.detached_known.pop(backend, None)
        except TypeError:
            return None

    def _to_transfer(self, msg: Any, reply: Any) -> bool:
        try:
            self.transfer_mailbox.put_internal(msg)
        except RuntimeClosed as exc:  # stopping: the control cannot finish
            reply.set_exception(exc)
            return False
        return True


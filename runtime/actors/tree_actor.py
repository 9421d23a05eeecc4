"""TreeActor: the single writer of the radix tree, the slot ledgers and the request records.

Its state is one `CacheCore` (synchronous). Each handler is one call on the core; after
every message the transfer plans the core issued are sent to the transfer actor (an
internal send: never blocks), and with `debug_invariants` the invariant checker runs over
the whole state and fails the runtime on a violation.
"""

from __future__ import annotations

import asyncio
from typing import Any

from runtime.actors.base import DEFERRED, Actor, Mailbox, Reply
from runtime.invariants import check_invariants
from runtime.messages import (
    Abort,
    Admit,
    AdmitResult,
    PrefetchDeadline,
    SubmitCopy,
    SubmitStorage,
    Available,
    Cache,
    CanAdmit,
    CloseSession,
    Commit,
    Extend,
    Finish,
    Flush,
    Inspect,
    MatchPrefix,
    OpenSession,
    DrainTree,
    ReleaseAbandoned,
    Prepare,
    Rewind,
    StorageAck,
    StorageOverdue,
    TransferAck,
    TransferMessage,
    TreeMessage,
    TreeStats,
)
from runtime.messages import OffloadMessage, OffloadStarted, ReleaseOffloaded, StartOffload  # decode offload
from runtime.errors import CallerError, StateError
from runtime.tree.cache import CacheCore


class TreeActor(Actor[TreeMessage]):
    name = "tree"

    # -- state -------------------------------------------------------------------
    def __init__(self, core: CacheCore, transfer_mailbox: Mailbox[TransferMessage], *, mailbox_capacity: int,
                 debug_invariants: bool = False, offload_mailbox: Mailbox[OffloadMessage] | None = None,
                 mailbox: Mailbox[TreeMessage] | None = None) -> None:
        super().__init__(mailbox_capacity, mailbox)
        self.core = core
        self.transfer_mailbox = transfer_mailbox
        self.debug_invariants = debug_invariants
        self.quiesce_waiters: list[Reply[None]] = []
        # storage ops past their deadline: still in flight (pages pinned) until their ack, but
        # nothing waits for them any more (admits, DrainTree)
        self.storage_overdue: set[int] = set()
        self.offload_mailbox = offload_mailbox  # decode offload: where OffloadCommit/Finish/Ack go
        self.handlers = {
            Admit: self.on_admit,
            Extend: self.on_extend,
            Commit: self.on_commit,
            Cache: self.on_cache,
            Finish: self.on_finish,
            Abort: self.on_abort,
            Rewind: self.on_rewind,
            OpenSession: self.on_open_session,
            CloseSession: self.on_close_session,
            ReleaseAbandoned: self.on_release_abandoned,
            MatchPrefix: self.on_match_prefix,
            CanAdmit: self.on_can_admit,
            Available: self.on_available,
            Flush: self.on_flush,
            TreeStats: self.on_stats,
            DrainTree: self.on_quiesce,
            Inspect: self.on_inspect,
            TransferAck: self.on_transfer_ack,
        }
        self.handlers.update({StartOffload: self.on_start_offload, ReleaseOffloaded: self.on_release_offloaded})
        self.handlers.update({Prepare: self.on_prepare, StorageAck: self.on_storage_ack,
                              StorageOverdue: self.on_storage_overdue, PrefetchDeadline: self.on_prefetch_timeout})

    # -- handlers ----------------------------------------------------------------
    def on_admit(self, msg: Admit) -> Any:
        core = self.core
        if core.storage_on:
            core.prefetched.discard(msg.rid)
        if core.storage_on and msg.session is None and msg.rid not in core.requests:
            # storage tier: wait for the request's prefetch by the policy (a batch item never waits)
            policy = core.config.prefetch_policy
            if policy == "best_effort" or msg.reply is None:
                pf = core.prefetches.get(msg.rid)
                if pf is not None:
                    core._prefetch_detach(pf)
            else:
                pf = core.prefetches.get(msg.rid)
                if pf is None and core.prepare(msg.rid, msg.tokens, msg.extra_key):
                    pf = core.prefetches[msg.rid]
                    pf.by_prepare = False  # the admit's own: its rid is not one the caller prepared
                if pf is not None:
                    pf.waiters.append(msg)
                    if policy == "timeout":
                        asyncio.get_running_loop().call_later(
                            core.config.prefetch_timeout(len(msg.tokens)), self._post_timeout, pf)
                    return DEFERRED
        return core.admit(msg.rid, msg.tokens, msg.extra_key, msg.session)

    def on_extend(self, msg: Extend) -> Any:
        return self.core.extend(msg.rid, msg.num_tokens)

    def on_commit(self, msg: Commit) -> int:
        return self.core.commit(msg.rid, msg.committed_len)

    def on_cache(self, msg: Cache) -> int:
        return self.core.cache(msg.rid, msg.tokens)

    def on_finish(self, msg: Finish) -> int:
        return self.core.finish(msg.rid, msg.tokens, msg.finished_len)

    def on_abort(self, msg: Abort) -> None:
        pf = self.core.prefetches.get(msg.rid) if self.core.storage_on else None
        self.core.abort(msg.rid)
        if pf is not None:
            waiters, pf.waiters = pf.waiters, []
            for w in waiters:
                w.reply.set_exception(StateError(f"request {msg.rid!r} was aborted while its prefetch ran"))

    def on_rewind(self, msg: Rewind) -> int:
        return self.core.rewind(msg.rid, msg.new_len)

    def on_open_session(self, msg: OpenSession) -> None:
        self.core.open_session(msg.sid, msg.extra_key)

    def on_close_session(self, msg: CloseSession) -> int:
        return self.core.close_session(msg.sid, msg.insert)

    def on_release_abandoned(self, msg: ReleaseAbandoned) -> None:
        self.core.abort_if_live(msg.rid, msg.generation)

    def on_match_prefix(self, msg: MatchPrefix) -> dict[str, int]:
        return self.core.match_prefix(msg.tokens, msg.extra_key)

    def on_can_admit(self, msg: CanAdmit) -> bool:
        return self.core.can_admit(msg.tokens, msg.extra_key)

    def on_available(self, msg: Available) -> dict[str, int]:
        return self.core.available()

    def on_flush(self, msg: Flush) -> int:
        return self.core.flush()

    def on_stats(self, msg: TreeStats) -> dict[str, Any]:
        core = self.core
        return {
            **core.stats,
            "live_requests": len(core.requests),
            "inflight_copies": len(core.ops),
            "inflight_storage_ops": len(core.storage_ops),
            "tree_nodes": core.tree.num_nodes,
            "device_free_slots": core.device.num_free_slots(),
            "host_free_slots": core.host.num_free_slots() if core.host is not None else 0,
            "tree_mailbox_depth": self.mailbox.depth,
            **core.offload_stats(),
        }

    def on_quiesce(self, msg: DrainTree) -> Any:
        if self._quiet():
            return None
        if msg.reply is not None:
            self.quiesce_waiters.append(msg.reply)
        return DEFERRED

    def on_inspect(self, msg: Inspect) -> Any:
        return msg.fn(self.core)

    def on_transfer_ack(self, msg: TransferAck) -> None:
        self.core.apply_ack(msg.op_id, msg.error)
        self._maybe_quiesced()

    def _quiet(self) -> bool:
        """No copy in flight and no storage op but overdue ones (their calls may never return)."""
        core = self.core
        return not core.ops and len(core.storage_ops) == len(self.storage_overdue)

    def _maybe_quiesced(self) -> None:
        if self.quiesce_waiters and self._quiet():
            for reply in self.quiesce_waiters:
                reply.set_result(None)
            self.quiesce_waiters.clear()

    # -- helpers -----------------------------------------------------------------
    def after_message(self, msg: Any) -> None:
        outbox = self.core.outbox
        if outbox:
            for plan, readiness in outbox:
                self.transfer_mailbox.put_internal(SubmitCopy(plan, self.mailbox, readiness))
            outbox.clear()
        stores = self.core.storage_outbox
        if stores:
            for op_id, write, keys, pages in stores:
                self.transfer_mailbox.put_internal(SubmitStorage(op_id, write, keys, pages, self.mailbox))
            stores.clear()
        self._send_offload_notes()
        if self.debug_invariants:
            check_invariants(self.core)

    # -- decode offload ------------------------------------------------------------
    # Messages from the offload actor are internal: a caller error there is a bug of
    # the runtime, never a caller's mistake, so it fails the runtime instead of vanishing.
    def on_start_offload(self, msg: StartOffload) -> OffloadStarted | None:
        try:
            return self.core.offload_start(msg.rid, msg.generation, msg.start, msg.end)
        except CallerError as exc:
            raise RuntimeError(f"offload start refused: {exc}") from exc

    def on_release_offloaded(self, msg: ReleaseOffloaded) -> None:
        try:
            self.core.offload_release(msg.rid, msg.generation)
        except CallerError as exc:
            raise RuntimeError(f"offload release failed: {exc}") from exc

    def _send_offload_notes(self) -> None:
        notes = self.core.offload_outbox
        if notes:
            mailbox = self.offload_mailbox
            if mailbox is not None and not mailbox.closed:
                for note in notes:
                    mailbox.put_internal(note)
            notes.clear()

    # -- storage tier ----------------------------------------------------------------
    def on_prepare(self, msg: Prepare) -> int:
        return self.core.prepare(msg.rid, msg.tokens, msg.extra_key)

    def on_storage_ack(self, msg: StorageAck) -> None:
        self.storage_overdue.discard(msg.op_id)
        pf = self.core.apply_storage_ack(msg.op_id, msg.pages, msg.error, msg.ok)
        if pf is not None:
            self._release_waiters(pf)
        self._maybe_quiesced()

    def on_storage_overdue(self, msg: StorageOverdue) -> None:
        """A storage call ran past its deadline: a prefetch's waiting admits go on without it (it
        still lands into the tree if its call ever returns); DrainTree stops waiting for the op."""
        sop = self.core.storage_ops.get(msg.op_id)
        if sop is None:  # its ack came first
            return
        self.storage_overdue.add(msg.op_id)
        pf = sop.prefetch
        if pf is not None and pf.waiters:
            self.core._prefetch_detach(pf)
            self._release_waiters(pf)
        self._maybe_quiesced()

    def on_prefetch_timeout(self, msg: PrefetchDeadline) -> None:
        if msg.prefetch.waiters:
            self.core._prefetch_detach(msg.prefetch)
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
        waiters, pf.waiters = pf.waiters, []
        for w in waiters:
            if w.reply.future.done():
                continue
            try:
                result = self.core.admit(w.rid, w.tokens, w.extra_key, w.session)
            except CallerError as exc:
                w.reply.set_exception(exc)
            else:
                w.reply.set_result(result)

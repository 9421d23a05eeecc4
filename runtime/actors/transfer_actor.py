"""TransferActor: owns the copy engine, the completion bridge and the in-flight copies.

It allocates and frees nothing and never touches a ledger: the requester pinned the
plan's slots when it issued the plan and unpins them when it applies the ack. Every
completion (CUDA event, worker future, fake event) becomes an awaitable through the
bridge; per-layer completions of a load resolve the plan's `LayerReadiness` as they
arrive, and the op's ack goes back to the requester's mailbox without blocking (acks
are internal sends), in issue order per direction.

Back-pressure: at most `max_inflight_loads` loads and `max_queued_backups` backups are
in the engine at once; more wait in this actor's queues (never fail).

Storage backends are not trusted: every value one returns is checked against its contract
(`checked_count` / `checked_flags`; out of contract, the whole op is a miss, logged and counted
in `storage_backend_errors`), and every storage op has a deadline (`storage_timeout_s`): past
it the requester gets one `StorageOverdue` and the op stays in flight until its call returns
(its worker may still be writing into pinned host pages), and a drain for close no longer
waits for it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from runtime.actors.base import DEFERRED, Actor, Reply
from runtime.completion import CompletionBridge, as_transfer_error
from runtime.errors import InternalError, RuntimeClosed, TransferError
from runtime.messages import (
    CopyDone,
    Direction,
    DrainTransfer,
    RemoveStoragePages,
    SetStorageBackend,
    StorageAck,
    StorageCleared,
    StorageCallbackFailed,
    StorageOverdue,
    SubmitCopy,
    SubmitStorage,
    TransferAck,
    TransferMessage,
    TransferStats,
)
from runtime.stats import LatencyHistogram
from runtime.storage.backend import ContractViolation, StorageError, checked_count, read_prefix, write_pages
from runtime.storage.integrity import PageSeal
from runtime.trace import get_logger
from runtime.transfer.engine import CopyEngine, merged_plan
from runtime.transfer.state_io import StateBlobIO

log = get_logger("hicache.transfer")


def _page_rows(pool: Any) -> np.ndarray | None:
    """A page_first host pool's pages as contiguous byte rows (read and written in place), else None."""
    if pool.layout == "page_first" and pool.buffer.is_contiguous():
        return pool.buffer.view(-1).view(torch.uint8).view(pool.num_pages, -1).numpy()
    return None


@dataclass(frozen=True, slots=True)
class _StorageDone:
    """A storage op's outcome (not a message: applied on the loop thread as the worker finishes)."""

    op_id: int
    pages: int
    ok: tuple[bool, ...]
    error: str | None
    violation: ContractViolation | None = None  # the backend returned a value outside its contract
    states_ok: tuple[bool, ...] = ()  # per `SubmitStorage.states` entry (`StateBlobIO`)


@dataclass(slots=True)
class _InFlight:
    submit: SubmitCopy
    done: bool = False
    error: str | None = None
    started: float = 0.0  # perf_counter() when the engine took it (latency histogram)


# Backups coalesced into one engine submission at most: each one's ack waits for the whole
# submission, and a caller refused for capacity waits for the acks of the write-backs it started.
BACKUPS_PER_SUBMISSION = 8

# stats() names of the latency histograms (runtime.stats.STATS)
LATENCIES = ("load_seconds", "backup_seconds", "storage_write_seconds", "storage_read_seconds",
             "storage_lookup_seconds")


class TransferActor(Actor[TransferMessage]):
    name = "transfer"

    # -- state -------------------------------------------------------------------
    def __init__(self, engine: CopyEngine, *, max_inflight_loads: int, max_queued_backups: int,
                 mailbox_capacity: int, bytes_per_slot: int = 0, storage: Any = None,
                 host_pool: Any = None, storage_timeout_s: float = 5.0,
                 pool_slot_bytes: dict[str, int] | None = None, rank_host_pools: Sequence[Any] = (),
                 state_io: StateBlobIO | None = None, seal: PageSeal | None = None) -> None:
        """`bytes_per_slot`: a KV slot's bytes (a token's); `pool_slot_bytes`: a slot's bytes in the
        plan's other pools (a recurrent state's components), for the byte counters;
        `rank_host_pools`: under one control plane over tensor-parallel ranks, every rank's host
        pool (rank 0's is `host_pool`), each rank's storage I/O its own (`SubmitStorage.rank_keys`);
        `state_io`: a hybrid model's host state pool as storage ops write and read its snapshots;
        `seal`: the page tags written with every page and checked on every page read (one per
        runtime: its count of refused pages outlives a detach / attach of the backend)."""
        super().__init__(mailbox_capacity)
        self.engine = engine
        self.bridge: CompletionBridge | None = None
        self.limits = {Direction.LOAD: max_inflight_loads, Direction.BACKUP: max_queued_backups}
        self.waiting: dict[Direction, deque[SubmitCopy]] = {d: deque() for d in Direction}
        self.inflight: dict[int, _InFlight] = {}
        self.issue_order: dict[Direction, deque[int]] = {d: deque() for d in Direction}
        self.running = {d: 0 for d in Direction}
        self._to_pump: set[Direction] = set()  # directions with copies queued in this burst
        # an engine that copies several backups as one submission (one hand-off to its copy
        # thread, one completion): a burst's backups start together, each still acked alone
        self._coalesce_backups = getattr(engine, "coalesce_backups", False) is True
        self.drain_waiters: list[Reply[None]] = []
        self.bytes_per_slot = bytes_per_slot
        self.pool_slot_bytes = {"kv": bytes_per_slot, **(pool_slot_bytes or {})}
        self.counters = {"ops_done": 0, "ops_failed": 0, "bytes_device_to_host": 0, "bytes_host_to_device": 0}
        # storage tier: backend calls run in worker threads, one batch per op
        self.storage = storage
        self.host_pool = host_pool
        self.state_io = state_io
        self.storage_inflight: dict[int, SubmitStorage] = {}
        self.storage_timeout_s = storage_timeout_s
        self.seal = seal if seal is not None else PageSeal()
        self._storage_timers: dict[int, asyncio.TimerHandle] = {}
        self.storage_overdue: set[int] = set()  # in flight past their deadline (a subset of storage_inflight)
        # in flight when this actor stopped: settled as abandoned (counted once); a call that returns
        # later is dropped here (nobody to ack)
        self.storage_abandoned: set[int] = set()
        self._storage_pool: ThreadPoolExecutor | None = None
        # every rank's host pool with its page rows (page_first: page p is one contiguous row, read
        # and written in place; else None); one rank: the host pool's
        pools = tuple(rank_host_pools) or ((host_pool,) if host_pool is not None else ())
        if rank_host_pools and rank_host_pools[0] is not host_pool:
            raise InternalError("rank_host_pools[0] must be host_pool (rank 0's)")
        self._rank_pools: tuple[tuple[Any, np.ndarray | None], ...] = tuple((p, _page_rows(p)) for p in pools)
        self._registered: list[Any] = []  # host pool buffers we registered with the backend (zero-copy)
        self._removals = 0  # clear_storage removals running in worker threads
        self.counters.update({"storage_ops_done": 0, "storage_ops_failed": 0, "storage_bytes_written": 0,
                              "storage_bytes_read": 0, "storage_errors": 0, "storage_backend_errors": 0,
                              "storage_ops_overdue": 0, "storage_ops_submitted": 0, "storage_ops_abandoned": 0})
        # latency per kind of operation, observed where it completes (stats() and metrics read them)
        self.latency = {name: LatencyHistogram() for name in LATENCIES}
        self._storage_started: dict[int, float] = {}  # op id -> perf_counter() at submit
        self._use_backend(storage)
        self.handlers = {
            SubmitCopy: self.on_submit,
            CopyDone: self.on_copy_done,
            DrainTransfer: self.on_drain,
            TransferStats: self.on_stats,
            SubmitStorage: self.on_submit_storage,
            StorageCallbackFailed: self.on_storage_callback_failed,
            SetStorageBackend: self.on_set_storage,
            RemoveStoragePages: self.on_remove_storage,
        }

    def started(self) -> None:
        self.bridge = CompletionBridge().start()
        self._register_host_pool()

    async def stopping(self) -> None:
        assert self.bridge is not None
        for timer in self._storage_timers.values():  # nobody to tell any more
            timer.cancel()
        self._storage_timers.clear()
        self._abandon_storage()
        self._abandon_queued()
        await self.bridge.aclose()
        await asyncio.to_thread(self.engine.close)
        if self._storage_pool is not None:
            self._storage_pool.shutdown(wait=False, cancel_futures=True)
        self._unregister_host_pool()

    def _register_host_pool(self) -> None:
        """Register the page_first host pool with a backend that takes registrations (Mooncake), so
        that storage reads land in pool pages and writes leave from them with no staging copy."""
        register = getattr(self.storage, "register_buffer", None)
        if register is None:
            return
        for pool, rows in self._rank_pools:  # (every rank's, under one control plane)
            if rows is None:
                continue
            try:
                register(pool.buffer)
            except Exception as exc:  # noqa: BLE001 - e.g. the embedder registered it (or more) already
                log.debug("storage_register_host_pool_skipped", error=repr(exc))
            else:
                self._registered.append(pool.buffer)

    def _unregister_host_pool(self) -> None:
        if self._registered:
            if self.storage_inflight or self.storage_abandoned:  # a worker may still move pool pages:
                return  # keep it registered (the backend holds the tensor; its teardown unregisters it)
            buffers, self._registered = self._registered, []
            for buffer in buffers:
                try:
                    self.storage.unregister_buffer(buffer)
                except Exception as exc:  # noqa: BLE001 - backend closed first: nothing left to unregister
                    log.debug("storage_unregister_host_pool_failed", error=repr(exc))

    # -- handlers ----------------------------------------------------------------
    def on_submit(self, msg: SubmitCopy) -> None:
        direction = msg.plan.direction
        self.waiting[direction].append(msg)
        self.issue_order[direction].append(msg.plan.op_id)
        self.inflight[msg.plan.op_id] = _InFlight(msg)
        self._to_pump.add(direction)  # at the burst's end, with the rest of the burst's copies

    def on_copy_done(self, msg: CopyDone) -> None:
        entry = self.inflight[msg.op_id]
        entry.done, entry.error = True, msg.error
        direction = entry.submit.plan.direction
        self.latency["load_seconds" if direction is Direction.LOAD else "backup_seconds"].observe(
            time.perf_counter() - entry.started)
        self.running[direction] -= 1
        self._flush_acks(direction)
        self._to_pump.add(direction)
        self._maybe_drained()

    def on_submit_storage(self, msg: SubmitStorage) -> None:
        self.counters["storage_ops_submitted"] += 1
        self.storage_inflight[msg.op_id] = msg
        self._storage_started[msg.op_id] = time.perf_counter()
        if not msg.write and not msg.pages and msg.keys and self._probe_inline and self._absent(msg.keys[0]):
            # a lookup on a local backend without the first page: a miss, no worker thread needed
            self._storage_done(_StorageDone(msg.op_id, 0, (), None))
            return
        loop = asyncio.get_running_loop()
        fut = self._worker_pool().submit(self._run_storage, msg)
        # armed before the worker can finish: `_storage_done` (on this thread, later) cancels it
        self._storage_timers[msg.op_id] = loop.call_later(self.storage_timeout_s, self._on_storage_deadline, msg.op_id)
        # straight back onto the loop from the worker (no asyncio future in between)
        fut.add_done_callback(lambda f, op_id=msg.op_id: self._post_storage_future(loop, op_id, f))

    def _absent(self, key: bytes) -> bool:
        """Inline probe (local backends only): True when storage surely lacks `key`."""
        try:
            return checked_count("exists_prefix", self.storage.exists_prefix([key]), 1) == 0
        except Exception:  # noqa: BLE001 - let the worker path meet (and count) the error
            return False

    def _run_storage(self, msg: SubmitStorage) -> tuple[int, tuple[bool, ...], tuple[bool, ...]]:
        """In a worker thread: the op's KV pages, then its state snapshots (`StateBlobIO`) if any
        (recurrent state has one rank: `tp_ranks > 1` refuses it). Every result is checked against
        the backend contract (`ContractViolation` otherwise)."""
        pages, ok = self._run_storage_kv(msg)
        if not msg.states:
            return pages, ok, ()
        io = self.state_io
        if io is None:
            raise InternalError(f"storage op {msg.op_id} carries state snapshots and there is no host state pool")
        if msg.write:
            return pages, ok, io.write(self.storage, msg.states)
        if not msg.pages:
            return pages, ok, io.lookup(self.storage, msg.states, pages)
        return pages, ok, io.read(self.storage, msg.states, pages)

    def _run_storage_kv(self, msg: SubmitStorage) -> tuple[int, tuple[bool, ...]]:
        """The op's KV pages on every rank, each with its own keys and host pool (one rank without
        tensor parallelism). A write stores a page only when every rank's shard is stored (the
        flags' AND; a replicated shard: rank 0 writes the one copy); a lookup or read counts the
        leading pages every rank has (the minimum; a later rank looks only that far)."""
        if not msg.keys:  # (an op for state snapshots alone)
            return 0, ()
        ranks = self._rank_pools
        keys_of = msg.rank_keys or (msg.keys,) * len(ranks)
        if len(keys_of) != len(ranks) or any(len(keys) != len(msg.keys) for keys in keys_of):
            raise InternalError(f"storage op {msg.op_id}: {len(keys_of)} key lists for {len(ranks)} ranks")
        if msg.write:
            ok = (True,) * len(msg.keys)
            for (pool, rows), keys in zip(ranks if msg.rank_keys else ranks[:1], keys_of):
                ok = tuple(a and b for a, b in zip(ok, self._storage_call(True, keys, msg.pages, pool, rows)[1]))
            return sum(ok), ok
        count = len(msg.keys)
        lookers = ranks if msg.rank_keys or msg.pages else ranks[:1]  # a replicated lookup: one list
        for (pool, rows), keys in zip(lookers, keys_of):
            if count == 0:
                break
            count = self._storage_call(False, keys[:count], msg.pages[:count], pool, rows)[0]
        return count, ()

    def _storage_call(self, write: bool, keys: Sequence[bytes], pages: Sequence[int], pool: Any,
                      rows: np.ndarray | None) -> tuple[int, tuple[bool, ...]]:
        """One rank's part of a storage op: one batch call (a write), or one read of the leading
        present pages, into or from `pool`'s `pages` (`rows`: its page rows, page_first). Every
        result is checked against the backend contract (`ContractViolation` otherwise)."""
        backend = self.storage
        if write:
            srcs = [rows[p] for p in pages] if rows is not None else [pool.read_page(p) for p in pages]
            ok = write_pages(backend, keys, srcs, self.seal)
            return sum(ok), ok
        if not pages:  # a lookup
            return checked_count("exists_prefix", backend.exists_prefix(list(keys)), len(keys)), ()
        if rows is not None:
            # page_first keeps a page contiguous in the canonical form: read straight into the pool
            # (the pages are pinned and prefetch-owned; a page that misses is freed unused)
            return read_prefix(backend, list(keys), [rows[p] for p in pages], self.seal), ()
        shape = pool.shape
        stage = torch.empty((len(keys), shape.num_layers, shape.parts, pool.page_size, shape.num_kv_heads,
                             shape.head_dim), dtype=shape.dtype)  # untouched: pages never read cost no memory
        bufs = list(stage)
        # a missing page, or one whose tag does not check out, ends the hit (presence is a hint)
        k = read_prefix(backend, list(keys), bufs, self.seal)
        for i in range(k):
            pool.write_page(pages[i], bufs[i])
        return k, ()

    def _post_storage_future(self, loop: asyncio.AbstractEventLoop, op_id: int, fut: Any) -> None:
        try:
            loop.call_soon_threadsafe(self._on_storage_future, op_id, fut)
        except RuntimeError:  # the loop is closed: the runtime is gone, nobody to ack
            pass

    def _on_storage_future(self, op_id: int, fut: Any) -> None:
        """On the loop thread, as the worker finishes: apply the outcome and ack the requester here,
        not via a message to this actor. One hop shorter, and this actor stays idle-waiting, so a
        copy that the requester issues in reply (a waiting admit's host -> device load) is queued
        behind the admit's caller as on a plain host hit. (Via the mailbox, this actor was still in
        its receive checkpoint when the tree replied, and submitted the load, ~0.5 ms of CPU engine
        work plus its threads' CPU, before the caller resumed.) Only storage bookkeeping is touched,
        between two of this actor's handlers (they are all synchronous, so never inside one)."""
        if op_id in self.storage_abandoned:  # returned (or cancelled unstarted) after this actor stopped
            self.storage_abandoned.discard(op_id)
            log.debug("storage_op_returned_after_close", op=op_id)
            return
        if fut.cancelled():
            done = _StorageDone(op_id, 0, (), "cancelled")
        elif isinstance(fut.exception(), ContractViolation):
            exc = fut.exception()
            done = _StorageDone(op_id, 0, (), f"backend contract violation: {exc}", exc)
        elif fut.exception() is not None:
            done = _StorageDone(op_id, 0, (), repr(fut.exception()))
        else:
            pages, ok, states_ok = fut.result()
            done = _StorageDone(op_id, pages, ok, None, states_ok=states_ok)
        try:
            self._storage_done(done)
        except Exception as exc:  # noqa: BLE001 - a bug: fail whole, from inside the actor
            try:
                self.mailbox.put_internal(StorageCallbackFailed(exc))
            except Exception:  # noqa: BLE001 - mailbox aborted: the runtime already failed
                pass

    def on_storage_callback_failed(self, msg: StorageCallbackFailed) -> None:
        raise InternalError(f"applying a storage completion failed: {msg.error!r}") from msg.error

    def _on_storage_deadline(self, op_id: int) -> None:
        """On the loop thread, `storage_timeout_s` after the op was submitted, if its call has not
        returned: tell the requester once (it may stop waiting for the op), keep the op in flight."""
        try:
            self._storage_timers.pop(op_id, None)
            submit = self.storage_inflight.get(op_id)
            if submit is None:
                return
            self.storage_overdue.add(op_id)
            self.counters["storage_ops_overdue"] += 1
            log.warning("storage_op_overdue", op=op_id, write=submit.write, lookup=not submit.write and not submit.pages,
                        pages=len(submit.keys), timeout_s=self.storage_timeout_s)
            try:
                submit.ack_to.put_internal(StorageOverdue(op_id))
            except RuntimeClosed:
                log.warning("ack_undeliverable", op=op_id, direction="storage_overdue")
            self._maybe_drained()
        except Exception as exc:  # noqa: BLE001 - a bug: fail whole, from inside the actor
            try:
                self.mailbox.put_internal(StorageCallbackFailed(exc))
            except Exception:  # noqa: BLE001 - mailbox aborted: the runtime already failed
                pass

    def _storage_done(self, msg: _StorageDone) -> None:
        submit = self.storage_inflight.pop(msg.op_id)
        kind = "storage_write_seconds" if submit.write else "storage_read_seconds" if submit.pages \
            else "storage_lookup_seconds"
        self.latency[kind].observe(time.perf_counter() - self._storage_started.pop(msg.op_id))
        timer = self._storage_timers.pop(msg.op_id, None)
        if timer is not None:
            timer.cancel()
        self.storage_overdue.discard(msg.op_id)
        page_bytes = self.bytes_per_slot * (self.host_pool.page_size if self.host_pool is not None else 0)
        if msg.error is None:
            self.counters["storage_ops_done"] += 1
            if submit.write or submit.pages:  # a lookup moves no bytes
                key = "storage_bytes_written" if submit.write else "storage_bytes_read"
                # every rank's shard (a replicated shard: one copy written, read by every rank)
                movers = 1 if submit.write and not submit.rank_keys else len(self._rank_pools)
                chunks = self.state_io.format.chunks if self.state_io is not None else 0  # (a state's)
                self.counters[key] += (msg.pages * movers + chunks * sum(msg.states_ok)) * page_bytes
        elif msg.violation is not None:
            self.counters["storage_ops_failed"] += 1
            self.counters["storage_backend_errors"] += 1
            log.warning("storage_backend_contract_violation", op=msg.op_id, call=msg.violation.call,
                        value=msg.violation.value, write=submit.write)
        else:
            self.counters["storage_ops_failed"] += 1
            self.counters["storage_errors"] += 1
            log.warning("storage_op_failed", op=msg.op_id, write=submit.write, error=msg.error)
        try:
            submit.ack_to.put_internal(StorageAck(msg.op_id, msg.pages, msg.error, msg.ok, msg.states_ok))
        except RuntimeClosed:
            log.warning("ack_undeliverable", op=msg.op_id, direction="storage")
        self._maybe_drained()

    # -- storage controls (sent by the tree actor once no storage op is in flight) -------------
    def on_set_storage(self, msg: SetStorageBackend) -> Any:
        """Attach (a backend) or detach (None) the storage backend; replies with the previous one."""
        if self.storage_inflight or self._removals:
            raise InternalError(f"storage backend changed with {len(self.storage_inflight)} storage ops in flight")
        old = self.storage
        self._unregister_host_pool()
        self._use_backend(msg.backend)
        if self.bridge is not None:  # running (else `run` registers it)
            self._register_host_pool()
        log.info("storage_attached" if msg.backend is not None else "storage_detached",
                 backend=type(msg.backend if msg.backend is not None else old).__name__)
        return old

    def on_remove_storage(self, msg: RemoveStoragePages) -> None:
        """`clear_storage`: the backend's `remove(keys)` in a worker thread; `StorageCleared` back."""
        if not msg.keys:
            self._post_cleared(msg, 0, None)
            return
        self._removals += 1
        loop = asyncio.get_running_loop()
        fut = self._worker_pool().submit(self.storage.remove, list(msg.keys))

        def landed(f: Any) -> None:
            try:
                loop.call_soon_threadsafe(self._removed, msg, f)
            except RuntimeError:  # the loop is closed: nobody to tell
                pass
        fut.add_done_callback(landed)

    def _removed(self, msg: RemoveStoragePages, fut: Any) -> None:
        self._removals -= 1
        removed, error = 0, None
        try:
            removed = checked_count("remove", fut.result(), len(msg.keys))
        except BaseException as exc:  # noqa: BLE001 - the caller of clear_storage gets it
            error = exc if isinstance(exc, Exception) else StorageError(repr(exc))
            log.warning("storage_clear_failed", pages=len(msg.keys), error=repr(exc))
        self._post_cleared(msg, removed, error)
        self._maybe_drained()

    def _post_cleared(self, msg: RemoveStoragePages, removed: int, error: BaseException | None) -> None:
        log.info("storage_cleared", pages=len(msg.keys), removed=removed)
        try:
            msg.ack_to.put_internal(StorageCleared(removed, error, msg.caller))
        except RuntimeClosed as exc:
            msg.caller.set_exception(exc)

    def on_drain(self, msg: DrainTransfer) -> Any:
        if msg.reply is not None:
            self.drain_waiters.append(msg.reply)
        self._maybe_drained()
        return DEFERRED

    def on_stats(self, msg: TransferStats) -> dict[str, Any]:
        return {
            **self.counters,
            "inflight_loads": self.running[Direction.LOAD],
            "inflight_backups": self.running[Direction.BACKUP],
            "queued_loads": len(self.waiting[Direction.LOAD]),
            "queued_backups": len(self.waiting[Direction.BACKUP]),
            "mailbox_depth": self.mailbox.depth,
            "inflight_storage_ops": len(self.storage_inflight),
            "storage_pages_rejected": self.seal.rejected,
            **{name: hist.snapshot() for name, hist in self.latency.items()},
        }

    def after_burst(self) -> None:
        if self._to_pump:
            for direction in (Direction.LOAD, Direction.BACKUP):  # loads first: requests wait on them
                if direction in self._to_pump:
                    self._pump(direction)
            self._to_pump.clear()

    # -- helpers -----------------------------------------------------------------
    def _use_backend(self, storage: Any) -> None:
        self.storage = storage
        self._probe_inline = storage is not None and getattr(storage, "exists_is_local", False) is True

    def _worker_pool(self) -> ThreadPoolExecutor:
        if self._storage_pool is None:
            self._storage_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="hicache-storage")
        return self._storage_pool

    def _pump(self, direction: Direction) -> None:
        queue = self.waiting[direction]
        limit = self.limits[direction]
        while queue and self.running[direction] < limit:
            n = min(len(queue), limit - self.running[direction], BACKUPS_PER_SUBMISSION)
            if n > 1 and direction is Direction.BACKUP and self._coalesce_backups:
                self._start([queue.popleft() for _ in range(n)])
            else:
                self._start([queue.popleft()])

    def _start(self, group: list[SubmitCopy]) -> None:
        """Start one copy, or several backups as one engine submission (their pages concatenated
        under the first op id); each op is acked alone, in issue order, with the submission's
        outcome. Only a lone copy has a readiness (a load)."""
        assert self.bridge is not None
        first = group[0]
        direction = first.plan.direction
        ids = tuple(submit.plan.op_id for submit in group)
        plan = first.plan if len(group) == 1 else merged_plan(ids[0], [submit.plan for submit in group])
        self.running[direction] += len(group)
        started = time.perf_counter()
        for op_id in ids:
            self.inflight[op_id].started = started
        log.debug("copy_start", op=ids[0], direction=direction.value, slots=plan.num_slots, ops=len(ids))
        try:
            handle = self.engine.submit(plan)
        except Exception as exc:  # noqa: BLE001 - an engine that refuses a plan is a failed copy
            for op_id in ids:
                self.mailbox.put_internal(CopyDone(op_id, repr(exc)))
            if first.readiness is not None:
                first.readiness.fail_all(as_transfer_error(exc))
            return
        if first.readiness is not None:
            first.readiness.bind(self.bridge, handle)
        done = self.bridge.watch(handle.done)
        done.add_done_callback(lambda fut, ids=ids: self._on_done_future(ids, fut))

    def _on_done_future(self, ids: tuple[int, ...], fut: asyncio.Future[None]) -> None:
        if fut.cancelled():
            error: str | None = "cancelled"
        else:
            exc = fut.exception()
            error = None if exc is None else repr(exc.__cause__ or exc)
        try:
            for op_id in ids:
                self.mailbox.put_internal(CopyDone(op_id, error))
        except Exception:  # noqa: BLE001 - mailbox aborted: the runtime already failed
            pass

    def _flush_acks(self, direction: Direction) -> None:
        order = self.issue_order[direction]
        while order and self.inflight[order[0]].done:
            entry = self.inflight.pop(order.popleft())
            plan = entry.submit.plan
            if entry.error is None:
                self.counters["ops_done"] += 1
                key = "bytes_device_to_host" if direction is Direction.BACKUP else "bytes_host_to_device"
                # every rank runs the plan on its own pools (one control plane): every rank's bytes
                moved = sum(t.src.numel() * self.pool_slot_bytes.get(t.pool, 0) for t in plan.transfers)
                self.counters[key] += max(1, len(self._rank_pools)) * moved
            else:
                self.counters["ops_failed"] += 1
                log.warning("copy_failed", op=plan.op_id, direction=direction.value, error=entry.error)
            try:
                entry.submit.ack_to.put_internal(TransferAck(plan.op_id, direction, entry.error))
            except RuntimeClosed:  # the requester stopped first (close without a drain): nobody to ack
                log.warning("ack_undeliverable", op=plan.op_id, direction=direction.value)

    def _abandon_storage(self) -> None:
        """Stopping with storage ops in flight (overdue ones: a drain does not wait for them, or any
        after a failure): each is settled as abandoned, counted once; nobody is acked. Their calls
        may still run in worker threads (into pinned host pages that nothing reuses now); the
        backend's close waits for them before it tears anything down (`CallGate`)."""
        if not self.storage_inflight:
            return
        ops = sorted(self.storage_inflight)
        self.counters["storage_ops_abandoned"] += len(ops)
        log.warning("storage_ops_abandoned_at_close", count=len(ops), ops=ops)
        self.storage_abandoned.update(ops)
        self.storage_inflight.clear()
        self.storage_overdue.clear()
        self._storage_started.clear()

    def _abandon_queued(self) -> None:
        """Stopping with copies still queued (close drains first, so normally none): they will
        never start; fail their readiness so that no waiter hangs."""
        for queue in self.waiting.values():
            while queue:
                submit = queue.popleft()
                if submit.readiness is not None:
                    submit.readiness.fail_all(TransferError(
                        f"copy {submit.plan.op_id} never started: the transfer actor stopped"))

    def _maybe_drained(self) -> None:
        # overdue storage ops do not hold a drain: their calls may never return (the ops stay in
        # flight; their pages stay pinned, and their acks still go out if the calls come back)
        if self.drain_waiters and not self.inflight and len(self.storage_overdue) == len(self.storage_inflight) \
                and not self._removals:
            for reply in self.drain_waiters:
                reply.set_result(None)
            self.drain_waiters.clear()

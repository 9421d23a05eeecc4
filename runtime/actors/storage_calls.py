"""StorageCalls: the transfer actor's storage backend calls, the one owner of their state.

Each storage op runs its backend calls in a worker thread (one batch per op and rank). Its end
comes back like a copy's: the worker's future posts a `StorageDone` into the transfer actor's
mailbox, and the handler applies it and acks the requester. A deadline (`storage_timeout_s`)
posts a `StorageDeadline` the same way: past it the requester gets one `StorageOverdue` and the
op stays in flight until its call returns (its worker may still be writing into pinned host
pages), and a drain for close no longer waits for it. `clear_storage`'s removal runs in a
worker too and comes back as a `StorageRemoved`. Whether a call starts at all is its
`BackendGate`'s (`runtime/actors/backend_gate.py`: calls in flight bounded, host pages of overdue
ops bounded, the backend's health, probes while it is down).

Storage backends are not trusted: every value one returns is checked against its contract
(`checked_count` / `checked_flags`; out of contract, the whole op is a miss, logged and counted
in `storage_backend_errors`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from runtime.actors.backend_gate import WATCH_S, BackendGate
from runtime.errors import InternalError, RuntimeClosed
from runtime.messages import (
    RemoveStoragePages,
    StorageAck,
    StorageCleared,
    StorageDeadline,
    StorageDone,
    StorageOverdue,
    StorageProbe,
    StorageRemoved,
    StorageWatch,
    SubmitStorage,
)
from runtime.stats import LatencyHistogram
from runtime.storage.backend import ContractViolation, StorageError, checked_count, read_prefix, write_pages
from runtime.storage.health import Health
from runtime.storage.integrity import PageSeal
from runtime.trace import get_logger
from runtime.transfer.state_io import StateBlobIO

log = get_logger("hicache.transfer")

# stats() names of the storage latency histograms (runtime.stats.STATS)
LATENCIES = ("storage_write_seconds", "storage_read_seconds", "storage_lookup_seconds")
COUNTERS = ("storage_ops_done", "storage_ops_failed", "storage_bytes_written", "storage_bytes_read", "storage_errors",
            "storage_backend_errors", "storage_ops_overdue", "storage_ops_submitted", "storage_ops_abandoned",
            "storage_ops_skipped", "storage_probes")


def _page_rows(pool: Any) -> np.ndarray | None:
    """A page_first host pool's pages as contiguous byte rows (read and written in place), else None."""
    if pool.layout == "page_first" and pool.buffer.is_contiguous():
        return pool.buffer.view(-1).view(torch.uint8).view(pool.num_pages, -1).numpy()
    return None


@dataclass(frozen=True, slots=True)
class _Call:
    """A storage op in flight: its request and when it started."""

    submit: SubmitStorage
    started: float


class StorageCalls:
    # -- state -------------------------------------------------------------------
    def __init__(self, post: Callable[[Any], None], *, backend: Any, host_pool: Any, bytes_per_slot: int,
                 timeout_s: float, rank_host_pools: Sequence[Any] = (), state_io: StateBlobIO | None = None,
                 seal: PageSeal | None = None, max_inflight: int = 4, max_overdue_pages: int | None = None) -> None:
        """`post`: a message into the transfer actor's mailbox (on the loop thread); the rest as
        `TransferActor`'s arguments of the same names (`max_overdue_pages` None: an eighth of the
        host pool)."""
        self._post = post
        if max_overdue_pages is None:
            max_overdue_pages = host_pool.num_pages // 8 if host_pool is not None else 0
        self.gate = BackendGate(post, timeout_s=timeout_s, max_inflight=max_inflight, max_overdue_pages=max_overdue_pages)
        self.state_io = state_io
        self.seal = seal if seal is not None else PageSeal()
        self.inflight: dict[int, _Call] = {}
        # op id -> its deadline's timer, until the op returns or the deadline passes: the ops in
        # flight without one are overdue (an inline probe's lookup is settled at once)
        self.timers: dict[int, asyncio.TimerHandle] = {}
        # in flight when the actor stopped: settled as abandoned (counted once); a call that returns
        # later is dropped (nobody to ack)
        self.abandoned: set[int] = set()
        self.removals = 0  # clear_storage removals running in worker threads
        self._pool: ThreadPoolExecutor | None = None
        # every rank's host pool with its page rows (page_first: page p is one contiguous row, read
        # and written in place; else None); one rank: the host pool's
        pools = tuple(rank_host_pools) or ((host_pool,) if host_pool is not None else ())
        if rank_host_pools and rank_host_pools[0] is not host_pool:
            raise InternalError("rank_host_pools[0] must be host_pool (rank 0's)")
        self.rank_pools: tuple[tuple[Any, np.ndarray | None], ...] = tuple((p, _page_rows(p)) for p in pools)
        self._page_bytes = bytes_per_slot * (host_pool.page_size if host_pool is not None else 0)
        self._registered: list[Any] = []  # host pool buffers we registered with the backend (zero-copy)
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.latency = {name: LatencyHistogram() for name in LATENCIES}
        self.backend: Any = backend

    # -- ops ---------------------------------------------------------------------------
    def submit(self, msg: SubmitStorage) -> None:
        self.counters["storage_ops_submitted"] += 1  # (probes too: every op ends done, failed, skipped or abandoned)
        if msg.ack_to is None:
            self.counters["storage_probes"] += 1
        self.inflight[msg.op_id] = _Call(msg, time.perf_counter())
        if not msg.write and not msg.pages and msg.keys and self._absent(msg.keys[0]):
            # a lookup on a local backend without the first page: a miss, no worker thread needed
            self._settle(msg.op_id, 0, (), None)
            return
        # armed before the worker can finish: `done` (on the loop thread, later) cancels it
        self.timers[msg.op_id] = asyncio.get_running_loop().call_later(self.gate.timeout_s, self._post,
                                                                       StorageDeadline(msg.op_id))
        if self.gate.queue(msg):
            self._call_in_worker(msg)
        elif msg.op_id not in self.gate.waiting:  # refused: skipped
            self._settle(msg.op_id, 0, (), None, skipped=True)

    def _start_waiting(self) -> None:
        """Start the waiting ops the gate lets go."""
        for op_id in self.gate.startable():
            self._start(self.inflight[op_id].submit)

    def _start(self, msg: SubmitStorage) -> None:
        """A waiting op's call in a worker thread, or, refused by the gate, the op skipped."""
        if self.gate.admit(msg):
            self._call_in_worker(msg)
        else:
            self._settle(msg.op_id, 0, (), None, skipped=True)

    def _call_in_worker(self, msg: SubmitStorage) -> None:
        loop = asyncio.get_running_loop()
        if getattr(self.backend, "reachable", None) is not None:
            self.gate.watch_later()
        fut = self._workers().submit(self._run, msg)
        fut.add_done_callback(lambda f, op_id=msg.op_id: _post_threadsafe(loop, self._post, StorageDone(op_id, f)))

    def done(self, msg: StorageDone) -> None:
        """A worker's call returned: apply its outcome, ack the requester, tell the gate."""
        fut = msg.future
        submit = self.inflight[msg.op_id].submit
        exc = None if fut.cancelled() else fut.exception()
        if fut.cancelled():
            failure = None
            self._settle(msg.op_id, 0, (), "cancelled")
        elif isinstance(exc, ContractViolation):
            failure = f"backend contract violation: {exc}"
            self._settle(msg.op_id, 0, (), failure, exc)
        elif exc is not None:
            failure = repr(exc)
            self._settle(msg.op_id, 0, (), failure)
        else:
            pages, ok, states_ok = fut.result()
            failure = "stored no page" if ok and not any(ok) else None
            self._settle(msg.op_id, pages, ok, None, states_ok=states_ok)
        self.gate.returned(submit, failure)
        if self.gate.waiting:
            self._start_waiting()

    def probe(self, _msg: StorageProbe) -> None:
        """The down backend's probe is due: one lookup through the gate like any op (no requester)."""
        msg = self.gate.probe()
        if msg is not None:
            self.submit(msg)

    def watch(self, msg: StorageWatch) -> None:
        """The watch's timer (`reachable` None): with a call running since before it was armed,
        ask the backend whether it is there (off the loop). Its answer: not there, the backend is
        down and every call running is overdue now."""
        if msg.reachable is None:
            old = time.perf_counter() - min(WATCH_S, self.gate.timeout_s / 2)  # (a call this old counts)
            if any(call.started < old for op, call in self.inflight.items()
                   if op not in self.gate.waiting and op not in self.gate.overdue):
                self.gate.watching()
                fut = asyncio.get_running_loop().run_in_executor(None, _reachable, self.backend)
                fut.add_done_callback(lambda f: self._post(StorageWatch(bool(f.result()))))
                return
        elif not msg.reachable:
            self.gate.health.mark_down("the backend is not reachable")
            for op_id in [op for op in self.timers if op not in self.gate.waiting]:
                self.timers[op_id].cancel()
                self.deadline(StorageDeadline(op_id))  # overdue now: its waiters go on, its pages stay held
        self.gate.watched()

    def returned_after_stop(self, msg: Any) -> None:
        """A completion that found the actor stopped (its mailbox closed): the op was abandoned."""
        if type(msg) is StorageDone and msg.op_id in self.abandoned:
            self.abandoned.discard(msg.op_id)
            log.debug("storage_op_returned_after_close", op=msg.op_id)

    def deadline(self, msg: StorageDeadline) -> None:
        """`timeout_s` after the op was submitted, if its call has not returned: an op still waiting
        to start is skipped; else tell the requester once (it may stop waiting for the op), keep the
        op in flight (its host pages held: the call may still move them)."""
        call = self.inflight.get(msg.op_id)
        if self.timers.pop(msg.op_id, None) is None or call is None:  # it returned first
            return
        submit = call.submit
        healthy = self.gate.health.state is Health.HEALTHY  # (before this op counts against it)
        if self.gate.expired(submit):
            self._settle(msg.op_id, 0, (), None, skipped=True)
            self._start_waiting()
            return
        self.counters["storage_ops_overdue"] += 1
        (log.warning if healthy else log.debug)("storage_op_overdue", op=msg.op_id, write=submit.write, lookup=not submit.write and not submit.pages,
                    pages=len(submit.keys), timeout_s=self.gate.timeout_s)
        if submit.ack_to is None:  # (a probe)
            return
        try:
            submit.ack_to.put_internal(StorageOverdue(msg.op_id))
        except RuntimeClosed:
            log.warning("ack_undeliverable", op=msg.op_id, direction="storage_overdue")

    def _settle(self, op_id: int, pages: int, ok: tuple[bool, ...], error: str | None,
                violation: ContractViolation | None = None, states_ok: tuple[bool, ...] = (),
                skipped: bool = False) -> None:
        call = self.inflight.pop(op_id)
        submit = call.submit
        timer = self.timers.pop(op_id, None)
        if timer is not None:
            timer.cancel()
        counters = self.counters
        if not skipped:
            kind = "storage_write_seconds" if submit.write else "storage_read_seconds" if submit.pages \
                else "storage_lookup_seconds"
            self.latency[kind].observe(time.perf_counter() - call.started)
        if skipped:
            counters["storage_ops_skipped"] += 1
        elif error is None:
            counters["storage_ops_done"] += 1
            if submit.write or submit.pages:  # a lookup moves no bytes
                key = "storage_bytes_written" if submit.write else "storage_bytes_read"
                # every rank's shard (a replicated shard: one copy written, read by every rank)
                movers = 1 if submit.write and not submit.rank_keys else len(self.rank_pools)
                chunks = self.state_io.format.chunks if self.state_io is not None else 0  # (a state's)
                counters[key] += (pages * movers + chunks * sum(states_ok)) * self._page_bytes
        elif violation is not None:
            counters["storage_ops_failed"] += 1
            counters["storage_backend_errors"] += 1
            log.warning("storage_backend_contract_violation", op=op_id, call=violation.call,
                        value=violation.value, write=submit.write)
        else:
            counters["storage_ops_failed"] += 1
            counters["storage_errors"] += 1
            # (a warning while the backend is healthy; past that its health's change said it)
            self._log_op("storage_op_failed", op=op_id, write=submit.write, error=error)
        if submit.ack_to is None:  # a probe: its outcome went to the gate (skipped: another one later)
            if skipped:
                self.gate.probe_later()
            return
        try:
            submit.ack_to.put_internal(StorageAck(op_id, pages, error, ok, states_ok, skipped))
        except RuntimeClosed:
            log.warning("ack_undeliverable", op=op_id, direction="storage")

    # -- in a worker thread ----------------------------------------------------------------
    def _absent(self, key: bytes) -> bool:
        """Inline probe (local backends only): True when storage surely lacks `key`."""
        if getattr(self.backend, "exists_is_local", False) is not True or self.gate.health.state is not Health.HEALTHY:
            return False
        try:
            return checked_count("exists_prefix", self.backend.exists_prefix([key]), 1) == 0
        except Exception:  # noqa: BLE001 - let the worker path meet (and count) the error
            return False

    def _run(self, msg: SubmitStorage) -> tuple[int, tuple[bool, ...], tuple[bool, ...]]:
        """The op's KV pages, then its state snapshots (`StateBlobIO`) if any (recurrent state has
        one rank: `tp_ranks > 1` refuses it). Every result is checked against the backend
        contract (`ContractViolation` otherwise)."""
        pages, ok = self._run_kv(msg)
        if not msg.states:
            return pages, ok, ()
        io = self.state_io
        if io is None:
            raise InternalError(f"storage op {msg.op_id} carries state snapshots and there is no host state pool")
        if msg.write:
            return pages, ok, io.write(self.backend, msg.states)
        if not msg.pages:
            return pages, ok, io.lookup(self.backend, msg.states, pages)
        return pages, ok, io.read(self.backend, msg.states, pages)

    def _run_kv(self, msg: SubmitStorage) -> tuple[int, tuple[bool, ...]]:
        """The op's KV pages on every rank, each with its own keys and host pool (one rank without
        tensor parallelism). A write stores a page only when every rank's shard is stored (the
        flags' AND; a replicated shard: rank 0 writes the one copy); a lookup or read counts the
        leading pages every rank has (the minimum; a later rank looks only that far)."""
        if not msg.keys:  # (an op for state snapshots alone)
            return 0, ()
        ranks = self.rank_pools
        keys_of = msg.rank_keys or (msg.keys,) * len(ranks)
        if len(keys_of) != len(ranks) or any(len(keys) != len(msg.keys) for keys in keys_of):
            raise InternalError(f"storage op {msg.op_id}: {len(keys_of)} key lists for {len(ranks)} ranks")
        if msg.write:
            ok = (True,) * len(msg.keys)
            for (pool, rows), keys in zip(ranks if msg.rank_keys else ranks[:1], keys_of):
                ok = tuple(a and b for a, b in zip(ok, self._call(True, keys, msg.pages, pool, rows)[1]))
            return sum(ok), ok
        count = len(msg.keys)
        lookers = ranks if msg.rank_keys or msg.pages else ranks[:1]  # a replicated lookup: one list
        for (pool, rows), keys in zip(lookers, keys_of):
            if count == 0:
                break
            count = self._call(False, keys[:count], msg.pages[:count], pool, rows)[0]
        return count, ()

    def _call(self, write: bool, keys: Sequence[bytes], pages: Sequence[int], pool: Any,
              rows: np.ndarray | None) -> tuple[int, tuple[bool, ...]]:
        """One rank's part of a storage op: one batch call (a write), or one read of the leading
        present pages, into or from `pool`'s `pages` (`rows`: its page rows, page_first). Every
        result is checked against the backend contract (`ContractViolation` otherwise)."""
        backend = self.backend
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

    # -- controls (sent by the tree actor once no storage op is in flight) -------------------
    def set_backend(self, backend: Any, running: bool) -> Any:
        """Attach (a backend) or detach (None) the storage backend; returns the previous one."""
        if self.inflight or self.removals:
            raise InternalError(f"storage backend changed with {len(self.inflight)} storage ops in flight")
        old = self.backend
        self.unregister()
        self.backend = backend
        self.gate.reset()
        if running:  # (else the actor's start registers it)
            self.register()
        log.info("storage_attached" if backend is not None else "storage_detached",
                 backend=type(backend if backend is not None else old).__name__)
        return old

    def remove(self, msg: RemoveStoragePages) -> None:
        """`clear_storage`: the backend's `remove(keys)` in a worker thread; `StorageCleared` back."""
        if not msg.keys:
            self._cleared(msg, 0, None)
            return
        self.removals += 1
        loop = asyncio.get_running_loop()
        fut = self._workers().submit(self.backend.remove, list(msg.keys))
        fut.add_done_callback(lambda f: _post_threadsafe(loop, self._post, StorageRemoved(msg, f)))

    def removed(self, msg: StorageRemoved) -> None:
        self.removals -= 1
        request = msg.request
        removed, error = 0, None
        try:
            removed = checked_count("remove", msg.future.result(), len(request.keys))
        except BaseException as exc:  # noqa: BLE001 - the caller of clear_storage gets it
            error = exc if isinstance(exc, Exception) else StorageError(repr(exc))
            log.warning("storage_clear_failed", pages=len(request.keys), error=repr(exc))
        self._cleared(request, removed, error)

    def _cleared(self, msg: RemoveStoragePages, removed: int, error: BaseException | None) -> None:
        log.info("storage_cleared", pages=len(msg.keys), removed=removed)
        try:
            msg.ack_to.put_internal(StorageCleared(removed, error, msg.caller))
        except RuntimeClosed as exc:
            msg.caller.set_exception(exc)

    # -- lifecycle ---------------------------------------------------------------------------
    def settled(self) -> bool:
        """Nothing a drain waits for: overdue ops do not hold one (their calls may never return;
        they stay in flight, their pages pinned, and their acks still go out if the calls return)."""
        return not self.timers and not self.removals

    def stop(self) -> None:
        """The actor stops: no deadline fires any more, ops in flight are abandoned (counted once,
        nobody acked: their calls may still run in worker threads, into pinned host pages that
        nothing reuses now; the backend's close waits for them, `CallGate`)."""
        for timer in self.timers.values():
            timer.cancel()
        self.timers.clear()
        self.gate.stop()
        if self.inflight:
            ops = sorted(self.inflight)
            self.counters["storage_ops_abandoned"] += len(ops)
            log.warning("storage_ops_abandoned_at_close", count=len(ops), ops=ops)
            self.abandoned.update(ops)
            self.inflight.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self.unregister()

    def register(self) -> None:
        """Register the page_first host pool with a backend that takes registrations (Mooncake), so
        that storage reads land in pool pages and writes leave from them with no staging copy."""
        register = getattr(self.backend, "register_buffer", None)
        if register is None:
            return
        for pool, rows in self.rank_pools:  # (every rank's, under one control plane)
            if rows is None:
                continue
            try:
                register(pool.buffer)
            except Exception as exc:  # noqa: BLE001 - e.g. the embedder registered it (or more) already
                log.debug("storage_register_host_pool_skipped", error=repr(exc))
            else:
                self._registered.append(pool.buffer)

    def unregister(self) -> None:
        if self._registered:
            if self.inflight or self.abandoned:  # a worker may still move pool pages:
                return  # keep it registered (the backend holds the tensor; its teardown unregisters it)
            buffers, self._registered = self._registered, []
            for buffer in buffers:
                try:
                    self.backend.unregister_buffer(buffer)
                except Exception as exc:  # noqa: BLE001 - backend closed first: nothing left to unregister
                    log.debug("storage_unregister_host_pool_failed", error=repr(exc))

    def stats(self) -> dict[str, Any]:
        return {**self.counters, "storage_pages_rejected": self.seal.rejected,
                **self.gate.stats(self._page_bytes * max(1, len(self.rank_pools))),
                **{name: hist.snapshot() for name, hist in self.latency.items()}}

    # -- helpers -------------------------------------------------------------------------------
    def _log_op(self, event: str, **fields: Any) -> None:
        """An op's failure: a warning while the backend is healthy, else debug (the change of its
        health was the line worth reading; an outage is not a line per op)."""
        (log.warning if self.gate.health.state is Health.HEALTHY else log.debug)(event, **fields)

    def _workers(self) -> ThreadPoolExecutor:
        if self._pool is None:
            # (as many as calls may run: a call waits in the gate, never in the pool's queue)
            self._pool = ThreadPoolExecutor(max_workers=self.gate.max_inflight + 1, thread_name_prefix="hicache-storage")
        return self._pool


def _reachable(backend: Any) -> bool:
    """The backend's own check that it is there (in a worker thread); an error says no."""
    try:
        return bool(backend.reachable())
    except Exception:  # noqa: BLE001 - a check that fails is an answer
        return False


def _post_threadsafe(loop: asyncio.AbstractEventLoop, post: Callable[[Any], None], msg: Any) -> None:
    """From a worker thread: `post(msg)` on the loop thread."""
    try:
        loop.call_soon_threadsafe(post, msg)
    except RuntimeError:  # the loop is closed: the runtime is gone, nobody to tell
        pass

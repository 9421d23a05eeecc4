"""The connector's worker side (`runtime.integrations.vllm`): the host pool, the copies and the
storage calls.

The copies run through a `PagedKVCopier` over the registered KV tensors. Host-only loads are
copied in `start_load_kv`; loads that read storage first run on a load thread, backups and
storage writes on a save thread, each in order. All are reported when done: loads through
`get_finished`'s receiving set, backups through its sending set (vLLM then frees the blocks),
outcomes through `CopyAcks`. Blocks a load could not fill go to
`get_block_ids_with_load_errors` (vLLM recomputes them).

On CPU, copies are plain tensor copies, so `wait_for_layer_load` and `save_kv_layer` have
nothing to do; a CUDA worker would start the loads on a side stream and wait per layer there.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.logger import init_logger

from runtime.errors import ConfigError
from runtime.integrations.vllm.config import storage_key
from runtime.integrations.vllm.messages import CopyAcks, JobResult, LoadJob, StorageOutcome, TieredMeta
from runtime.integrations.vllm.metrics import Deltas, HiCacheConnectorStats, report
from runtime.messages import TransferPlan
from runtime.storage.backend import read_prefix, write_pages
from runtime.storage.health import HealthTracked
from runtime.storage.integrity import PageSeal
from runtime.transfer.block_copier import PagedKVCopier
from runtime.tree.tiers.storage import StorageRequest

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = init_logger("vllm.hicache.worker")  # (under vLLM's logger: VLLM_LOGGING_LEVEL governs it)

__all__ = ["HiCacheConnectorWorker"]


class HiCacheConnectorWorker:
    # -- state -------------------------------------------------------------------
    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, host_blocks: int,
                 storage: HealthTracked | None) -> None:
        self.block_size = vllm_config.cache_config.block_size
        group = kv_cache_config.kv_cache_groups[0]
        self.page_bytes = len(group.layer_names) * group.kv_cache_spec.page_size_bytes  # (a block, every layer)
        self.counts = Deltas()  # bytes moved and storage failures (vLLM's metrics; `stats`)
        self._reported_health: int | None = None
        self.host_blocks = host_blocks
        self._kv_cache_config = kv_cache_config
        parallel = vllm_config.parallel_config
        self.tp_rank = parallel.rank % parallel.tensor_parallel_size  # (its storage keys are its rank's)
        self.storage = storage
        # a staging read from a local backend (files: the page cache or a local disk) runs in the
        # step that gets it, as a host load's copy does: its ack is in the same step's report, so
        # vLLM asks about the request once more, not once per step a thread takes to get the GIL
        # (in one process with vLLM's scheduler, hundreds of idle steps in bench_vllm_connector.py)
        self._stage_inline = storage is not None and getattr(storage.inner, "exists_is_local", False) is True
        # a load from host pages runs in the step that gets it (whole-block CPU copies); off, it
        # runs on the load lane's thread and lands steps later, as a CUDA copy on a side stream
        # would (the connector fuzzer runs both)
        self._load_inline = True
        # page tags written and checked here (docs/STORAGE.md, "Page integrity"; keyed by HICACHE_STORAGE_KEY)
        self.seal = PageSeal(storage_key())
        self.copier: PagedKVCopier | None = None
        self._jobs: deque[tuple[Future[JobResult], str, str]] = deque()  # (result, kind, request id), in order
        # one thread for loads (a request waits for its load) and one for backups and storage
        # writes, so that loads never queue behind the writes of finished requests; each runs
        # its jobs in order, and no load depends on a backup or write still in flight (a backup's
        # pages join the tree, and a write is issued, only once the backup has landed)
        self._executors: dict[str, ThreadPoolExecutor] = {}
        self._outcomes: dict[int, str | None] = {}
        self._storage_outcomes: dict[int, StorageOutcome] = {}
        self._load_errors: set[int] = set()
        self._sent: set[str] = set()  # requests whose backups ran, not yet reported
        self._finished: set[str] = set()  # requests vLLM said finished, not yet reported
        self._received: set[str] = set()  # requests whose async loads ran, not yet reported

    # -- vLLM's worker calls ----------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.copier = PagedKVCopier(kv_caches, self.block_size, self.host_blocks)
        if self.storage is not None:
            spec = self._kv_cache_config.kv_cache_groups[0].kv_cache_spec
            want = (spec.num_kv_heads, self.block_size, 2 * spec.head_size)
            if self.copier.layout.kv_first or self.copier.layout.block != want:
                raise ConfigError(f"storage pages are vLLM 0.33 blocks {want}; the engine registered "
                                  f"{self.copier.layout}")

    def start_load_kv(self, meta: TieredMeta) -> None:
        for job in meta.loads:
            if job.load.read is None and self._load_inline:
                # host pages only: copied here and now (vLLM still sees an asynchronous load, done
                # at this step's report); a worker thread would wait on the GIL for each copy
                self._record("load", job.rid, self._load(job))
            else:  # a storage read first: on the load lane's thread
                self._submit("load", job.rid, self._load, job)
        for request in meta.stages:
            if self._stage_inline:  # a local file read of a few pages: here, acked in this step's report
                self._record("stage", "", self._stage(request))
            else:  # (a remote store's latency): on the load lane's thread
                self._submit("stage", "", self._stage, request)

    def wait_for_save(self, meta: TieredMeta) -> None:
        for rid, plan in meta.backups:
            self._submit("backup", rid, self._backup, plan)
        for request in meta.storage_writes:
            self._submit("write", "", self._write, request)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._collect()
        # vLLM takes a request back only after it named it finished (its blocks are ours till then)
        self._finished.update(finished_req_ids)
        sent = self._sent & self._finished
        self._sent -= sent
        self._finished -= sent
        received, self._received = self._received, set()
        return (sent or None), (received or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        self._collect()
        if not self._outcomes and not self._storage_outcomes:
            return None
        acks = CopyAcks.of_worker(self._outcomes, self._storage_outcomes)
        self._outcomes, self._storage_outcomes = {}, {}
        return acks

    def get_kv_connector_stats(self) -> HiCacheConnectorStats | None:
        """What this worker moved since the last report (`runtime.integrations.vllm.metrics`)."""
        health = self.storage.state.level if self.storage is not None else None
        stats = report(self.counts.take(), "storage_health_worker", health, self._reported_health)
        if stats is not None:
            self._reported_health = health
        return stats

    def stats(self) -> dict[str, Any]:
        """This worker's totals and, with storage, its backend's (health included)."""
        out: dict[str, Any] = dict(self.counts.totals)
        if self.storage is not None:
            out["storage"] = self.storage.stats()
        return out

    def shutdown(self) -> None:
        for executor in self._executors.values():
            executor.shutdown(wait=True)
        if self.storage is not None:
            self.storage.close()

    # -- helpers -----------------------------------------------------------------------
    def _submit(self, kind: str, rid: str, fn: Any, arg: Any) -> None:
        lane = "save" if kind in ("backup", "write") else "load"
        executor = self._executors.get(lane)
        if executor is None:
            executor = self._executors[lane] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hicache-{lane}")
        self._jobs.append((executor.submit(fn, arg), kind, rid))

    def _collect(self) -> None:
        """Record the jobs that ended (each lane's in its order; a job's outcome is reported once)."""
        if not any(fut.done() for fut, _, _ in self._jobs):
            return
        left: deque[tuple[Future[JobResult], str, str]] = deque()
        for fut, kind, rid in self._jobs:
            if fut.done():
                self._record(kind, rid, fut.result())
            else:
                left.append((fut, kind, rid))
        self._jobs = left

    def _record(self, kind: str, rid: str, result: JobResult) -> None:
        """A job ended: its outcomes go to the next `CopyAcks`, its request to the next report."""
        outcomes, storage, errors = result
        self._outcomes.update(outcomes)
        self._storage_outcomes.update(storage)
        self._load_errors |= errors
        if kind == "load":
            self._received.add(rid)
        elif kind == "backup":
            self._sent.add(rid)

    def _load(self, job: LoadJob) -> JobResult:
        """A storage read (if any), then the copy of what the tiers hold into the blocks.
        Never raises: a failure is an outcome, its blocks load errors."""
        copier = self._copier()
        outcomes: dict[int, str | None] = {}
        storage: dict[int, StorageOutcome] = {}
        errors = set(job.unloadable)
        load = job.load
        usable = None
        if load.read is not None:
            got, err = self._read(load.read)
            storage[load.read.op_id] = (got, err, ())
            usable = load.read_at + max(0, got - load.read_skip)
        if load.plan is not None:
            blocks = (load.plan.transfers[0].dst[:: self.block_size] // self.block_size).tolist()
            if usable is not None and usable < len(blocks):
                errors.update(blocks[usable:])
            try:
                copier.run(load.plan, usable)
                outcomes[load.plan.op_id] = None
                self.counts.add(loaded_bytes=(len(blocks) if usable is None else min(usable, len(blocks)))
                                * self.page_bytes)
            except Exception as exc:  # noqa: BLE001
                logger.warning("HiCache load copy %d failed: %r", load.plan.op_id, exc)
                outcomes[load.plan.op_id] = repr(exc)
                errors.update(blocks)
        return outcomes, storage, errors

    def _read(self, request: StorageRequest) -> tuple[int, str | None]:
        """A storage read into its host pages: (leading pages read whole and verified, error).
        Never raises: a failure is an outcome."""
        copier = self._copier()
        refused = self.seal.rejected  # (the load lane is the seal's only checker)
        try:
            got = read_prefix(self.storage, self._own_keys(request),
                              [copier.page_buffer(p) for p in request.pages], self.seal)
            self.counts.add(storage_read_bytes=got * self.page_bytes,
                            storage_pages_refused=self.seal.rejected - refused)
            return got, None
        except Exception as exc:  # noqa: BLE001 - reported, never a crashed worker
            self.counts.add(storage_read_failures=1)  # (the health tracker logs the backend's state)
            logger.debug("HiCache storage read %d failed: %r", request.op_id, exc)
            return 0, repr(exc)

    def _stage(self, request: StorageRequest) -> JobResult:
        """A staging read: storage pages into host pages, acked like any storage op."""
        got, err = self._read(request)
        return {}, {request.op_id: (got, err, ())}, set()

    def _backup(self, plan: TransferPlan) -> JobResult:
        try:
            self._copier().run(plan)
            self.counts.add(stored_bytes=len(plan.transfers[0].src) // self.block_size * self.page_bytes)
            return {plan.op_id: None}, {}, set()
        except Exception as exc:  # noqa: BLE001 - reported, never a crashed worker
            logger.warning("HiCache backup copy %d failed: %r", plan.op_id, exc)
            return {plan.op_id: repr(exc)}, {}, set()

    def _write(self, request: StorageRequest) -> JobResult:
        op_id, keys, pages = request.op_id, self._own_keys(request), request.pages
        copier = self._copier()
        try:
            ok = write_pages(self.storage, keys, [copier.page_buffer(p) for p in pages], self.seal)
            written = sum(ok)
            self.counts.add(storage_written_bytes=written * self.page_bytes, storage_write_failures=len(ok) - written)
            return {}, {op_id: (0, None, ok)}, set()
        except Exception as exc:  # noqa: BLE001
            self.counts.add(storage_write_failures=len(keys))  # (the health tracker logs the backend's state)
            logger.debug("HiCache storage write %d failed: %r", op_id, exc)
            return {}, {op_id: (0, repr(exc), ())}, set()

    def _own_keys(self, request: StorageRequest) -> tuple[bytes, ...]:
        """This worker's keys of a storage op: its rank's list (its own heads), or the one list."""
        return request.rank_keys[self.tp_rank] if request.rank_keys else request.keys

    def _copier(self) -> PagedKVCopier:
        if self.copier is None:
            raise ConfigError("HiCacheConnector: no KV caches registered")
        return self.copier

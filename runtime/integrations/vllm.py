"""The runtime's host and storage tiers as a vLLM v1 KV connector (tiers-only mode; vLLM 0.33).

vLLM owns the device KV blocks and the request lifecycle; the runtime owns the host tier and,
optionally, a storage tier behind it. Load it with::

    --kv-transfer-config '{"kv_connector": "HiCacheConnector",
                           "kv_connector_module_path": "runtime.integrations.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"host_blocks": 4096,
                                                         "storage_dir": "/mnt/kv"}}'

(``kv_load_failure_policy: recompute``: a load that fails makes vLLM recompute the blocks from
the first failed one on; with vLLM's default ``fail`` the request ends with an error.)
docs/VLLM.md has every option and how they map to vLLM's and LMCache's.

Split as vLLM splits a connector:

- scheduler side (vLLM's synchronous scheduler calls it directly): a `TiersOnlyCore` decides.
  `get_num_new_matched_tokens` answers, without side effects, how many tokens past vLLM's own
  prefix-cache hit the host tier, then storage, hold; every hit is an asynchronous load (the
  request waits in ``WAITING_FOR_REMOTE_KVS`` until the worker reports it: docs/VLLM.md says why
  no load is synchronous).
  `update_state_after_alloc` turns it into a load into the blocks vLLM allocated;
  `request_finished` backs up the request's computed blocks the tier lacks and returns
  ``delay_free_blocks=True`` while that backup reads them, so vLLM never frees a block a copy
  still reads (seed 000, enforced by vLLM's own free); a landed backup is written through to
  storage; `build_connector_meta` carries the step's work (`TieredMeta`: immutable, picklable)
  to the workers; `update_connector_output` applies the workers' acks (`CopyAcks`, through vLLM's
  worker-metadata channel); with vLLM's KV events on, `take_events` hands vLLM's scheduler the
  host tier's and storage's events under vLLM's block hashes (`runtime.integrations.vllm_events`).
- worker side: the host pool, the copies (`PagedKVCopier` over the registered KV tensors) and the
  storage calls. Host-only loads are copied in `start_load_kv`; loads that read storage first run
  on a load thread, backups and storage writes on a save thread, each in order. All are reported
  when done: loads through `get_finished`'s receiving set, backups through its sending set (vLLM
  then frees the blocks), outcomes through `CopyAcks`. Blocks a load could not
  fill go to `get_block_ids_with_load_errors` (vLLM recomputes them).

On CPU, copies are plain tensor copies, so `wait_for_layer_load` and `save_kv_layer` have
nothing to do; a CUDA worker would start the loads on a side stream and wait per layer there.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Hashable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from runtime.errors import ConfigError
from runtime.integrations.vllm_events import ConnectorEvents
from runtime.messages import TransferPlan
from runtime.storage.backend import read_prefix, write_pages
from runtime.storage.file_backend import FileBackend
from runtime.storage.hashing import KVIdentity, tp_shard
from runtime.storage.integrity import PageSeal
from runtime.trace import get_logger
from runtime.transfer.block_copier import PagedKVCopier
from runtime.tree.storage_tier import StorageRequest
from runtime.tree.tiers_only import TierLoad, TiersOnlyCore
from runtime.validation import tokens as checked_tokens

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = get_logger("hicache.vllm")

__all__ = ["HiCacheConnector", "TieredMeta", "LoadJob", "CopyAcks"]


@dataclass(frozen=True)
class LoadJob:
    """A load into one request's blocks: what the core started (`TierLoad`: the plan and the
    storage read it needs first, if any) and the blocks promised to vLLM that nothing will fill
    (load errors)."""

    rid: str
    load: TierLoad
    unloadable: tuple[int, ...] = ()


@dataclass(frozen=True)
class TieredMeta(KVConnectorMetadata):
    """One step's work for the workers: loads (asynchronous, reported through `get_finished`),
    backups of finished requests, storage writes."""

    loads: tuple[LoadJob, ...] = ()
    backups: tuple[tuple[str, TransferPlan], ...] = ()  # (request id, plan)
    storage_writes: tuple[StorageRequest, ...] = ()


StorageOutcome = tuple[int, str | None, tuple[bool, ...]]  # pages read, error, pages written
# a worker job's outcome: copies' outcomes, storage ops' outcomes, blocks a load left unfilled
JobResult = tuple[dict[int, str | None], dict[int, StorageOutcome], set[int]]


@dataclass
class CopyAcks(KVConnectorWorkerMetadata):
    """Workers -> scheduler: each copy's outcome (None: done; else what failed) and each storage
    op's. An op failed on any worker failed (each worker holds its own shard of every page); a
    storage op's pages are the minimum over workers, a write's per-page flags the AND.
    `reports`: per op, how many workers' outcomes this holds (workers finish an op at different
    steps; the scheduler applies it once every worker reported it)."""

    outcomes: dict[int, str | None] = field(default_factory=dict)
    storage: dict[int, StorageOutcome] = field(default_factory=dict)
    reports: dict[int, int] = field(default_factory=dict)

    @classmethod
    def of_worker(cls, outcomes: dict[int, str | None], storage: dict[int, StorageOutcome]) -> "CopyAcks":
        return cls(outcomes, storage, dict.fromkeys([*outcomes, *storage], 1))

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, CopyAcks)
        merged = dict(self.outcomes)
        for op, err in other.outcomes.items():
            merged[op] = merged.get(op) or err
        stored = dict(self.storage)
        for op, (pages, err, ok) in other.storage.items():
            if op in stored:
                p0, e0, ok0 = stored[op]
                pages, err, ok = min(p0, pages), e0 or err, tuple(a and b for a, b in zip(ok0, ok))
            stored[op] = (pages, err, ok)
        reports = dict(self.reports)
        for op, n in other.reports.items():
            reports[op] = reports.get(op, 0) + n
        return CopyAcks(merged, stored, reports)

    def split(self, workers: int) -> tuple["CopyAcks", "CopyAcks"]:
        """(the ops every one of `workers` reported, the rest)."""
        done = {op for op, n in self.reports.items() if n >= workers}
        parts = tuple(CopyAcks({op: e for op, e in self.outcomes.items() if (op in done) == whole},
                               {op: o for op, o in self.storage.items() if (op in done) == whole},
                               {op: n for op, n in self.reports.items() if (op in done) == whole})
                      for whole in (True, False))
        return parts[0], parts[1]


@dataclass(frozen=True)
class _Asked:
    """What `get_num_new_matched_tokens` answered last for a waiting request."""

    local: int  # vLLM's own hit it was asked past
    tokens: np.ndarray  # the request's tokens, checked (vLLM asks again every step it waits)
    keys: list[bytes]  # their page keys (storage)


def _namespace(request: Request) -> Hashable:
    """What keeps KV of one prompt apart from another's with the same tokens: the LoRA adapter
    and vLLM's cache salt (the same inputs as vLLM's own block hashes)."""
    lora = request.lora_request.lora_name if request.lora_request is not None else None
    salt = request.cache_salt
    return None if lora is None and salt is None else ("vllm", lora, salt)


class HiCacheConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.HOST
    _namespace = staticmethod(_namespace)  # (what keeps tenants' KV apart; a test variant breaks it)

    # -- state -------------------------------------------------------------------
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)
        if kv_cache_config is None:
            raise ConfigError("HiCacheConnector needs vLLM's KVCacheConfig (vLLM >= 0.33)")
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ConfigError("HiCacheConnector supports one KV cache group (full attention) for now")
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        if type(spec) is not FullAttentionSpec:
            # a sliding-window group's blocks out of the window are vLLM's null block (a backup would
            # store it as those tokens' KV), a Mamba group's are states, an MLA group's latents:
            # none is one block of every token's K and V, which the tiers and storage pages hold
            raise ConfigError(f"HiCacheConnector supports a FullAttentionSpec KV cache group for now, "
                              f"got {type(spec).__name__}")
        self.block_size = vllm_config.cache_config.block_size
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        unknown = set(extra) - {"host_blocks", "storage_dir", "storage_cap_bytes", "model_id", "weight_version",
                                "storage_key"}
        if unknown:
            raise ConfigError(f"kv_connector_extra_config: unknown options {sorted(unknown)}")
        host_blocks = extra.get("host_blocks", kv_cache_config.num_blocks)
        if type(host_blocks) is not int or host_blocks <= 0:
            raise ConfigError(f"kv_connector_extra_config.host_blocks must be a positive int, got {host_blocks!r}")
        self.host_blocks = host_blocks
        parallel = vllm_config.parallel_config
        # tensor parallelism: every worker stores its own heads under its own keys, which the
        # scheduler's storage ops carry for every rank (`StorageRequest.rank_keys`); the scheduler
        # applies an op once every worker reported it
        self.tp_size = parallel.tensor_parallel_size
        self.tp_rank = parallel.rank % self.tp_size  # (a worker's; the scheduler's is 0)
        self._workers = parallel.world_size
        self._partial_acks = CopyAcks()  # ops some workers reported, not all yet
        self.identity = _identity(vllm_config, kv_cache_config, extra)
        self.storage = _open_storage(vllm_config, kv_cache_config, extra)
        # page tags written and checked by every worker (keyed: the option, else HICACHE_STORAGE_KEY)
        self.seal = PageSeal(extra.get("storage_key", os.environ.get("HICACHE_STORAGE_KEY")))
        # scheduler side
        self.core: TiersOnlyCore | None = None
        self._asked: dict[str, _Asked] = {}  # waiting requests' last answers (update_state_after_alloc needs them)
        # live requests' token ids as checked arrays, from their lookup to their finish: a
        # request's list is converted once, and only the tokens vLLM appends after it later
        self._token_ids: dict[str, np.ndarray] = {}
        self._loads: list[LoadJob] = []
        # requests whose load the workers have not reported received yet: vLLM frees a finished
        # request's blocks at the first report naming it, so such a request is never backed up too
        self._awaiting: set[str] = set()
        # requests a load covered less of than the lookup promised (host room short, pages lost):
        # the token position it reached, past which they are promised nothing again (vLLM asks
        # again after recomputing the shortfall; the same promise would fail the same way)
        self._reached: dict[str, int] = {}
        self._backups: list[tuple[str, TransferPlan]] = []
        # worker side
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
        if role is KVConnectorRole.SCHEDULER:
            self.core = TiersOnlyCore(self.block_size, host_blocks * self.block_size, kv_cache_config.num_blocks)
            if self.storage is not None:
                self.core.enable_storage(self.identity, self.storage.exists_prefix, self.tp_size)
        # KV events of the host tier and storage (`take_events`): on with vLLM's own
        self.events: ConnectorEvents | None = None
        kv_events = vllm_config.kv_events_config
        if self.core is not None and kv_events is not None and kv_events.enable_kv_cache_events:
            # (vLLM hashes requests' blocks at hash_block_size, which the engine core sets first)
            self.events = ConnectorEvents(self.core, self.identity, self.block_size,
                                          kv_cache_config.hash_block_size or self.block_size)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a backup lost to preemption is a future miss

    # -- scheduler side ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.core is not None
        rid = request.request_id
        asked = self._asked.get(rid)
        namespace = self._namespace(request)
        if asked is not None and len(asked.tokens) == request.num_tokens:  # asked again while it waits
            tokens, keys = asked.tokens, asked.keys
        else:
            tokens = self._tokens_of(request)
            keys = self.core.page_keys(tokens, namespace)
        hit = self.core.lookup(tokens, namespace, num_computed_tokens, keys)
        total = hit.total
        reached = self._reached.get(rid)
        if reached is not None:
            total = min(total, max(0, reached - num_computed_tokens))
        self._asked[rid] = _Asked(num_computed_tokens, tokens, keys)
        # every load is asynchronous: vLLM 0.33 caches a synchronous load's blocks as it allocates
        # them, and under kv_load_failure_policy="recompute" a failed one's blocks stay in its
        # prefix cache; a request preempted or aborted before recomputing them leaves them there
        # for the next request with that prefix to read (found by the connector fuzzer)
        return total, total > 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.core is not None
        rid = request.request_id
        asked = self._asked.pop(rid, None)
        if num_external_tokens == 0:
            return
        assert asked is not None, "vLLM allocates an external hit only after asking for it"
        (block_ids,) = blocks.get_block_ids()
        local = asked.local
        ld = self.core.load(rid, asked.tokens, self._namespace(request), local, num_external_tokens, block_ids, asked.keys)
        # blocks promised but not to be filled: the tiers lost pages since the lookup (vLLM recomputes them)
        first, end = (local + ld.tokens) // self.block_size, (local + num_external_tokens) // self.block_size
        if first < end:
            self._reached[rid] = local + ld.tokens
        # reported through get_finished whatever happens (vLLM waits for it)
        self._loads.append(LoadJob(rid, ld, tuple(block_ids[first:end])))
        if self.events is not None and ld.read is not None:  # (its pages join the tier at its ack)
            self.events.learn(ld.read[0], request, asked.keys[:(local + num_external_tokens) // self.block_size])
        self._awaiting.add(rid)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.core is not None
        meta = TieredMeta(tuple(self._loads), tuple(self._backups),
                          tuple(self.core.take_storage_writes()))
        self._loads, self._backups = [], []
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.core is not None
        self._awaiting.difference_update(connector_output.finished_recving or ())
        acks = connector_output.kv_connector_worker_meta
        if acks is None:
            return
        if not isinstance(acks, CopyAcks):
            raise ConfigError(f"unexpected worker metadata {type(acks).__name__}")
        acks, self._partial_acks = self._partial_acks.aggregate(acks).split(self._workers)
        for op_id, error in sorted(acks.outcomes.items()):
            self.core.apply_ack(op_id, error)
        for op_id, (pages, error, ok) in sorted(acks.storage.items()):  # (after the loads that pin their pages)
            self.core.apply_storage_ack(op_id, pages, error, ok)
        if self.events is not None:
            self.events.acked(acks.outcomes)
            self.events.acked(acks.storage)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The host tier's (CPU) and storage's (STORAGE) KV events since the last call, named by
        vLLM's block hashes; vLLM's scheduler publishes them with its own GPU events each step."""
        return self.events.take() if self.events is not None else ()

    def has_pending_push_work(self) -> bool:
        """Copies or storage writes in flight keep vLLM stepping until their acks."""
        return self.core is not None and self.core.busy()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Back up the request's computed blocks the tier lacks; vLLM keeps them until the
        backup ran (`get_finished` reports the request). A request finished while its load runs
        (aborted) is not backed up; vLLM keeps its blocks until the load is reported."""
        assert self.core is not None
        rid = request.request_id
        self._asked.pop(rid, None)
        self._reached.pop(rid, None)
        if rid in self._awaiting:  # (its blocks do not hold their KV yet; the load's report frees them)
            self._token_ids.pop(rid, None)
            self.core.finish(rid)
            return True, None
        if request.status is RequestStatus.FINISHED_ERROR:  # (e.g. a failed load under vLLM's `fail` policy)
            self._token_ids.pop(rid, None)
            return self.core.finish(rid), None  # its KV may never have arrived: nothing is backed up
        tokens = self._tokens_of(request)
        del self._token_ids[rid]
        namespace = self._namespace(request)
        plan = self.core.backup(rid, tokens, namespace, request.num_computed_tokens, block_ids)
        if plan is not None:
            self._backups.append((rid, plan))
            if self.events is not None:  # (its pages join the tier at its ack)
                self.events.learn_tokens(plan.op_id, request, tokens, namespace,
                                         request.num_computed_tokens // self.block_size)
        return self.core.finish(rid), None

    # -- worker side -------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.copier = PagedKVCopier(kv_caches, self.block_size, self.host_blocks)
        if self.storage is not None:
            spec = self._kv_cache_config.kv_cache_groups[0].kv_cache_spec
            want = (spec.num_kv_heads, self.block_size, 2 * spec.head_size)
            if self.copier.layout.kv_first or self.copier.layout.block != want:
                raise ConfigError(f"storage pages are vLLM 0.33 blocks {want}; the engine registered "
                                  f"{self.copier.layout}")

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        for job in self._meta().loads:
            if job.load.read is None:
                # host pages only: copied here and now (vLLM still sees an asynchronous load, done
                # at this step's report); a worker thread would wait on the GIL for each copy
                self._record("load", job.rid, self._load(job))
            else:  # a storage read first: on the load lane's thread
                self._submit("load", job.rid, self._load, job)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous: a request's forward runs once its load is reported done."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Backups copy whole blocks of finished requests after the forward (`wait_for_save`)."""

    def wait_for_save(self) -> None:
        meta = self._meta()
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

    def shutdown(self) -> None:
        for executor in self._executors.values():
            executor.shutdown(wait=True)
        if self.storage is not None:
            self.storage.close()

    # -- helpers -----------------------------------------------------------------------
    def _tokens_of(self, request: Request) -> np.ndarray:
        """The request's token ids as a checked array, kept until it finishes. vLLM only appends
        to a request's tokens, so a kept array is extended by the new tail; a kept array that is
        longer than the list, or whose last token the list no longer has there, is not used."""
        ids = request.all_token_ids
        rid = request.request_id
        known = self._token_ids.get(rid)
        n = 0 if known is None else len(known)
        if n == 0 or n > len(ids) or ids[n - 1] != known[-1]:  # (a cheap check of that contract)
            tokens = checked_tokens(np.asarray(ids))
        elif n == len(ids):
            tokens = known
        else:
            tokens = np.concatenate((known, checked_tokens(np.asarray(ids[n:]))))
        self._token_ids[rid] = tokens
        return tokens

    def _meta(self) -> TieredMeta:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TieredMeta)
        return meta

    def _submit(self, kind: str, rid: str, fn: Any, arg: Any) -> None:
        lane = "load" if kind == "load" else "save"
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
            op_id, keys, pages = load.read.op_id, self._own_keys(load.read), load.read.pages
            try:
                got, err = read_prefix(self.storage, keys, [copier.page_buffer(p) for p in pages], self.seal), None
            except Exception as exc:  # noqa: BLE001 - reported, never a crashed worker
                got, err = 0, repr(exc)
                log.warning("vllm_storage_read_failed", op=op_id, rid=job.rid, error=err)
            storage[op_id] = (got, err, ())
            usable = load.read_at + max(0, got - load.read_skip)
        if load.plan is not None:
            blocks = (load.plan.transfers[0].dst[:: self.block_size] // self.block_size).tolist()
            if usable is not None and usable < len(blocks):
                errors.update(blocks[usable:])
            try:
                copier.run(load.plan, usable)
                outcomes[load.plan.op_id] = None
            except Exception as exc:  # noqa: BLE001
                log.warning("vllm_copy_failed", op=load.plan.op_id, direction="load", error=repr(exc))
                outcomes[load.plan.op_id] = repr(exc)
                errors.update(blocks)
        return outcomes, storage, errors

    def _backup(self, plan: TransferPlan) -> JobResult:
        try:
            self._copier().run(plan)
            return {plan.op_id: None}, {}, set()
        except Exception as exc:  # noqa: BLE001 - reported, never a crashed worker
            log.warning("vllm_copy_failed", op=plan.op_id, direction="backup", error=repr(exc))
            return {plan.op_id: repr(exc)}, {}, set()

    def _write(self, request: StorageRequest) -> JobResult:
        op_id, keys, pages = request.op_id, self._own_keys(request), request.pages
        copier = self._copier()
        try:
            ok = write_pages(self.storage, keys, [copier.page_buffer(p) for p in pages], self.seal)
            return {}, {op_id: (0, None, ok)}, set()
        except Exception as exc:  # noqa: BLE001
            log.warning("vllm_storage_write_failed", op=op_id, error=repr(exc))
            return {}, {op_id: (0, repr(exc), ())}, set()

    def _own_keys(self, request: StorageRequest) -> tuple[bytes, ...]:
        """This worker's keys of a storage op: its rank's list (its own heads), or the one list."""
        return request.rank_keys[self.tp_rank] if request.rank_keys else request.keys

    def _copier(self) -> PagedKVCopier:
        if self.copier is None:
            raise ConfigError("HiCacheConnector: no KV caches registered")
        return self.copier


def _identity(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, extra: dict[str, Any]) -> KVIdentity:
    """What makes a stored page reusable by another instance: the model and its weights, the KV
    dtype and shape (a rank's heads), the page layout (a vLLM 0.33 block: heads x block x K|V,
    every layer) and, under tensor parallelism, rank 0's shard (the scheduler's storage tier
    derives every rank's from it)."""
    group = kv_cache_config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    model = vllm_config.model_config
    layout = f"vllm-block:{spec.num_kv_heads}x{spec.block_size}x{2 * spec.head_size}"
    return KVIdentity(str(extra.get("model_id", model.model)), str(extra.get("weight_version", model.revision or "")),
                      str(spec.dtype).removeprefix("torch."), len(group.layer_names), spec.num_kv_heads,
                      spec.head_size, layout, shard=tp_shard(0, vllm_config.parallel_config.tensor_parallel_size))


def _open_storage(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, extra: dict[str, Any]) -> FileBackend | None:
    path = extra.get("storage_dir")
    if path is None:
        return None
    if not isinstance(path, str) or not path:
        raise ConfigError(f"kv_connector_extra_config.storage_dir must be a directory path, got {path!r}")
    # Under tensor parallelism each rank holds its own heads under its own keys (the scheduler's
    # storage ops carry every rank's). Pipeline stages hold different layers of one page: no
    # per-stage keys yet, so a stage would read another stage's layers
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise ConfigError("HiCacheConnector's storage tier supports pipeline_parallel_size 1 for now")
    group = kv_cache_config.kv_cache_groups[0]  # a page: one block of every layer
    return FileBackend(path, len(group.layer_names) * group.kv_cache_spec.page_size_bytes,
                       cap_bytes=extra.get("storage_cap_bytes"))

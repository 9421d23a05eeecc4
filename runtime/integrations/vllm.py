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

Split as vLLM splits a connector (its OffloadingConnector): this class is a thin facade that
vLLM loads and calls, and hands each call to its role's side:

- scheduler side (`runtime.integrations.vllm_scheduler.HiCacheConnectorScheduler`): a
  `TiersOnlyCore` decides what is a hit, loads it into the blocks vLLM allocated, backs up
  finished requests' blocks and writes them through to storage;
- worker side (`runtime.integrations.vllm_worker.HiCacheConnectorWorker`): the host pool, the
  copies and the storage calls, reported back through `get_finished` and `CopyAcks`;
- what they send each other: `runtime.integrations.vllm_messages`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from runtime.errors import ConfigError
from runtime.integrations.vllm_messages import CopyAcks, LoadJob, TieredMeta
from runtime.integrations.vllm_metrics import HiCacheConnectorStats, HiCachePromMetrics
from runtime.integrations.vllm_scheduler import HiCacheConnectorScheduler
from runtime.integrations.vllm_worker import HiCacheConnectorWorker
from runtime.storage.file_backend import FileBackend
from runtime.storage.hashing import KVIdentity, tp_shard
from runtime.storage.health import Health, HealthTracked

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["HiCacheConnector", "TieredMeta", "LoadJob", "CopyAcks"]

logger = init_logger("vllm.hicache.connector")  # (under vLLM's logger: VLLM_LOGGING_LEVEL governs it)


class HiCacheConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.HOST
    # each role's side (a test variant swaps one for a broken subclass)
    Scheduler: type[HiCacheConnectorScheduler] = HiCacheConnectorScheduler
    Worker: type[HiCacheConnectorWorker] = HiCacheConnectorWorker

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
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        unknown = set(extra) - {"host_blocks", "storage_dir", "storage_cap_bytes", "model_id", "weight_version"}
        if unknown:
            raise ConfigError(f"kv_connector_extra_config: unknown options {sorted(unknown)}")
        host_blocks = extra.get("host_blocks", kv_cache_config.num_blocks)
        if type(host_blocks) is not int or host_blocks <= 0:
            raise ConfigError(f"kv_connector_extra_config.host_blocks must be a positive int, got {host_blocks!r}")
        identity = _identity(vllm_config, kv_cache_config, extra)
        opened = _open_storage(vllm_config, kv_cache_config, extra)
        side = "scheduler" if role is KVConnectorRole.SCHEDULER else "worker"
        # (a failing backend: its health tracked, its calls held back with backoff while it is down)
        storage = None if opened is None else HealthTracked(opened, on_change=_health_logger(side))
        self.connector_scheduler: HiCacheConnectorScheduler | None = None
        self.connector_worker: HiCacheConnectorWorker | None = None
        if role is KVConnectorRole.SCHEDULER:
            self.connector_scheduler = self.Scheduler(vllm_config, kv_cache_config, host_blocks, identity, storage)
        else:
            self.connector_worker = self.Worker(vllm_config, kv_cache_config, host_blocks, storage)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a backup lost to preemption is a future miss

    @property
    def scheduler(self) -> HiCacheConnectorScheduler:
        assert self.connector_scheduler is not None, "a scheduler-side call on a worker's connector"
        return self.connector_scheduler

    @property
    def worker(self) -> HiCacheConnectorWorker:
        assert self.connector_worker is not None, "a worker-side call on the scheduler's connector"
        return self.connector_worker

    # -- scheduler side ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self.scheduler.take_events()

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        return self.scheduler.get_external_cache_hit_sources(request, num_external_tokens)

    def has_pending_push_work(self) -> bool:
        return self.connector_scheduler is not None and self.connector_scheduler.has_pending_push_work()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    # -- worker side -------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous: a request's forward runs once its load is reported done."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Backups copy whole blocks of finished requests after the forward (`wait_for_save`)."""

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.build_connector_worker_meta()

    # -- both ----------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This side's stats since its last report (vLLM merges the workers' and the scheduler's
        and hands them to its stat loggers: `runtime.integrations.vllm_metrics`)."""
        side = self.connector_scheduler or self.connector_worker
        return side.get_kv_connector_stats() if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return HiCacheConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> HiCachePromMetrics:
        return HiCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        for side in (self.connector_worker, self.connector_scheduler):
            if side is not None:
                side.shutdown()

    def _meta(self) -> TieredMeta:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TieredMeta)
        return meta


def _health_logger(side: str) -> Any:
    """One log line (vLLM's logging) per change of a side's storage health."""
    def changed(old: Health, new: Health, reason: str) -> None:
        (logger.info if new is Health.HEALTHY else logger.warning)(
            "HiCache storage (%s side) %s -> %s: %s", side, old.value, new.value, reason)
    return changed


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

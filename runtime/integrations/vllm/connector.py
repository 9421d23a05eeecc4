"""The runtime's host and storage tiers as a vLLM v1 KV connector (tiers-only mode; vLLM 0.33).

vLLM owns the device KV blocks and the request lifecycle; the runtime owns the host tier and,
optionally, a storage tier behind it. Load it with::

    --kv-transfer-config '{"kv_connector": "HiCacheConnector",
                           "kv_connector_module_path": "runtime.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"host_bytes": "64GiB",
                                                         "storage_dir": "/mnt/kv"}}'

(vLLM's default ``kv_load_failure_policy``, ``fail``, stays: a reported hit is held, and a
storage hit is read into the host tier before it is reported.)
`runtime.integrations.vllm.config` reads and checks the options; docs/VLLM.md has every option
and how they map to vLLM's and LMCache's.

Split as vLLM splits a connector (its OffloadingConnector): this class is a thin facade that
vLLM loads and calls, and hands each call to its role's side:

- scheduler side (`runtime.integrations.vllm.scheduler.HiCacheConnectorScheduler`): a
  `TiersOnlyCore` decides what is a hit, loads it into the blocks vLLM allocated, backs up
  finished requests' blocks and writes them through to storage;
- worker side (`runtime.integrations.vllm.worker.HiCacheConnectorWorker`): the host pool, the
  copies and the storage calls, reported back through `get_finished` and `CopyAcks`;
- what they send each other: `runtime.integrations.vllm.messages`.
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
from runtime.integrations.vllm.config import ConnectorConfig, open_storage
from runtime.integrations.vllm.messages import CopyAcks, LoadJob, TieredMeta
from runtime.integrations.vllm.metrics import HiCacheConnectorStats, HiCachePromMetrics
from runtime.integrations.vllm.scheduler import HiCacheConnectorScheduler
from runtime.integrations.vllm.worker import HiCacheConnectorWorker
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
        # every option checked (a `ConfigError` naming its key) before anything is created
        self.config = ConnectorConfig.from_vllm(vllm_config, kv_cache_config)
        host_blocks, identity = self.config.host_blocks, self.config.identity
        opened = _open_storage(self.config, role is not KVConnectorRole.SCHEDULER)  # (workers lend Mooncake memory)
        side = "scheduler" if role is KVConnectorRole.SCHEDULER else "worker"
        # (a failing backend: its health tracked, its calls held back with backoff while it is down)
        storage = None if opened is None else HealthTracked(opened, on_change=_health_logger(side))
        self.connector_scheduler: HiCacheConnectorScheduler | None = None
        self.connector_worker: HiCacheConnectorWorker | None = None
        if role is KVConnectorRole.SCHEDULER:
            self.connector_scheduler = self.Scheduler(vllm_config, kv_cache_config, host_blocks, identity, storage)
            logger.info("HiCache connector started: host tier %d blocks (%d bytes) per worker, storage %s, "
                        "model_id %s, weight_version %r, KV %s, pages %s", host_blocks, self.config.host_bytes,
                        self.config.storage_where, identity.model_id, identity.weight_version, identity.kv_dtype,
                        identity.page_layout)
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
        and hands them to its stat loggers: `runtime.integrations.vllm.metrics`)."""
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


# the storage tier's opener, looked up at each connector's start (a test wraps the backend it returns)
_open_storage = open_storage

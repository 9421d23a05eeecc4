"""The runtime's host tier as a vLLM v1 KV connector (tiers-only mode; vLLM 0.33).

vLLM owns the device KV blocks and the request lifecycle; the runtime owns the host tier. Load
it with::

    --kv-transfer-config '{"kv_connector": "HiCacheConnector",
                           "kv_connector_module_path": "runtime.integrations.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"host_blocks": 4096}}'

(``kv_load_failure_policy: recompute``: a load that fails makes vLLM recompute the blocks from
the first failed one on; with vLLM's default ``fail`` the request ends with an error.)

Split as vLLM splits a connector:

- scheduler side (vLLM's synchronous scheduler calls it directly): a `TiersOnlyCore` decides.
  `get_num_new_matched_tokens` answers, without side effects, how many tokens past vLLM's own
  prefix-cache hit the host tier holds (a synchronous hit: loaded before the step's forward);
  `update_state_after_alloc` turns it into a load plan into the blocks vLLM allocated;
  `request_finished` backs up the request's computed blocks the tier lacks and returns
  ``delay_free_blocks=True`` while that backup reads them, so vLLM never frees a block a copy
  still reads (seed 000, enforced by vLLM's own free); `build_connector_meta` carries the step's
  plans (`TieredMeta`: immutable, picklable) to the workers; `update_connector_output` applies
  the workers' acks (`CopyAcks`, through vLLM's worker-metadata channel).
- worker side: the host pool and the copies (`PagedKVCopier` over the registered KV tensors).
  Loads run in `start_load_kv`, before the forward; backups in `wait_for_save`, after it (a
  backup reads blocks of finished requests only, which vLLM keeps until `get_finished`
  reports them). A failed load's blocks go to `get_block_ids_with_load_errors`.

On CPU the copies are synchronous, so `wait_for_layer_load` and `save_kv_layer` have nothing to
do; a CUDA worker would start the loads on a side stream and wait per layer there.

`kv_connector_extra_config`: ``host_blocks`` (int > 0, default: as many as vLLM's device
blocks): the host tier's size in blocks, the same on every worker.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from runtime.errors import ConfigError
from runtime.messages import TransferPlan
from runtime.trace import get_logger
from runtime.transfer.block_copier import PagedKVCopier
from runtime.tree.tiers_only import TiersOnlyCore

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = get_logger("hicache.vllm")

__all__ = ["HiCacheConnector", "TieredMeta", "CopyAcks"]


@dataclass(frozen=True)
class TieredMeta(KVConnectorMetadata):
    """One step's copies for the workers: loads (run before the forward) with the blocks the
    tier could not supply after all (reported as load errors), and backups of finished requests."""

    loads: tuple[TransferPlan, ...] = ()
    backups: tuple[tuple[str, TransferPlan], ...] = ()  # (request id, plan)
    unloadable: tuple[int, ...] = ()  # block ids promised to a load that the tier no longer held


@dataclass
class CopyAcks(KVConnectorWorkerMetadata):
    """Workers -> scheduler: each copy's outcome (None: done; else what failed). A copy failed
    on any worker failed (each worker holds its own shard of every host page)."""

    outcomes: dict[int, str | None] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, CopyAcks)
        merged = dict(self.outcomes)
        for op, err in other.outcomes.items():
            merged[op] = merged.get(op) or err
        return CopyAcks(merged)


def _namespace(request: Request) -> Hashable:
    """What keeps KV of one prompt apart from another's with the same tokens: the LoRA adapter
    and vLLM's cache salt (the same inputs as vLLM's own block hashes)."""
    lora = request.lora_request.lora_name if request.lora_request is not None else None
    salt = request.cache_salt
    return None if lora is None and salt is None else ("vllm", lora, salt)


class HiCacheConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.HOST

    # -- state -------------------------------------------------------------------
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)
        if kv_cache_config is None:
            raise ConfigError("HiCacheConnector needs vLLM's KVCacheConfig (vLLM >= 0.33)")
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ConfigError("HiCacheConnector supports one KV cache group (full attention) for now")
        self.block_size = vllm_config.cache_config.block_size
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        host_blocks = extra.get("host_blocks", kv_cache_config.num_blocks)
        if type(host_blocks) is not int or host_blocks <= 0:
            raise ConfigError(f"kv_connector_extra_config.host_blocks must be a positive int, got {host_blocks!r}")
        self.host_blocks = host_blocks
        # scheduler side
        self.core: TiersOnlyCore | None = None
        self._local_hit: dict[str, int] = {}  # rid -> vLLM's own hit when last asked (update_state_after_alloc needs it)
        self._loads: list[TransferPlan] = []
        self._backups: list[tuple[str, TransferPlan]] = []
        self._unloadable: list[int] = []
        # worker side
        self.copier: PagedKVCopier | None = None
        self._outcomes: dict[int, str | None] = {}
        self._load_errors: set[int] = set()
        self._sent: set[str] = set()  # requests whose backups ran, not yet reported
        self._finished: set[str] = set()  # requests vLLM said finished, not yet reported
        if role is KVConnectorRole.SCHEDULER:
            self.core = TiersOnlyCore(self.block_size, host_blocks * self.block_size, kv_cache_config.num_blocks)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a backup lost to preemption is a future miss

    # -- scheduler side ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.core is not None
        hit = self.core.lookup(request.all_token_ids, _namespace(request), num_computed_tokens)
        self._local_hit[request.request_id] = num_computed_tokens
        return hit, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.core is not None
        if num_external_tokens == 0:
            return
        rid = request.request_id
        (block_ids,) = blocks.get_block_ids()
        local = self._local_hit[rid]
        plan, got = self.core.load(rid, request.all_token_ids, _namespace(request), local, num_external_tokens,
                                   block_ids)
        if plan is not None:
            self._loads.append(plan)
        if got < num_external_tokens:  # the tier lost pages since the lookup: vLLM recomputes them
            first, end = (local + got) // self.block_size, (local + num_external_tokens) // self.block_size
            self._unloadable.extend(block_ids[first:end])

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = TieredMeta(tuple(self._loads), tuple(self._backups), tuple(self._unloadable))
        self._loads, self._backups, self._unloadable = [], [], []
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.core is not None
        acks = connector_output.kv_connector_worker_meta
        if acks is None:
            return
        if not isinstance(acks, CopyAcks):
            raise ConfigError(f"unexpected worker metadata {type(acks).__name__}")
        for op_id, error in sorted(acks.outcomes.items()):
            self.core.apply_ack(op_id, error)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Back up the request's computed blocks the tier lacks; vLLM keeps them until the
        backup ran (`get_finished` reports the request)."""
        assert self.core is not None
        rid = request.request_id
        self._local_hit.pop(rid, None)
        if request.status is RequestStatus.FINISHED_ERROR:  # (e.g. a failed load under vLLM's `fail` policy)
            return self.core.finish(rid), None  # its KV may never have arrived: nothing is backed up
        plan = self.core.backup(rid, request.all_token_ids, _namespace(request), request.num_computed_tokens,
                                block_ids)
        if plan is not None:
            self._backups.append((rid, plan))
        return self.core.finish(rid), None

    # -- worker side -------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.copier = PagedKVCopier(kv_caches, self.block_size, self.host_blocks)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TieredMeta)
        self._load_errors.update(meta.unloadable)
        for plan in meta.loads:
            if not self._run(plan):
                dst = plan.transfers[0].dst
                self._load_errors.update((dst[:: self.block_size] // self.block_size).tolist())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads ran whole in `start_load_kv` (CPU copies are synchronous)."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Backups copy whole blocks after the forward (`wait_for_save`)."""

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TieredMeta)
        for rid, plan in meta.backups:
            self._run(plan)
            self._sent.add(rid)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # vLLM takes a request back only after it named it finished (its blocks are ours till then)
        self._finished.update(finished_req_ids)
        done = self._sent & self._finished
        self._sent -= done
        self._finished -= done
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._outcomes:
            return None
        acks, self._outcomes = CopyAcks(self._outcomes), {}
        return acks

    # -- helpers -----------------------------------------------------------------------
    def _run(self, plan: TransferPlan) -> bool:
        if self.copier is None:
            raise ConfigError("HiCacheConnector: no KV caches registered")
        try:
            self.copier.run(plan)
        except Exception as exc:  # noqa: BLE001 - a failed copy is reported, never a crashed worker
            log.warning("vllm_copy_failed", op=plan.op_id, direction=plan.direction.value, error=repr(exc))
            self._outcomes[plan.op_id] = repr(exc)
            return False
        self._outcomes[plan.op_id] = None
        return True


"""vLLM's real scheduler on CPU with the connector's scheduler and worker sides in one process.

`FakeEngine` stands in for vLLM's engine core and model runner (as vLLM's own connector unit
tests do): `schedule()`, then the worker connector's per-step calls around a fake forward, then
`update_from_output`. The fake forward writes a fingerprint of each computed token's prefix
into its KV slot in every layer, and samples the next token from a sum over *all* the KV it
reads: wrong KV anywhere in a request's context changes its output. A tiny `LlamaConfig` saved
to a temp dir is the model (no hub); vLLM's block size 16, KV float32, one group. Under tensor
parallelism (`vllm_config(tp=n)`) there is a worker connector and KV tensors per rank, each rank's
fingerprints its own, every rank's KV read for sampling, and the workers' outputs merged by
vLLM's own `KVOutputAggregator`, as vLLM's executor merges them.
"""

from __future__ import annotations

import copy
import os
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from runtime.integrations.vllm import HiCacheConnector  # noqa: E402
from runtime.integrations.vllm.scheduler import HiCacheConnectorScheduler  # noqa: E402
from runtime.integrations.vllm.worker import HiCacheConnectorWorker  # noqa: E402

BLOCK, LAYERS, KV_HEADS, HEAD, VOCAB, EOS = 16, 2, 2, 8, 1000, 2
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
init_none_hash(sha256)


def save_tiny_model(path: str) -> None:
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=KV_HEADS * HEAD * 2, intermediate_size=64, num_hidden_layers=LAYERS,
                num_attention_heads=4, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
                max_position_embeddings=4096).save_pretrained(path)


def vllm_config(model_dir: str, *, connector: str | None, module: str = "runtime.integrations.vllm",
                extra: dict[str, Any] | None = None, max_batched: int = 256, max_seqs: int = 16,
                kv_events: bool = False, tp: int = 1, failure_policy: str = "recompute") -> VllmConfig:
    kvt = None
    if connector is not None:
        kvt = KVTransferConfig(kv_connector=connector, kv_connector_module_path=module, kv_role="kv_both",
                               kv_connector_extra_config=dict(extra or {}), kv_load_failure_policy=failure_policy)
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    cache.kv_cache_layout = "LBNHC"  # what the engine core resolves for vLLM's default backend
    return VllmConfig(
        model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32", seed=0),
        scheduler_config=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_batched, max_model_len=4096,
                                         enable_chunked_prefill=True, is_encoder_decoder=False,
                                         async_scheduling=False, disable_hybrid_kv_cache_manager=True),
        cache_config=cache, kv_transfer_config=kvt, device_config=DeviceConfig("cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        # (publisher "null": a test puts its own collector in the scheduler's `kv_event_publisher`)
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None)


def fingerprint(prefix_hash: int, layer: int, rank: int = 0) -> float:
    """A token's KV in `layer` of tensor-parallel rank `rank` (its own heads: every rank's differ)."""
    return float(prefix_hash % 4093 + 1 + 5000 * layer + 10007 * rank)  # exact in float32; sums of 2k stay exact


@dataclass
class FakeEngine:
    """One vLLM instance: scheduler, worker connector (if any), paged KV tensors."""

    config: VllmConfig
    num_blocks: int
    scheduler: Scheduler = field(init=False)
    workers: list[Any] = field(init=False)  # the worker connectors vLLM calls, one per tensor-parallel rank
    kv: dict[str, torch.Tensor] = field(init=False)  # rank 0's KV tensors
    kvs: list[dict[str, torch.Tensor]] = field(init=False)  # every rank's
    aggregator: KVOutputAggregator = field(init=False)
    computed: dict[str, int] = field(default_factory=dict)  # tokens the fake forward computed per request
    outputs: dict[str, list[int]] = field(default_factory=dict)  # tokens sampled per request
    finished: set[str] = field(default_factory=set)
    errors: set[str] = field(default_factory=set)  # requests vLLM ended with an error (a failed load, policy "fail")
    # the connector's stats as vLLM's stat loggers receive them (`SchedulerStats.kv_connector_stats`), per step
    connector_stats: list[dict[str, Any]] = field(default_factory=list)
    hits_by_source: dict[str, int] = field(default_factory=dict)  # vLLM's connector prefix-cache hits by tier
    steps: int = 0
    preemptions: int = 0
    preempted: set[str] = field(default_factory=set)  # requests preempted at least once
    # every KV read checked against its token's fingerprint (the fuzzer): a token sampled from a
    # wrong read fails the step (vLLM discards a step's token when a load it read failed)
    check_reads: bool = False
    _wrong_reads: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.float32)
        page = spec.page_size_bytes
        tensor = KVCacheTensor(size=page * self.num_blocks * LAYERS, layers=NAMES,
                               layer_stride=page * self.num_blocks, block_stride=page)
        kvc = KVCacheConfig(num_blocks=self.num_blocks, kv_cache_tensors=[tensor],
                            kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)])
        self.config.cache_config.num_gpu_blocks = self.num_blocks
        self.scheduler = Scheduler(vllm_config=self.config, kv_cache_config=kvc,
                                   structured_output_manager=StructuredOutputManager(self.config),
                                   block_size=BLOCK, log_stats=True)
        # one worker per tensor-parallel rank, each with KV tensors of its own (rank r's heads)
        ranks = self.config.parallel_config.tensor_parallel_size
        self.kvs = [dict(zip(NAMES, create_kv_cache_views(torch.zeros(tensor.size, dtype=torch.int8), spec,
                                                          self.num_blocks, KVCacheLayout.LBNHC, tensor)))
                    for _ in range(ranks)]
        self.kv = self.kvs[0]
        self.workers = []
        if self.config.kv_transfer_config is not None:
            for rank, kv in enumerate(self.kvs):
                config = self.config if rank == 0 else copy.deepcopy(self.config)
                config.parallel_config.rank = rank  # (what vLLM's worker sets)
                worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kvc)
                worker.register_kv_caches(kv)
                self.workers.append(worker)
        # every worker's outputs as vLLM's executor merges them (a request's load or backup is
        # finished once every worker reported it; the workers' metadata aggregated per step)
        self.aggregator = KVOutputAggregator(ranks)

    @property
    def connector(self) -> Any:
        """The connector's scheduler side (vLLM's facade is `scheduler.connector`); None without one."""
        facade = self.scheduler.connector
        return None if facade is None else facade.connector_scheduler

    @property
    def worker(self) -> Any:
        """Rank 0's worker connector's worker side (None without a connector)."""
        return self.workers[0].connector_worker if self.workers else None

    def add(self, rid: str, prompt: list[int], max_tokens: int, cache_salt: str | None = None) -> None:
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sp.update_from_generation_config({}, EOS)
        self.scheduler.add_request(Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=sp,
                                           pooling_params=None, block_hasher=get_request_block_hasher(BLOCK, sha256),
                                           cache_salt=cache_salt))

    def run(self, max_steps: int = 10_000) -> None:
        """Step until vLLM has no request left, then until the connector's storage ops landed:
        those do not keep vLLM stepping (an idle engine takes no step), so here each wait for the
        workers' jobs is followed by one step that delivers their acks (and sends what they
        started)."""
        while True:
            while self.scheduler.has_requests():
                self.step()
                if self.steps > max_steps:
                    raise AssertionError("the engine did not drain")
            core = getattr(self.connector, "core", None)  # (this connector's: a peer's has none)
            if core is None or not core.busy():
                return
            self.wait_for_workers()
            self.step()
            if self.steps > max_steps:
                raise AssertionError("the connector did not drain")

    def wait_for_workers(self, timeout_s: float = 60.0) -> None:
        """Until every worker's jobs in flight ended (their threads' reads and writes)."""
        deadline = time.monotonic() + timeout_s
        for w in self.workers:
            for fut, _, _ in list(w.connector_worker._jobs):
                fut.result(timeout=max(0.0, deadline - time.monotonic()))

    def step(self) -> None:
        so = self._schedule()
        self.steps += 1
        self.preemptions += len(so.preempted_req_ids or ())
        self.preempted |= set(so.preempted_req_ids or ())
        if not so.num_scheduled_tokens:
            time.sleep(0.0005)  # waiting on the worker's thread: do not spin
        for w in self.workers:
            w.handle_preemptions(so.kv_connector_metadata)  # (as vLLM's model runner: before the forward)
            w.bind_connector_metadata(so.kv_connector_metadata)
            if so.has_sync_kv_loads:
                w.start_load_kv(None)
        sampled = self._forward(so)
        ids = list(so.num_scheduled_tokens)
        outputs = [ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                     sampled_token_ids=[sampled.get(r, []) for r in ids],
                                     kv_connector_output=self._worker_output(w, so))
                   for w in self.workers or [None]]
        engine_out = self.scheduler.update_from_output(
            so, outputs[0] if len(outputs) == 1 else self.aggregator.aggregate(outputs))
        for outputs in engine_out.values():
            stats = outputs.scheduler_stats
            if stats is not None and stats.kv_connector_stats is not None:
                self.connector_stats.append(stats.kv_connector_stats)
            if stats is not None and stats.connector_prefix_cache_stats is not None:
                for source, n in stats.connector_prefix_cache_stats.hits_by_source.items():
                    self.hits_by_source[source.value] = self.hits_by_source.get(source.value, 0) + n
            for o in outputs.outputs:
                self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finished.add(o.request_id)
                    if o.finish_reason == FinishReason.ERROR:
                        self.errors.add(o.request_id)
                if o.new_token_ids and o.request_id in self._wrong_reads:
                    raise AssertionError(self._wrong_reads[o.request_id])
        self._wrong_reads.clear()

    def _worker_output(self, w: Any, so: Any) -> KVConnectorOutput | None:
        """A worker's part of the step after the forward (None without a connector)."""
        if w is None:
            return None
        if not so.has_sync_kv_loads:
            w.start_load_kv(None)
        w.wait_for_save()
        sending, recving = w.get_finished(so.finished_req_ids)
        out = KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                invalid_block_ids=w.get_block_ids_with_load_errors(),
                                kv_connector_stats=w.get_kv_connector_stats(),
                                kv_connector_worker_meta=w.build_connector_worker_meta())
        w.clear_connector_metadata()
        return out

    def _schedule(self) -> Any:
        return self.scheduler.schedule()

    def _forward(self, so: Any) -> dict[str, list[int]]:
        """Write each scheduled token's fingerprint into its KV slot, then sample from all KV read:
        as a model's forward, every KV write of the step comes before any read (requests that
        share a block vLLM recomputes for one of them both see it). With `check_reads`, a read
        of a slot that does not hold its token's fingerprint is noted (`step` fails if vLLM
        keeps the token sampled from it)."""
        sampled = {}
        scheduled = []
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            end = req.num_computed_tokens  # (the scheduler advanced it past this step's tokens)
            start = end - n
            blocks = self.scheduler.kv_cache_manager.get_block_ids(rid)[0]
            tokens = req.all_token_ids
            h = _prefix_hash(tokens[:start], req.cache_salt)
            for pos in range(start, end):
                h = _extend_hash(h, tokens[pos])
                b, off = blocks[pos // BLOCK], pos % BLOCK
                for rank, kv in enumerate(self.kvs):
                    for layer, name in enumerate(NAMES):
                        kv[name][b, :, off, :] = fingerprint(h, layer, rank)
            self.computed[rid] = self.computed.get(rid, 0) + n
            scheduled.append((rid, req, blocks, end))
        for rid, req, blocks, end in scheduled:
            if end >= req.num_tokens:  # prefill done (or a decode step): sample from every KV slot read
                pos = torch.arange(end)
                where = torch.tensor(blocks)[pos // BLOCK]
                # every rank's KV is read (a rank served another rank's heads changes the output)
                reads = [kv[name][where, 0, pos % BLOCK, 0] for kv in self.kvs for name in NAMES]
                if self.check_reads:
                    self._check_read(rid, req.all_token_ids, blocks, reads[:len(NAMES)], req.cache_salt)
                # (float64 sums of integer-valued float32 fingerprints: exact, in any order)
                total = sum(float(r.double().sum()) for r in reads)
                sampled[rid] = [int(total) % (VOCAB - 10) + 10]
        return sampled

    def _check_read(self, rid: str, tokens: Any, blocks: list[int], reads: list[torch.Tensor],
                    salt: str | None) -> None:
        hashes, h = [], _seed(salt)
        for t in tokens[:len(reads[0])]:
            h = _extend_hash(h, t)
            hashes.append(h)
        for layer, got in enumerate(reads):
            bad = (got != torch.tensor([fingerprint(x, layer) for x in hashes], dtype=got.dtype)).nonzero()
            if len(bad):
                p = int(bad[0])
                self._wrong_reads[rid] = (f"step {self.steps}: request {rid} sampled from wrong KV at position {p} "
                                          f"(block {blocks[p // BLOCK]}, layer {layer}) of {len(got)}")
                return

    def assert_drained(self) -> None:
        """Nothing leaked: no request, every block back (but vLLM's null block), and the
        connector's core quiescent."""
        sched = self.scheduler
        assert not sched.requests and not sched.has_requests()
        pool = sched.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == self.num_blocks - 1
        if self.connector is not None:
            from runtime.integrations.vllm.invariants import check_tiers_only

            check_tiers_only(self.connector.core, quiescent=True)
            conn = self.connector
            assert not (conn._asked or conn._awaiting or conn._token_ids or conn._reached or conn._held
                        or conn._partial_acks.reports)
            assert not any(w.connector_worker._jobs for w in self.workers)


class _EagerFreeScheduler(HiCacheConnectorScheduler):
    def request_finished(self, request, block_ids):  # type: ignore[no-untyped-def]
        super().request_finished(request, block_ids)
        return False, None


class _EagerFreeWorker(HiCacheConnectorWorker):
    def get_finished(self, finished_req_ids):  # type: ignore[no-untyped-def]
        _, received = super().get_finished(finished_req_ids)
        return None, received  # (nothing was held for a finished request: nothing to hand back)


class EagerFreeConnector(HiCacheConnector):
    """A broken variant: lets vLLM free a finished request's blocks while their backup has not
    read them yet (seed 000's class at the engine boundary)."""

    Scheduler = _EagerFreeScheduler
    Worker = _EagerFreeWorker


def expected_block(tokens: list[int], index: int, layer: int, salt: str | None = None, rank: int = 0) -> torch.Tensor:
    """What the fake forward writes into block `index` of `tokens` in `layer` of rank `rank`."""
    h = _prefix_hash(tokens[: index * BLOCK], salt)
    values = []
    for pos in range(index * BLOCK, (index + 1) * BLOCK):
        h = _extend_hash(h, tokens[pos])
        values.append(fingerprint(h, layer, rank))
    return torch.tensor(values, dtype=torch.float32)[None, :, None].expand(KV_HEADS, BLOCK, 2 * HEAD)


def _seed(salt: str | None) -> int:
    """Where a request's fingerprints start: its cache salt's own (a tenant's KV of the same
    tokens differs from another's, so KV served across tenants changes an output)."""
    return 1469598103934665603 if salt is None else (1469598103934665603 ^ zlib.crc32(salt.encode()) << 16)


def _prefix_hash(tokens: Iterable[int], salt: str | None = None) -> int:
    h = _seed(salt)
    for t in tokens:
        h = _extend_hash(h, t)
    return h


def _extend_hash(h: int, token: int) -> int:
    return ((h ^ int(token)) * 1099511628211) & 0xFFFFFFFFFFFFFFFF

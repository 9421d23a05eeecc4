"""The connector's scheduler side (`runtime.integrations.vllm`): a `TiersOnlyCore` decides.

vLLM's synchronous scheduler calls it directly. `get_num_new_matched_tokens` answers how many
tokens past vLLM's own prefix-cache hit the host tier holds, and holds them for the request; a
storage hit is first staged (read into host pages held for the request: the answer is None,
"not known yet", until the read landed, then the staged pages are a host hit); every hit is an
asynchronous load (the request waits in ``WAITING_FOR_REMOTE_KVS`` until the worker reports it:
docs/VLLM.md says why no load is synchronous). A request's page keys come from a cache by vLLM's
own block hashes for the blocks earlier requests had (a chat's next turn hashes its new pages only).
`update_state_after_alloc` turns it into a load into the blocks vLLM allocated;
`request_finished` backs up the request's computed blocks the tier lacks and returns
``delay_free_blocks=True`` while that backup reads them, so vLLM never frees a block a copy
still reads (seed 000, enforced by vLLM's own free); a landed backup is written through to
storage; `build_connector_meta` carries the step's work (`TieredMeta`) to the workers;
`update_connector_output` applies the workers' acks (`CopyAcks`, through vLLM's worker-metadata
channel); with vLLM's KV events on, `take_events` hands vLLM's scheduler the host tier's and
storage's events under vLLM's block hashes (`runtime.integrations.vllm.events`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.core.kv_cache_utils import resolve_block_hashes
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from runtime.config import RuntimeConfig
from runtime.errors import ConfigError
from runtime.integrations.vllm.events import ConnectorEvents
from runtime.integrations.vllm.messages import CopyAcks, LoadJob, TieredMeta
from runtime.integrations.vllm.metrics import HiCacheConnectorStats, report
from runtime.messages import TransferPlan
from runtime.storage.health import HealthTracked
from runtime.storage.hashing import KVIdentity
from runtime.integrations.vllm.core import TiersOnlyCore
from runtime.validation import tokens as checked_tokens

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["HiCacheConnectorScheduler"]


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


_KEY_CACHE_CAP = 1 << 18  # vLLM block hashes -> page keys kept (~50 MB at most)


def _checked(ids: list[int]) -> np.ndarray:
    """Token ids (a plain list: vLLM's `ConstantList` slices to one; numpy reads a list in C, a
    `ConstantList` element by element) as a checked int32 array."""
    try:
        return checked_tokens(np.array(ids, dtype=np.int32))
    except (OverflowError, TypeError, ValueError):
        return checked_tokens(ids)  # (its typed error says what is wrong)


class HiCacheConnectorScheduler:
    _namespace = staticmethod(_namespace)  # (what keeps tenants' KV apart; a test variant breaks it)

    # -- state -------------------------------------------------------------------
    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, host_blocks: int,
                 identity: KVIdentity, storage: HealthTracked | None) -> None:
        self.block_size = vllm_config.cache_config.block_size
        parallel = vllm_config.parallel_config
        # tensor parallelism: every worker stores its own heads under its own keys, which the
        # storage ops carry for every rank (`StorageRequest.rank_keys`); an op is applied once
        # every worker reported it
        self.tp_size = parallel.tensor_parallel_size
        self._workers = parallel.world_size
        self._partial_acks = CopyAcks()  # ops some workers reported, not all yet
        self.identity = identity
        self.storage = storage
        self.core = TiersOnlyCore(self.block_size, host_blocks * self.block_size, kv_cache_config.num_blocks)
        if storage is not None:
            self.core.enable_storage(identity, storage.exists_prefix, self.tp_size,
                                     evicts_tails_first=getattr(storage.inner, "evicts_tails_first", False) is True)
        self._asked: dict[str, _Asked] = {}  # waiting requests' last answers (update_state_after_alloc needs them)
        # live requests' token ids as checked arrays, from their lookup to their finish: a
        # request's list is converted once, and only the tokens vLLM appends after it later
        self._token_ids: dict[str, np.ndarray] = {}
        # their page keys (storage) as far as hashed, kept with their tokens: asked again after a
        # preemption, a request's lookup hashes only the pages it added since
        self._keys: dict[str, list[bytes]] = {}
        self._loads: list[LoadJob] = []
        # requests whose load the workers have not reported received yet: vLLM frees a finished
        # request's blocks at the first report naming it, so such a request is never backed up too
        self._awaiting: set[str] = set()
        # requests a load covered less of than the lookup promised (host room short, pages lost):
        # the token position it reached, past which they are promised nothing again (vLLM asks
        # again after recomputing the shortfall; the same promise would fail the same way)
        self._reached: dict[str, int] = {}
        self._backups: list[tuple[str, TransferPlan]] = []
        # requests whose storage hit was staged (`TiersOnlyCore.reserve(stage=True)`, once per
        # request): when vLLM stops waiting for the read (the prefetch timeout's deadline)
        self._staged: dict[str, float] = {}
        # the page keys of blocks requests had, by vLLM's block hash (`_keys_of`)
        self._key_cache: dict[Any, bytes] = {}
        self._hash_block_size = kv_cache_config.hash_block_size or self.block_size
        self._stage_timeout = RuntimeConfig().prefetch_timeout
        # requests holding a reported hit (`TiersOnlyCore.reserve`) that vLLM has not allocated for yet
        self._held: dict[str, Request] = {}
        # this step's loads by tier, for vLLM's prefix-cache hits by source (asked right after the load)
        self._sources: dict[str, dict[CacheHitSource, int]] = {}
        self._reported: dict[str, int] = {}  # the counters of the last stats report (vLLM's metrics)
        self._reported_health: int | None = None
        self._reported_total = -1  # the sum of the tiers' counters at the last report
        # KV events of the host tier and storage (`take_events`): on with vLLM's own
        self.events: ConnectorEvents | None = None
        kv_events = vllm_config.kv_events_config
        if kv_events is not None and kv_events.enable_kv_cache_events:
            # (vLLM hashes requests' blocks at hash_block_size, which the engine core sets first)
            self.events = ConnectorEvents(self.core, identity, self.block_size,
                                          kv_cache_config.hash_block_size or self.block_size)

    # -- vLLM's scheduler calls -------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        deadline = self._staged.get(rid)
        if deadline is not None and self.core.staging(rid) and time.monotonic() < deadline:
            return None, False  # (its staging read runs: asked again next step, at no cost)
        asked = self._asked.get(rid)
        namespace = self._namespace(request)
        if asked is not None and len(asked.tokens) == request.num_tokens:  # asked again while it waits
            tokens, keys = asked.tokens, asked.keys
        else:
            tokens = self._tokens_of(request)
            keys = self._keys_of(request, tokens, namespace)
        reached = self._reached.get(rid)
        if reached is not None and reached <= num_computed_tokens:  # (promised nothing past it again)
            self.core.release(rid)
            total = 0
        else:
            # a hit told to vLLM is one the tiers can load: held for the request until its load.
            # A storage hit is staged first (read into host pages: vLLM is told "not known yet",
            # None, and asks again each step), once per request: what landed is then a host hit,
            # and a page gone from storage meanwhile a shorter hit, never a failed load. Past
            # the prefetch timeout, what landed is reported (the read goes on, detached).
            stage = self.storage is not None and deadline is None
            hit = self.core.reserve(rid, tokens, namespace, num_computed_tokens, keys, stage=stage,
                                    storage=stage)
            if hit.staging:
                self._staged[rid] = time.monotonic() + self._stage_timeout(len(tokens))
                self._asked.pop(rid, None)
                if self.events is not None:  # (its pages join the tier at its ack)
                    self.events.learn(self.core.stages[rid].read, request,
                                      keys[:(num_computed_tokens + hit.total) // self.block_size])
                return None, False
            total = hit.total
            if reached is not None and total > reached - num_computed_tokens:
                total = reached - num_computed_tokens  # (the load uses a prefix of the hold)
        self._asked[rid] = _Asked(num_computed_tokens, tokens, keys)
        if total:
            self._held[rid] = request
        # every load is asynchronous: vLLM 0.33 caches a synchronous load's blocks as it allocates
        # them, and under kv_load_failure_policy="recompute" a failed one's blocks stay in its
        # prefix cache; a request preempted or aborted before recomputing them leaves them there
        # for the next request with that prefix to read (found by the connector fuzzer)
        return total, total > 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        rid = request.request_id
        asked = self._asked.pop(rid, None)
        self._held.pop(rid, None)
        if num_external_tokens == 0:
            self.core.release(rid)
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
        self._sources[rid] = {CacheHitSource.HOST: ld.tokens - ld.from_storage, CacheHitSource.DISK: ld.from_storage,
                              CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens - ld.tokens}
        if self.events is not None and ld.read is not None:  # (its pages join the tier at its ack)
            self.events.learn(ld.read[0], request, asked.keys[:(local + num_external_tokens) // self.block_size])
        self._awaiting.add(rid)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        # a hit vLLM did not allocate blocks for this step is not held for it (vLLM asks again);
        # one whose load vLLM deferred to a later step (its request waits for remote KV) is
        for rid, request in self._held.items():
            if request.status is not RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.core.release(rid)
        self._held = {rid: r for rid, r in self._held.items() if r.status is RequestStatus.WAITING_FOR_REMOTE_KVS}
        self._sources.clear()
        meta = TieredMeta(tuple(self._loads), tuple(self._backups),
                          tuple(self.core.take_storage_writes()), tuple(self.core.take_stage_reads()))
        self._loads, self._backups = [], []
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
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

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Back up the request's computed blocks the tier lacks; vLLM keeps them until the
        backup ran (`get_finished` reports the request). A request finished while its load runs
        (aborted) is not backed up; vLLM keeps its blocks until the load is reported."""
        rid = request.request_id
        self._asked.pop(rid, None)
        self._reached.pop(rid, None)
        self._held.pop(rid, None)  # (its hold and staging, if any, go with `finish`)
        self._staged.pop(rid, None)
        if rid in self._awaiting:  # (its blocks do not hold their KV yet; the load's report frees them)
            self._forget_tokens(rid)
            self.core.finish(rid)
            return True, None
        if request.status is RequestStatus.FINISHED_ERROR:  # (e.g. a failed load under vLLM's `fail` policy)
            self._forget_tokens(rid)
            return self.core.finish(rid), None  # its KV may never have arrived: nothing is backed up
        tokens = self._tokens_of(request)
        self._forget_tokens(rid)
        namespace = self._namespace(request)
        plan = self.core.backup(rid, tokens, namespace, request.num_computed_tokens, block_ids)
        if plan is not None:
            self._backups.append((rid, plan))
            if self.events is not None:  # (its pages join the tier at its ack)
                self.events.learn_tokens(plan.op_id, request, tokens, namespace,
                                         request.num_computed_tokens // self.block_size)
        return self.core.finish(rid), None

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """The load's tokens by tier: host, disk (storage), and any it could not cover."""
        split = self._sources.pop(request.request_id, None)
        if split is None:
            return {CacheHitSource.HOST: num_external_tokens} if num_external_tokens else {}
        return {source: n for source, n in split.items() if n}

    def get_kv_connector_stats(self) -> HiCacheConnectorStats | None:
        """What changed since the last report (`runtime.integrations.vllm.metrics`)."""
        health = self.storage.state.level if self.storage is not None else None
        # (asked every step; the tiers' counters only grow, so an unchanged sum is nothing new)
        total = sum(self.core.stats.values())
        if total == self._reported_total and health == self._reported_health and not health:
            return None
        self._reported_total = total
        now = self._counters()
        counters = {k: v - self._reported.get(k, 0) for k, v in now.items() if v != self._reported.get(k, 0)}
        self._reported = now
        stats = report(counters, "storage_health_scheduler", health, self._reported_health)
        if stats is not None:
            self._reported_health = health
        return stats

    def stats(self) -> dict[str, Any]:
        """The tiers' counters and, with storage, its backend's (health included)."""
        out: dict[str, Any] = dict(self.core.stats)
        if self.storage is not None:
            out["storage"] = self.storage.stats()
        return out

    def _counters(self) -> dict[str, int]:
        s = self.core.stats
        return {"host_hit_tokens": s["tokens_loaded"] - s["tokens_storage_loaded"],
                "storage_hit_tokens": s["tokens_storage_loaded"], "hits_cut": s["hits_cut"],
                "hit_tokens_cut": s["tokens_hit_cut"], "backed_up_tokens": s["tokens_backed_up"],
                "load_failures": s["load_errors"] + s["loads_short"] + s["storage_reads_short"],
                "backup_failures": s["backup_errors"], "storage_lookup_failures": s["storage_lookup_errors"]}

    def shutdown(self) -> None:
        if self.storage is not None:
            self.storage.close()

    # -- helpers -----------------------------------------------------------------------
    def _keys_of(self, request: Request, tokens: np.ndarray, namespace: Hashable) -> list[bytes]:
        """The request's page keys (storage), kept while it lives. A turn of a chat is a new
        request whose tokens start with the last turn's: the keys of the pages it shares with an
        earlier request come from `_key_cache`, by vLLM's own hashes of those blocks (which
        commit to the whole prefix and the request's extra keys: LoRA, cache salt, media), so
        only its new pages are hashed. The keys themselves stay the portable chain hashes of
        `runtime.storage.hashing` (vLLM's hashes may be seeded per process)."""
        rid = request.request_id
        known = self._keys.get(rid)
        if self.storage is None:
            return []
        n = (len(tokens) - 1) // self.block_size
        have = known if known is not None else []
        if len(have) < n:
            hashes = request.block_hashes
            if self._hash_block_size != self.block_size:
                hashes = resolve_block_hashes(hashes, self._hash_block_size, self.block_size)
            cache = self._key_cache
            have = list(have)
            stop = min(n, len(hashes))
            i = len(have)
            while i < stop:
                key = cache.get(hashes[i])
                if key is None:
                    break
                have.append(key)
                i += 1
            if i < n:
                have = self.core.page_keys(tokens, namespace, have)
                for j in range(i, min(len(have), stop)):
                    cache[hashes[j]] = have[j]
                if len(cache) > _KEY_CACHE_CAP:  # (the oldest quarter goes: a dict keeps insertion order)
                    for old in list(itertools.islice(cache, len(cache) // 4)):
                        del cache[old]
        self._keys[rid] = have
        return have

    def _forget_tokens(self, rid: str) -> None:
        self._token_ids.pop(rid, None)
        self._keys.pop(rid, None)

    def _tokens_of(self, request: Request) -> np.ndarray:
        """The request's token ids as a checked array, kept until it finishes. vLLM only appends
        to a request's tokens, so a kept array is extended by the new tail; a kept array that is
        longer than the list, or whose last token the list no longer has there, is not used."""
        ids = request.all_token_ids
        rid = request.request_id
        known = self._token_ids.get(rid)
        n = 0 if known is None else len(known)
        if n == 0 or n > len(ids) or ids[n - 1] != known[-1]:  # (a cheap check of that contract)
            tokens = _checked(ids[:])
            self._keys.pop(rid, None)  # (hashed from tokens it no longer has)
        elif n == len(ids):
            tokens = known
        else:
            tokens = np.concatenate((known, _checked(ids[n:])))
        self._token_ids[rid] = tokens
        return tokens

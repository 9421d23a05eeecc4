"""CacheRuntime: the façade a serving framework embeds.

    async with CacheRuntime.open(config) as rt:
        res = await rt.admit("r1", prompt_tokens)
        ...

`open` starts the actors in one anyio task group inside the caller's running loop (the
library never picks the loop). Every call sends one message and awaits its reply; the hot
calls also come in a batch form (one message per scheduling step). Every argument is checked
here before anything is sent (`runtime.validation`): a bad one is a `ValidationError` for its
caller alone. Closing stops intake, waits for every in-flight copy and then stops the actors;
it is cancellation-safe (a cancelled owner still stops every actor task). If an actor crashes,
every pending and later call raises `RuntimeFailed` and leaving the `async with` re-raises it.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
from collections.abc import AsyncIterator, Callable, Hashable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import zmq

from runtime.actors.base import Mailbox, Reply
from runtime.actors.offload_actor import OffloadActor
from runtime.actors.transfer_actor import TransferActor
from runtime.actors.tree_actor import TreeActor
from runtime.completion import LayerReadiness
from runtime.config import RuntimeConfig
from runtime.errors import (
    ArgumentError,
    ConfigError,
    HiCacheError,
    LengthError,
    RuntimeFailed,
    StateError,
    TransferError,
    ValidationError,
)
from runtime.events.hub import EventHub, EventSubscription
from runtime.events.publisher import ZmqEventPublisher
from runtime.memory.pools import DevicePool, HostPool, KVShape
from runtime.memory.state_pool import StatePool
from runtime.memory.swa import SWA_POOL
from runtime.storage.state_blobs import StateBlobFormat
from runtime.transfer.state_io import StateBlobIO
from runtime.messages import (
    Abort,
    Admit,
    AdmitResult,
    AttachStorage,
    Available,
    Batch,
    Cache,
    CanAdmit,
    ClearStorage,
    CloseSession,
    Commit,
    DecodeStep,
    DetachStorage,
    DrainTransfer,
    DrainTree,
    Extend,
    Finish,
    Flush,
    Inspect,
    MatchPrefix,
    OpenSession,
    Prepare,
    ReleaseAbandoned,
    Rewind,
    Snapshot,
    TransferStats,
    TreeMessage,
    TreeStats,
)
from runtime.messages import DrainOffload, OffloadStats  # decode offload
from runtime.stats import nest
from runtime.supervisor import State, Supervisor, wait_shielded
from runtime.trace import JsonlSink, SlotTracer, get_logger
from runtime.transfer.engine import CopyEngine
from runtime.transfer.sharded import ShardedCopyEngine, pool_geometry
from runtime.tree.cache import CacheCore
from runtime.validation import (
    TOKEN_LIMIT,
    check_count,
    check_flag,
    check_id,
    check_namespace,
    check_optional_count,
    check_optional_id,
    check_priority,
    step_item,
    step_tokens,
)
from runtime.validation import tokens as _checked_tokens

if TYPE_CHECKING:  # prometheus_client is imported only when metrics are on
    from prometheus_client.registry import CollectorRegistry

    from runtime.metrics import MetricsEndpoint, StatsCollector

log = get_logger("hicache.runtime")


EngineFactory = Callable[[Mapping[str, tuple[DevicePool, HostPool]]], CopyEngine]


class _NoHostTier:
    """The engine of a runtime without a host tier: it is never given a plan."""

    def submit(self, plan: Any) -> Any:
        raise TransferError("no host tier configured")

    def close(self) -> None:
        pass


def make_engine(config: RuntimeConfig, device_pool: DevicePool, host_pool: HostPool | None,
                factory: EngineFactory | None = None,
                states: tuple[StatePool, StatePool] | None = None,
                swa: tuple[DevicePool, HostPool] | None = None) -> CopyEngine:
    """The copy engine over the KV pools and, for a hybrid model, the state pools' components
    (plan pools ``state.<component>``); with sliding layers, their pools (plan pool ``swa``)."""
    if host_pool is None:
        return _NoHostTier()
    pools: dict[str, Any] = {"kv": (device_pool, host_pool)}
    if swa is not None:
        pools[SWA_POOL] = swa
    if states is not None:
        device_states, host_states = states
        for (name, dev), (_, host) in zip(device_states.component_pools(), host_states.component_pools(), strict=True):
            pools[name] = (dev, host)
    if factory is not None:
        return factory(pools)
    kind = config.copy_engine
    if kind == "auto":
        kind = "cuda" if torch.device(config.device).type == "cuda" else "cpu"
    if kind == "cuda":
        from runtime.transfer.cuda_engine import CudaCopyEngine

        return CudaCopyEngine(pools)
    if kind == "fake":
        from runtime.transfer.fake_engine import FakeCopyEngine

        return FakeCopyEngine(pools)
    from runtime.transfer.cpu_engine import CpuCopyEngine

    return CpuCopyEngine(pools, workers_per_direction=config.copy_workers)


def make_rank_engines(config: RuntimeConfig, device_pools: Sequence[DevicePool], host_pools: Sequence[HostPool],
                      factory: EngineFactory | None = None) -> CopyEngine:
    """The copy engine of one control plane over `config.tp_ranks` ranks: an engine per rank over
    that rank's pools (`factory(pools)` each, or the config's kind), all behind one
    `ShardedCopyEngine` (every rank runs every plan; an op completes when every rank's did)."""
    if not host_pools:
        return _NoHostTier()
    engines = [make_engine(config, device, host, factory) for device, host in zip(device_pools, host_pools, strict=True)]
    return ShardedCopyEngine(engines, [pool_geometry({"kv": pair}) for pair in zip(device_pools, host_pools)])


def check_backend(config: RuntimeConfig, storage: Any) -> None:
    """A storage backend given by the caller (`open(storage=)`, `attach_storage`): it has the
    protocol's methods and pages of this config's size (a hybrid model's state snapshots are
    stored in the same pages: `runtime.storage.state_blobs`), and no sliding layers (their dropped
    pages have no storage rule yet); `ConfigError` otherwise."""
    if config.sliding_layer_set:
        raise ConfigError("sliding_layers has no storage tier yet")
    if config.state_shape is not None and config.host_slots > 0 and config.host_state_slot_count == 0:
        raise ConfigError("host_state_slots: a storage tier with recurrent state needs host state slots "
                          "(snapshots reach storage through their host copies)")
    missing = [name for name in ("exists_prefix", "get_batch", "set_batch", "close", "stats")
               if not callable(getattr(storage, name, None))]
    if missing:
        raise ConfigError(f"storage backend {type(storage).__name__} lacks {', '.join(missing)} (see StorageBackend)")
    want = config.page_size * config.bytes_per_token
    if getattr(storage, "page_bytes", None) != want:
        raise ConfigError(f"storage backend pages are {getattr(storage, 'page_bytes', None)} bytes; "
                          f"this config's pages are {want}")


def make_event_hub(config: RuntimeConfig) -> EventHub | None:
    """The event hub of `config` (None: events off), its ZMQ publisher bound when an endpoint is set."""
    if not config.kv_events:
        return None
    publisher = None
    if config.kv_events_endpoint is not None:
        try:
            publisher = ZmqEventPublisher(config.kv_events_endpoint, replay_endpoint=config.kv_events_replay_endpoint,
                                          topic=config.kv_events_topic, buffer_steps=config.kv_events_buffer_steps)
        except zmq.ZMQError as exc:
            raise ConfigError(f"kv_events_endpoint {config.kv_events_endpoint!r} / kv_events_replay_endpoint "
                              f"{config.kv_events_replay_endpoint!r}: cannot bind: {exc}") from None
    return EventHub(config.page_size, config.data_parallel_rank, publisher)


def make_storage(config: RuntimeConfig, storage: Any = None) -> tuple[Any, bool]:
    """The storage backend (given, or built from the config) and whether the runtime owns it."""
    if storage is not None:
        check_backend(config, storage)
        return storage, False
    if config.storage_backend == "none":
        return None, False
    page_bytes = config.page_size * config.bytes_per_token
    if config.storage_backend == "file":
        from runtime.storage.file_backend import FileBackend

        assert config.storage_dir is not None
        return FileBackend(config.storage_dir, page_bytes, cap_bytes=config.storage_cap_bytes), True
    # mooncake: the cluster comes from the environment (MOONCAKE_MASTER, ... or MOONCAKE_CONFIG_PATH,
    # see docs/STORAGE.md); or pass storage=MooncakeBackend(page_bytes, MooncakeConfig(...))
    from runtime.storage.mooncake_backend import MooncakeBackend, MooncakeConfig

    return MooncakeBackend(page_bytes, MooncakeConfig.from_env()), True


class CacheRuntime:
    """Public handle of the runtime. Create it with `CacheRuntime.open(config)`."""

    def __init__(self, config: RuntimeConfig, *, engine_factory: EngineFactory | None = None,
                 storage: Any = None, metrics_registry: CollectorRegistry | None = None) -> None:
        metrics_on = metrics_registry is not None or config.metrics_port is not None
        if metrics_on:
            from prometheus_client.registry import CollectorRegistry

            from runtime.metrics import StatsCollector

            if metrics_registry is not None and not isinstance(metrics_registry, CollectorRegistry):
                raise ConfigError(f"metrics_registry must be a prometheus_client CollectorRegistry, "
                                  f"got {type(metrics_registry).__name__}")
        self.config = config
        shape = KVShape(config.num_layers, config.num_kv_heads, config.head_dim, config.torch_dtype,
                        parts=config.kv_parts)
        sliding = len(config.sliding_layer_set)
        # sliding layers: the full pool holds the other layers, in order; the sliding ones are in
        # `swa_pool`, addressed through `swa_map` (set below, from the tree's ledger)
        full = dataclasses.replace(shape, num_layers=config.num_layers - sliding) if sliding else shape
        self.device_pool = DevicePool(full, config.device_slots, config.page_size, torch.device(config.device))
        self.swa_pool = (DevicePool(dataclasses.replace(shape, num_layers=sliding), config.swa_slots, config.page_size,
                                    torch.device(config.device)) if sliding else None)
        self.swa_map: torch.Tensor | None = None
        self.host_pool = (HostPool(full, config.host_slots, config.page_size, layout=config.host_layout)
                          if config.host_slots > 0 else None)
        # host copies keep every layer: the sliding ones at the same host slots as the full ones
        self.host_swa_pool = (HostPool(self.swa_pool.shape, config.host_slots, config.page_size,
                                       layout=config.host_layout)
                              if self.swa_pool is not None and self.host_pool is not None else None)
        # one control plane over `tp_ranks` tensor-parallel ranks: every rank's pools, one geometry
        # (rank 0's the ones above); one rank: just those
        self.device_pools: tuple[DevicePool, ...] = (self.device_pool,) + tuple(
            DevicePool(full, config.device_slots, config.page_size, torch.device(config.device))
            for _ in range(config.tp_ranks - 1))
        self.host_pools: tuple[HostPool, ...] = () if self.host_pool is None else (self.host_pool,) + tuple(
            HostPool(full, config.host_slots, config.page_size, layout=config.host_layout)
            for _ in range(config.tp_ranks - 1))
        # a hybrid model's recurrent states: running requests' and the tree's snapshots
        self.state_pool = (StatePool(config.state_shape, config.state_slots, torch.device(config.device))
                           if config.state_shape is not None else None)
        self.host_state_pool = (StatePool(config.state_shape, config.host_state_slot_count,
                                          pin_memory=torch.device(config.device).type == "cuda")
                                if config.host_state_slot_count > 0 else None)
        sinks = [JsonlSink(config.trace_path)] if config.trace_path else []
        self.tracer = SlotTracer(config.page_size, sinks)
        storage, own = make_storage(config, storage)
        if storage is not None and self.host_pool is None:
            raise ConfigError("a storage tier needs the host tier")
        self._owned_storage = storage if own else None  # closed by the runtime (built from the config)
        if config.tp_ranks == 1:
            self.engine = make_engine(
                config, self.device_pool, self.host_pool, engine_factory,
                (self.state_pool, self.host_state_pool) if self.host_state_pool is not None else None,
                (self.swa_pool, self.host_swa_pool) if self.host_swa_pool is not None else None)
        else:
            self.engine = make_rank_engines(config, self.device_pools, self.host_pools, engine_factory)
        self._transfer = TransferActor(
            self.engine, max_inflight_loads=config.max_inflight_loads,
            max_queued_backups=config.max_queued_backups, mailbox_capacity=config.mailbox_capacity,
            bytes_per_slot=full.bytes_per_token, storage=storage, host_pool=self.host_pool,
            storage_timeout_s=config.storage_timeout_s,
            pool_slot_bytes=({name: pool.shape.num_layers * pool.component.row_bytes
                              for name, pool in self.state_pool.component_pools()}
                             if self.state_pool is not None else
                             {SWA_POOL: self.swa_pool.shape.bytes_per_token} if self.swa_pool is not None else None),
            rank_host_pools=self.host_pools if config.tp_ranks > 1 else (),
            state_io=(StateBlobIO(self.host_state_pool, StateBlobFormat.of(config.state_shape,
                                                                           config.page_size * config.bytes_per_token))
                      if self.host_state_pool is not None and config.state_shape is not None else None))
        readiness = (LayerReadiness.pending if config.tp_ranks == 1
                     else functools.partial(LayerReadiness.pending, ranks=config.tp_ranks))
        self._core = CacheCore(config, self.tracer, readiness_factory=readiness)
        if self._core.residency.sliding is not None:
            # the full -> sliding slot map, shared with the tree actor's ledger (read-only here)
            self.swa_map = torch.from_numpy(self._core.residency.sliding.swa.map)
        if storage is not None:
            self._core.enable_storage()
        # decode offload: the offload actor and the tree actor know each other's mailbox
        tree_mailbox: Mailbox[TreeMessage] = Mailbox(config.mailbox_capacity)
        self._offload = OffloadActor(tree_mailbox, page_size=config.page_size, stride=config.stride,
                                     mailbox_capacity=config.mailbox_capacity)
        self._events = make_event_hub(config)
        if self._events is not None:
            self._core.enable_events()
        self._tree = TreeActor(self._core, self._transfer.mailbox, mailbox_capacity=config.mailbox_capacity,
                               debug_invariants=config.debug_invariants, offload_mailbox=self._offload.mailbox,
                               mailbox=tree_mailbox, storage=storage, events=self._events)
        self._sup = Supervisor([self._tree, self._transfer, self._offload])
        self._token_limit = config.vocab_size if config.vocab_size is not None else TOKEN_LIMIT
        self._closer: asyncio.Task[None] | None = None
        # metrics: on with a registry given or an endpoint asked for (a private registry then)
        if metrics_on and metrics_registry is None:
            metrics_registry = CollectorRegistry()
        self.metrics_registry: CollectorRegistry | None = metrics_registry
        self._metrics: StatsCollector | None = StatsCollector() if metrics_on else None
        self._metrics_endpoint: MetricsEndpoint | None = None
        self._metrics_task: asyncio.Task[None] | None = None

    # A close whose caller is cancelled (a shutdown deadline) still waits this long for the copies in
    # flight, then stops the actors without them (the runtime fails). Copies take milliseconds; a
    # hung storage backend must not hold a cancelled owner forever.
    close_grace_s: float = 5.0

    def _tokens(self, value: Any) -> np.ndarray:
        """The call's own int32 copy of `value`, every id checked (`runtime.validation.tokens`)."""
        return _checked_tokens(value, self._token_limit, self.config.device_slots)

    # -- lifecycle -----------------------------------------------------------------
    @classmethod
    @asynccontextmanager
    async def open(cls, config: RuntimeConfig | None = None, *, engine_factory: EngineFactory | None = None,
                   storage: Any = None, metrics_registry: CollectorRegistry | None = None
                   ) -> AsyncIterator["CacheRuntime"]:
        """Start the runtime in the running loop. `engine_factory(pools)` overrides the copy
        engine (tests hold copies in flight with `FakeCopyEngine`; with `tp_ranks` > 1 it makes
        each rank's engine over that rank's pools, `rt.engine.engines[r]`); `storage` is a storage
        backend instance (overrides `config.storage_backend`; the caller closes it);
        `metrics_registry`: export `hicache_*` metrics on it (docs/API.md, "Metrics")."""
        rt = cls(config or RuntimeConfig(), engine_factory=engine_factory, storage=storage,
                 metrics_registry=metrics_registry)
        try:
            rt._register_metrics()  # a refusal here closes what __init__ built (nothing started)
            await rt._sup.start()  # a cancel here still closes: the actors' task exists already
            await rt._start_metrics()
            yield rt
        finally:
            await rt.close()
        rt._sup.raise_if_failed()

    async def close(self) -> None:
        """Stop intake, wait for every in-flight copy, then stop the actors. Idempotent.

        The close runs in a task of its own, shielded from the caller's cancellation: a cancelled
        caller (`task.cancel()`, `asyncio.timeout`, `anyio.fail_after`) still waits for it, at most
        `close_grace_s` longer; past that the actors are stopped without the copies still in
        flight (the runtime fails, one `runtime_terminated` event). Then the cancellation goes on.
        `ForeignLoopError` from another loop or thread (the close must run in the runtime's loop)."""
        self._sup.check_loop()
        closer = self._closer
        if closer is None:
            closer = self._closer = asyncio.get_running_loop().create_task(self._close(), name="hicache-close")
        try:
            await asyncio.shield(closer)
        except asyncio.CancelledError:
            await self._close_cancelled(closer)
            raise

    async def _close(self) -> None:
        await self._stop_metrics()
        sup = self._sup
        if sup.state is State.OPEN:
            sup.state = State.CLOSING
            if sup.started:
                try:
                    # offloads first: no new ones, the last ones land and their requests are released
                    await sup.ask_internal(self._offload.mailbox, DrainOffload(Reply()))
                    await sup.ask_internal(self._tree.mailbox, DrainTree(Reply()))
                    await sup.ask_internal(self._transfer.mailbox, DrainTransfer(Reply()))
                except RuntimeFailed:
                    pass
        await sup.stop()
        self.tracer.close()
        if self._events is not None:
            self._events.close()
        owned, self._owned_storage = self._owned_storage, None
        if owned is not None:
            # safe with abandoned calls still inside it: it tears down once they return, and waits
            # for them at most its own close timeout (`CallGate`); off the loop, as that wait blocks
            await asyncio.to_thread(owned.close)

    async def _close_cancelled(self, closer: asyncio.Task[None]) -> None:
        """The caller of `close` was cancelled: finish the close anyway, bounded by `close_grace_s`."""
        if not await wait_shielded(closer, self.close_grace_s):
            # copies still in flight: stop without them; nothing of theirs is freed. (An owned storage
            # backend still closes: its teardown waits for its own calls.)
            await self._sup.terminate(TimeoutError(
                f"close was cancelled and copies were still in flight after {self.close_grace_s} s"))
            await wait_shielded(closer, 1.0)  # its asks failed and the actors' task ended: it returns
            bridge = self._transfer.bridge
            if bridge is not None:  # its poller would watch the abandoned copies forever
                await wait_shielded(asyncio.ensure_future(bridge.aclose(wait=False)), 1.0)
        if closer.done() and not closer.cancelled() and closer.exception() is not None:
            log.error("close_failed", error=repr(closer.exception()))

    @property
    def storage(self) -> Any:
        """The storage backend in use (None: no storage tier). The transfer actor holds it."""
        return self._transfer.storage

    @property
    def failed(self) -> bool:
        return self._sup.state is State.FAILED

    @property
    def closed(self) -> bool:
        return self._sup.state is not State.OPEN

    # -- request lifecycle ------------------------------------------------------------
    async def admit(self, rid: Hashable, tokens: Sequence[int] | np.ndarray | torch.Tensor,
                    extra_key: Hashable = None, *, session: Hashable = None, priority: int = 0) -> AdmitResult:
        """Match the longest cached prefix, lock it, load its host part, allocate the rest.
        With `session`, the turn appends to that session's KV instead (no tree match).
        `priority` (an int >= 0) is raised onto every tree node the request inserts (`cache`,
        `finish`): with `eviction_policy="priority"` lower priorities are evicted first."""
        msg = Admit(check_id(rid), self._tokens(tokens), check_namespace(extra_key),
                    check_optional_id(session, "session"), check_priority(priority),
                    reply=Reply(on_abandon=self._release_abandoned))
        return await self._sup.ask(self._tree.mailbox, msg)

    async def prepare(self, rid: Hashable, tokens: Sequence[int] | np.ndarray | torch.Tensor,
                      extra_key: Hashable = None) -> int:
        """A request arrived: start reading from storage what it holds beyond the device and
        host hit (returns the tokens being read; 0 without a storage tier or below
        `prefetch_threshold`). `admit` ends it by `prefetch_policy`; `abort` cancels it. Tokens of
        a bad length give 0 (`admit` reports them); ids and values are checked as for `admit`."""
        rid = check_id(rid)
        extra_key = check_namespace(extra_key)
        try:
            arr = self._tokens(tokens)
        except LengthError:
            self._sup.check_open()
            return 0
        return await self._sup.ask(self._tree.mailbox, Prepare(rid, arr, extra_key, Reply()))

    async def extend(self, rid: Hashable, num_tokens: int) -> torch.Tensor:
        """Allocate device slots for `num_tokens` more tokens (evicting if needed)."""
        msg = Extend(check_id(rid), check_count(num_tokens, "num_tokens"), Reply())
        return await self._sup.ask(self._tree.mailbox, msg)

    async def decode_step(self, rids: Sequence[Hashable]) -> torch.Tensor:
        """One decode step of the running requests `rids`, in one message: each commits every token
        it has (their KV was just computed) and gets the slot of its next token (a new page when
        that token starts one). Returns the new slots, one per request, in order. All or nothing:
        an unknown or repeated rid, a request as long as the device pool, or a pool too full
        (`CapacityError`) changes nothing. The same as `commit(rid, seq_len)` then
        `extend(rid, 1)` for each."""
        if type(rids) is not tuple:
            if type(rids) is not list:
                raise ArgumentError(f"decode_step takes a list or tuple of rids, got {type(rids).__name__}")
            rids = tuple(rids)
        return await self._sup.ask(self._tree.mailbox, DecodeStep(rids, Reply()))

    async def commit(self, rid: Hashable, committed_len: int) -> int:
        """Record the request's new total committed length (idempotent; smaller than before is a
        `LengthError`). With `decode_offload` the tree actor tells the offload actor, which
        offloads each new `offload_stride` of whole committed pages to host."""
        msg = Commit(check_id(rid), check_count(committed_len, "committed_len"), Reply())
        return await self._sup.ask(self._tree.mailbox, msg)

    async def cache(self, rid: Hashable, tokens: Sequence[int] | np.ndarray | torch.Tensor) -> int:
        """Insert the page-aligned part of `tokens` (whose KV is computed) into the tree."""
        return await self._sup.ask(self._tree.mailbox, Cache(check_id(rid), self._tokens(tokens), Reply()))

    async def finish(self, rid: Hashable, tokens: Sequence[int] | np.ndarray | torch.Tensor,
                     finished_len: int | None = None) -> int:
        """Keep prompt + `finished_len` tokens (all when None), insert what is computed (or hand it
        to the turn's session), unlock, free duplicates and the rest; the request ends."""
        msg = Finish(check_id(rid), self._tokens(tokens), check_optional_count(finished_len, "finished_len"), Reply())
        return await self._sup.ask(self._tree.mailbox, msg)

    async def rewind(self, rid: Hashable, new_len: int) -> int:
        """Forget tokens past `new_len` (a retraction); whole pages past it are freed."""
        msg = Rewind(check_id(rid), check_count(new_len, "new_len"), Reply())
        return await self._sup.ask(self._tree.mailbox, msg)

    async def snapshot(self, rid: Hashable, position: int) -> int:
        """A hybrid model's recurrent state after the first `position` tokens of `rid` (page-aligned,
        past its cached prefix): returns a slot of `state_pool` to copy that state into, once the
        engine has computed exactly `position` tokens. An insert reaching `position` (cache,
        finish) keeps it with the tree node ending there: later hits can end there."""
        msg = Snapshot(check_id(rid), check_count(position, "position"), Reply())
        return await self._sup.ask(self._tree.mailbox, msg)

    async def open_session(self, sid: Hashable, extra_key: Hashable = None) -> None:
        """A streaming session: its turns (`admit(..., session=sid)`) keep KV across turns."""
        msg = OpenSession(check_id(sid, "session id"), check_namespace(extra_key), Reply())
        return await self._sup.ask(self._tree.mailbox, msg)

    async def close_session(self, sid: Hashable, *, insert: bool = False) -> int:
        """Free the session's KV (inserting its page-aligned part into the tree first if asked)."""
        msg = CloseSession(check_id(sid, "session id"), check_flag(insert, "insert"), Reply())
        return await self._sup.ask(self._tree.mailbox, msg)

    async def abort(self, rid: Hashable) -> None:
        """Release everything the request holds (the same release as `finish`, nothing inserted)."""
        return await self._sup.ask(self._tree.mailbox, Abort(check_id(rid), Reply()))

    async def step(self, items: Sequence[Admit | Extend | Commit | Cache | Finish | Abort]) -> tuple[Any, ...]:
        """A scheduling step in one message: results per item, a `ValidationError` for a failed one.

        Build items with reply=None, e.g. `Admit(rid, tokens)`; token lists are converted here.
        Every item is checked here first: a bad one (not one of those types, or a bad field) gets
        its `ValidationError` in its place of the result and is not sent; the others are. A caller
        cancelled while awaiting it leaves no admission behind (as for `admit`)."""
        if type(items) is not list and type(items) is not tuple:
            raise ArgumentError(f"step takes a list or tuple of items, got {type(items).__name__}")
        toks = step_tokens(self._token_limit, self.config.device_slots)
        try:
            sent = [step_item(item, toks) for item in items]
        except ValidationError:
            return await self._step_with_refusals(items, toks)
        return await self._ask_step(sent)

    async def _ask_step(self, items: list[Any]) -> tuple[Any, ...]:
        return await self._sup.ask(self._tree.mailbox, Batch(tuple(items), Reply(on_abandon=self._release_step)))

    async def _step_with_refusals(self, items: Sequence[Any], toks: Callable[[Any], np.ndarray]) -> tuple[Any, ...]:
        """`step` with refused items: the others go in one message, the refusals keep their places."""
        out: list[Any] = []
        sent: list[Any] = []
        for item in items:
            try:
                sent.append(step_item(item, toks))
                out.append(None)
            except ValidationError as exc:
                out.append(exc)
        results = iter(await self._ask_step(sent) if sent else ())
        return tuple(next(results) if r is None else r for r in out)

    # -- KV cache events -------------------------------------------------------------------
    def kv_events(self, maxsize: int = 4096) -> EventSubscription:
        """Every KV event batch from now on, in order (`async for batch in rt.kv_events()`), until
        the runtime closes; more than `maxsize` batches unread ends it with `EventsLostError`.
        Needs `kv_events=True` (docs/EVENTS.md)."""
        self._sup.check_loop()
        if type(maxsize) is not int or maxsize <= 0:
            raise ArgumentError(f"maxsize must be a positive int, got {maxsize!r}")
        if self._events is None:
            raise StateError("KV events are off (RuntimeConfig.kv_events=False)")
        if self.closed:
            raise StateError("the runtime is closed")
        return self._events.subscribe(maxsize)

    @property
    def kv_events_endpoints(self) -> tuple[str | None, str | None]:
        """The bound (PUB, replay) ZMQ endpoints, a `*` port resolved; (None, None) without."""
        pub = None if self._events is None else self._events.publisher
        return (None, None) if pub is None else (pub.endpoint, pub.replay_endpoint)

    # -- questions ------------------------------------------------------------------------
    async def match_prefix(self, tokens: Sequence[int] | np.ndarray | torch.Tensor,
                           extra_key: Hashable = None) -> dict[str, int]:
        """Read-only look: tokens cached per tier, no lock, no split, no side effect."""
        msg = MatchPrefix(self._tokens(tokens), check_namespace(extra_key), Reply())
        return await self._sup.ask(self._tree.mailbox, msg)

    async def can_admit(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, extra_key: Hashable = None) -> bool:
        msg = CanAdmit(self._tokens(tokens), check_namespace(extra_key), Reply())
        return await self._sup.ask(self._tree.mailbox, msg)

    async def available(self) -> dict[str, int]:
        return await self._sup.ask(self._tree.mailbox, Available(Reply()))

    async def flush(self) -> int:
        """Drop every unlocked cached prefix from device and host (after a weight update)."""
        return await self._sup.ask(self._tree.mailbox, Flush(Reply()))

    async def stats(self) -> dict[str, dict[str, Any]]:
        """Counters, sizes, queue depths and latency histograms, nested by tier and concern
        (`runtime.stats.STATS`; schema in docs/API.md), e.g. `stats()["host"]["hit_tokens"]`."""
        tree = await self._sup.ask(self._tree.mailbox, TreeStats(Reply()))
        transfer = await self._sup.ask(self._transfer.mailbox, TransferStats(Reply()))
        offload = await self._sup.ask(self._offload.mailbox, OffloadStats(Reply()))
        return nest(tree, transfer, offload)

    async def refresh_metrics(self) -> dict[str, dict[str, Any]]:
        """Take a `stats()` snapshot and make it what the metrics export now (they are refreshed
        every `metrics_interval_s` anyway); returns a copy of it. `StateError` when metrics are off."""
        self._sup.check_loop()
        if self._metrics is None:
            raise StateError("metrics are off: open the runtime with metrics_registry= or config.metrics_port")
        return copy.deepcopy(await self._snapshot_metrics())

    async def _snapshot_metrics(self) -> dict[str, dict[str, Any]]:
        """A `stats()` snapshot handed to the collector (nobody changes it again)."""
        assert self._metrics is not None
        snapshot = await self.stats()
        self._metrics.update(snapshot)
        return snapshot

    @property
    def metrics_port(self) -> int | None:
        """The port the `/metrics` endpoint is bound to (None without one)."""
        return self._metrics_endpoint.port if self._metrics_endpoint is not None else None

    # -- storage controls -----------------------------------------------------------------
    # One at a time, in call order (the tree actor queues them). Cancelling the await of one does
    # not cancel it: it was accepted and completes in the actors.
    async def attach_storage(self, backend: Any) -> None:
        """Put a storage tier behind the host tier, on `backend` (checked as `open(storage=)`
        checks it; the caller keeps it and closes it after `detach_storage`). From now on landed
        backups are written through and `prepare`/`admit` read from it. `ConfigError` (nothing
        changed): not a backend of this config's page size, or no host tier; `StateError`: one is
        attached already."""
        self._sup.check_loop()
        if self.host_pool is None:
            raise ConfigError("a storage tier needs the host tier (host_slots > 0)")
        check_backend(self.config, backend)
        await self._sup.ask(self._tree.mailbox, AttachStorage(backend, Reply()))

    async def detach_storage(self) -> None:
        """Turn the storage tier off: no storage op starts from now on; those in flight (writes,
        prefetch lookups and reads, overdue ones too) land or fail as usual, releasing their pins
        and host pages; then the backend is forgotten (closed if the runtime built it from the
        config). Device and host tiers keep working. `StateError`: no storage tier attached."""
        old = await self._sup.ask(self._tree.mailbox, DetachStorage(Reply()))
        if old is not None and old is self._owned_storage:
            self._owned_storage = None
            await asyncio.to_thread(old.close)  # (a Mooncake teardown talks to its master: off the loop)

    async def clear_storage(self) -> int:
        """Remove from storage every page this runtime knows stored (wrote, or found by a lookup or
        read: pages of its own KV identity, since the page hash encodes it) and forget them, so that
        no later admit gets a storage hit on one. Storage ops in flight drain first (no new one
        starts meanwhile). Returns the pages removed (pages the backend had already evicted are not
        counted). `StateError`: no storage tier, or a backend without `remove(keys)`;
        `StorageError`: the backend's removal failed (the hints are forgotten either way)."""
        return await self._sup.ask(self._tree.mailbox, ClearStorage(Reply()))

    async def inspect(self, fn: Any) -> Any:
        """Debug/test hook: run `fn(core)` inside the tree actor (between two messages)."""
        return await self._sup.ask_internal(self._tree.mailbox, Inspect(fn, Reply()))

    # -- helpers -------------------------------------------------------------------------
    def _register_metrics(self) -> None:
        if self._metrics is None:
            return
        assert self.metrics_registry is not None
        try:
            self.metrics_registry.register(self._metrics)
        except ValueError as exc:  # names taken: another runtime (or anything) exports hicache_* there
            raise ConfigError(f"metrics_registry already has these metrics ({exc}); "
                              f"give each runtime a registry of its own") from None

    async def _start_metrics(self) -> None:
        """The first snapshot, the endpoint (if asked for), then the periodic refresh."""
        if self._metrics is None:
            return
        await self._snapshot_metrics()
        cfg = self.config
        if cfg.metrics_port is not None:
            from runtime.metrics import MetricsEndpoint

            assert self.metrics_registry is not None
            self._metrics_endpoint = MetricsEndpoint(self.metrics_registry, cfg.metrics_addr, cfg.metrics_port)
        self._metrics_task = asyncio.get_running_loop().create_task(
            self._refresh_metrics_every(cfg.metrics_interval_s), name="hicache-metrics")

    async def _refresh_metrics_every(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self._snapshot_metrics()  # (no copy: nobody reads it here)
            except HiCacheError:  # closing or failed: the last snapshot stays until close unregisters
                return

    async def _stop_metrics(self) -> None:
        """At close, first: no refresh asks a closing actor; the endpoint and registration go."""
        task, self._metrics_task = self._metrics_task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                if not task.cancelled():  # our caller was cancelled, not the task
                    raise
        endpoint, self._metrics_endpoint = self._metrics_endpoint, None
        if endpoint is not None:
            await asyncio.to_thread(endpoint.stop)  # shutdown() waits for the server's poll loop
        if self._metrics is not None and self.metrics_registry is not None:
            try:
                self.metrics_registry.unregister(self._metrics)
            except KeyError:  # never registered (open refused it), or already gone
                pass
            self._metrics = None

    def _release_abandoned(self, result: AdmitResult) -> None:
        """A caller cancelled while awaiting `admit`: release that admission (same path as abort)."""
        if self._sup.failure is None and not self._tree.mailbox.closed:
            self._tree.mailbox.put_internal(ReleaseAbandoned(result.rid, result.generation))

    def _release_step(self, results: tuple[Any, ...]) -> None:
        """A caller cancelled while awaiting `step`: release every admission the step made."""
        for r in results:
            if type(r) is AdmitResult:
                self._release_abandoned(r)

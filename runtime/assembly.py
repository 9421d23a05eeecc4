"""How a `CacheRuntime` is put together from a config: pools, copy engine, storage backend, core
and actors (`assemble`), and the helpers it uses. The façade (`runtime/runtime.py`) keeps what
`assemble` returns and never builds a part itself.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from runtime.actors.base import Mailbox
from runtime.actors.offload_actor import OffloadActor
from runtime.actors.transfer_actor import TransferActor
from runtime.actors.tree_actor import TreeActor
from runtime.completion import LayerReadiness
from runtime.config import RuntimeConfig
from runtime.errors import ConfigError, TransferError
from runtime.events.hub import EventHub
from runtime.events.publisher import ZmqEventPublisher
from runtime.memory.host_memory import MAX_HOST_SHARE, available_memory, gib
from runtime.memory.pools import DevicePool, HostPool, KVShape
from runtime.memory.state_pool import StatePool
from runtime.memory.swa import SWA_POOL
from runtime.messages import TreeMessage
from runtime.storage.integrity import PageSeal
from runtime.storage.state_blobs import StateBlobFormat
from runtime.supervisor import Supervisor
from runtime.trace import JsonlSink, SlotTracer, file_problem
from runtime.transfer.engine import CopyEngine
from runtime.transfer.sharded import ShardedCopyEngine, pool_geometry
from runtime.transfer.state_io import StateBlobIO
from runtime.tree.groups.sliding import SlidingWindow
from runtime.tree.cache import CacheCore

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
        try:
            return FileBackend(config.storage_dir, page_bytes, cap_bytes=config.storage_cap_bytes), True
        except OSError as exc:  # (checked by check_machine; the OS may still refuse: a pseudo file system, a race)
            raise ConfigError(f"storage_dir {config.storage_dir!r}: cannot open it: {exc}") from exc
    # mooncake: the cluster comes from the environment (MOONCAKE_MASTER, ... or MOONCAKE_CONFIG_PATH,
    # see docs/STORAGE.md); or pass storage=MooncakeBackend(page_bytes, MooncakeConfig(...))
    from runtime.storage.mooncake_backend import MooncakeBackend
    from runtime.storage.mooncake_config import MooncakeConfig

    return MooncakeBackend(page_bytes, MooncakeConfig.from_env()), True


@dataclass(frozen=True, slots=True)
class Pools:
    """The instance's pools (rank 0's; every rank's in `device_pools` / `host_pools`)."""

    device_pool: DevicePool
    swa_pool: DevicePool | None
    host_pool: HostPool | None
    host_swa_pool: HostPool | None
    device_pools: tuple[DevicePool, ...]
    host_pools: tuple[HostPool, ...]
    state_pool: StatePool | None
    host_state_pool: StatePool | None


@dataclass(frozen=True, slots=True)
class Actors:
    """The core, the actors over it and their supervisor (and the KV event hub the tree feeds)."""

    transfer: TransferActor
    core: CacheCore
    offload: OffloadActor
    events: EventHub | None
    tree: TreeActor
    sup: Supervisor


@dataclass(frozen=True, slots=True)
class Parts:
    """What `assemble` built; the façade keeps each one."""

    pools: Pools
    actors: Actors
    swa_map: torch.Tensor | None  # the full -> sliding slot map (the tree's ledger's, read-only)
    tracer: SlotTracer
    engine: CopyEngine
    owned_storage: Any  # closed by the runtime (built from the config); None otherwise


def assemble(config: RuntimeConfig, engine_factory: EngineFactory | None = None, storage: Any = None) -> Parts:
    """The pools, copy engine, storage backend, core and actors of a runtime of `config` (nothing
    started). `ConfigError` for a storage tier without a host tier or a backend that does not fit,
    and for what the machine does not allow (`check_machine`, before anything is built); a step
    that fails closes what the steps before it opened (the trace file, the storage, the engine)."""
    check_machine(config, storage)
    pools = make_pools(config)
    opened: list[Callable[[], None]] = []  # closers, in the order opened
    try:
        tracer = make_tracer(config)
        opened.append(tracer.close)
        storage, own = make_storage(config, storage)
        if own:
            opened.append(storage.close)
        if storage is not None and pools.host_pool is None:
            raise ConfigError("a storage tier needs the host tier")
        engine = _make_engines(config, pools, engine_factory)
        opened.append(engine.close)
        actors = make_actors(config, pools, engine, storage, tracer)
    except BaseException:
        for close in reversed(opened):
            close()
        raise
    # the full -> sliding slot map, shared with the tree actor's ledger (read-only here)
    swa_map = next((torch.from_numpy(g.swa.map) for g in actors.core.residency.groups
                    if isinstance(g, SlidingWindow)), None)
    return Parts(pools, actors, swa_map, tracer, engine, storage if own else None)


def _make_engines(config: RuntimeConfig, pools: Pools, factory: EngineFactory | None) -> CopyEngine:
    if config.tp_ranks > 1:
        return make_rank_engines(config, pools.device_pools, pools.host_pools, factory)
    return make_engine(
        config, pools.device_pool, pools.host_pool, factory,
        (pools.state_pool, pools.host_state_pool) if pools.host_state_pool is not None else None,
        (pools.swa_pool, pools.host_swa_pool) if pools.host_swa_pool is not None else None)


def make_tracer(config: RuntimeConfig) -> SlotTracer:
    """The slot tracer, appending to `trace_path` when one is set."""
    sinks = []
    if config.trace_path:
        try:
            sinks.append(JsonlSink(config.trace_path))
        except OSError as exc:  # (checked by check_machine; the file system may have changed since)
            raise ConfigError(f"trace_path {config.trace_path!r}: cannot open it to append: {exc}") from exc
    return SlotTracer(config.page_size, sinks)


# -- what the machine must allow, checked before anything is built -------------------------------
def check_machine(config: RuntimeConfig, storage: Any = None, available: int | None = None) -> None:
    """What `config` asks of this machine, before `assemble` allocates, creates or opens anything:
    the host pools fit in memory, `storage_dir` is (or can be made) a writable directory (file
    backend from the config; `storage`: a backend given instead), `trace_path` can be appended to.
    A `ConfigError` naming the field otherwise. `available`: bytes of memory (default: the machine's, now)."""
    check_host_memory(config, available_memory() if available is None else available)
    if storage is None and config.storage_backend == "file" and config.storage_dir:
        from runtime.storage.file_backend import directory_problem

        why = directory_problem(config.storage_dir)
        if why is not None:
            raise ConfigError(f"storage_dir {config.storage_dir!r} {why}")
    if config.trace_path:
        why = file_problem(config.trace_path)
        if why is not None:
            raise ConfigError(f"trace_path {config.trace_path!r} {why}")


def host_pool_bytes(config: RuntimeConfig) -> int:
    """Bytes of the host pools `make_pools` allocates: every rank's KV (the full layers per rank,
    the sliding layers' copies once) and the recurrent state's host snapshots."""
    if config.host_slots == 0:
        return 0
    per_layer = config.bytes_per_token // config.num_layers
    sliding = len(config.sliding_layer_set)
    kv = config.host_slots * per_layer * ((config.num_layers - sliding) * config.tp_ranks + sliding)
    shape = config.state_shape
    return kv + (config.host_state_slot_count * shape.bytes_per_slot if shape is not None else 0)


def check_host_memory(config: RuntimeConfig, available: int) -> None:
    """The host pools take at most `MAX_HOST_SHARE` of the `available` bytes (as the vLLM
    connector's host tiers); a `ConfigError` naming the sizing field used otherwise (torch's
    allocator would fail, or the kernel kill the process, partway through)."""
    asked = host_pool_bytes(config)
    most = int(available * MAX_HOST_SHARE)
    if asked <= most:
        return
    field = next(name for name in ("host_tokens", "host_bytes", "host_ratio") if getattr(config, name) is not None)
    ranks = f" x {config.tp_ranks} ranks" if config.tp_ranks > 1 else ""
    raise ConfigError(f"{field}={getattr(config, field)!r}: the host pools ({config.host_slots} slots{ranks}) take "
                      f"{asked} bytes ({gib(asked)}), more than {MAX_HOST_SHARE:.0%} of the {available} bytes "
                      f"({gib(available)}) of memory available")


def make_pools(config: RuntimeConfig) -> Pools:
    shape = KVShape(config.num_layers, config.num_kv_heads, config.head_dim, config.torch_dtype,
                    parts=config.kv_parts)
    sliding = len(config.sliding_layer_set)
    device = torch.device(config.device)
    # sliding layers: the full pool holds the other layers, in order; the sliding ones are in
    # `swa_pool`, addressed through `swa_map` (from the tree's ledger)
    full = dataclasses.replace(shape, num_layers=config.num_layers - sliding) if sliding else shape
    device_pool = DevicePool(full, config.device_slots, config.page_size, device)
    swa_pool = (DevicePool(dataclasses.replace(shape, num_layers=sliding), config.swa_slots, config.page_size,
                           device) if sliding else None)
    host_pool = (HostPool(full, config.host_slots, config.page_size, layout=config.host_layout)
                 if config.host_slots > 0 else None)
    # host copies keep every layer: the sliding ones at the same host slots as the full ones
    host_swa_pool = (HostPool(swa_pool.shape, config.host_slots, config.page_size, layout=config.host_layout)
                     if swa_pool is not None and host_pool is not None else None)
    # one control plane over `tp_ranks` tensor-parallel ranks: every rank's pools, one geometry
    # (rank 0's the ones above); one rank: just those
    device_pools: tuple[DevicePool, ...] = (device_pool,) + tuple(
        DevicePool(full, config.device_slots, config.page_size, device) for _ in range(config.tp_ranks - 1))
    host_pools: tuple[HostPool, ...] = () if host_pool is None else (host_pool,) + tuple(
        HostPool(full, config.host_slots, config.page_size, layout=config.host_layout)
        for _ in range(config.tp_ranks - 1))
    # a hybrid model's recurrent states: running requests' and the tree's snapshots
    state_pool = (StatePool(config.state_shape, config.state_slots, device)
                  if config.state_shape is not None else None)
    host_state_pool = (StatePool(config.state_shape, config.host_state_slot_count, pin_memory=device.type == "cuda")
                       if config.host_state_slot_count > 0 else None)
    return Pools(device_pool, swa_pool, host_pool, host_swa_pool, device_pools, host_pools, state_pool,
                 host_state_pool)


def make_actors(config: RuntimeConfig, pools: Pools, engine: CopyEngine, storage: Any, tracer: SlotTracer) -> Actors:
    transfer = make_transfer_actor(config, pools, engine, storage)
    readiness = (LayerReadiness.pending if config.tp_ranks == 1
                 else functools.partial(LayerReadiness.pending, ranks=config.tp_ranks))
    core = CacheCore(config, tracer, readiness_factory=readiness)
    if storage is not None:
        core.enable_storage(read_only=getattr(storage, "read_only", False) is True)
    # decode offload: the offload actor and the tree actor know each other's mailbox
    tree_mailbox: Mailbox[TreeMessage] = Mailbox(config.mailbox_capacity)
    offload = OffloadActor(tree_mailbox, page_size=config.page_size, stride=config.stride,
                           mailbox_capacity=config.mailbox_capacity)
    events = make_event_hub(config)
    if events is not None:
        core.enable_events()
    tree = TreeActor(core, transfer.mailbox, mailbox_capacity=config.mailbox_capacity,
                     debug_invariants=config.debug_invariants, offload_mailbox=offload.mailbox,
                     mailbox=tree_mailbox, storage=storage, events=events)
    return Actors(transfer, core, offload, events, tree, Supervisor([tree, transfer, offload]))


def make_transfer_actor(config: RuntimeConfig, pools: Pools, engine: CopyEngine, storage: Any) -> TransferActor:
    state_pool, host_state_pool, swa_pool = pools.state_pool, pools.host_state_pool, pools.swa_pool
    seal = PageSeal(config.storage_key)  # (one per runtime: tags every page stored, checks every page read)
    return TransferActor(
        engine, max_inflight_loads=config.max_inflight_loads,
        max_queued_backups=config.max_queued_backups, mailbox_capacity=config.mailbox_capacity,
        bytes_per_slot=pools.device_pool.shape.bytes_per_token, storage=storage, host_pool=pools.host_pool,
        storage_timeout_s=config.storage_timeout_s, storage_max_inflight_ops=config.storage_max_inflight_ops,
        storage_max_overdue_pages=config.storage_max_overdue_pages,
        pool_slot_bytes=({name: pool.shape.num_layers * pool.component.row_bytes
                          for name, pool in state_pool.component_pools()}
                         if state_pool is not None else
                         {SWA_POOL: swa_pool.shape.bytes_per_token} if swa_pool is not None else None),
        rank_host_pools=pools.host_pools if config.tp_ranks > 1 else (),
        state_io=(StateBlobIO(host_state_pool, StateBlobFormat.of(config.state_shape,
                                                                  config.page_size * config.bytes_per_token), seal)
                  if host_state_pool is not None and config.state_shape is not None else None),
        seal=seal)

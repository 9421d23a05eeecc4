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
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from runtime.actors.base import Reply
from runtime.assembly import EngineFactory, assemble, check_backend
from runtime.assembly import make_engine, make_storage  # noqa: F401 - public helpers, imported from here too
from runtime.config import RuntimeConfig
from runtime.errors import (
    ArgumentError,
    ConfigError,
    LengthError,
    RuntimeFailed,
    StateError,
    ValidationError,
)
from runtime.events.hub import EventSubscription
from runtime.messages import (
    Abort,
    Admit,
    AdmitResult,
    Batch,
    Cache,
    CloseSession,
    Commit,
    DecodeStep,
    ControlAction,
    DrainTransfer,
    DrainTree,
    Extend,
    Finish,
    Flush,
    ObservePrefill,
    OpenSession,
    Query,
    Prepare,
    ReleaseAbandoned,
    Rewind,
    Snapshot,
    StorageControl,
    TransferStats,
    TreeStats,
)
from runtime.messages import DrainOffload, OffloadStats  # decode offload
from runtime.stats import nest
from runtime.storage.hash_chain import load_chain
from runtime.supervisor import State, wait_shielded
from runtime.trace import get_logger
from runtime.validation import (
    TOKEN_LIMIT,
    admit_message,
    check_count,
    check_flag,
    check_id,
    check_namespace,
    check_optional_count,
    step_item,
    step_tokens,
)
from runtime.validation import tokens as _checked_tokens
from runtime.transfer.load_cost import check_sample

if TYPE_CHECKING:  # prometheus_client is imported only when metrics are on
    from prometheus_client.registry import CollectorRegistry

    from runtime.actors.offload_actor import OffloadActor
    from runtime.actors.transfer_actor import TransferActor
    from runtime.events.hub import EventHub
    from runtime.memory.pools import DevicePool, HostPool
    from runtime.memory.state_pool import StatePool
    from runtime.metrics import MetricsExporter
    from runtime.tree.cache import CacheCore

log = get_logger("hicache.runtime")


class CacheRuntime:
    """Public handle of the runtime. Create it with `CacheRuntime.open(config)`."""

    def __init__(self, config: RuntimeConfig, *, engine_factory: EngineFactory | None = None,
                 storage: Any = None, metrics_registry: CollectorRegistry | None = None) -> None:
        metrics_on = metrics_registry is not None or config.metrics_port is not None
        if metrics_on:
            from prometheus_client.registry import CollectorRegistry

            from runtime.metrics import MetricsExporter

            if metrics_registry is not None and not isinstance(metrics_registry, CollectorRegistry):
                raise ConfigError(f"metrics_registry must be a prometheus_client CollectorRegistry, "
                                  f"got {type(metrics_registry).__name__}")
        self.config = config
        parts = assemble(config, engine_factory, storage)
        self.pools = parts.pools  # (each pool is a property below: rt.device_pool, rt.host_pool, ...)
        self.swa_map, self.tracer, self.engine = parts.swa_map, parts.tracer, parts.engine
        self._owned_storage = parts.owned_storage
        self._actors = parts.actors
        self._tree, self._sup = parts.actors.tree, parts.actors.sup  # (every call's)
        self._token_limit = config.vocab_size if config.vocab_size is not None else TOKEN_LIMIT
        self._closer: asyncio.Task[None] | None = None
        # metrics: on with a registry given or an endpoint asked for (a private registry then)
        if metrics_on and metrics_registry is None:
            metrics_registry = CollectorRegistry()
        self.metrics_registry: CollectorRegistry | None = metrics_registry
        self._metrics: MetricsExporter | None = None if metrics_registry is None else MetricsExporter(
            metrics_registry, self.stats, interval_s=config.metrics_interval_s, addr=config.metrics_addr,
            port=config.metrics_port)

    # -- the pools (rank 0's; every rank's in device_pools / host_pools) and the actors -------
    @property
    def device_pool(self) -> DevicePool:
        return self.pools.device_pool

    @property
    def swa_pool(self) -> DevicePool | None:
        return self.pools.swa_pool

    @property
    def host_pool(self) -> HostPool | None:
        return self.pools.host_pool

    @property
    def host_swa_pool(self) -> HostPool | None:
        return self.pools.host_swa_pool

    @property
    def device_pools(self) -> tuple[DevicePool, ...]:
        return self.pools.device_pools

    @property
    def host_pools(self) -> tuple[HostPool, ...]:
        return self.pools.host_pools

    @property
    def state_pool(self) -> StatePool | None:
        return self.pools.state_pool

    @property
    def host_state_pool(self) -> StatePool | None:
        return self.pools.host_state_pool

    @property
    def _transfer(self) -> TransferActor:
        return self._actors.transfer

    @property
    def _core(self) -> CacheCore:
        return self._actors.core

    @property
    def _offload(self) -> OffloadActor:
        return self._actors.offload

    @property
    def _events(self) -> EventHub | None:
        return self._actors.events

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
            if rt.config.kv_events or rt.host_pool is not None:
                # the page hash's code (events, or storage now or attached later: it needs the
                # host tier) is loaded here, off the loop, before the caller can admit, not in the
                # first admit's turn; not at attach_storage, which must send its control before
                # its first await
                await asyncio.to_thread(load_chain, rt.config.hash_algo)
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
        return self._transfer.storage.backend

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
        reply = Reply(on_abandon=self._release_abandoned)
        msg = admit_message(rid, tokens, extra_key, session, priority, reply, self._token_limit,
                            self.config.device_slots)
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
        arr, ns = self._tokens(tokens), check_namespace(extra_key)
        return await self._sup.ask(self._tree.mailbox, Query(lambda core: core.match_prefix(arr, ns), Reply()))

    async def can_admit(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, extra_key: Hashable = None) -> bool:
        arr, ns = self._tokens(tokens), check_namespace(extra_key)
        return await self._sup.ask(self._tree.mailbox, Query(lambda core: core.can_admit(arr, ns), Reply()))

    async def available(self) -> dict[str, int]:
        return await self._sup.ask(self._tree.mailbox, Query(lambda core: core.available(), Reply()))

    async def flush(self) -> int:
        """Drop every unlocked cached prefix from device and host (after a weight update)."""
        return await self._sup.ask(self._tree.mailbox, Flush(Reply()))

    async def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Tell the runtime a prefill the model ran: `tokens` computed in `seconds`. With
        `reuse_cost="measured"` an admission then loads a host hit only where the load beats
        recomputing it (runtime/transfer/load_cost.py); otherwise the samples are kept unused.
        `ValidationError`: `tokens` not an int > 0, `seconds` not a finite number >= 0."""
        check_sample(tokens, seconds)
        await self._sup.ask(self._tree.mailbox, ObservePrefill(tokens, float(seconds), Reply()))

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
        return copy.deepcopy(await self._metrics.refresh())

    @property
    def metrics_port(self) -> int | None:
        """The port the `/metrics` endpoint is bound to (None without one)."""
        return self._metrics.port if self._metrics is not None else None

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
        await self._sup.ask(self._tree.mailbox, StorageControl(ControlAction.ATTACH, backend, Reply()))

    async def detach_storage(self) -> None:
        """Turn the storage tier off: no storage op starts from now on; those in flight (writes,
        prefetch lookups and reads, overdue ones too) land or fail as usual, releasing their pins
        and host pages; then the backend is forgotten (closed if the runtime built it from the
        config). Device and host tiers keep working. `StateError`: no storage tier attached."""
        old = await self._sup.ask(self._tree.mailbox, StorageControl(ControlAction.DETACH, reply=Reply()))
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
        return await self._sup.ask(self._tree.mailbox, StorageControl(ControlAction.CLEAR, reply=Reply()))

    async def inspect(self, fn: Any) -> Any:
        """Debug/test hook: run `fn(core)` inside the tree actor (between two messages)."""
        return await self._sup.ask_internal(self._tree.mailbox, Query(fn, Reply()))

    # -- helpers -------------------------------------------------------------------------
    def _register_metrics(self) -> None:
        if self._metrics is not None:
            self._metrics.register()

    async def _start_metrics(self) -> None:
        if self._metrics is not None:
            await self._metrics.start()

    async def _stop_metrics(self) -> None:
        """At close, first (`MetricsExporter.stop`); metrics are off from then on."""
        exporter, self._metrics = self._metrics, None
        if exporter is not None:
            await exporter.stop()

    def _release_abandoned(self, result: AdmitResult) -> None:
        """A caller cancelled while awaiting `admit`: release that admission (same path as abort)."""
        if self._sup.failure is None and not self._tree.mailbox.closed:
            self._tree.mailbox.put_internal(ReleaseAbandoned(result.rid, result.generation))

    def _release_step(self, results: tuple[Any, ...]) -> None:
        """A caller cancelled while awaiting `step`: release every admission the step made."""
        for r in results:
            if type(r) is AdmitResult:
                self._release_abandoned(r)

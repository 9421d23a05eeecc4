"""Completion bridge: work finished elsewhere (worker thread, CUDA stream) -> asyncio futures.

`CompletionBridge.watch(c)` returns an `asyncio.Future[None]` of the running loop that
resolves when ``c`` completes, without ever blocking the loop:

- a `concurrent.futures.Future` (or an object exposing one as ``.future``, like
  `FutureCompletion`) is bridged with ``add_done_callback`` + ``loop.call_soon_threadsafe``;
- any other object with ``query()`` / ``synchronize()`` (CUDA events, fake completions) is
  polled by one poller task per bridge with an adaptive sleep (``min_poll`` after progress,
  doubling up to ``max_poll`` while idle). ``synchronize()`` is called only after
  ``query()`` returned true, to collect a failure: it does not block then.

A failed copy becomes the future's exception: `TransferError` whose ``__cause__`` is the
original error (a `TransferError` passes through as is). ``timeout`` sets `TimeoutError`
on the future; the copy keeps running and is still tracked. Cancelling the returned future
only detaches that awaiter: the copy, the bridge and other awaiters are unaffected.

`aclose()` stops intake, waits for every watched completion (including timed-out and
detached ones; ``wait=False`` cancels the pending futures instead) and stops the poller.

`LayerReadiness` is the per-layer readiness of one load, shareable by any number of
awaiters (a second request that hits a node being loaded awaits the same object).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
from collections.abc import Sequence
from typing import Any

from runtime.errors import ArgumentError, InternalError, RuntimeClosed, TransferError

__all__ = ["CompletionBridge", "LayerReadiness", "as_transfer_error"]


def as_transfer_error(exc: BaseException) -> TransferError:
    if isinstance(exc, TransferError):
        return exc
    err = TransferError(f"copy failed: {exc!r}")
    err.__cause__ = exc
    return err


class _Watch:
    __slots__ = ("completion", "future", "timer", "finished")

    def __init__(self, completion: Any, future: asyncio.Future) -> None:
        self.completion = completion
        self.future = future
        self.timer: asyncio.TimerHandle | None = None
        self.finished = False


def _cf_future_of(c: Any) -> cf.Future | None:
    if isinstance(c, cf.Future):
        return c
    f = getattr(c, "future", None)
    return f if isinstance(f, cf.Future) else None


class CompletionBridge:
    """Turns completions into futures of one event loop (see the module doc)."""

    def __init__(self, *, min_poll: float = 50e-6, max_poll: float = 2e-3) -> None:
        self._min_poll = min_poll
        self._max_poll = max_poll
        self._loop: asyncio.AbstractEventLoop | None = None
        self._polled: list[_Watch] = []
        self._outstanding: set[_Watch] = set()
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._poller: asyncio.Task | None = None
        self._closing = False
        self._stopping = False

    # ---- lifecycle ----------------------------------------------------------------------

    def start(self) -> "CompletionBridge":
        """Bind to the running loop (idempotent)."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._wake = asyncio.Event()
            self._idle = asyncio.Event()
            self._idle.set()
        return self

    async def __aenter__(self) -> "CompletionBridge":
        return self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def in_flight(self) -> int:
        """Watched completions that have not finished yet (awaited or not)."""
        return len(self._outstanding)

    async def aclose(self, *, wait: bool = True, timeout: float | None = None) -> None:
        """Stop intake; wait for every watched completion (or cancel their futures); stop the poller."""
        self._closing = True
        if self._loop is None:
            return
        if wait and self._outstanding:
            assert self._idle is not None
            await asyncio.wait_for(self._idle.wait(), timeout)
        if not wait:
            for w in list(self._outstanding):
                self._drop(w)
                if not w.future.done():
                    w.future.cancel()
        self._stopping = True
        if self._poller is not None:
            assert self._wake is not None
            self._wake.set()
            await self._poller
            self._poller = None

    # ---- watching -----------------------------------------------------------------------

    def watch(self, c: Any, timeout: float | None = None) -> asyncio.Future:
        """An `asyncio.Future[None]` that resolves when ``c`` completes (see the module doc)."""
        if self._closing:
            raise RuntimeClosed("completion bridge is closed")
        loop = self.start()._loop
        assert loop is not None and self._idle is not None
        fut = loop.create_future()
        w = _Watch(c, fut)
        self._outstanding.add(w)
        self._idle.clear()
        if timeout is not None:
            w.timer = loop.call_later(timeout, self._on_timeout, w, timeout)
        cff = _cf_future_of(c)
        if cff is not None:
            cff.add_done_callback(lambda f, w=w: self._post(self._settle_cf, w, f))
        else:
            if not (callable(getattr(c, "query", None)) and callable(getattr(c, "synchronize", None))):
                self._drop(w)
                raise TypeError(f"cannot watch {type(c).__name__}: need a concurrent Future or query()/synchronize()")
            self._polled.append(w)
            self._ensure_poller()
        return fut

    # ---- internals ----------------------------------------------------------------------

    def _post(self, fn: Any, *args: Any) -> None:
        loop = self._loop
        try:
            loop.call_soon_threadsafe(fn, *args)  # type: ignore[union-attr]
        except RuntimeError:
            pass  # loop closed: nobody is left to tell

    def _settle_cf(self, w: _Watch, f: cf.Future) -> None:
        if f.cancelled():
            self._settle(w, cf.CancelledError("copy was cancelled"))
        else:
            self._settle(w, f.exception())

    def _settle(self, w: _Watch, exc: BaseException | None) -> None:
        if w.finished:
            return
        self._drop(w)
        if not w.future.done():
            if exc is None:
                w.future.set_result(None)
            else:
                w.future.set_exception(as_transfer_error(exc))

    def _drop(self, w: _Watch) -> None:
        w.finished = True
        if w.timer is not None:
            w.timer.cancel()
            w.timer = None
        self._outstanding.discard(w)
        if not self._outstanding and self._idle is not None:
            self._idle.set()

    def _on_timeout(self, w: _Watch, timeout: float) -> None:
        w.timer = None
        if not w.future.done():
            w.future.set_exception(TimeoutError(f"completion not done after {timeout}s"))

    def _ensure_poller(self) -> None:
        assert self._wake is not None and self._loop is not None
        if self._poller is None or self._poller.done():
            self._stopping = False
            self._poller = self._loop.create_task(self._poll(), name="hicache-completion-poller")
        self._wake.set()

    async def _poll(self) -> None:
        assert self._wake is not None
        delay = self._min_poll
        while True:
            if not self._polled:
                if self._stopping:
                    return
                self._wake.clear()
                await self._wake.wait()
                delay = self._min_poll
                continue
            progressed = False
            still = []
            for w in self._polled:
                if w.finished:
                    progressed = True
                    continue
                try:
                    ready = w.completion.query()
                    exc = None
                    if ready:
                        try:
                            w.completion.synchronize()  # query() is true: does not block
                        except BaseException as e:  # noqa: BLE001
                            exc = e
                except BaseException as e:  # noqa: BLE001 - query() itself failed (e.g. CUDA error)
                    ready, exc = True, e
                if ready:
                    self._settle(w, exc)
                    progressed = True
                else:
                    still.append(w)
            self._polled[:] = still
            if progressed:
                delay = self._min_poll
                await asyncio.sleep(0)
            else:
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._max_poll)


class LayerReadiness:
    """Per-layer readiness of one load; any number of tasks may await the same object.

    ``wait(layer)`` resolves when layer ``layer`` (and so every earlier one) is on the
    device, or raises its `TransferError` / `TimeoutError`. Cancelling a waiter never
    cancels the shared per-layer futures.

    Under one control plane over tensor-parallel ranks it is the instance's readiness (a layer
    is ready when every rank's is) and holds each rank's own: ``rank(r)``, so that rank r's
    model waits for its own copy only.
    """

    def __init__(self, futures: Sequence[asyncio.Future], events: Sequence[Any] | None = None, op_id: int | None = None,
                 ranks: Sequence["LayerReadiness"] = ()) -> None:
        self._futs = tuple(futures)
        self._events = tuple(events) if events is not None else None
        self.op_id = op_id
        self._ranks = tuple(ranks)
        seen: set[int] = set()
        for f in self._futs:
            if id(f) not in seen:
                seen.add(id(f))
                f.add_done_callback(_retrieve)  # failure is reported through the ack; no "never retrieved" noise

    @classmethod
    def watch(cls, bridge: CompletionBridge, handle: Any, timeout: float | None = None) -> "LayerReadiness":
        """Readiness of a `CopyHandle`'s layers (a completion shared by layers is watched once)."""
        by_id: dict[int, asyncio.Future] = {}
        futs = []
        for c in handle.layers:
            f = by_id.get(id(c))
            if f is None:
                f = by_id[id(c)] = bridge.watch(c, timeout)
            futs.append(f)
        return cls(futs, handle.layer_events, handle.op_id)

    @classmethod
    def completed(cls, num_layers: int) -> "LayerReadiness":
        """Readiness with every layer ready (data already on the device)."""
        loop = asyncio.get_running_loop()
        f = loop.create_future()
        f.set_result(None)
        return cls([f] * num_layers)

    @classmethod
    def pending(cls, num_layers: int, op_id: int | None = None, ranks: int = 1) -> "LayerReadiness":
        """Readiness created when a load is issued, before the engine starts it; the transfer
        actor later `bind`s it to the copy's per-layer completions. `ranks` > 1: with a pending
        readiness of each rank's own (`rank(r)`)."""
        loop = asyncio.get_running_loop()
        own = () if ranks == 1 else tuple(cls.pending(num_layers, op_id) for _ in range(ranks))
        return cls([loop.create_future() for _ in range(num_layers)], None, op_id, own)

    def rank(self, r: int) -> "LayerReadiness":
        """Rank `r`'s readiness under one control plane over tensor-parallel ranks (its layers
        ready when its own copy's are); one rank, or a load with no per-rank part: this one."""
        if type(r) is not int or not 0 <= r < self.num_ranks:
            raise ArgumentError(f"rank must be an int in [0, {self.num_ranks}), got {r!r}")
        return self._ranks[r] if self._ranks else self

    @property
    def num_ranks(self) -> int:
        return len(self._ranks) or 1

    def bind(self, bridge: CompletionBridge, handle: Any, timeout: float | None = None) -> None:
        """Resolve each pending layer from the handle's completion for that layer (and each rank's
        readiness from that rank's handle, `CopyHandle.ranks`)."""
        if self._ranks:
            if len(handle.ranks) != len(self._ranks):
                raise InternalError(f"a load's readiness of {len(self._ranks)} ranks got a copy of "
                                    f"{len(handle.ranks)} ranks")
            for own, rank_handle in zip(self._ranks, handle.ranks):
                own.bind(bridge, rank_handle, timeout)
        by_id: dict[int, asyncio.Future] = {}
        layers = list(handle.layers)
        events = list(handle.layer_events) if handle.layer_events is not None else None
        if len(layers) > len(self._futs):
            # the plan's pools have more layers than this readiness (a recurrent state's beside the
            # KV's): the last one waits for the copy's last layer, which finishes after all others
            # (its future and its event alike: a stream waits on the event instead of the future)
            layers[len(self._futs) - 1] = layers[-1]
            if events is not None:
                events[len(self._futs) - 1] = events[-1]
        elif len(layers) < len(self._futs):
            # fewer copy layers than readiness layers (a model's sliding layers in a pool of their
            # own: each pool has fewer layers than the model): the rest wait for the copy's last
            layers += [layers[-1]] * (len(self._futs) - len(layers))
            if events is not None:
                events += [events[-1]] * (len(self._futs) - len(events))
        if events is not None:
            self._events = tuple(events[: len(self._futs)])
        for target, c in zip(self._futs, layers):
            src = by_id.get(id(c))
            if src is None:
                src = by_id[id(c)] = bridge.watch(c, timeout)
            src.add_done_callback(lambda f, target=target: _copy_outcome(f, target))

    def fail_all(self, exc: BaseException) -> None:
        for own in self._ranks:
            own.fail_all(exc)
        for f in self._futs:
            if not f.done():
                f.set_exception(exc)

    @property
    def num_layers(self) -> int:
        return len(self._futs)

    def ready(self, layer: int) -> bool:
        f = self._futs[layer]
        return f.done() and not f.cancelled() and f.exception() is None

    def all_ready(self) -> bool:
        return all(self.ready(i) for i in range(len(self._futs)))

    def error(self) -> BaseException | None:
        """The failure of the first failed layer, if any layer failed."""
        for f in self._futs:
            if f.done() and not f.cancelled() and f.exception() is not None:
                return f.exception()
        return None

    def done(self) -> bool:
        """Every layer settled (ready or failed)."""
        return all(f.done() for f in self._futs)

    def event(self, layer: int) -> Any | None:
        """The CUDA event of ``layer`` (for ``stream.wait_event``), or None off CUDA."""
        return None if self._events is None else self._events[layer]

    async def wait(self, layer: int) -> None:
        await asyncio.shield(self._futs[layer])

    async def wait_all(self) -> None:
        for f in self._futs:
            await asyncio.shield(f)


def _retrieve(f: asyncio.Future) -> None:
    if not f.cancelled():
        f.exception()


def _copy_outcome(src: asyncio.Future, target: asyncio.Future) -> None:
    if target.done():
        return
    if src.cancelled():
        target.set_exception(TransferError("copy watch cancelled"))
    elif src.exception() is not None:
        target.set_exception(src.exception())
    else:
        target.set_result(None)

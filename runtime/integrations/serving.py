"""A small async serving loop that embeds `CacheRuntime` the way a serving framework does.

    async with CacheRuntime.open(config) as rt:
        async with ServingLoop(rt, PagedKVModel(model, rt.device_pool), eos_token_ids=[2]) as srv:
            out = await srv.generate(prompt_ids, max_new_tokens=32)
            print(out.tokens, out.metrics.host_tokens, out.metrics.ttft_s)

What it does, per scheduling step (one task, `ServingLoop._run`):

1. **Arrival** (`submit`): the request joins the waiting queue (first come, first served, but
   ahead of requests that yielded: see 2); ``rt.prepare`` is called
   when the runtime has it (a storage prefetch while the request waits).
2. **Admission** (prefills first): head of the queue first, while ``rt.can_admit(prompt +
   reserve)`` says yes (``reserve`` = room for ``max_new_tokens``, at most ``max_reserve``
   tokens), up to ``max_running`` requests and ``max_prefill_tokens`` recomputed tokens per
   step; ``rt.admit`` gives the slots of every prompt token and the per-tier hit counts. When
   the head does not fit (device room or ``max_running``), a decoding request that has had its
   quantum (``yield_after`` tokens since its admission) *yields*: ``finish`` caches its KV and
   it queues again at the tail, so a waiting turn whose prompt is mostly cached starts within
   a few steps instead of waiting for a whole reply to finish; the yielded request resumes
   from its cached KV (one yield per step, so the copies the first one started can settle; a
   request yields only when its written KV ends on a page boundary, so that resuming
   recomputes nothing the cache could not keep).
   New turns queue ahead of yielded requests, but at most ``max_running`` of them pass each
   yielded request (one left behind every later turn would lose its cached KV to eviction);
   only a new turn makes a decode yield.
3. **Extend** (one ``rt.step`` message): each decoding request commits its computed length and
   gets one more slot. A request whose extend finds no room is *preempted*: ``finish`` caches
   its computed KV and it goes back to the head of the queue to resume later (greedy decoding
   makes the resumed output identical).
4. **Forward**: one ragged batch of prefills (positions ``cached .. len-1``) and decodes (one
   token) through :class:`~runtime.integrations.hf_llama.PagedKVModel`, run in a worker thread
   (``asyncio.to_thread``) so the loop keeps serving the runtime's actors. Host->device loads
   are awaited **per layer**: a pump task on the loop awaits ``readiness.wait(i)`` and sets a
   ``threading.Event`` per layer; the model's ``before_layer(i)`` hook blocks on it, so layer 0
   runs while the later layers are still being copied (``layerwise=False`` awaits all layers
   before the forward instead; a hybrid model always does: its forward reads each resumed
   state first, and the loads' layers are the pools', not the model's). On CUDA, once the
   copies are issued (every layer has its CUDA event), ``before_layer(i)`` makes the forward's
   stream wait on layer ``i``'s event instead (``stream.wait_event``: the GPU orders it, nothing
   on the host waits); the awaitables then only report a copy that failed to issue.
5. **Sample and finish**: greedy (argmax); a request that emits an EOS id or reaches
   ``max_new_tokens`` is finished with ``rt.finish(rid, prompt + generated[:-1])`` (only
   tokens whose KV was written: the last sampled token never went through the model).

Per-request metrics (:class:`TurnMetrics`): prompt tokens served from device / host / storage
(``AdmitResult.loaded_storage``) /
recomputed, time to first token, decode tokens/s. The library never picks the event loop: the
caller's ``main`` does (the demo uses uvloop when it is installed).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from runtime.errors import CapacityError, HiCacheError, TransferError, ValidationError
from runtime.integrations.hf_llama import PagedSeq
from runtime.messages import Commit, Extend, Finish

__all__ = ["TurnMetrics", "Completion", "ServingLoop", "ServingError"]


class ServingError(HiCacheError):
    """A request could not be served (its error is the ``__cause__``)."""


@dataclass
class TurnMetrics:
    """What one request (a chat turn) cost.

    ``device/host/storage/recomputed_tokens`` say how the prompt was served at admission (they
    sum to ``prompt_tokens``). A request preempted for room (or yielding to a waiting prefill)
    is admitted again later to resume; what those re-admissions found cached (any tier) and
    recomputed is in ``resume_*``."""

    rid: Hashable
    prompt_tokens: int = 0
    generated_tokens: int = 0
    device_tokens: int = 0  # prompt tokens whose KV was already on device
    host_tokens: int = 0  # loaded back from the host tier
    storage_tokens: int = 0  # read from storage (0 until the runtime has a storage tier)
    recomputed_tokens: int = 0  # prefilled by the model
    queue_s: float = 0.0  # arrival -> first admission (waiting for room or a slot in the batch)
    prefill_s: float = 0.0  # first admission -> first generated token (loads, the prefill step)
    ttft_s: float = 0.0  # arrival -> first generated token (= queue_s + prefill_s)
    latency_s: float = 0.0  # arrival -> last token
    tokens_per_s: float = 0.0  # decode rate: (generated - 1) / (last token - first token)
    preemptions: int = 0  # preempted for room (a decode step found none)
    yields: int = 0  # made room for a waiting prefill (after its quantum of decode steps)
    resume_cached_tokens: int = 0
    resume_recomputed_tokens: int = 0

    @property
    def cached_tokens(self) -> int:
        return self.device_tokens + self.host_tokens + self.storage_tokens


@dataclass
class Completion:
    rid: Hashable
    prompt: list[int]
    tokens: list[int]  # generated ids (the EOS id included when it stopped on one)
    finish_reason: str  # "eos" | "length"
    metrics: TurnMetrics
    logits: list[torch.Tensor] | None = None  # [vocab] per generated token (record_logits=True)


@dataclass(eq=False)
class _Request:
    rid: Hashable
    prompt: list[int]
    max_new_tokens: int
    eos: frozenset[int]
    extra_key: Hashable
    future: asyncio.Future
    t_arrival: float
    metrics: TurnMetrics
    generated: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] | None = None
    # while running
    slots: torch.Tensor | None = None  # device slots of context[:seq_len]
    kv_len: int = 0  # tokens whose KV is written
    start: int = 0  # first position the next forward computes
    readiness: tuple = ()
    t_first: float | None = None
    t_admitted: float = 0.0
    generated_at_admission: int = 0
    yielded: bool = False  # queued again after yielding to a waiting prefill (new turns go first)
    overtaken: int = 0  # new turns queued ahead of it since it yielded

    def admitted(self) -> None:
        """Record an admission: when, and how much had been generated by then (a yield's quantum)."""
        self.t_admitted = time.perf_counter()
        self.yielded = False
        self.generated_at_admission = len(self.generated)

    def yield_room(self) -> None:
        """Mark the request as queued again behind new turns, after yielding its room."""
        self.yielded = True
        self.overtaken = 0

    def overtaken_by_new_turn(self) -> None:
        self.overtaken += 1
    admissions: int = 0
    # recurrent state (a hybrid model): the running state slot, the snapshot the next forward
    # resumes from, and the last position a snapshot was asked at
    state_slot: int | None = None
    state_from: int | None = None
    snapshot_at: int = 0

    @property
    def context(self) -> list[int]:
        return self.prompt + self.generated


class _LayerGate:
    """Bridge from per-layer readiness (futures of the loop) to the forward's thread."""

    def __init__(self, readiness: Sequence[Any], num_layers: int) -> None:
        self.events = [threading.Event() for _ in range(num_layers)]
        self.failed_from: int | None = None
        self.error: BaseException | None = None
        self.wait_s = 0.0
        self.task = asyncio.get_running_loop().create_task(self._pump(list(readiness)))

    async def _pump(self, readiness: list[Any]) -> None:
        layer = 0
        try:
            for layer in range(len(self.events)):
                for r in readiness:
                    await r.wait(layer)
                self.events[layer].set()
        except BaseException as exc:  # noqa: BLE001 - the forward's thread re-raises it
            self.error = exc if not isinstance(exc, asyncio.CancelledError) else TransferError("load wait cancelled")
            self.failed_from = layer
            for ev in self.events:
                ev.set()

    def before_layer(self, layer: int) -> None:  # runs on the forward's thread
        ev = self.events[layer]
        if not ev.is_set():
            t0 = time.perf_counter()
            ev.wait()
            self.wait_s += time.perf_counter() - t0
        if self.failed_from is not None and layer >= self.failed_from:
            raise self.error  # type: ignore[misc]

    def close(self) -> None:
        if not self.task.done():
            self.task.cancel()
        if self.failed_from is None and not all(ev.is_set() for ev in self.events):
            self.error, self.failed_from = TransferError("forward abandoned"), 0
        for ev in self.events:
            ev.set()


class _EventGate:
    """The forward's CUDA stream waits on each layer's copy event: no host round trip (no poller,
    future, pump task or thread wake-up between a layer's copy and its compute)."""

    wait_s = 0.0  # the forward's thread never blocks

    def __init__(self, events: list[list[Any]], stream_of: Any) -> None:
        self.events = events  # [layer][load]
        self._stream_of = stream_of

    def before_layer(self, layer: int) -> None:  # runs on the forward's thread
        stream = self._stream_of()
        for ev in self.events[layer]:
            stream.wait_event(ev)

    def close(self) -> None:
        pass


def _layer_gate(readiness: Sequence[Any], num_layers: int, stream_of: Any) -> _EventGate | _LayerGate:
    """A CUDA event for every layer of every load (the CUDA copy engine's, bound once the copy
    was issued): the stream waits on them; otherwise (a CPU model, a copy not issued yet) the
    per-layer awaitables, bridged to the forward's thread."""
    events = [[rd.event(layer) for rd in readiness] for layer in range(num_layers)]
    if all(ev is not None for per_layer in events for ev in per_layer):
        return _EventGate(events, stream_of)
    return _LayerGate(readiness, num_layers)


def _cuda_stream() -> Any:
    return torch.cuda.current_stream()


class ServingLoop:
    """Continuous batching over one `CacheRuntime` and one paged model.

    ``model``: a :class:`~runtime.integrations.hf_llama.PagedKVModel` on ``runtime.device_pool``
    (anything with ``forward(seqs, before_layer=...) -> .logits [B, vocab]`` and
    ``num_layers``). Use it as an async context manager (or ``start``/``close``); ``close``
    serves what was submitted before stopping, unless ``cancel=True``.
    """

    def __init__(
        self,
        runtime: Any,
        model: Any,
        *,
        max_running: int = 8,
        max_prefill_tokens: int = 4096,
        max_reserve: int = 64,
        eos_token_ids: Iterable[int] = (),
        layerwise: bool = True,
        record_logits: bool = False,
        admit_timeout_s: float = 10.0,
        snapshot_every: int | None = None,
        yield_after: int | None = 2,
    ) -> None:
        if max_running < 1 or max_prefill_tokens < 1:
            raise ValueError("max_running and max_prefill_tokens must be >= 1")
        if yield_after is not None and yield_after < 1:
            raise ValueError("yield_after must be >= 1 (or None: decodes never yield to waiting prefills)")
        self.rt = runtime
        self.model = model
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.max_reserve = max_reserve
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.layerwise = layerwise
        self.record_logits = record_logits
        self.admit_timeout_s = admit_timeout_s
        self.yield_after = yield_after
        self.num_layers = int(model.num_layers)
        self._device_slots = int(runtime.config.device_slots)
        self._page_size = int(runtime.config.page_size)
        # a hybrid model (the runtime keeps recurrent state): a snapshot is asked for at the last
        # page boundary a forward reaches, at least `snapshot_every` tokens after the previous one
        self._hybrid = getattr(runtime, "state_pool", None) is not None
        if self._hybrid:  # a forward reads each request's resumed state first: loads must be whole
            self.layerwise = False
        self.snapshot_every = snapshot_every or self._page_size
        if self.snapshot_every % self._page_size:
            raise ValueError(f"snapshot_every must be a multiple of the page size {self._page_size}")
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._rids = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closing = False
        self.stats: dict[str, float] = {
            "steps": 0, "forwards": 0, "forward_s": 0.0, "layer_wait_s": 0.0, "prefill_tokens": 0,
            "decode_tokens": 0, "max_batch": 0, "preemptions": 0, "yields": 0, "load_failures": 0, "finished": 0,
        }

    # -- lifecycle -------------------------------------------------------------------
    async def __aenter__(self) -> "ServingLoop":
        self.start()
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        await self.close(cancel=exc_type is not None)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="serving-loop")

    async def close(self, cancel: bool = False) -> None:
        """Stop intake; serve what is queued and running (or abort it with ``cancel``)."""
        self._closing = True
        self._wake.set()
        if self._task is None:
            return
        if cancel and not self._task.done():
            self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        finally:
            await self._abort_all(ServingError("serving loop closed"))

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    # -- requests ----------------------------------------------------------------------
    async def submit(self, prompt: Sequence[int] | np.ndarray | torch.Tensor, *, max_new_tokens: int,
                     rid: Hashable | None = None, extra_key: Hashable = None,
                     eos_token_ids: Iterable[int] | None = None) -> asyncio.Future:
        """Queue a request; returns a future of its :class:`Completion`."""
        if self._closing:
            raise ServingError("serving loop is closing")
        if self._task is None or self._task.done():
            raise ServingError("serving loop not running (use `async with ServingLoop(...)`)")
        if isinstance(prompt, torch.Tensor):
            ids = [int(t) for t in prompt.reshape(-1).tolist()]
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("empty prompt")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        rid = f"req-{next(self._rids)}" if rid is None else rid
        fut = asyncio.get_running_loop().create_future()
        req = _Request(rid, ids, int(max_new_tokens), self.eos if eos_token_ids is None else frozenset(eos_token_ids),
                       extra_key, fut, time.perf_counter(), TurnMetrics(rid, prompt_tokens=len(ids)),
                       logits=[] if self.record_logits else None)
        prepare = getattr(self.rt, "prepare", None)
        if prepare is not None:  # storage prefetch while the request waits
            await prepare(rid, np.asarray(ids, dtype=np.int32), extra_key)
        self._enqueue(req)
        self._wake.set()
        return fut

    def _enqueue(self, req: _Request) -> None:
        """A new turn goes ahead of the yielded requests at the tail of the queue (they resume from
        cached KV in any case), but each yielded request lets at most ``max_running`` new turns
        pass: one that waits behind every later turn waits for the whole trace, long enough for
        its cached KV to leave the host tier too (then it recomputes its whole context)."""
        at = len(self._waiting)
        while at and self._waiting[at - 1].yielded and self._waiting[at - 1].overtaken < self.max_running:
            at -= 1
        for i in range(at, len(self._waiting)):
            self._waiting[i].overtaken_by_new_turn()
        self._waiting.insert(at, req)

    async def generate(self, prompt: Sequence[int] | np.ndarray | torch.Tensor, *, max_new_tokens: int,
                       **kw: Any) -> Completion:
        return await (await self.submit(prompt, max_new_tokens=max_new_tokens, **kw))

    # -- the scheduling loop ---------------------------------------------------------------
    async def _run(self) -> None:
        stuck_since: float | None = None
        try:
            while True:
                if not self._waiting and not self._running:
                    if self._closing:
                        return
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                prefills = await self._admit()
                decodes = await self._extend([r for r in self._running if r not in prefills])
                if not prefills and not decodes:
                    # nothing runs and the head of the queue does not fit yet: copies in flight
                    # (write-back, backups) still lock evictable pages. Wait a little.
                    now = time.perf_counter()
                    stuck_since = stuck_since or now
                    if now - stuck_since > self.admit_timeout_s and self._waiting:
                        req = self._waiting.popleft()
                        self._fail(req, CapacityError(f"request {req.rid!r} never fit the device pool"))
                        stuck_since = None
                    await asyncio.sleep(0.002)
                    continue
                stuck_since = None
                await self._step(prefills, decodes)
        except BaseException as exc:
            await self._abort_all(exc)
            raise

    async def _admit(self) -> list[_Request]:
        admitted: list[_Request] = []
        budget = self.max_prefill_tokens
        made_room = False  # one yield per step (its copies settle before the next)
        while self._waiting and budget > 0:
            req = self._waiting[0]
            if len(self._running) >= self.max_running:
                if not made_room and await self._yield_to_prefill(req, admitted):
                    made_room = True
                    continue
                break
            ctx = req.context
            reserve = min(req.max_new_tokens - len(req.generated), self.max_reserve,
                          max(0, self._device_slots - len(ctx)))
            probe = np.asarray(ctx + [0] * reserve, dtype=np.int32)
            try:
                if not await self.rt.can_admit(probe, req.extra_key):
                    if not made_room and await self._yield_to_prefill(req, admitted):
                        made_room = True
                        continue
                    break
                res = await self.rt.admit(req.rid, np.asarray(ctx, dtype=np.int32), req.extra_key)
            except CapacityError:
                break
            except ValidationError as exc:
                self._waiting.remove(req)
                self._fail(req, exc)
                continue
            # by identity, not popleft: a turn submitted while this one was being admitted may
            # have gone ahead of it (new turns queue before yielded ones)
            self._waiting.remove(req)
            m = req.metrics
            storage = res.loaded_storage  # part of loaded_host that this request's prefetch read from storage
            cached = res.cached_device + res.loaded_host
            req.admitted()
            if req.admissions == 0:
                m.device_tokens, m.host_tokens, m.storage_tokens = res.cached_device, res.loaded_host - storage, storage
                m.recomputed_tokens = len(ctx) - cached
                m.queue_s = req.t_admitted - req.t_arrival
            else:
                m.resume_cached_tokens += cached
                m.resume_recomputed_tokens += len(ctx) - cached
            req.admissions += 1
            req.slots = res.slots.to(torch.long)
            req.start = cached
            req.kv_len = cached
            req.readiness = tuple(res.readiness)
            req.state_slot, req.state_from, req.snapshot_at = res.state_slot, res.state_from, cached
            self._running.append(req)
            admitted.append(req)
            budget -= len(ctx) - cached
        return admitted

    async def _yield_to_prefill(self, head: _Request, admitted: list[_Request]) -> bool:
        """Make room for a new turn at the head of the queue: the running decode that has run
        longest since its admission (at least `yield_after` tokens) goes back to the tail with
        its KV cached. A request resuming (after a yield or a preemption) waits for room instead:
        resumes making each other yield would only move KV back and forth."""
        if self.yield_after is None or head.admissions:
            return False
        # only at a page boundary of its written KV: the cache keeps whole pages, so a request
        # yielding mid-page recomputes that page's tail when it resumes (yielding anywhere cost
        # the --quick serving benchmark 7% more prefill than an infinite cache)
        ready = [r for r in self._running if r not in admitted and r.kv_len % self._page_size == 0
                 and len(r.generated) - r.generated_at_admission >= self.yield_after]
        if not ready:
            return False
        victim = max(ready, key=lambda r: (len(r.generated) - r.generated_at_admission, r.kv_len))
        await self._preempt([victim], yielded=True)
        return True

    async def _extend(self, decodes: list[_Request]) -> list[_Request]:
        if not decodes:
            return []
        items: list[Any] = []
        for r in decodes:
            items += [Commit(r.rid, r.kv_len), Extend(r.rid, 1)]
        out = await self.rt.step(items)
        ok: list[_Request] = []
        preempt: list[_Request] = []
        for i, r in enumerate(decodes):
            commit, ext = out[2 * i], out[2 * i + 1]
            if isinstance(ext, CapacityError):
                preempt.append(r)
            elif isinstance(commit, BaseException) or isinstance(ext, BaseException):
                err = commit if isinstance(commit, BaseException) else ext
                self._running.remove(r)
                await self._release(r, abort=True)
                self._fail(r, err)
            else:
                r.slots = torch.cat((r.slots, ext.to(torch.long)))
                r.start = r.kv_len
                r.readiness = ()
                ok.append(r)
        if preempt:
            await self._preempt(preempt)
        return ok

    async def _step(self, prefills: list[_Request], decodes: list[_Request]) -> None:
        batch = prefills + decodes
        seqs = await self._seqs(batch) if self._hybrid else [
            PagedSeq(slots=r.slots, start=r.start, input_ids=r.context[r.start:]) for r in batch]
        pending = []
        for r in batch:
            for rd in r.readiness:
                if not rd.all_ready() and rd not in pending:
                    pending.append(rd)
        gate: _EventGate | _LayerGate | None = None
        try:
            if pending and self.layerwise:
                gate = _layer_gate(pending, self.num_layers, _cuda_stream)
            else:
                for rd in pending:
                    await rd.wait_all()
            t0 = time.perf_counter()
            try:
                out = await asyncio.to_thread(
                    self.model.forward, seqs, before_layer=gate.before_layer if gate is not None else None)
            finally:
                if gate is not None:
                    gate.close()
                    self.stats["layer_wait_s"] += gate.wait_s
            if isinstance(gate, _EventGate):
                # the stream waited on the events, not on the outcomes: a copy that failed to
                # issue left its layers unwritten (settled while the forward ran, as a rule)
                for rd in pending:
                    await rd.wait_all()
        except TransferError:
            # a host->device load failed: its requests lost their prefix. Release the whole
            # batch (the others' KV of this step may be half written) and serve it again.
            self.stats["load_failures"] += 1
            await self._preempt(batch, abort=[r for r in batch if r.readiness])
            return
        now = time.perf_counter()
        await self._note_step(len(batch), sum(len(s.input_ids) for s in seqs[: len(prefills)]), len(decodes),
                              now - t0)
        next_ids = out.logits.argmax(dim=-1).tolist()
        finished: list[tuple[_Request, str]] = []
        for i, r in enumerate(batch):
            r.kv_len = len(r.context)
            r.readiness = ()
            r.state_from = None  # the running slot now holds the state after kv_len tokens
            tok = int(next_ids[i])
            r.generated.append(tok)
            if r.logits is not None:
                r.logits.append(out.logits[i].detach().to("cpu", copy=True))
            if r.t_first is None:
                r.t_first = now
                r.metrics.ttft_s = now - r.t_arrival
                r.metrics.prefill_s = now - r.t_arrival - r.metrics.queue_s
            if tok in r.eos:
                finished.append((r, "eos"))
            elif len(r.generated) >= r.max_new_tokens:
                finished.append((r, "length"))
        if finished:
            await self._finish(finished, now)

    async def _note_step(self, batch: int, prefill_tokens: int, decode_tokens: int, forward_s: float) -> None:
        st = self.stats
        st["steps"] += 1
        st["forwards"] += 1
        st["forward_s"] += forward_s
        st["max_batch"] = max(st["max_batch"], batch)
        st["prefill_tokens"] += prefill_tokens
        st["decode_tokens"] += decode_tokens
        if prefill_tokens and self.rt.config.reuse_cost == "measured":  # the runtime's load-cost model weighs loads against it
            await self.rt.observe_prefill(prefill_tokens, forward_s)

    async def _finish(self, finished: list[tuple[_Request, str]], now: float) -> None:
        out = await self.rt.step([Finish(r.rid, np.asarray(r.context[: r.kv_len], dtype=np.int32))
                                  for r, _ in finished])
        for (r, reason), res in zip(finished, out, strict=True):
            self._running.remove(r)
            if isinstance(res, BaseException):
                self._fail(r, res)
                continue
            m = r.metrics
            m.generated_tokens = len(r.generated)
            m.latency_s = now - r.t_arrival
            n = len(r.generated)
            if n > 1 and r.t_first is not None and now > r.t_first:
                m.tokens_per_s = (n - 1) / (now - r.t_first)
            self.stats["finished"] += 1
            if not r.future.done():
                r.future.set_result(Completion(r.rid, r.prompt, list(r.generated), reason, m, r.logits))

    async def _preempt(self, reqs: list[_Request], abort: Sequence[_Request] = (), yielded: bool = False) -> None:
        """Give back the device slots of `reqs` (caching their computed KV unless in `abort`)
        and queue them again at the head, in their order (`yielded`: at the tail, behind the
        waiting prefills they made room for)."""
        kind = "yields" if yielded else "preemptions"
        for r in reqs:
            self._running.remove(r)
            await self._release(r, abort=r in abort)
            setattr(r.metrics, kind, getattr(r.metrics, kind) + 1)
            self.stats[kind] += 1
        if yielded:
            for r in reqs:
                r.yield_room()
            self._waiting.extend(reqs)
        else:
            self._waiting.extendleft(reversed(reqs))

    async def _release(self, r: _Request, abort: bool) -> None:
        try:
            if abort or r.kv_len == 0:
                await self.rt.abort(r.rid)
            else:
                await self.rt.finish(r.rid, np.asarray(r.context[: r.kv_len], dtype=np.int32))
        except TransferError:
            pass  # finish released it (its cached prefix was lost)
        r.slots, r.readiness, r.kv_len, r.start = None, (), 0, 0
        r.state_slot = r.state_from = None

    async def _seqs(self, batch: list[_Request]) -> list[Any]:
        """A hybrid model's sequences: each with its state slot, the snapshot it resumes from and
        the snapshot this forward leaves (the runtime keeps it with the node ending there once
        the request's KV is inserted); no snapshot when no state slot is free."""
        from runtime.integrations.hf_hybrid import HybridSeq

        ends = [len(r.context) - len(r.context) % self._page_size for r in batch]
        asks = [i for i, (r, at) in enumerate(zip(batch, ends, strict=True))
                if at > r.start and at - r.snapshot_at >= self.snapshot_every]
        # the step's snapshots asked together: one wait for the tree actor, not one per request
        slots = await asyncio.gather(*(self.rt.snapshot(batch[i].rid, ends[i]) for i in asks), return_exceptions=True)
        snaps: dict[int, tuple[tuple[int, int], ...]] = {}
        for i, slot in zip(asks, slots, strict=True):
            if isinstance(slot, CapacityError):
                continue  # no state slot: this forward leaves no snapshot
            if isinstance(slot, BaseException):
                raise slot
            snaps[i] = ((ends[i], slot),)
            batch[i].snapshot_at = ends[i]
        return [HybridSeq(slots=r.slots, start=r.start, input_ids=r.context[r.start:], state_slot=r.state_slot,
                          state_from=r.state_from, snapshots=snaps.get(i, ())) for i, r in enumerate(batch)]

    def _fail(self, r: _Request, exc: BaseException) -> None:
        if not r.future.done():
            err = ServingError(f"request {r.rid!r} failed: {exc}")
            err.__cause__ = exc
            r.future.set_exception(err)

    async def _abort_all(self, exc: BaseException) -> None:
        running, self._running = self._running, []
        for r in running:
            if not getattr(self.rt, "closed", False):
                try:
                    await self.rt.abort(r.rid)
                except HiCacheError:
                    pass
            self._fail(r, exc)
        while self._waiting:
            self._fail(self._waiting.popleft(), exc)

"""PrefillServer: the prefill side of a disaggregated pair, answering decode runtimes' `Fill`s.

Each `Fill` is a request of the prefill runtime's own: admitted (its device, host and storage
tiers serve what they hold of the prompt), the rest computed by the model, the asked pages
gathered from the device pool into a registered staging buffer in the storage page form, tagged
(`PageSeal`), and written by the transport straight into the decode side's reserved host pages.
Then the request finishes (its KV stays cached here for the conversation's next turn) and the
decode side gets `Filled` with the tags; on any failure the request is aborted and it gets
`Failed`. Ownership: the request's device pages are the prefill runtime's until the gather into
staging is done; the staging pages are the write's until the transport returns. A write that
failed may still land later (a transport's timeout does not cancel it), so its staging pages are
quarantined, never reused (`quarantined_pages`, bounded by `staging_pages`: past that, fills fail).

One fill computes at a time (the model's forward is one per process); fills queue in order.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import numpy as np
import torch
import zmq
import zmq.asyncio

from runtime.disagg.protocol import (Cancel, Cancelled, Failed, Fill, Filled, Hello, Refused, Welcome, as_extra_key,
                                     decode, disagreement, encode)
from runtime.integrations.hf_llama import PagedSeq
from runtime.storage.hashing import KVIdentity, page_hashes
from runtime.storage.integrity import PageSeal
from runtime.trace import get_logger

_log = get_logger("hicache.disagg")


class Staging:
    """Registered pages in the storage page form [L, C, page_size, H, D] that writes leave from:
    taken per fill, given back once its write returned, quarantined (never reused) when it failed."""

    def __init__(self, pool: Any, page_size: int, pages: int, transport: Any) -> None:
        shape = pool.shape
        self.pages = torch.empty((pages, shape.num_layers, shape.parts, page_size, shape.num_kv_heads, shape.head_dim),
                                 dtype=shape.dtype)
        transport.register(self.pages)
        self.free = list(range(pages))
        self.quarantined = 0

    def take(self, n: int) -> list[int] | None:
        return [self.free.pop() for _ in range(n)] if len(self.free) >= n else None

    def give_back(self, pages: list[int], quarantine: bool) -> None:
        if quarantine:  # the write may still land later: its source stays untouched
            self.quarantined += len(pages)
        else:
            self.free.extend(pages)


class FillBook:
    """The fills of every peer socket, by (socket, request id): queued or computing, writing, and
    those cancelled before their write started."""

    def __init__(self) -> None:
        self.pending: set[tuple[bytes, int]] = set()
        self.writing: set[tuple[bytes, int]] = set()
        self.cancelled: set[tuple[bytes, int]] = set()

    def queued(self, key: tuple[bytes, int]) -> None:
        self.pending.add(key)

    def cancel(self, key: tuple[bytes, int]) -> bool:
        """Cancel a fill that has not started writing (True); one that has answers itself (False)."""
        if key in self.writing:
            return False
        if key in self.pending:
            self.cancelled.add(key)
        return True

    def write_starts(self, key: tuple[bytes, int]) -> None:
        self.writing.add(key)

    def end(self, key: tuple[bytes, int]) -> bool:
        """The fill ended; True when it had been cancelled (its answer went out already)."""
        self.pending.discard(key)
        self.writing.discard(key)
        cancelled = key in self.cancelled
        self.cancelled.discard(key)
        return cancelled


class PrefillServer:
    def __init__(self, runtime: Any, model: Any, transport: Any, *, endpoint: str = "tcp://127.0.0.1:0",
                 staging_pages: int = 256) -> None:
        """`runtime`: the prefill side's `CacheRuntime`; `model`: a `PagedKVModel` on its device
        pool; `transport`: a `KVTransport`; `endpoint`: the ZMQ address to bind (port 0: any)."""
        config = runtime.config
        self.rt = runtime
        self.model = model
        self.transport = transport
        self.identity = KVIdentity.from_config(config)
        self.seal = PageSeal(config.storage_key)
        self.staging = Staging(runtime.device_pool, config.page_size, staging_pages, transport)
        self.counters = dict.fromkeys(("fills", "fill_failures", "pages_sent", "tokens_computed", "tokens_cached",
                                       "refused"), 0)
        self._sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self.endpoint: str = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._compute = asyncio.Lock()
        self._rids = itertools.count()
        self._task: asyncio.Task | None = None
        self._fills: set[asyncio.Task] = set()
        self.book = FillBook()

    @property
    def page_size(self) -> int:
        return self.rt.config.page_size

    @property
    def page_bytes(self) -> int:
        return self.rt.config.page_size * self.rt.config.bytes_per_token

    # -- lifecycle ---------------------------------------------------------------------------------
    async def __aenter__(self) -> "PrefillServer":
        self._task = asyncio.create_task(self._serve())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, *self._fills, return_exceptions=True)
            self._task = None
        self._sock.close(linger=0)

    # -- messages ----------------------------------------------------------------------------------
    async def _serve(self) -> None:
        while True:
            ident, payload = await self._sock.recv_multipart()
            try:
                msg = decode(payload)
            except Exception as exc:  # noqa: BLE001 - a peer's garbage: dropped, logged
                _log.warning("prefill_bad_message", error=repr(exc))
                continue
            if isinstance(msg, Hello):
                await self._send(ident, self._welcome(msg))
            elif isinstance(msg, Fill):
                task = asyncio.create_task(self._answer(ident, msg))
                self._fills.add(task)
                task.add_done_callback(self._fills.discard)
                self.book.queued((ident, msg.req))
            elif isinstance(msg, Cancel):
                await self._cancel(ident, msg.req)

    async def _cancel(self, ident: bytes, req: int) -> None:
        """A fill whose write started answers when the write ends; any other is cancelled now."""
        if self.book.cancel((ident, req)):
            await self._send(ident, Cancelled(req))

    def _welcome(self, hello: Hello) -> Welcome | Refused:
        why = disagreement(hello, self.identity, self.page_size, self.page_bytes, self.seal.keyed)
        if why is not None:
            self.counters["refused"] += 1
            _log.warning("prefill_peer_refused", reason=why)
            return Refused(why)
        return Welcome(self.transport.session)

    async def _answer(self, ident: bytes, fill: Fill) -> None:
        key = (ident, fill.req)
        try:
            async with self._compute:
                try:
                    reply: Filled | Failed | None = await self._fill(fill, key)
                except Exception as exc:  # noqa: BLE001 - the decode side computes it itself
                    self.counters["fill_failures"] += 1
                    _log.warning("prefill_fill_failed", req=fill.req, error=repr(exc))
                    reply = Failed(fill.req, repr(exc))
        finally:
            cancelled = self.book.end(key)
        if reply is not None and not cancelled:
            await self._send(ident, reply)

    async def _send(self, ident: bytes, msg: Any) -> None:
        await self._sock.send_multipart([ident, encode(msg)])

    # -- a fill ------------------------------------------------------------------------------------
    async def _fill(self, fill: Fill, key: tuple[bytes, int]) -> Filled | Failed | None:
        """The fill, or None when it was cancelled before its write started (answered already)."""
        if key in self.book.cancelled:
            return None
        ps, n = self.page_size, fill.pages
        tokens = np.frombuffer(fill.tokens, dtype="<i4").astype(np.int32)
        if n < 1 or len(fill.dst_addrs) != n or len(fill.keys) != n or len(tokens) != (fill.first_page + n) * ps:
            return Failed(fill.req, f"malformed fill: {n} pages, {len(fill.dst_addrs)} destinations, "
                                    f"{len(fill.keys)} keys, {len(tokens)} tokens from page {fill.first_page}")
        extra_key = as_extra_key(fill.extra_key)
        keys = page_hashes(tokens, ps, extra_key, self.identity)[fill.first_page:]
        if keys != list(fill.keys):
            return Failed(fill.req, "page hashes differ: the tokens or the KV identity disagree")
        stage = self.staging.take(n)
        if stage is None:
            return Failed(fill.req, f"{n} pages asked, {len(self.staging.free)} staging pages free")
        rid = f"prefill-fill-{next(self._rids)}"
        computed = writing = sent = False
        try:
            await self._compute_kv(rid, tokens, extra_key, fill.first_page, stage)
            computed = True
            tags = self.seal.tags(keys, [self.staging.pages[i] for i in stage])
            src = [self.staging.pages[i].data_ptr() for i in stage]
            if key in self.book.cancelled:  # (while it computed)
                return None
            writing = True
            self.book.write_starts(key)
            await asyncio.to_thread(self.transport.write, fill.session, src, list(fill.dst_addrs), [self.page_bytes] * n)
            sent = True
        finally:
            self.staging.give_back(stage, quarantine=writing and not sent)
            if sent or (computed and not writing):  # (computed KV stays cached here, even for a cancelled fill)
                await self.rt.finish(rid, tokens)
            else:
                await _quietly(self.rt.abort(rid))
        self.counters["fills"] += 1
        self.counters["pages_sent"] += n
        return Filled(fill.req, n, tags)

    async def _compute_kv(self, rid: str, tokens: np.ndarray, extra_key: Any, first_page: int,
                          stage: list[int]) -> None:
        """Admit `tokens` as request `rid`, compute what no tier held, gather the asked pages into
        staging pages `stage` (in order)."""
        ps = self.page_size
        res = await self.rt.admit(rid, tokens, extra_key)
        for readiness in res.readiness:
            await readiness.wait_all()
        slots = res.slots.to(torch.long)
        if res.cached < len(tokens):
            seq = PagedSeq(slots[:len(tokens)], res.cached, torch.as_tensor(tokens[res.cached:], dtype=torch.long))
            await asyncio.to_thread(self.model.forward, [seq])
        self.counters["tokens_computed"] += len(tokens) - res.cached
        self.counters["tokens_cached"] += res.cached
        # the asked pages' KV in one gather ([L, C, pages * page_size, H, D]), a page to each staging page
        kv = self.rt.device_pool.read_slots(slots[first_page * ps:(first_page + len(stage)) * ps])
        for j, i in enumerate(stage):
            self.staging.pages[i].copy_(kv[:, :, j * ps:(j + 1) * ps])

    def stats(self) -> dict[str, int]:
        return {**self.counters, "free_staging_pages": len(self.staging.free),
                "quarantined_pages": self.staging.quarantined}


async def _quietly(aw: Any) -> None:
    try:
        await aw
    except Exception as exc:  # noqa: BLE001 - already gone (the runtime failed or closed)
        _log.debug("prefill_abort_failed", error=repr(exc))

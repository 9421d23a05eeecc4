"""`EventHub`: where each tree-actor turn's KV events go.

The tree actor hands the hub the records its turn made (`publish`, on the event loop, O(1) per
subscriber); the hub numbers the batch and gives it to every in-process subscription and to the
ZMQ publisher, if any, as a `PendingBatch`: its wire objects are built once, by the first reader
(`PendingBatch.batch`), off the tree actor's turn. A subscription that falls behind by more than its `maxsize` batches is
cut off with `EventsLostError` after the batches it holds (it never slows the runtime and never
silently skips a batch: an index built from it would be wrong).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator

from runtime.errors import HiCacheError

from .publisher import ZmqEventPublisher
from .recorder import Record, materialize
from .wire import KVEventBatch


class PendingBatch:
    """A turn's records with their time stamp; `batch()` builds (once) the `KVEventBatch`."""

    __slots__ = ("ts", "records", "data_parallel_rank", "page_size", "_batch")

    def __init__(self, ts: float, records: list[Record], data_parallel_rank: int | None, page_size: int) -> None:
        self.ts = ts
        self.records = records
        self.data_parallel_rank = data_parallel_rank
        self.page_size = page_size
        self._batch: KVEventBatch | None = None

    def batch(self) -> KVEventBatch:
        # (read from the loop and the publisher's thread: both may build it; either result is the same)
        b = self._batch
        if b is None:
            b = self._batch = KVEventBatch(self.ts, materialize(self.records, self.page_size), self.data_parallel_rank)
        return b


class EventsLostError(HiCacheError):
    """A subscription fell more than `maxsize` batches behind: later batches were not kept for it."""


class EventSubscription(AsyncIterator[KVEventBatch]):
    """`async for batch in runtime.kv_events(): ...` — every batch from the subscription on, in
    order, until the runtime closes (or `close()`)."""

    def __init__(self, hub: "EventHub", maxsize: int) -> None:
        self._hub = hub
        self._maxsize = maxsize
        self._batches: collections.deque[PendingBatch] = collections.deque()
        self._ready = asyncio.Event()
        self._ended = False
        self._lost = False

    def __aiter__(self) -> "EventSubscription":
        return self

    async def __anext__(self) -> KVEventBatch:
        while not self._batches:
            if self._lost:
                raise EventsLostError(f"subscription fell more than {self._maxsize} batches behind")
            if self._ended:
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()
        return self._batches.popleft().batch()

    def take_ready(self) -> list[KVEventBatch]:
        """The batches held now, without waiting (`EventsLostError` if batches were lost)."""
        out = [b.batch() for b in self._batches]
        self._batches.clear()
        if self._lost:
            raise EventsLostError(f"subscription fell more than {self._maxsize} batches behind")
        return out

    def close(self) -> None:
        """Stop receiving (what is held can still be read)."""
        self._hub._subscriptions.discard(self)
        self._end()

    # -- the hub's side -------------------------------------------------------------
    def _offer(self, batch: PendingBatch) -> None:
        if len(self._batches) >= self._maxsize:
            self._lost = True
            self._hub._subscriptions.discard(self)
        else:
            self._batches.append(batch)
        self._ready.set()

    def _end(self) -> None:
        self._ended = True
        self._ready.set()


class EventHub:
    # -- state -------------------------------------------------------------------
    def __init__(self, page_size: int, data_parallel_rank: int | None = None,
                 publisher: ZmqEventPublisher | None = None) -> None:
        self.page_size = page_size
        self.data_parallel_rank = data_parallel_rank
        self.publisher = publisher
        self._subscriptions: set[EventSubscription] = set()
        self.next_seq = 0
        self.events_published = 0

    def publish(self, records: list[Record]) -> None:
        batch = PendingBatch(time.time(), records, self.data_parallel_rank, self.page_size)
        seq = self.next_seq
        self.next_seq += 1
        self.events_published += len(records)
        for sub in tuple(self._subscriptions):
            sub._offer(batch)
        if self.publisher is not None:
            self.publisher.publish(seq, batch)

    def subscribe(self, maxsize: int) -> EventSubscription:
        sub = EventSubscription(self, maxsize)
        self._subscriptions.add(sub)
        return sub

    def close(self) -> None:
        """End every subscription; the publisher sends what it holds, then stops."""
        for sub in tuple(self._subscriptions):
            sub.close()
        if self.publisher is not None:
            self.publisher.close()


__all__ = ["EventHub", "EventSubscription", "EventsLostError", "PendingBatch"]

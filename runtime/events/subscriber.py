"""`ZmqEventSubscriber`: KV event batches from a publisher's ZMQ stream, in order, gaps replayed.

For a router or an index in another process. It reads vLLM's framing (topic, 8-byte sequence,
msgpack payload), so it follows vLLM's and SGLang's publishers as well as ours. A sequence gap
(the SUB socket dropped batches, or it joined late with `start_seq`) is filled from the replay
endpoint when one is given; without one, or when the publisher no longer buffers the missing
batches, iteration raises `EventsLostError` (an index built from a stream with a hole is wrong,
and the caller must rebuild it, e.g. `PrefixIndex.forget` the instance).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from .hub import EventsLostError
from .publisher import END_SEQ
from .wire import KVEventBatch, decode


class ZmqEventSubscriber(AsyncIterator[tuple[int, KVEventBatch]]):
    # -- state -------------------------------------------------------------------
    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
                 start_seq: int = 0) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.connect(endpoint)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        self._replay: zmq.asyncio.Socket | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.DEALER)
            self._replay.connect(replay_endpoint)
        self.next_seq = start_seq  # the sequence number expected next
        self._pending: list[tuple[int, KVEventBatch]] = []  # replayed batches not yet handed out

    def __aiter__(self) -> "ZmqEventSubscriber":
        return self

    async def __anext__(self) -> tuple[int, KVEventBatch]:
        """The next batch in sequence order, with its sequence number."""
        while True:
            if self._pending:
                return self._pending.pop(0)
            _topic, seq_bytes, payload = await self._sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq < self.next_seq:  # already had it (replayed)
                continue
            if seq > self.next_seq:
                await self._fill(seq)
                self._pending.append((seq, decode(payload)))
                self.next_seq = seq + 1
                continue
            self.next_seq = seq + 1
            return seq, decode(payload)

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    # -- helpers -----------------------------------------------------------------------
    async def _fill(self, upto: int) -> None:
        """Get batches [next_seq, upto) from the replay endpoint, or raise `EventsLostError`."""
        want = self.next_seq
        if self._replay is None:
            raise EventsLostError(f"batches {want}..{upto - 1} were missed and there is no replay endpoint")
        await self._replay.send_multipart((b"", want.to_bytes(8, "big")))
        got: list[tuple[int, KVEventBatch]] = []
        while True:
            frames = await self._replay.recv_multipart()
            _, _topic, seq_bytes, payload = frames
            if seq_bytes == END_SEQ:
                break
            seq = int.from_bytes(seq_bytes, "big")
            if want <= seq < upto:
                got.append((seq, decode(payload)))
        if [s for s, _ in got] != list(range(want, upto)):
            raise EventsLostError(f"the replay endpoint no longer holds batches {want}..{upto - 1}")
        self._pending.extend(got)


__all__ = ["ZmqEventSubscriber"]

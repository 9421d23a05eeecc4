"""`ZmqEventPublisher`: KV event batches over ZMQ, framed as vLLM frames them.

A PUB socket sends each batch as three frames: the topic (utf-8), the batch's sequence number
(8 bytes, big-endian) and its msgpack payload. With a replay endpoint, a ROUTER socket answers a
request `(client_id, b"", start_seq)` with every buffered batch from `start_seq` on, as
`(client_id, b"", topic, seq, payload)`, then the end marker `(client_id, b"", b"", -1, b"")`
(seq -1 as 8 signed big-endian bytes): a subscriber that saw a gap in the sequence asks for it.

The sockets are bound in the constructor (a bad or busy endpoint fails `open`, not later) and
used only by the publisher's thread from then on (ZMQ sockets are not thread-safe; handing one
over before the thread starts is allowed). The event loop only enqueues: encoding and sending
never cost the tree actor's turn. Endpoints bind as given; the config's examples and the tests
use 127.0.0.1, and `tcp://127.0.0.1:*` picks a free port (`endpoint` says which).
"""

from __future__ import annotations

import collections
import queue
import threading
from typing import TYPE_CHECKING

import zmq

from runtime.trace import get_logger

from .wire import KVEventBatch, encode

if TYPE_CHECKING:  # pragma: no cover
    from .hub import PendingBatch

_log = get_logger("hicache.events")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_STOP = object()


class ZmqEventPublisher:
    # -- state -------------------------------------------------------------------
    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000, max_queue: int = 100_000) -> None:
        self._ctx = zmq.Context()
        self._topic = topic.encode("utf-8")
        self._queue: queue.Queue[object] = queue.Queue(max_queue)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self.dropped = 0  # batches refused because the queue was full (the thread fell behind)
        self.published = 0
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.set_hwm(hwm)
            self.endpoint = _bind(self._pub, endpoint)
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))  # a whole replay and its end marker
                self.replay_endpoint = _bind(self._replay, replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="hicache-kv-events", daemon=True)
        self._thread.start()

    # -- the loop's side -----------------------------------------------------------
    def publish(self, seq: int, batch: KVEventBatch | PendingBatch) -> None:
        """Enqueue a batch (never blocks: past `max_queue` waiting batches it is dropped, counted and
        logged; a subscriber sees the gap in the sequence and can ask for a replay)."""
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.dropped += 1
            _log.warning("kv_events_dropped", seq=seq, dropped=self.dropped)

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, then stop the thread and close the sockets."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                _log.warning("kv_events_publisher_stuck", queued=self._queue.qsize())
                return  # its sockets stay with it (closing them under it would crash the process)
        self._close_sockets()

    # -- the publisher's thread ---------------------------------------------------------
    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is _STOP:
                return
            seq, batch = item  # type: ignore[misc]
            payload = encode(batch if type(batch) is KVEventBatch else batch.batch())
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError as exc:  # the batch stays in the replay buffer
                _log.warning("kv_events_send_failed", seq=seq, error=str(exc))
            self._buffer.append((seq, payload))
            self.published += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            _log.warning("kv_events_bad_replay_request", frames=len(frames))
            return
        client_id, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client_id, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client_id, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=1000)  # what the thread sent still reaches connected subscribers
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind `endpoint`; returns the endpoint bound (a `*` port resolved)."""
    sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


__all__ = ["ZmqEventPublisher", "END_SEQ"]

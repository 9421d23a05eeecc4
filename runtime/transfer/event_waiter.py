"""Completions of recorded events as `concurrent.futures.Future`s, set by a thread that waits on them.

Why: the completion bridge (`runtime.completion`) polls a completion that has only ``query()``
from a task on the event loop, backing off from 50 µs to 2 ms; on the default asyncio loop a
sleep shorter than a millisecond lasts about one (epoll's timeout is in milliseconds), so a
load's layers, done on the GPU microseconds apart, became ready to their awaiters a poll tick
apart. A completion with a ``future`` is not polled: the bridge takes the future's done callback,
which wakes the loop at once. `EventWaiter` gives each recorded event such a future: one thread
per copy stream waits on the stream's events in the order they were recorded (a stream completes
them in that order, so waiting on them one by one loses nothing) and settles each future as soon
as its event completes. With blocking-sync events the thread sleeps in the wait instead of
spinning.

CUDA-free: an event is anything with ``synchronize()`` (tests use stand-ins).
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
from typing import Any

__all__ = ["EventWaiter"]

_STOP = object()


class EventWaiter:
    """One thread settling futures of events in the order `watch` was called."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._closed = False

    def watch(self, event: Any, error: BaseException | None = None) -> cf.Future:
        """A future done when ``event`` has completed: its result None, or ``error`` (a copy that
        failed to issue: its event is recorded all the same, and completes)."""
        fut: cf.Future = cf.Future()
        fut.set_running_or_notify_cancel()
        if self._closed:
            raise RuntimeError("event waiter is closed")
        self._queue.put((event, error, fut))
        return fut

    def close(self) -> None:
        """Settle what was watched, then stop the thread."""
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)
            self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            event, error, fut = item
            try:
                event.synchronize()
            except BaseException as exc:  # noqa: BLE001 - the waiter (a CUDA error) reports it
                fut.set_exception(exc)
                continue
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)

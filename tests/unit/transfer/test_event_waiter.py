"""EventWaiter: each recorded event's future is settled by a thread as soon as the event completes
(fake events stand in for CUDA's), so that the completion bridge takes a callback instead of
polling; in order, with a copy's issue-time error, and through the bridge."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from runtime.completion import CompletionBridge
from runtime.errors import TransferError
from runtime.transfer.event_waiter import EventWaiter


class FakeEvent:
    """``synchronize`` blocks until the test completes the event (as a blocking-sync CUDA event)."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def complete(self) -> None:
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        assert self._done.wait(5)


class Completion:
    """The CUDA engine's completion shape: an event, and the waiter's future."""

    def __init__(self, event: FakeEvent, future) -> None:
        self.event, self.future = event, future

    def query(self) -> bool:
        return self.future.done()

    def synchronize(self) -> None:
        self.future.result()


def test_futures_settle_as_their_events_complete_in_order():
    waiter = EventWaiter("test-events")
    try:
        events = [FakeEvent() for _ in range(3)]
        futs = [waiter.watch(e) for e in events]
        time.sleep(0.02)
        assert not any(f.done() for f in futs)
        events[0].complete()
        futs[0].result(timeout=2)
        assert not futs[1].done()
        events[1].complete()
        events[2].complete()
        for f in futs:
            assert f.result(timeout=2) is None
    finally:
        waiter.close()


def test_an_issue_time_error_is_the_futures_outcome():
    waiter = EventWaiter("test-events")
    try:
        ev = FakeEvent()
        ev.complete()
        fut = waiter.watch(ev, RuntimeError("copy failed to issue"))
        with pytest.raises(RuntimeError, match="failed to issue"):
            fut.result(timeout=2)
    finally:
        waiter.close()
    with pytest.raises(RuntimeError):
        waiter.watch(FakeEvent())


async def test_the_bridge_takes_the_callback_and_is_not_polling():
    waiter = EventWaiter("test-events")
    bridge = CompletionBridge(min_poll=10.0, max_poll=10.0)  # a poll would take 10 s
    try:
        ok, bad = FakeEvent(), FakeEvent()
        ready = bridge.watch(Completion(ok, waiter.watch(ok)))
        failed = bridge.watch(Completion(bad, waiter.watch(bad, RuntimeError("boom"))))
        ok.complete()
        bad.complete()
        await asyncio.wait_for(ready, 2)
        with pytest.raises(TransferError):
            await asyncio.wait_for(failed, 2)
    finally:
        await bridge.aclose()
        waiter.close()

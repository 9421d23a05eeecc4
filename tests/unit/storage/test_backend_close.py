"""Closing a backend with calls in flight (`CallGate`): no call starts after close, the teardown
never runs under a call, close waits for it at most its timeout and counts the calls it abandons."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from runtime.errors import StateError
from runtime.storage.backend import CallGate, gated
from runtime.storage.file_backend import FileBackend

PB = 4096


class Held:
    """A backend whose `call` blocks until released (a call waiting on a dead server)."""

    def __init__(self) -> None:
        self._gate = CallGate("Held")
        self.entered = threading.Event()
        self.go = threading.Event()
        self.torn = 0

    @gated
    def call(self) -> str:
        self.entered.set()
        self.go.wait(10)
        return "ok"

    def teardown(self) -> None:
        self.torn += 1


def test_close_with_a_call_inside_abandons_it_and_tears_down_after_it_returns():
    b = Held()
    results: list[str] = []
    t = threading.Thread(target=lambda: results.append(b.call()))
    t.start()
    assert b.entered.wait(5)
    t0 = time.monotonic()
    assert b._gate.close(b.teardown, 0.2) is False  # the call is still inside
    assert 0.15 <= time.monotonic() - t0 < 2.0
    assert b._gate.abandoned == 1 and b.torn == 0 and not b._gate.torn_down
    with pytest.raises(StateError):
        b.call()  # no call starts once closed
    b.go.set()
    t.join(5)
    assert results == ["ok"]
    deadline = time.monotonic() + 5
    while not b._gate.torn_down and time.monotonic() < deadline:
        time.sleep(0.01)
    assert b.torn == 1 and b._gate.stats() == {"calls_running": 0, "calls_abandoned_at_close": 1, "torn_down": True}


def test_close_without_calls_tears_down_at_once_and_only_once():
    b = Held()
    b.go.set()
    assert b.call() == "ok"
    assert b._gate.close(b.teardown, 1.0) is True
    assert b._gate.close(b.teardown, 1.0) is True
    assert b.torn == 1 and b._gate.abandoned == 0


def test_file_backend_close_keeps_its_descriptor_until_the_call_in_flight_returns(tmp_path, monkeypatch):
    """A read held inside `get_batch` while the backend closes: close returns after its timeout,
    the call still completes on the directory's state descriptor (not closed under it: its number
    could have been reused by another open), and the descriptor is closed once it returns.
    Checked failing with a gate whose close tears down at once (the descriptor was closed under
    the held read: EBADF)."""
    fb = FileBackend(tmp_path, PB, close_timeout_s=0.2)
    k = b"k" * 16
    assert fb.set_batch([k], [np.full(PB, 7, np.uint8)]) == [True]
    entered, go = threading.Event(), threading.Event()
    real = fb._read_one

    def held_read(*args):
        entered.set()
        go.wait(10)
        return real(*args)

    monkeypatch.setattr(fb, "_read_one", held_read)
    out: list = []
    dest = np.zeros(PB, np.uint8)
    t = threading.Thread(target=lambda: out.append(fb.get_prefix([k], [dest])))
    t.start()
    assert entered.wait(5)
    fd = fb._dir.state_fd
    fb.close()
    assert fb.stats()["calls_abandoned_at_close"] == 1
    os.fstat(fd)  # still open
    with pytest.raises(StateError):
        fb.exists_prefix([k])
    go.set()
    t.join(5)
    assert out == [1] and (dest == 7).all()
    deadline = time.monotonic() + 5
    while fb._dir.state_fd is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fb._dir.state_fd is None and fb.stats()["torn_down"]

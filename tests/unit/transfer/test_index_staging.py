"""Page indices staged for the CUDA engine in reused host buffers (CPU stand-ins for pinned
buffers and CUDA events): nothing is allocated or pinned per submit in a steady stream, and a
buffer the device may still read is never written."""

from __future__ import annotations

import numpy as np
import torch

from runtime.transfer.index_staging import IndexStaging


class FakeEvent:
    def __init__(self, done: bool = False) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def pages(*xs: int) -> np.ndarray:
    return np.asarray(xs, dtype=np.int64)


def test_a_steady_stream_of_submits_allocates_nothing_and_pins_nothing(monkeypatch):
    made: list[int] = []
    staging = IndexStaging(lambda n: made.append(n) or torch.empty(n, dtype=torch.int64), initial=64)
    pinned: list[int] = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: pinned.append(1) or self)
    for i in range(200):
        staged = staging.stage([pages(i, i + 1, i + 2), pages(7, 8, 9)])
        src, dst = staged.split(staged.host.clone())  # (the device copy, as the engine makes it)
        assert src.tolist() == [i, i + 1, i + 2] and dst.tolist() == [7, 8, 9]
        staging.release_after(staged, FakeEvent(done=True))  # the device read it
    assert staging.allocations == 1 and made == [64] and not pinned


def test_a_buffer_the_device_may_still_read_is_never_written():
    staging = IndexStaging(lambda n: torch.empty(n, dtype=torch.int64), initial=16)
    first = staging.stage([pages(1, 2, 3)])
    pending = FakeEvent(done=False)
    staging.release_after(first, pending)
    second = staging.stage([pages(4, 5)])  # the first buffer's copy has not run: a second one
    assert staging.allocations == 2 and first.host.tolist() == [1, 2, 3]
    staged_not_released = staging.stage([pages(6)])  # staged, its copy not queued yet: busy too
    assert staging.allocations == 3
    staging.release_after(second, None)  # nothing read it (the copy failed to queue): free at once
    staging.release_after(staged_not_released, FakeEvent(done=True))
    pending.done = True
    for _ in range(10):
        staging.release_after(staging.stage([pages(9, 9)]), FakeEvent(done=True))
    assert staging.allocations == 3 and staging.num_buffers == 3


def test_a_larger_submit_gets_a_larger_buffer_once():
    staging = IndexStaging(lambda n: torch.empty(n, dtype=torch.int64), initial=8)
    big = np.arange(100, dtype=np.int64)
    for _ in range(5):
        staged = staging.stage([big, big[::-1].copy()])
        a, b = staged.split(staged.host)
        assert torch.equal(a, torch.from_numpy(big)) and torch.equal(b, torch.from_numpy(big[::-1].copy()))
        staging.release_after(staged, FakeEvent(done=True))
    assert staging.allocations == 1 and staging.num_buffers == 1  # (one of 256: the next power of two)
    staging.release_after(staging.stage([]), FakeEvent(done=True))
    assert staging.allocations == 1

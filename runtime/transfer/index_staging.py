"""Page indices staged for the device in host buffers made once, not pinned on every submit.

A CUDA copy needs its page indices on the device. Copying them there asynchronously needs them in
pinned host memory, and ``torch.tensor(...).pin_memory()`` per submit allocates (and registers)
pinned memory on the critical path of every load. `IndexStaging` keeps a few host buffers (pinned
on CUDA) and reuses one once the device has read it: each use ends with an event recorded after
the copy that reads it, and a buffer whose event has not completed is never written. When every
buffer is busy (or too small) a new one is made, so a burst costs a few buffers once, not one
per submit; `allocations` counts them (a test checks that a steady stream allocates nothing).

CUDA-free: the buffers and events come from factories (the CUDA engine's pin host memory and
record CUDA events; tests give plain tensors and fake events with ``query()``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import threading

import numpy as np
import torch

__all__ = ["IndexStaging", "StagedIndices"]


@dataclass(eq=False)
class _Buffer:
    data: torch.Tensor  # int64, 1-D
    busy_until: Any = None  # the event after which the device no longer reads it

    def hold(self, until: Any) -> None:
        self.busy_until = until


@dataclass(frozen=True, eq=False)
class StagedIndices:
    """One submit's page-index arrays, concatenated in one host buffer: ``host`` (their span) and
    each array's ``(offset, length)`` in it."""

    host: torch.Tensor
    spans: tuple[tuple[int, int], ...]
    buffer: _Buffer

    def split(self, device_copy: torch.Tensor) -> list[torch.Tensor]:
        """Views of each array in the device copy of ``host``."""
        return [device_copy[o:o + n] for o, n in self.spans]


class IndexStaging:
    def __init__(self, make_buffer: Callable[[int], torch.Tensor], *, initial: int = 8192) -> None:
        """``make_buffer(n)``: a new int64 host tensor of ``n`` elements (pinned for CUDA)."""
        self._make = make_buffer
        self._initial = initial
        self._buffers: list[_Buffer] = []
        self._lock = threading.Lock()
        self.allocations = 0

    def stage(self, arrays: Sequence[np.ndarray]) -> StagedIndices:
        """Write ``arrays`` (int64) one after another into a free buffer; the caller copies
        ``host`` to the device and then calls `release_after` with an event recorded after that copy."""
        total = sum(int(a.size) for a in arrays)
        with self._lock:
            buf = self._free(max(1, total))
            buf.hold(_PENDING)  # until the caller says which event frees it
        out = buf.data.numpy()
        spans = []
        at = 0
        for a in arrays:
            out[at:at + a.size] = a
            spans.append((at, int(a.size)))
            at += int(a.size)
        return StagedIndices(buf.data[:at], tuple(spans), buf)

    @staticmethod
    def release_after(staged: StagedIndices, event: Any) -> None:
        """The buffer is free again once ``event`` (``query()`` True) has completed; None: at once
        (nothing that reads it was queued)."""
        staged.buffer.hold(event)

    def _free(self, n: int) -> _Buffer:
        for buf in self._buffers:
            ev = buf.busy_until
            if buf.data.numel() >= n and (ev is None or (ev is not _PENDING and ev.query())):
                return buf
        size = max(self._initial, 1 << (n - 1).bit_length())
        buf = _Buffer(self._make(size))
        self.allocations += 1
        self._buffers.append(buf)
        return buf

    @property
    def num_buffers(self) -> int:
        return len(self._buffers)


class _Pending:
    """Staged, its copy not yet queued: never free."""


_PENDING = _Pending()

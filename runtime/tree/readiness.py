"""What the tree core needs of a load's readiness, and a loop-free one.

The core creates a readiness object for every host -> device load it issues (admit returns it
at once) through a factory it is given: the tree actor gives `LayerReadiness.pending` (per-layer
asyncio futures, resolved by the transfer actor); unit tests and tools that drive the core by
hand use `ManualReadiness`. The core itself only asks the questions of `LoadReadiness` and never
touches an event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class LoadReadiness(Protocol):
    op_id: int | None

    def done(self) -> bool: ...  # every layer settled (ready or failed)

    def all_ready(self) -> bool: ...  # every layer on device

    def error(self) -> BaseException | None: ...  # the first failed layer's error, if any


ReadinessFactory = Callable[[int, int], LoadReadiness]  # (num_layers, op_id) -> a pending readiness


class ManualReadiness:
    """A load's readiness settled by hand: `complete()` (every layer ready) or `fail(exc)`."""

    def __init__(self, num_layers: int, op_id: int | None = None) -> None:
        self.num_layers = num_layers
        self.op_id = op_id
        self._ready = False
        self._error: BaseException | None = None

    def complete(self) -> None:
        self._ready = True

    def fail(self, exc: BaseException) -> None:
        self._error = exc

    def done(self) -> bool:
        return self._ready or self._error is not None

    def all_ready(self) -> bool:
        return self._ready and self._error is None

    def error(self) -> BaseException | None:
        return self._error

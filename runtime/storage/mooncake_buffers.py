"""The memory a `MooncakeBackend` registered with its store: the caller's buffers for zero-copy
I/O (`RegisteredBuffers`) and the backend's own staging buffer for reads into unregistered
memory (`StagingBuffer`). Mooncake's ``*_from`` / ``*_into`` calls must only ever see registered
memory (``batch_put_from`` from an unregistered address corrupts the heap), so these two parts
are the one place that knows which addresses are registered."""

from __future__ import annotations

import bisect
import threading
from typing import Any

import numpy as np

from runtime.errors import ConfigError
from runtime.storage.backend import StorageError
from runtime.trace import get_logger

_log = get_logger("hicache.storage.mooncake")


class RegisteredBuffers:
    """Registered address ranges, sorted and disjoint, with the buffers kept alive until unregistered."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._objs: list[Any] = []

    def add(self, buf: Any, addr: int, nbytes: int) -> None:
        with self._lock:
            i = bisect.bisect_right(self._starts, addr)
            if (i > 0 and self._ends[i - 1] > addr) or (i < len(self._starts) and self._starts[i] < addr + nbytes):
                raise ConfigError("buffer overlaps a registered buffer")
            rc = self._store.register_buffer(addr, nbytes)
            if rc != 0:
                raise StorageError(f"Mooncake register_buffer failed ({rc})")
            self._starts.insert(i, addr)
            self._ends.insert(i, addr + nbytes)
            self._objs.insert(i, buf)

    def remove(self, addr: int) -> None:
        with self._lock:
            i = bisect.bisect_left(self._starts, addr)
            if i == len(self._starts) or self._starts[i] != addr:
                raise ConfigError("buffer is not registered")
            self._store.unregister_buffer(addr)
            del self._starts[i], self._ends[i], self._objs[i]

    def ranges(self) -> tuple[list[int], list[int]]:
        """A snapshot of the (starts, ends) of the registered ranges, sorted."""
        with self._lock:
            return list(self._starts), list(self._ends)

    def __len__(self) -> int:
        return len(self._starts)

    def unregister_all(self) -> None:
        with self._lock:
            for addr in self._starts:
                try:
                    self._store.unregister_buffer(addr)
                except Exception:  # noqa: BLE001
                    pass
            self._starts.clear()
            self._ends.clear()
            self._objs.clear()


class StagingBuffer:
    """The backend's own registered buffer of whole pages: one transfer + one copy for reads into
    unregistered destinations. One user at a time (`try_acquire`); absent when registering failed."""

    def __init__(self, store: Any, page_bytes: int, staging_bytes: int) -> None:
        self._store = store
        self._lock = threading.Lock()
        self.pages = max(1, staging_bytes // page_bytes) if staging_bytes > 0 else 0
        self.array: np.ndarray | None = None
        if self.pages:
            staging = np.ones(self.pages * page_bytes, dtype=np.uint8)  # touched: no faults later
            if store.register_buffer(int(staging.ctypes.data), staging.nbytes) == 0:
                self.array = staging
                self.addr = int(staging.ctypes.data)
                self.view = memoryview(staging)
            else:
                _log.warning("mooncake_staging_register_failed", bytes=staging.nbytes)

    def try_acquire(self) -> bool:
        return self.array is not None and self._lock.acquire(blocking=False)

    def release(self) -> None:
        self._lock.release()

    def unregister(self) -> None:
        with self._lock:
            if self.array is not None:
                try:
                    self._store.unregister_buffer(self.addr)
                except Exception:  # noqa: BLE001
                    pass
                self.array = None

"""StateBlobIO: a storage op's recurrent-state snapshots, moved between host state slots and a backend.

Runs in the transfer actor's storage worker threads, after the op's KV pages (a write, a lookup or
a read: `StateBlob` in `runtime.messages`). A blob is `StateBlobFormat.chunks` page-sized chunks
(`runtime.storage.state_blobs`); it counts only whole: every chunk stored, present or read. Every
backend result is checked against its contract (`ContractViolation` makes the whole op a miss).
The host state slots a blob names are pinned by the op's requester until its ack.

A blob moves through a staging buffer of its chunks (one copy from or into the slot, whose
components are not contiguous); two are kept for reuse (the transfer actor's storage worker
threads): a fresh one costs a first touch of every page (a Bamba-9B state is 118 MiB).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

import torch

from runtime.memory.state_pool import StatePool
from runtime.messages import StateBlob
from runtime.storage.backend import checked_count, read_pages, write_pages
from runtime.storage.integrity import PageSeal
from runtime.storage.state_blobs import StateBlobFormat

__all__ = ["StateBlobIO"]

_SPARES = 2  # staging buffers kept for reuse


class StateBlobIO:
    def __init__(self, pool: StatePool, fmt: StateBlobFormat, seal: PageSeal | None = None) -> None:
        self.pool = pool
        self.format = fmt
        self.seal = seal if seal is not None else PageSeal()  # chunks are tagged and checked like KV pages
        self._spare: list[np.ndarray] = []  # staging buffers not in use (`_staging`)
        self._lock = threading.Lock()

    def write(self, backend: Any, blobs: Sequence[StateBlob]) -> tuple[bool, ...]:
        """Store every blob's slot under its keys (one batch call); per blob: every chunk stored."""
        if not blobs:
            return ()
        fmt = self.format
        keys: list[bytes] = []
        srcs = []
        staged = [self._take() for _ in blobs]
        try:
            for blob, bufs in zip(blobs, staged, strict=True):
                keys += blob.keys
                flat = bufs.reshape(-1)  # the slot's bytes copied once, straight into its zero-padded chunks
                self.pool.read_slot_into(blob.slot, torch.from_numpy(flat))
                flat[fmt.state_bytes:] = 0
                srcs += list(bufs)
            ok = write_pages(backend, keys, srcs, self.seal)
        finally:
            self._give(staged)
        n = fmt.chunks
        return tuple(all(ok[i * n:(i + 1) * n]) for i in range(len(blobs)))

    def lookup(self, backend: Any, blobs: Sequence[StateBlob], found: int) -> tuple[bool, ...]:
        """Deepest first, the first blob whose `after` <= `found` KV pages with every chunk present:
        True for it alone (presence is a hint, like the KV's: the read checks again)."""
        out = [False] * len(blobs)
        for i in sorted(range(len(blobs)), key=lambda i: -blobs[i].after):
            blob = blobs[i]
            if blob.after > found:
                continue
            keys = list(self.format.keys(blob.page))  # (a lookup's blob names its page alone)
            if checked_count("exists_prefix", backend.exists_prefix(keys), len(keys)) == len(keys):
                out[i] = True
                break
        return tuple(out)

    def read(self, backend: Any, blobs: Sequence[StateBlob], read: int) -> tuple[bool, ...]:
        """Read each blob whose `after` <= `read` KV pages (the leading pages the op read whole) into
        its slot; per blob: every chunk read whole (else its slot is left undefined: the requester
        frees it)."""
        out = []
        for blob in blobs:
            if blob.after > read:
                out.append(False)
                continue
            with self._staging() as bufs:
                ok = read_pages(backend, list(blob.keys), list(bufs), self.seal)
                if all(ok):
                    self.pool.write_slot(blob.slot, torch.from_numpy(self.format.join(bufs)))
            out.append(all(ok))
        return tuple(out)

    # -- staging buffers ---------------------------------------------------------------
    def _take(self) -> np.ndarray:
        with self._lock:
            if self._spare:
                return self._spare.pop()
        return self.format.buffers()

    def _give(self, bufs: list[np.ndarray]) -> None:
        with self._lock:  # (kept: as many as the transfer actor's storage worker threads)
            self._spare.extend(bufs[:max(0, _SPARES - len(self._spare))])

    @contextmanager
    def _staging(self) -> Iterator[np.ndarray]:
        bufs = self._take()
        try:
            yield bufs
        finally:
            self._give([bufs])

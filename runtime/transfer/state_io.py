"""StateBlobIO: a storage op's recurrent-state snapshots, moved between host state slots and a backend.

Runs in the transfer actor's storage worker threads, after the op's KV pages (a write, a lookup or
a read: `StateBlob` in `runtime.messages`). A blob is `StateBlobFormat.chunks` page-sized chunks
(`runtime.storage.state_blobs`); it counts only whole: every chunk stored, present or read. Every
backend result is checked against its contract (`ContractViolation` makes the whole op a miss).
The host state slots a blob names are pinned by the op's requester until its ack.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from runtime.memory.state_pool import StatePool
from runtime.messages import StateBlob
from runtime.storage.backend import checked_count, checked_flags
from runtime.storage.state_blobs import StateBlobFormat

__all__ = ["StateBlobIO"]


class StateBlobIO:
    def __init__(self, pool: StatePool, fmt: StateBlobFormat) -> None:
        self.pool = pool
        self.format = fmt

    def write(self, backend: Any, blobs: Sequence[StateBlob]) -> tuple[bool, ...]:
        """Store every blob's slot under its keys (one batch call); per blob: every chunk stored."""
        if not blobs:
            return ()
        fmt = self.format
        keys: list[bytes] = []
        srcs = []
        for blob in blobs:
            keys += blob.keys
            bufs = fmt.buffers()  # the slot's bytes copied once, straight into its zero-padded chunks
            flat = bufs.reshape(-1)
            self.pool.read_slot_into(blob.slot, torch.from_numpy(flat))
            flat[fmt.state_bytes:] = 0
            srcs += list(bufs)
        ok = checked_flags("set_batch", backend.set_batch(keys, srcs), len(keys))
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
            if checked_count("exists_prefix", backend.exists_prefix(list(blob.keys)), len(blob.keys)) == len(blob.keys):
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
            bufs = self.format.buffers()
            ok = checked_flags("get_batch", backend.get_batch(list(blob.keys), list(bufs)), len(blob.keys))
            if all(ok):
                self.pool.write_slot(blob.slot, torch.from_numpy(self.format.join(bufs)))
            out.append(all(ok))
        return tuple(out)

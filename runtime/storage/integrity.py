"""Page integrity from host pool to host pool: the tag a page is stored with, and its check.

The storage tier, not the backend, computes a page's tag from the bytes in the host pool as the
page leaves it (`write_pages`), and checks it against the bytes that landed in the host pool
after a read (`read_prefix`, `read_pages` in `runtime.storage.backend`). A backend only keeps
the tag beside the page (the file backend in its trailer, Mooncake in a companion object) and
hands it back; so a fault anywhere between the two pools (the disk, the network, a transport
that writes wrong bytes, a backend bug) is a miss, never a served page.

Two kinds of tag, 16 bytes each, both bound to the page's key (a page's bytes stored under
another key do not verify):

- unkeyed (default): XXH3-128 of the payload, seeded by the key. Catches corruption and
  misplacement at ~30 GiB/s; anyone who can write the storage can compute it.
- keyed (``storage_key`` set): BLAKE3 in keyed mode (a MAC) over the key and the payload, under
  a key derived from ``storage_key``. A page written without the key, with another key, or
  planted by someone who can write the directory or the pool but lacks the key fails the
  check. BLAKE3 and not ``hashlib.blake2b(key=...)``: the same MAC strength at ~5x the speed
  (7 vs 1.3 GiB/s on this project's machine), from a maintained package (docs/STORAGE.md,
  "Page integrity"). The key is kept only here; never in a repr, a log or stats.

`PageSeal.rejected` counts pages that failed a check (thread-safe: storage worker threads).
"""

from __future__ import annotations

import hmac
import os
import threading
from collections.abc import Sequence

import blake3
import numpy as np
import torch
import xxhash

from runtime.config import MIN_KEY_BYTES
from runtime.errors import ConfigError

__all__ = ["TAG_BYTES", "MIN_KEY_BYTES", "PageSeal"]

TAG_BYTES = 16
# BLAKE3 hashes one page on this many threads (its tree splits a page into 1 KiB chunks): 2 threads
# ran keyed tags of 1.4 MiB pages at ~5.3 GiB/s against ~3.1 on one on this project's 2-core
# machine, and blake3.AUTO (one per CPU the host has, not per CPU this process may use) at ~2.2
_MAC_THREADS = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))
_KDF_CONTEXT = "hicache-runtime 2026 storage page mac v1"


def _hashable(payload: object) -> object:
    """A page buffer as something the hash functions read without a copy (torch tensors have no
    buffer protocol: their numpy view shares the memory)."""
    if isinstance(payload, torch.Tensor):
        return payload.view(torch.uint8).numpy() if payload.dtype != torch.uint8 else payload.numpy()
    if isinstance(payload, np.ndarray) and not payload.flags.c_contiguous:
        raise ValueError("page buffers must be contiguous")
    return payload


class PageSeal:
    """Computes and checks page tags; keyed when built with a storage key."""

    __slots__ = ("_mac_key", "_lock", "_rejected")

    def __init__(self, storage_key: str | bytes | None = None) -> None:
        if storage_key is None:
            self._mac_key: bytes | None = None
        else:
            raw = storage_key.encode() if isinstance(storage_key, str) else storage_key
            if not isinstance(raw, bytes) or len(raw) < MIN_KEY_BYTES:
                raise ConfigError(f"storage_key must be at least {MIN_KEY_BYTES} bytes (its value is not shown)")
            self._mac_key = blake3.blake3(raw, derive_key_context=_KDF_CONTEXT).digest()
        self._lock = threading.Lock()
        self._rejected = 0

    @property
    def keyed(self) -> bool:
        return self._mac_key is not None

    @property
    def rejected(self) -> int:
        """Pages that failed a check since this seal was made."""
        with self._lock:
            return self._rejected

    def tag(self, key: bytes, payload: object) -> bytes:
        """The 16-byte tag of page `key` holding `payload` (a contiguous CPU buffer)."""
        data = _hashable(payload)
        if self._mac_key is None:
            return xxhash.xxh3_128_digest(data, seed=xxhash.xxh3_64_intdigest(key))
        h = blake3.blake3(key=self._mac_key, max_threads=_MAC_THREADS)
        h.update(len(key).to_bytes(1, "little"))
        h.update(key)
        h.update(data)
        return h.digest(length=TAG_BYTES)

    def tags(self, keys: Sequence[bytes], payloads: Sequence[object]) -> list[bytes]:
        return [self.tag(bytes(k), p) for k, p in zip(keys, payloads, strict=True)]

    def check(self, key: bytes, payload: object, tag: object) -> bool:
        """Whether `tag` (what the backend returned with the page) is the tag of `payload` under
        `key`; a failure is counted."""
        ok = isinstance(tag, (bytes, bytearray)) and len(tag) == TAG_BYTES \
            and hmac.compare_digest(bytes(tag), self.tag(bytes(key), payload))
        if not ok:
            with self._lock:
                self._rejected += 1
        return ok

    def __repr__(self) -> str:
        return f"PageSeal(keyed={self.keyed})"

    def __reduce__(self) -> object:  # never pickled with its key (into a log, a child process)
        raise TypeError("PageSeal is not picklable")

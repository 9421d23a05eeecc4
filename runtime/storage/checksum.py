"""Page checksums: XXH64 compiled with numba (GIL released), seeded per key.

Why XXH64 and not a `hashlib` digest: a page is read from the page cache at ~8-10 GiB/s, and
every read is verified. On this project's 2-core machine `hashlib.blake2b` hashes 1.4 MiB pages
at ~0.6 GiB/s and `sha256` at ~1.6 GiB/s, so either would cut the file backend's read throughput
several times over; this XXH64 runs at several GiB/s per thread (docs/STORAGE.md, "Page
integrity"). The `xxhash` package is not a dependency; numba already is (the copy kernel).

The checksum guards against corruption and misplacement, not against an attacker: anyone who
can write the storage directory can compute it. Bound to the key by its seed, so a page's bytes
stored (or copied) under another key do not verify.
"""

from __future__ import annotations

import hashlib

import numba
import numpy as np

__all__ = ["key_seed", "page_checksum", "xxh64"]

_P1 = np.uint64(0x9E3779B185EBCA87)
_P2 = np.uint64(0xC2B2AE3D27D4EB4F)
_P3 = np.uint64(0x165667B19E3779F9)
_P4 = np.uint64(0x85EBCA77C2B2AE63)
_P5 = np.uint64(0x27D4EB2F165667C5)


@numba.njit(inline="always")
def _rotl(x, r):  # noqa: ANN001, ANN202 - numba types it
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


@numba.njit(inline="always")
def _round(acc, lane):  # noqa: ANN001, ANN202
    acc = acc + lane * _P2
    acc = _rotl(acc, 31)
    return acc * _P1


@numba.njit(inline="always")
def _merge(acc, val):  # noqa: ANN001, ANN202
    acc = acc ^ _round(np.uint64(0), val)
    return acc * _P1 + _P4


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _xxh64(data, seed):  # noqa: ANN001, ANN202 - data: 1-D uint8 array, seed: uint64
    n = data.shape[0]
    words = data[: n - n % 8].view(np.uint64)  # little-endian host (x86-64, aarch64)
    nw = words.shape[0]
    i = 0
    if n >= 32:
        v1 = seed + _P1 + _P2
        v2 = seed + _P2
        v3 = seed
        v4 = seed - _P1
        while i + 4 <= nw:
            v1 = _round(v1, words[i])
            v2 = _round(v2, words[i + 1])
            v3 = _round(v3, words[i + 2])
            v4 = _round(v4, words[i + 3])
            i += 4
        h = _rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)
        h = _merge(h, v1)
        h = _merge(h, v2)
        h = _merge(h, v3)
        h = _merge(h, v4)
    else:
        h = seed + _P5
    h = h + np.uint64(n)
    while i < nw:
        h = h ^ _round(np.uint64(0), words[i])
        h = _rotl(h, 27) * _P1 + _P4
        i += 1
    p = nw * 8
    if p + 4 <= n:
        k = (np.uint64(data[p]) | (np.uint64(data[p + 1]) << np.uint64(8)) | (np.uint64(data[p + 2]) << np.uint64(16))
             | (np.uint64(data[p + 3]) << np.uint64(24)))
        h = h ^ (k * _P1)
        h = _rotl(h, 23) * _P2 + _P3
        p += 4
    while p < n:
        h = h ^ (np.uint64(data[p]) * _P5)
        h = _rotl(h, 11) * _P1
        p += 1
    h = h ^ (h >> np.uint64(33))
    h = h * _P2
    h = h ^ (h >> np.uint64(29))
    h = h * _P3
    return h ^ (h >> np.uint64(32))


def xxh64(data: memoryview | bytes | bytearray | np.ndarray, seed: int = 0) -> int:
    """XXH64 of a contiguous buffer (the reference algorithm: same values as the `xxhash` package)."""
    arr = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
    return int(_xxh64(arr, np.uint64(seed)))


def key_seed(key: bytes) -> int:
    """The checksum seed of a page key: 8 bytes of a keyed-by-purpose digest of the key."""
    return int.from_bytes(hashlib.blake2b(key, digest_size=8, person=b"hicache-pgsum").digest(), "little")


def page_checksum(key: bytes, payload: memoryview) -> int:
    """The stored checksum of a page: XXH64 of its payload, seeded by its key."""
    return xxh64(payload, key_seed(key))

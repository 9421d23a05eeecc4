"""The page-hash chains of `runtime.storage.hashing`: SHA-256 compiled with numba (one call per run
of pages), or xxHash's XXH3-128 through the `xxhash` package (`chain_function` picks one).

``h(i) = sha256(h(i-1) || page i's int32 tokens)[:16]``, with SHA-256 written out (FIPS 180-4) in
a loop numba compiles. Through hashlib a page costs ~0.9 µs of interpreter time (object creation
dominates a 20-80 byte message; OpenSSL's one-shot SHA256 through ctypes, 0.34 µs, was no
faster); here a page is one or two compression rounds inside one compiled call (0.31 µs at
1-token pages). `hashing.page_hashes` (the storage tier's keys) and the KV event recorder both
hash through it; tests/unit/storage/test_hash_chain.py checks it against hashlib's sha256 for
every page size and random tokens, and test_hashing.py pins known hashes.
"""

from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np

__all__ = ["chain_hashes", "chain_hashes_xxh3", "chain_function"]

_HASH_BYTES = 16  # (hashing.HASH_BYTES: a page hash is the digest's first 16 bytes)

_K = np.array([
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
], dtype=np.int64)
_H0 = np.array([0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19],
               dtype=np.int64)
_M = 0xFFFFFFFF  # words live in int64 (numba would turn mixed uint64/int64 arithmetic into floats)


@numba.njit(inline="always")
def _rotr(x, n):  # noqa: ANN001, ANN202 - numba types it
    return ((x >> n) | (x << (32 - n))) & _M


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _chain(prev, data, page_bytes, out):  # noqa: ANN001, ANN202
    """out[i] = sha256(out[i-1] || data[i*page_bytes:(i+1)*page_bytes])[:16], out[-1] = prev."""
    n = out.shape[0]
    length = 16 + page_bytes
    nblocks = (length + 9 + 63) // 64
    size = nblocks * 64
    buf = np.zeros(size, np.uint8)
    w = np.zeros(64, np.int64)
    h = np.zeros(8, np.int64)
    bits = length * 8
    buf[length] = 0x80  # the padding is the same for every page: only the message bytes change
    for j in range(8):
        buf[size - 1 - j] = (bits >> (8 * j)) & 0xFF
    buf[:16] = prev
    for i in range(n):
        buf[16:length] = data[i * page_bytes:(i + 1) * page_bytes]
        h[:] = _H0
        for blk in range(nblocks):
            base = blk * 64
            for t in range(16):
                o = base + 4 * t
                w[t] = (np.int64(buf[o]) << 24) | (np.int64(buf[o + 1]) << 16) | (np.int64(buf[o + 2]) << 8) \
                    | np.int64(buf[o + 3])
            for t in range(16, 64):
                x, y = w[t - 15], w[t - 2]
                s0 = _rotr(x, 7) ^ _rotr(x, 18) ^ (x >> 3)
                s1 = _rotr(y, 17) ^ _rotr(y, 19) ^ (y >> 10)
                w[t] = (w[t - 16] + s0 + w[t - 7] + s1) & _M
            a, b, c, d, e, f, g, hh = h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]
            for t in range(64):
                s1 = _rotr(e, 6) ^ _rotr(e, 11) ^ _rotr(e, 25)
                ch = (e & f) ^ ((~e) & g)
                t1 = (hh + s1 + ch + _K[t] + w[t]) & _M
                s0 = _rotr(a, 2) ^ _rotr(a, 13) ^ _rotr(a, 22)
                maj = (a & b) ^ (a & c) ^ (b & c)
                t2 = (s0 + maj) & _M
                hh, g, f, e, d, c, b, a = g, f, e, (d + t1) & _M, c, b, a, (t1 + t2) & _M
            h[0] = (h[0] + a) & _M
            h[1] = (h[1] + b) & _M
            h[2] = (h[2] + c) & _M
            h[3] = (h[3] + d) & _M
            h[4] = (h[4] + e) & _M
            h[5] = (h[5] + f) & _M
            h[6] = (h[6] + g) & _M
            h[7] = (h[7] + hh) & _M
        for j in range(4):  # the first 16 bytes of the digest, big-endian words: the next link
            for k in range(4):
                byte = (h[j] >> (24 - 8 * k)) & 0xFF
                out[i, 4 * j + k] = byte
                buf[4 * j + k] = byte


def chain_hashes(prev: bytes, data: bytes, page_bytes: int) -> bytes:
    """The hashes of the whole pages of `data` (`page_bytes` each: a page's tokens as
    little-endian int32), chained from `prev` (16 bytes), concatenated (16 bytes a page)."""
    n = len(data) // page_bytes
    out = np.empty((n, _HASH_BYTES), np.uint8)
    if n:
        _chain(np.frombuffer(prev, np.uint8), np.frombuffer(data, np.uint8), page_bytes, out)
    return out.tobytes()


def chain_hashes_xxh3(prev: bytes, data: bytes, page_bytes: int) -> bytes:
    """`chain_hashes` with ``h(i) = XXH3-128(h(i-1) || page i's tokens)`` (its whole 16-byte digest):
    one C call a page (~0.1 µs at 1-token pages, a third of the compiled SHA-256's)."""
    import xxhash  # (a dependency; imported where chosen, so a SHA-256 runtime never needs it loaded)

    digest = xxhash.xxh3_128_digest
    out = []
    for i in range(0, len(data) - page_bytes + 1, page_bytes):
        prev = digest(prev + data[i:i + page_bytes])
        out.append(prev)
    return b"".join(out)


_CHAINS: dict[str, Callable[[bytes, bytes, int], bytes]] = {"sha256": chain_hashes, "xxhash": chain_hashes_xxh3}


def chain_function(algo: str) -> Callable[[bytes, bytes, int], bytes]:
    """The chain of `algo` (`runtime.config.HASH_ALGOS`)."""
    return _CHAINS[algo]


def load_chain(algo: str) -> None:
    """Hash one page with `algo`'s chain, so that its code is loaded (numba compiles the SHA-256
    chain, or loads it from its cache: a quarter to a whole second of CPU) before a page is hashed
    inside an actor's turn. Call it off the event loop."""
    chain_function(algo)(bytes(_HASH_BYTES), bytes(4), 4)

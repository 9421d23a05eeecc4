"""The page-hash chains of `runtime.storage.hashing`: SHA-256 compiled with numba (one call per run
of pages), or xxHash's XXH3-128, also compiled for pages of up to 56 tokens and through the
`xxhash` package beyond (`chain_function` picks one).

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


# -- XXH3-128, compiled (inputs of 17-240 bytes: a 16-byte link and pages of up to 56 tokens) -------
# xxHash's XXH3_128bits for short and mid-size inputs with the default secret and seed 0, written
# out (xxhash.h: XXH3_len_17to128_128b, XXH3_len_129to240_128b) so a run of pages is one compiled
# call instead of a Python loop around one C call a page (~0.9 µs of interpreter time a page).
# Longer inputs (pages of more than 56 tokens) take the loop. Checked against the xxhash package
# for every page size (tests/unit/storage/test_hash_chain.py).
_U64 = np.uint64
_XXH_SECRET = np.frombuffer(bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671fcb79e64eccc0e578825ad07dccff7221"
    "b8084674f743248ee03590e6813a264c3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364eac5ac8334d3ebc3c581a0fffa1363eb"
    "170ddd51b7f0da49d316552629d4689e2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"),
    np.uint8)
_XXH_MAX_INPUT = 240
_P64_1 = _U64(0x9E3779B185EBCA87)
_P64_2 = _U64(0xC2B2AE3D27D4EB4F)
_P64_4 = _U64(0x85EBCA77C2B2AE63)
_AVALANCHE = _U64(0x165667919E3779F9)
_M32 = _U64(0xFFFFFFFF)
_S32 = _U64(32)
_S37 = _U64(37)


@numba.njit(inline="always")
def _le64(buf, o):  # noqa: ANN001, ANN202
    v = _U64(0)
    for k in range(7, -1, -1):
        v = (v << _U64(8)) | _U64(buf[o + k])
    return v


@numba.njit(inline="always")
def _mul_fold64(a, b):  # noqa: ANN001, ANN202 - the 128-bit product's halves xor-ed
    al, ah, bl, bh = a & _M32, a >> _S32, b & _M32, b >> _S32
    ll, hl, lh, hh = al * bl, ah * bl, al * bh, ah * bh
    cross = (ll >> _S32) + (hl & _M32) + lh
    upper = (hl >> _S32) + (cross >> _S32) + hh
    lower = (cross << _S32) | (ll & _M32)
    return lower ^ upper


@numba.njit(inline="always")
def _avalanche(h):  # noqa: ANN001, ANN202
    h ^= h >> _S37
    h *= _AVALANCHE
    return h ^ (h >> _S32)


@numba.njit(inline="always")
def _mix16(buf, i, secret, s):  # noqa: ANN001, ANN202 - seed 0
    return _mul_fold64(_le64(buf, i) ^ _le64(secret, s), _le64(buf, i + 8) ^ _le64(secret, s + 8))


@numba.njit(inline="always")
def _mix32(lo, hi, buf, i1, i2, secret, s):  # noqa: ANN001, ANN202
    lo += _mix16(buf, i1, secret, s)
    lo ^= _le64(buf, i2) + _le64(buf, i2 + 8)
    hi += _mix16(buf, i2, secret, s + 16)
    hi ^= _le64(buf, i1) + _le64(buf, i1 + 8)
    return lo, hi


@numba.njit(inline="always")
def _xxh3_128(buf, n, secret):  # noqa: ANN001, ANN202 - 17 <= n <= 240, seed 0: (high, low)
    lo, hi = _U64(n) * _P64_1, _U64(0)
    if n <= 128:
        i = (n - 1) // 32
        while i >= 0:
            lo, hi = _mix32(lo, hi, buf, 16 * i, n - 16 * (i + 1), secret, 32 * i)
            i -= 1
    else:
        rounds = n // 32
        for i in range(4):
            lo, hi = _mix32(lo, hi, buf, 32 * i, 32 * i + 16, secret, 32 * i)
        lo, hi = _avalanche(lo), _avalanche(hi)
        for i in range(4, rounds):
            lo, hi = _mix32(lo, hi, buf, 32 * i, 32 * i + 16, secret, 3 + 32 * (i - 4))
        lo, hi = _mix32(lo, hi, buf, n - 16, n - 32, secret, 136 - 17 - 16)  # (seed 0: its negation too)
    low = _avalanche(lo + hi)
    high = _U64(0) - _avalanche(lo * _P64_1 + hi * _P64_4 + _U64(n) * _P64_2)
    return high, low


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _chain_xxh3(prev, data, page_bytes, out, secret):  # noqa: ANN001, ANN202
    """out[i] = XXH3-128(out[i-1] || data[i*page_bytes:(i+1)*page_bytes]) (canonical: big-endian
    high then low half), out[-1] = prev."""
    n = out.shape[0]
    length = 16 + page_bytes
    buf = np.empty(length, np.uint8)
    buf[:16] = prev
    for i in range(n):
        buf[16:length] = data[i * page_bytes:(i + 1) * page_bytes]
        high, low = _xxh3_128(buf, length, secret)
        for k in range(8):
            b = (high >> _U64(56 - 8 * k)) & _U64(0xFF)
            out[i, k] = b
            buf[k] = b
            b = (low >> _U64(56 - 8 * k)) & _U64(0xFF)
            out[i, 8 + k] = b
            buf[8 + k] = b


def chain_hashes_xxh3(prev: bytes, data: bytes, page_bytes: int) -> bytes:
    """`chain_hashes` with ``h(i) = XXH3-128(h(i-1) || page i's tokens)`` (its whole 16-byte digest,
    canonical): compiled for pages of up to 56 tokens (~0.05 µs a 1-token page), else one call of
    the xxhash package a page."""
    n = len(data) // page_bytes
    if 16 + page_bytes <= _XXH_MAX_INPUT:
        out = np.empty((n, _HASH_BYTES), np.uint8)
        if n:
            _chain_xxh3(np.frombuffer(prev, np.uint8), np.frombuffer(data, np.uint8), page_bytes, out, _XXH_SECRET)
        return out.tobytes()
    import xxhash  # (a dependency; imported where chosen, so a SHA-256 runtime never needs it loaded)

    digest = xxhash.xxh3_128_digest
    parts = []
    for i in range(0, n * page_bytes, page_bytes):
        prev = digest(prev + data[i:i + page_bytes])
        parts.append(prev)
    return b"".join(parts)


_CHAINS: dict[str, Callable[[bytes, bytes, int], bytes]] = {"sha256": chain_hashes, "xxhash": chain_hashes_xxh3}


def chain_function(algo: str) -> Callable[[bytes, bytes, int], bytes]:
    """The chain of `algo` (`runtime.config.HASH_ALGOS`)."""
    return _CHAINS[algo]


def load_chain(algo: str) -> None:
    """Hash one page with `algo`'s chain, so that its code is loaded (numba compiles the chain,
    or loads it from its cache: a quarter to a whole second of CPU) before a page is hashed
    inside an actor's turn. Call it off the event loop."""
    chain_function(algo)(bytes(_HASH_BYTES), bytes(4), 4)

"""The compiled page-hash chain equals SHA-256 through hashlib, byte for byte (the definition of
`runtime.storage.hashing`: h(i) = sha256(h(i-1) || page i's int32 tokens)[:16])."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.storage.hash_chain import chain_hashes, chain_hashes_xxh3
from runtime.storage.hashing import KVIdentity, chain_seed, page_hashes

IDENTITY = KVIdentity("m", "0", "float32", 2, 2, 8)


def reference(prev: bytes, tokens: np.ndarray, page_size: int) -> list[bytes]:
    """The definition, one hashlib call per page."""
    raw = tokens.astype("<i4").tobytes()
    step = page_size * 4
    out = []
    for off in range(0, len(tokens) // page_size * step, step):
        prev = hashlib.sha256(prev + raw[off: off + step]).digest()[:16]
        out.append(prev)
    return out


@pytest.mark.parametrize("page_size", [1, 2, 4, 8, 11, 12, 13, 16, 32, 64, 256])
def test_every_page_size(page_size):
    tokens = np.random.default_rng(page_size).integers(0, 2**31 - 1, page_size * 9 + 3, dtype=np.int32)
    seed = chain_seed("ns", IDENTITY)
    want = reference(seed, tokens, page_size)
    whole = len(tokens) // page_size * page_size
    assert len(want) == len(tokens) // page_size
    assert chain_hashes(seed, tokens[:whole].astype("<i4").tobytes(), page_size * 4) == b"".join(want)
    assert page_hashes(tokens, page_size, "ns", IDENTITY) == want


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), max_size=200), st.sampled_from([1, 3, 4, 16]),
       st.binary(min_size=16, max_size=16))
def test_random_tokens_and_links(tokens, page_size, parent):
    arr = np.asarray(tokens, dtype=np.int32)
    want = reference(parent, arr, page_size)
    assert page_hashes(arr, page_size, None, IDENTITY, parent=parent) == want


def xxh3_reference(prev: bytes, raw: bytes, page_bytes: int) -> bytes:
    """h(i) = XXH3-128(h(i-1) || page i), one call of the xxhash package per page."""
    import xxhash

    out = []
    for off in range(0, len(raw) // page_bytes * page_bytes, page_bytes):
        prev = xxhash.xxh3_128_digest(prev + raw[off: off + page_bytes])
        out.append(prev)
    return b"".join(out)


@pytest.mark.parametrize("page_size", [*range(1, 60), 64, 256])
def test_xxh3_chain_every_page_size(page_size):
    """The compiled XXH3-128 (inputs of 17-240 bytes: both of xxhash's short-input paths, and
    the edges 32/64/96/128/240) equals the package's digest; longer pages take the package."""
    rng = np.random.default_rng(page_size)
    raw = rng.integers(0, 2**31 - 1, page_size * 9, dtype=np.int32).astype("<i4").tobytes()
    prev = rng.bytes(16)
    assert chain_hashes_xxh3(prev, raw, page_size * 4) == xxh3_reference(prev, raw, page_size * 4)
    assert chain_hashes_xxh3(prev, b"", page_size * 4) == b""


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=400), st.sampled_from([1, 3, 4, 16, 29, 30, 56]), st.binary(min_size=16, max_size=16))
def test_xxh3_random_bytes_and_links(raw, page_size, prev):
    assert chain_hashes_xxh3(prev, raw, page_size * 4) == xxh3_reference(prev, raw, page_size * 4)

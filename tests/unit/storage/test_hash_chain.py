"""The compiled page-hash chain equals the definition (`hashing.page_hashes`, hashlib) byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.storage.hash_chain import chain_hashes
from runtime.storage.hashing import KVIdentity, chain_seed, page_hashes

IDENTITY = KVIdentity("m", "0", "float32", 2, 2, 8)


@pytest.mark.parametrize("page_size", [1, 2, 4, 8, 11, 12, 13, 16, 32, 64, 256])
def test_every_page_size(page_size):
    tokens = np.random.default_rng(page_size).integers(0, 2**31 - 1, page_size * 9 + 3, dtype=np.int32)
    want = page_hashes(tokens, page_size, "ns", IDENTITY)
    got = chain_hashes(chain_seed("ns", IDENTITY), tokens.astype("<i4").tobytes(), page_size * 4)
    assert got == b"".join(want)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), max_size=200), st.sampled_from([1, 3, 4, 16]),
       st.binary(min_size=16, max_size=16))
def test_random_tokens_and_links(tokens, page_size, parent):
    arr = np.asarray(tokens, dtype=np.int32)
    want = page_hashes(arr, page_size, None, IDENTITY, parent=parent)
    assert chain_hashes(parent, arr.astype("<i4").tobytes(), page_size * 4) == b"".join(want)

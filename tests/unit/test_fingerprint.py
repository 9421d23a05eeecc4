"""The fingerprint oracle in every pool dtype: values exact in the dtype, distinct prefixes give
distinct vectors after rounding, the float32 encoding unchanged, and `mismatches` finds no fault
in a correct pool of any dtype and flags a slot that holds another prefix's KV."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.errors import ValidationError
from runtime.fingerprint import fingerprint_kv, identity_bits, mismatches, prefix_hashes, write_fingerprints
from runtime.memory.pools import DevicePool, HostPool, KVShape

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
LOW = [d for d in DTYPES if d != torch.float32]


def test_float32_encoding_is_unchanged():
    """Existing float32 callers (fuzz harness, benchmarks) compare against this exact encoding."""
    h = prefix_hashes(np.arange(50), "ns")
    got = fingerprint_kv(h, 3, 2, 8)
    assert torch.equal(got, fingerprint_kv(h, 3, 2, 8, torch.float32)) and got.dtype == torch.float32
    for layer, kv, pos, head, d in [(0, 0, 0, 0, 0), (2, 1, 49, 1, 7), (1, 0, 17, 1, 3)]:
        base = (int(h[pos]) % 65521 * 7 + layer * 2 + kv) % 65536
        assert got[layer, kv, pos, head, d].item() == base * 128 + (head * 8 + d) % 128


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_values_are_exact_in_the_dtype(dtype):
    f = fingerprint_kv(prefix_hashes(np.arange(3000)), 2, 2, 8, dtype)
    assert f.shape == (2, 2, 3000, 2, 8) and f.dtype == torch.float32
    assert torch.equal(f.to(dtype).to(torch.float32), f)
    assert torch.isfinite(f).all()


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_distinct_prefixes_stay_distinct_after_rounding(dtype):
    """With the fewest lanes that carry the whole 64-bit key, 4000 positions x 3 layers x K/V give
    24000 distinct vectors once stored in the dtype. The float32 encoding rounded into the same
    dtype collapses them (why the low-precision dtypes have their own encoding)."""
    per_elem = identity_bits(dtype, 1, 1)
    lanes = -(-64 // per_elem)
    assert identity_bits(dtype, 1, lanes) == 64 and identity_bits(dtype, 1, lanes - 1) < 64
    h = prefix_hashes(np.arange(4000) % 7, "tenant")
    stored = fingerprint_kv(h, 3, 1, lanes, dtype).to(dtype).view(torch.uint8).reshape(3 * 2 * 4000, -1)
    assert len({row.numpy().tobytes() for row in stored}) == 3 * 2 * 4000
    legacy = fingerprint_kv(h, 3, 1, lanes).to(dtype).to(torch.float32)
    assert len({row.numpy().tobytes() for row in legacy.reshape(3 * 2 * 4000, -1)}) < 3 * 2 * 4000 // 10


def test_identity_bits_per_dtype():
    assert identity_bits(torch.float32, 2, 8) == 16
    assert [identity_bits(d, 1, 1) for d in LOW] == [15, 15, 7, 7]
    assert [identity_bits(d, 2, 8) for d in LOW] == [64, 64, 64, 64]


def test_unknown_dtype_is_refused():
    with pytest.raises(ValidationError):
        fingerprint_kv(prefix_hashes(np.arange(4)), 1, 1, 4, torch.float64)
    with pytest.raises(ValidationError):
        identity_bits(torch.int8, 1, 4)


def pools(dtype: torch.dtype, parts: int = 2) -> list:
    shape = KVShape(num_layers=2, num_kv_heads=2 // parts, head_dim=8, dtype=dtype, parts=parts)
    return [DevicePool(shape, 32, 4), HostPool(shape, 32, 4, "layer_first"), HostPool(shape, 32, 4, "page_first")]


@pytest.mark.parametrize("parts", [2, 1], ids=["kv", "latent"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mismatches_clean_pool_and_a_wrong_slot(dtype, parts):
    """Every dtype, in K/V pools and in one-part (MLA latent) pools of 1 x 8 lanes."""
    a = np.arange(100, 112)
    b = np.arange(200, 212)
    slots = np.array([8, 9, 10, 11, 20, 21, 22, 23, 0, 1, 2, 3])
    for pool in pools(dtype, parts):
        write_fingerprints(pool, slots, a, "ns")
        assert mismatches(pool, slots, a, "ns") == []
        assert mismatches(pool, slots, a, "other") == list(range(12))  # another namespace's prefix
        # position 5 gets b's KV of the same position (another prefix): flagged, nothing else
        write_fingerprints(pool, slots[:6], b, "ns", start=5)
        assert mismatches(pool, slots, a, "ns") == [5]
        # an unwritten (zero) slot is not anyone's KV
        assert mismatches(pool, np.array([4, 5]), a[:2], "ns") == [0, 1]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_part_is_the_k_part(dtype):
    """A latent pool's fingerprint is what K would be (the K/V values are unchanged by `parts`);
    any other part count is refused."""
    h = prefix_hashes(np.arange(40), "ns")
    both = fingerprint_kv(h, 3, 1, 8, dtype)
    latent = fingerprint_kv(h, 3, 1, 8, dtype, parts=1)
    assert latent.shape == (3, 1, 40, 1, 8) and torch.equal(latent, both[:, :1])
    for bad in (0, 3, True):
        with pytest.raises(ValidationError):
            fingerprint_kv(h, 3, 1, 8, dtype, parts=bad)

"""Fingerprint oracle: KV content as a deterministic function of (prefix, position, layer, K/V).

A test (or a benchmark standing in for a model) writes `fingerprint_kv(...)` into the
slots of the tokens it "computes"; any later read anywhere (device, host, after a load,
from another request) can be checked against the prefix it must belong to, so
corruption, cross-request reads and lost data are caught without a model.

Every value is exact in the pool's dtype, so writing and reading back is lossless and
`mismatches` compares what the pool holds with the expected values rounded through its dtype.
Pools of one part per token (MLA's latent, `KVShape.parts == 1`) hold what K would hold.
Identity kept per (position, layer, K/V) vector of ``H * D`` lanes:

- float32 (the original encoding, unchanged): integers ``base * 128 + lane`` below 2**23, with
  ``base`` from the prefix hash mod 65521: ~16 bits of the prefix, the same in every lane.
- float16 / bfloat16 (15 bits an element), float8_e4m3fn / float8_e5m2 (7 bits an element):
  each lane holds one *digit* of a 64-bit key (SplitMix64 of the prefix hash, the layer and
  K/V), shown as the digit-th value of a table of the dtype's distinct finite values; lane
  ``i`` takes the key's bits from ``i * b`` on (rotating), so a vector keeps
  ``min(64, b * H * D)`` bits of the key: all 64 from 5 lanes (16-bit) or 10 lanes (fp8) on.
  Rounding to 16 or 8 bits cannot collapse two prefixes the way the float32 encoding would.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Hashable

import numpy as np
import torch

from runtime.errors import ValidationError

_MOD = (1 << 61) - 1
_MUL = 1_000_003
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
# pool dtypes with the digit encoding (float32 keeps the original one)
_DIGIT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2})


def _seed(extra_key: Hashable) -> int:
    return int.from_bytes(hashlib.sha256(repr(extra_key).encode()).digest()[:7], "little")


def prefix_hashes(tokens: np.ndarray, extra_key: Hashable = None) -> np.ndarray:
    """h[p] identifies tokens[0..p] under `extra_key` (a chained polynomial hash)."""
    out = np.empty(len(tokens), dtype=np.int64)
    h = _seed(extra_key)
    for i, t in enumerate(np.asarray(tokens, dtype=np.int64).tolist()):
        h = (h * _MUL + t + 1) % _MOD
        out[i] = h
    return out


def fingerprint_kv(hashes: np.ndarray, num_layers: int, num_heads: int, head_dim: int,
                   dtype: torch.dtype = torch.float32, parts: int = 2) -> torch.Tensor:
    """KV data `[layers, parts, n, heads, head_dim]` (float32) for the positions with these prefix
    hashes, every value exact in `dtype` (a pool dtype: `runtime.config.KV_DTYPES`); `parts` as
    `KVShape.parts` (2: K and V; 1: an MLA latent, whose values are those K would have)."""
    if parts not in (1, 2) or type(parts) is not int:
        raise ValidationError(f"parts must be 1 (latent) or 2 (K and V), got {parts!r}")
    if dtype == torch.float32:
        h = torch.from_numpy((hashes % 65521).astype(np.int64))  # [n]
        layer = torch.arange(num_layers).view(num_layers, 1, 1)
        kv = torch.arange(parts).view(1, parts, 1)
        base = (h.view(1, 1, -1) * 7 + layer * 2 + kv) % 65536  # [L, C, n]
        lane = (torch.arange(num_heads * head_dim) % 128).view(num_heads, head_dim)
        return (base.view(num_layers, parts, -1, 1, 1) * 128 + lane).to(torch.float32)
    table = _digit_table(dtype)
    bits = table.numel().bit_length() - 1
    # tag of (layer, part): 2 * layer + part + 1 (parts=2 numbering kept, so the MHA values are unchanged)
    tags = (np.arange(num_layers, dtype=np.uint64).reshape(num_layers, 1, 1) * np.uint64(2)
            + np.arange(parts, dtype=np.uint64).reshape(1, parts, 1) + np.uint64(1))
    keys = _splitmix64(np.asarray(hashes).astype(np.uint64).reshape(1, 1, -1) ^ (tags * _GOLDEN))  # [L, C, n]
    shift = (np.arange(num_heads * head_dim, dtype=np.uint64) * np.uint64(bits)) % np.uint64(64)
    k = keys[..., None]
    rotated = (k >> shift) | (k << ((np.uint64(64) - shift) % np.uint64(64)))  # [L, C, n, lanes]
    digits = torch.from_numpy((rotated & np.uint64(table.numel() - 1)).astype(np.int64))
    return table[digits].view(num_layers, parts, len(hashes), num_heads, head_dim)


def identity_bits(dtype: torch.dtype, num_heads: int, head_dim: int) -> int:
    """Bits of a position's identity that one (layer, K/V) vector of `num_heads * head_dim` lanes keeps
    in `dtype`: of the 64-bit key (64: two distinct prefix hashes never share a vector), or for
    float32 of the prefix hash mod 65521."""
    if dtype == torch.float32:
        return 16
    lanes = num_heads * head_dim
    return min(64, (_digit_table(dtype).numel().bit_length() - 1) * lanes)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer: a bijection of uint64 that spreads every input bit over the output."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@functools.cache
def _digit_table(dtype: torch.dtype) -> torch.Tensor:
    """A power-of-two count of `dtype`'s distinct finite values (float32, ascending; no -0, no value
    that is subnormal in float32): the digit ``d`` of a fingerprint is shown as ``table[d]``."""
    if dtype not in _DIGIT_DTYPES:
        raise ValidationError(f"fingerprints exist for the pool dtypes {sorted(map(str, _DIGIT_DTYPES))} "
                              f"and torch.float32, got {dtype!r}")
    codes = torch.arange(1 << (8 * torch.empty((), dtype=dtype).element_size()), dtype=torch.int32)
    values = (codes.to(torch.uint8) if codes.numel() == 256 else codes.to(torch.int16)).view(dtype).to(torch.float32)
    keep = torch.isfinite(values) & ((values.abs() >= torch.finfo(torch.float32).tiny)
                                     | ((values == 0) & ~torch.signbit(values)))
    distinct = torch.unique(values[keep])  # sorted
    return distinct[: 1 << (distinct.numel().bit_length() - 1)].contiguous()


def write_fingerprints(pool, slots, tokens, extra_key: Hashable = None, start: int = 0) -> None:
    """Write the fingerprint of tokens[start:len(slots)] into those slots of `pool` ("compute" their KV)."""
    slots = np.asarray(slots, dtype=np.int64)
    hashes = prefix_hashes(np.asarray(tokens)[: len(slots)], extra_key)
    shape = pool.shape
    data = fingerprint_kv(hashes[start:], shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype,
                          shape.parts)
    pool.write_slots(slots[start:], data.to(shape.dtype))


def mismatches(pool, slots, tokens, extra_key: Hashable = None) -> list[int]:
    """Positions whose KV in `pool` is not the fingerprint of their prefix (empty when all match)."""
    slots = np.asarray(slots, dtype=np.int64)
    if len(slots) == 0:
        return []
    shape = pool.shape
    want = fingerprint_kv(prefix_hashes(np.asarray(tokens)[: len(slots)], extra_key),
                          shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype, shape.parts)
    if shape.dtype != torch.float32:  # what the pool can hold of it (exact by construction)
        want = want.to(shape.dtype).to(torch.float32)
    got = pool.read_slots(slots).to(torch.float32)
    bad = (got != want).flatten(3).any(-1).any(0).any(0)  # [n]
    return torch.nonzero(bad).flatten().tolist()

"""Fingerprint oracle: KV content as a deterministic function of (prefix, position, layer, K/V).

A test (or a benchmark standing in for a model) writes `fingerprint_kv(...)` into the
slots of the tokens it "computes"; any later read anywhere (device, host, after a load,
from another request) can be checked against the prefix it must belong to, so
corruption, cross-request reads and lost data are caught without a model. Values are
integers below 2**23, exact in float32.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable

import numpy as np
import torch

_MOD = (1 << 61) - 1
_MUL = 1_000_003


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




def fingerprint_kv(hashes: np.ndarray, num_layers: int, num_heads: int, head_dim: int) -> torch.Tensor:
    """KV data `[layers, 2, n, heads, head_dim]` (float32) for the positions with these prefix hashes."""
    h = torch.from_numpy((hashes % 65521).astype(np.int64))  # [n]
    layer = torch.arange(num_layers).view(num_layers, 1, 1)
    kv = torch.arange(2).view(1, 2, 1)
    base = (h.view(1, 1, -1) * 7 + layer * 2 + kv) % 65536  # [L, 2, n]
    lane = (torch.arange(num_heads * head_dim) % 128).view(num_heads, head_dim)
    return (base.view(num_layers, 2, -1, 1, 1) * 128 + lane).to(torch.float32)


def write_fingerprints(pool, slots, tokens, extra_key: Hashable = None, start: int = 0) -> None:
    """Write the fingerprint of tokens[start:len(slots)] into those slots of `pool` ("compute" their KV)."""
    slots = np.asarray(slots, dtype=np.int64)
    hashes = prefix_hashes(np.asarray(tokens)[: len(slots)], extra_key)
    shape = pool.shape
    data = fingerprint_kv(hashes[start:], shape.num_layers, shape.num_kv_heads, shape.head_dim)
    pool.write_slots(slots[start:], data.to(shape.dtype))


def mismatches(pool, slots, tokens, extra_key: Hashable = None) -> list[int]:
    """Positions whose KV in `pool` is not the fingerprint of their prefix (empty when all match)."""
    slots = np.asarray(slots, dtype=np.int64)
    if len(slots) == 0:
        return []
    shape = pool.shape
    want = fingerprint_kv(prefix_hashes(np.asarray(tokens)[: len(slots)], extra_key),
                          shape.num_layers, shape.num_kv_heads, shape.head_dim)
    got = pool.read_slots(slots).to(torch.float32)
    bad = (got != want).flatten(3).any(-1).any(0).any(0)  # [n]
    return torch.nonzero(bad).flatten().tolist()

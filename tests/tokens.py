"""The one helper for test token arrays."""

from __future__ import annotations

import numpy as np


def toks(n: int, seed: int) -> np.ndarray:
    """`n` token ids drawn from `seed` (distinct seeds: distinct prompts), int32."""
    return np.random.default_rng(seed).integers(0, 30000, n, dtype=np.int32)

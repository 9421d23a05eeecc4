"""The CPU copy kernel: page rows copied in one pass, compiled with numba, GIL released.

A *page row* is one page of one layer's K or V (or its one part: an MLA latent, a recurrent
state component); it is contiguous in the device pool and in both host layouts
(`runtime.memory.pools`). A transfer copies the rows
``[part, layer, src_pages[i]] -> [part, layer, dst_pages[i]]``.

Why numba: numpy and torch have fast gathers (``take`` / ``index_select``) but no
scattered-to-scattered copy; a gather into a temporary plus a scatter (numpy fancy
assignment, torch ``index_copy_``) costs two passes and per-call overhead, and reached
0.27-0.63x of one contiguous copy of the same bytes at 16- and 64-token pages on this
project's 2-core machine. A compiled loop of row copies is one pass and releases the GIL, so
two threads copy in parallel: 0.51-0.68x of the contiguous copy through the whole engine at
16 and 64 (`benchmarks/bench_copy_engine.py`; raw kernel A/Bs on the real pools 0.63-0.89x;
docs/BENCHMARKS.md, "Transfer"). Compiled on first use and cached on disk.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["RowView", "copy_rows"]


class RowView:
    """A ``[C, L, P, W]`` row view (C parts: 2 for K and V, 1 for a latent or a state component)
    as one flat word array plus its strides in words.

    The flat array starts at row ``[0, 0, 0]`` and spans every row, so the kernel addresses
    rows by offset and copies each row as one unit-stride loop.
    """

    __slots__ = ("flat", "stride_kv", "stride_layer", "stride_page", "row_words", "num_layers", "parts")

    def __init__(self, rows: np.ndarray) -> None:
        if rows.ndim != 4 or rows.strides[3] != rows.itemsize or min(rows.strides) < 0:
            raise ValueError("rows must be a [C, L, P, W] view with contiguous rows and positive strides")
        item = rows.itemsize
        extent = sum((n - 1) * s for n, s in zip(rows.shape, rows.strides)) // item + 1
        self.flat = np.lib.stride_tricks.as_strided(rows, shape=(extent,), strides=(item,))
        self.stride_kv, self.stride_layer, self.stride_page = (s // item for s in rows.strides[:3])
        self.row_words = rows.shape[3]
        self.num_layers = rows.shape[1]
        self.parts = rows.shape[0]


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _copy_rows(src, s_kv, s_layer, s_page, dst, d_kv, d_layer, d_page, words, parts, layer_lo, layer_hi,
               src_pages, dst_pages):
    # one (layer, part) plane at a time: with pages sorted by source, each plane's source rows
    # are read in address order (a little faster than all planes of one page at a time)
    for layer in range(layer_lo, layer_hi):
        for kv in range(parts):
            s_base = layer * s_layer + kv * s_kv
            d_base = layer * d_layer + kv * d_kv
            for i in range(src_pages.shape[0]):
                so = s_base + src_pages[i] * s_page
                do = d_base + dst_pages[i] * d_page
                # copy through sub-views: LLVM vectorizes this loop (indexing the flat arrays
                # directly ran ~3x slower: possible aliasing blocks vectorization)
                s = src[so : so + words]
                d = dst[do : do + words]
                for j in range(words):
                    d[j] = s[j]


def copy_rows(src: RowView, dst: RowView, layer_lo: int, layer_hi: int, src_pages: np.ndarray, dst_pages: np.ndarray) -> None:
    """Copy every part's rows of layers ``[layer_lo, layer_hi)`` for each page pair (no bounds checks:
    callers validate page indices with `runtime.transfer.engine.check_bounds`)."""
    if src.flat.dtype != dst.flat.dtype or src.row_words != dst.row_words or src.parts != dst.parts:
        raise ValueError("source and destination rows differ in word type, size or parts")
    if src_pages.shape != dst_pages.shape:
        raise ValueError("src_pages and dst_pages differ in length")
    _copy_rows(
        src.flat, src.stride_kv, src.stride_layer, src.stride_page,
        dst.flat, dst.stride_kv, dst.stride_layer, dst.stride_page,
        src.row_words, src.parts, layer_lo, layer_hi, src_pages, dst_pages,
    )

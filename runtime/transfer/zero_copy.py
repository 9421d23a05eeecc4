"""Zero-copy page-row copies between a CUDA device pool and a pinned host pool (Triton).

A *page row* is one page of one layer's K or V (or its one part: an MLA latent, a state
component), contiguous in the device pool and in both host
layouts (`runtime.memory.pools`). One kernel launch copies the rows of a range of layers for a
list of page pairs, the GPU reading or writing the pinned host pool directly (pinned memory is
mapped into the device's address space: no staging buffer, no host-side pass, no copy per page).
On an H100 it moved 50-52 GB/s, 0.91-0.95x one contiguous pinned `copy_` of the same bytes, at
1-, 16- and 64-token pages in both host layouts (docs/BENCHMARKS.md, "Transfer on a GPU").

Imported by `cuda_engine` only: Triton comes with CUDA builds of torch, not with CPU ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["RowTensor", "copy_rows"]


class RowTensor:
    """A pool's ``[C, L, P, W]`` row view (C parts) as a torch tensor of machine words, and its strides."""

    __slots__ = ("rows", "stride_kv", "stride_layer", "stride_page", "words", "num_layers", "parts")

    def __init__(self, buffer: torch.Tensor, *, page_first: bool, num_layers: int, row_bytes: int,
                 parts: int = 2) -> None:
        word = next(w for w, n in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2), (torch.uint8, 1))
                    if row_bytes % n == 0)
        raw = buffer.view(torch.uint8)
        if page_first:
            rows = raw.reshape(-1, num_layers, parts, row_bytes).view(word).permute(2, 1, 0, 3)
        else:
            rows = raw.reshape(parts, num_layers, -1, row_bytes).view(word)
        self.rows = rows
        self.stride_kv, self.stride_layer, self.stride_page = rows.stride()[:3]
        self.words = rows.shape[3]
        self.num_layers = num_layers
        self.parts = parts


@triton.jit
def _rows_kernel(src, dst, src_pages, dst_pages, n_pages, layer_lo,
                 s_kv, s_layer, s_page, d_kv, d_layer, d_page, words, parts, BLOCK: tl.constexpr):
    r = tl.program_id(0)  # one row: (layer, part, page pair)
    c = tl.program_id(1)  # one block of it
    i = r % n_pages
    kl = r // n_pages
    layer = (layer_lo + kl // parts).to(tl.int64)  # (offsets past 2**31 words in large pools)
    kv = (kl % parts).to(tl.int64)
    sp = tl.load(src_pages + i)
    dp = tl.load(dst_pages + i)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    mask = offs < words
    x = tl.load(src + (kv * s_kv + layer * s_layer + sp * s_page) + offs, mask=mask)
    tl.store(dst + (kv * d_kv + layer * d_layer + dp * d_page) + offs, x, mask=mask)


def copy_rows(src: RowTensor, dst: RowTensor, layer_lo: int, layer_hi: int,
              src_pages: torch.Tensor, dst_pages: torch.Tensor) -> None:
    """Queue on the current stream: every part's rows of layers ``[layer_lo, layer_hi)`` for each page
    pair ``src_pages[i] -> dst_pages[i]`` (int64 CUDA tensors; bounds checked by the caller)."""
    n = src_pages.numel()
    if n == 0 or layer_hi <= layer_lo:
        return
    words = src.words
    block = min(1024, triton.next_power_of_2(words))
    grid = (src.parts * (layer_hi - layer_lo) * n, triton.cdiv(words, block))
    _rows_kernel[grid](src.rows, dst.rows, src_pages, dst_pages, n, layer_lo,
                       src.stride_kv, src.stride_layer, src.stride_page,
                       dst.stride_kv, dst.stride_layer, dst.stride_page, words, src.parts, BLOCK=block)

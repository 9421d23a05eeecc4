"""KV data pools: `DevicePool` (the model's KV buffers) and `HostPool` (the host tier).

Both hold K and V for every layer and slot of one model; only the copy engine and the
model touch their data (the ledgers say who owns which slot).

Storage:
A token's KV has ``C = KVShape.parts`` parts per layer: 2 (K and V, ``[H, D]`` each: MHA, GQA,
sliding window) or 1 (one latent vector per token, ``H = 1``, ``D`` = its width: MLA).

Storage:
- `DevicePool.buffer`: one tensor ``[C, L, S, H, D]`` (K = 0, V = 1) on ``device``;
  ``k[l]`` / ``v[l]`` are ``[S, H, D]`` views of it (``latent[l]`` with one part), so a run of
  slots is one strided slice over all layers and copies can coalesce.
- `HostPool.buffer`, layout ``layer_first`` (default): ``[C, L, S, H, D]`` like the device.
- `HostPool.buffer`, layout ``page_first``: ``[P, L, C, page_size, H, D]``: one page is
  contiguous across layers (storage reads/writes it without a gather).

The storage format of a page is the canonical ``[L, C, page_size, H, D]``
(`HostPool.read_page` / `write_page`), whatever the host layout, so processes with
different layouts or pool sizes share pages.

`page_rows()` gives the CPU copy engines a zero-copy numpy view ``[C, L, P, W]`` whose rows
are one page of one layer's part (``page_size * H * D * itemsize`` bytes as ``W`` words):
in both layouts a page row is contiguous, so every copy is a copy of page rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from runtime.errors import ConfigError, LengthError

__all__ = ["KVShape", "DevicePool", "HostPool", "HostLayout"]

HostLayout = Literal["layer_first", "page_first"]
_LAYOUTS = ("layer_first", "page_first")


@dataclass(frozen=True)
class KVShape:
    """Per-token KV geometry of a model: ``parts`` tensors ``[num_kv_heads, head_dim]`` per layer
    (2: K and V, MHA / GQA; 1: one latent vector, MLA, written ``num_kv_heads=1``)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float16
    parts: int = 2

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"KVShape.{name} must be a positive int, got {v!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ConfigError(f"KVShape.dtype must be a torch.dtype, got {self.dtype!r}")
        if self.parts not in (1, 2) or type(self.parts) is not int:
            raise ConfigError(f"KVShape.parts must be 1 (latent) or 2 (K and V), got {self.parts!r}")

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def token_elems(self) -> int:
        """Elements of one token in one layer's part (K, V or latent): ``num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token's KV: every part over all layers."""
        return self.parts * self.num_layers * self.token_elems * self.itemsize


# CPU torch has no index_copy_ for the fp8 dtypes: their slots are written through a uint8 view
# of the same bytes (the copy engines and storage already move every dtype as bytes)
_BYTE_FLOATS = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})


def _indexable(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in _BYTE_FLOATS else t


def _check_geometry(num_slots: int, page_size: int) -> None:
    if not isinstance(page_size, int) or page_size <= 0:
        raise ConfigError(f"page_size must be a positive int, got {page_size!r}")
    if not isinstance(num_slots, int) or num_slots <= 0 or num_slots % page_size:
        raise ConfigError(f"num_slots must be a positive multiple of page_size={page_size}, got {num_slots!r}")


def _slots_array(slots: np.ndarray | torch.Tensor | list[int], num_slots: int) -> torch.Tensor:
    if isinstance(slots, torch.Tensor):
        idx = slots.detach().to("cpu", torch.int64).reshape(-1).clone()
    else:
        idx = torch.from_numpy(np.array(slots, dtype=np.int64).reshape(-1))
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= num_slots):
        raise LengthError(f"slot index out of range [0, {num_slots})")
    return idx


def _page_rows(buffer: torch.Tensor, *, page_first: bool, shape: KVShape, page_size: int) -> np.ndarray:
    """Zero-copy numpy view ``[C, L, P, W]``: row ``[part, layer, page]`` is one page of one layer's part.

    Rows are ``W`` machine words (uint64 when the row size allows), the unit the CPU copy
    kernel (`runtime.transfer.row_kernel`) moves.
    """
    if buffer.device.type != "cpu":
        raise TypeError("page_rows() needs a CPU buffer (the CUDA engine has its own rows: runtime.transfer.zero_copy)")
    row_bytes = page_size * shape.token_elems * shape.itemsize
    word = next(w for w in (np.uint64, np.uint32, np.uint16, np.uint8) if row_bytes % np.dtype(w).itemsize == 0)
    raw = buffer.view(torch.uint8).numpy()  # shares memory; works for bf16 too
    L, C = shape.num_layers, shape.parts
    if page_first:
        rows = raw.reshape(-1, L, C, row_bytes).view(word)  # [P, L, C, W]
        return rows.transpose(2, 1, 0, 3)
    return raw.reshape(C, L, -1, row_bytes).view(word)  # [C, L, P, W]


class DevicePool:
    """Per-layer K and V buffers ``[num_slots, num_kv_heads, head_dim]`` on ``device``.

    ``buffer`` is ``[C, L, S, H, D]``; ``k[l]`` / ``v[l]`` are views of it (K and V), ``latent[l]``
    (one part: MLA; ``k`` names the same views so that code reading one part reads either).
    """

    def __init__(self, shape: KVShape, num_slots: int, page_size: int, device: torch.device | str = "cpu") -> None:
        _check_geometry(num_slots, page_size)
        self.shape = shape
        self.num_slots = num_slots
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.device = torch.device(device)
        self.buffer = torch.zeros(
            (shape.parts, shape.num_layers, num_slots, shape.num_kv_heads, shape.head_dim), dtype=shape.dtype, device=self.device
        )
        self.device = self.buffer.device  # with its index ("cuda" is "cuda:0"), as tensors compare
        self.k: list[torch.Tensor] = [self.buffer[0, layer] for layer in range(shape.num_layers)]
        self.v: list[torch.Tensor] = ([self.buffer[1, layer] for layer in range(shape.num_layers)]
                                      if shape.parts == 2 else [])
        self.latent: list[torch.Tensor] = self.k if shape.parts == 1 else []

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def page_rows(self) -> np.ndarray:
        """``[C, L, P, W]`` numpy view of page rows (CPU pools only)."""
        return _page_rows(self.buffer, page_first=False, shape=self.shape, page_size=self.page_size)

    def read_slots(self, slots: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Copy of the KV of ``slots``, ``[L, C, n, H, D]`` on the CPU (tests, fingerprint checks)."""
        idx = _slots_array(slots, self.num_slots).to(self.device)
        return self.buffer.index_select(2, idx).transpose(0, 1).contiguous().cpu()

    def write_slots(self, slots: np.ndarray | torch.Tensor, data: torch.Tensor) -> None:
        """Write ``data`` (``[L, C, n, H, D]``) into ``slots``."""
        idx = _slots_array(slots, self.num_slots).to(self.device)
        data = data.to(self.device, self.shape.dtype).transpose(0, 1)
        _indexable(self.buffer).index_copy_(2, idx, _indexable(data))

    def __repr__(self) -> str:
        return f"DevicePool(slots={self.num_slots}, page_size={self.page_size}, device={self.device}, {self.shape})"


class HostPool:
    """The host tier's KV buffers, in layout ``layer_first`` or ``page_first`` (see the module doc).

    Pinned when ``pin_memory`` is true (default: when CUDA is available), so that
    device<->host copies can run asynchronously on a copy stream.
    """

    def __init__(
        self,
        shape: KVShape,
        num_slots: int,
        page_size: int,
        layout: HostLayout = "layer_first",
        pin_memory: bool | None = None,
        *,
        zero: bool = True,
    ) -> None:
        _check_geometry(num_slots, page_size)
        if layout not in _LAYOUTS:
            raise ConfigError(f"host layout must be one of {_LAYOUTS}, got {layout!r}")
        self.shape = shape
        self.num_slots = num_slots
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.layout: HostLayout = layout
        self.device = torch.device("cpu")
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.pinned = bool(pin_memory)
        L, H, D = shape.num_layers, shape.num_kv_heads, shape.head_dim
        C = shape.parts
        dims = (C, L, num_slots, H, D) if layout == "layer_first" else (self.num_pages, L, C, page_size, H, D)
        self.buffer = torch.empty(dims, dtype=shape.dtype, pin_memory=self.pinned)
        if zero:
            self.buffer.zero_()

    # ---- sizing -----------------------------------------------------------------------

    @staticmethod
    def slots_for(
        device_slots: int,
        page_size: int,
        *,
        ratio: float | None = None,
        tokens: int | None = None,
        bytes_budget: int | None = None,
        shape: KVShape | None = None,
    ) -> int:
        """Host pool size in slots from exactly one of ``ratio`` (× device slots), ``tokens``
        or ``bytes_budget`` (needs ``shape``), rounded down to whole pages (at least one page)."""
        given = [x is not None for x in (ratio, tokens, bytes_budget)]
        if sum(given) != 1:
            raise ConfigError("give exactly one of ratio, tokens, bytes_budget")
        if not isinstance(page_size, int) or page_size <= 0:
            raise ConfigError(f"page_size must be a positive int, got {page_size!r}")
        if ratio is not None:
            if not ratio > 0:
                raise ConfigError(f"host ratio must be > 0, got {ratio!r}")
            slots = int(device_slots * ratio)
        elif tokens is not None:
            slots = int(tokens)
        else:
            if shape is None:
                raise ConfigError("bytes_budget needs shape")
            slots = int(bytes_budget) // shape.bytes_per_token
        slots -= slots % page_size
        if slots < page_size:
            raise ConfigError(f"host pool would hold less than one page ({slots} slots)")
        return slots

    # ---- views ------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def layer_k(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s K: ``[S, H, D]`` (layer_first) or a strided ``[P, page_size, H, D]`` view (page_first).

        Slot ``s`` is ``view[s]`` in the first case and ``view[s // page_size, s % page_size]`` in the second.
        """
        return self.buffer[0, layer] if self.layout == "layer_first" else self.buffer[:, layer, 0]

    def layer_v(self, layer: int) -> torch.Tensor:
        return self.buffer[1, layer] if self.layout == "layer_first" else self.buffer[:, layer, 1]

    def page_rows(self) -> np.ndarray:
        """``[C, L, P, W]`` numpy view of page rows (each row contiguous, in both layouts)."""
        return _page_rows(self.buffer, page_first=self.layout == "page_first", shape=self.shape, page_size=self.page_size)

    # ---- storage I/O (canonical page format) -----------------------------------------

    def _check_page(self, page: int) -> int:
        page = int(page)
        if not 0 <= page < self.num_pages:
            raise LengthError(f"page {page} out of range [0, {self.num_pages})")
        return page

    def read_page(self, page: int) -> torch.Tensor:
        """One page in the canonical ``[L, C, page_size, H, D]`` form, contiguous.

        page_first: a view of the pool (zero copy); layer_first: a copy. Treat it as
        read-only and use it before the page is freed or rewritten.
        """
        page = self._check_page(page)
        if self.layout == "page_first":
            return self.buffer[page]
        ps = self.page_size
        return self.buffer[:, :, page * ps : (page + 1) * ps].transpose(0, 1).contiguous()

    def write_page(self, page: int, data: torch.Tensor) -> None:
        """Write one page from its canonical ``[L, C, page_size, H, D]`` form."""
        page = self._check_page(page)
        L, H, D = self.shape.num_layers, self.shape.num_kv_heads, self.shape.head_dim
        expect = (L, self.shape.parts, self.page_size, H, D)
        if tuple(data.shape) != expect:
            raise LengthError(f"page data must be {expect}, got {tuple(data.shape)}")
        if self.layout == "page_first":
            self.buffer[page].copy_(data)
        else:
            ps = self.page_size
            self.buffer[:, :, page * ps : (page + 1) * ps].copy_(data.transpose(0, 1))

    # ---- test helpers ------------------------------------------------------------------

    def read_slots(self, slots: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Copy of the KV of ``slots``, ``[L, C, n, H, D]`` (tests, fingerprint checks)."""
        idx = _slots_array(slots, self.num_slots)
        if self.layout == "layer_first":
            return self.buffer.index_select(2, idx).transpose(0, 1).contiguous()
        ps = self.page_size
        # advanced indices on dims 0 and 3 (not adjacent) go first: [n, L, 2, H, D]
        return self.buffer[idx // ps, :, :, idx % ps].permute(1, 2, 0, 3, 4).contiguous()

    def write_slots(self, slots: np.ndarray | torch.Tensor, data: torch.Tensor) -> None:
        """Write ``data`` (``[L, C, n, H, D]``) into ``slots``."""
        idx = _slots_array(slots, self.num_slots)
        data = data.to("cpu", self.shape.dtype)
        if self.layout == "layer_first":
            _indexable(self.buffer).index_copy_(2, idx, _indexable(data.transpose(0, 1)))
        else:
            ps = self.page_size
            self.buffer[idx // ps, :, :, idx % ps] = data.permute(2, 0, 1, 3, 4)

    def __repr__(self) -> str:
        return (
            f"HostPool(slots={self.num_slots}, page_size={self.page_size}, layout={self.layout}, "
            f"pinned={self.pinned}, {self.shape})"
        )

"""PagedKVCopier: whole-page copies between an engine's paged KV tensors and a host pool.

Tiers-only mode: the engine (vLLM) owns the device KV, one tensor per attention layer, and
registers them with the connector's worker side; the runtime owns the host tier. A page here is
one engine block. The copier reads the layout it is given and copies a block's logical contents,
whatever its memory order:

- ``block_first`` (vLLM 0.33): ``(num_blocks, ...)``, e.g. ``(num_blocks, kv_heads, block_size,
  head_dim_k + head_dim_v)`` whose strides follow the engine's `KVCacheLayout`;
- ``kv_first`` (older vLLM, flash-attention): ``(2, num_blocks, block_size, heads, head_dim)``.

The host pool is one tensor ``[pages, layers, *block]`` (``block`` = one block's logical shape,
K and V first for ``kv_first``): a page is contiguous across layers, and the same logical
contents whichever memory layout the engine chose, so pages move between engines that differ in
it. Plans are the tiers-only core's `TransferPlan`s: token slots ``block * block_size + offset``
on the device side, ``page * block_size + offset`` on the host side, whole pages in order. A
plan's slots are checked as the copy engines check theirs, and against both pools, before
anything is copied.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from runtime.errors import ConfigError
from runtime.messages import Direction, PoolTransfer, TransferPlan
from runtime.transfer.engine import check_bounds, resolve


@dataclass(frozen=True)
class PagedLayout:
    """The geometry every registered layer shares."""

    kv_first: bool
    num_blocks: int
    block: tuple[int, ...]  # one block's logical shape, as the host pool stores it
    dtype: torch.dtype

    @staticmethod
    def of(t: torch.Tensor, kv_first: bool | None = None) -> "PagedLayout":
        """`kv_first` None: read from the shape (a 5-D tensor whose first dimension is 2)."""
        if kv_first is None:
            kv_first = t.dim() == 5 and t.shape[0] == 2
        if t.dim() < 2 or (kv_first and (t.dim() != 5 or t.shape[0] != 2)):
            raise ConfigError(f"a paged KV layer is (blocks, ...) or (2, blocks, block_size, heads, dim), "
                              f"got {tuple(t.shape)}")
        if kv_first:
            return PagedLayout(True, int(t.shape[1]), (2, *t.shape[2:]), t.dtype)
        return PagedLayout(False, int(t.shape[0]), tuple(t.shape[1:]), t.dtype)


class PagedKVCopier:
    """Copies plans' whole pages between the registered layers and the host pool it owns."""

    def __init__(self, layers: Mapping[str, torch.Tensor], block_size: int, host_pages: int, *,
                 kv_first: bool | None = None) -> None:
        if not layers:
            raise ConfigError("no KV layers registered")
        self.block_size = block_size
        self.names = list(layers)
        self.layers = [layers[n] for n in self.names]
        self.layout = PagedLayout.of(self.layers[0], kv_first)
        for name, t in zip(self.names, self.layers):
            if PagedLayout.of(t, self.layout.kv_first) != self.layout or t.device != self.layers[0].device:
                raise ConfigError(f"KV layer {name!r} differs from {self.names[0]!r} in shape, dtype or device")
        pin = self.layers[0].device.type == "cuda"
        self.host = torch.zeros((host_pages, len(self.layers), *self.layout.block), dtype=self.layout.dtype,
                                pin_memory=pin)

    @property
    def host_pages(self) -> int:
        return self.host.shape[0]

    def pages(self, plan: TransferPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """(device blocks, host pages) of a plan, checked as every copy engine checks its plans
        (`resolve`: one pool, equal lengths, whole aligned pages, no destination twice) and
        against both pools (`check_bounds`); a `ValidationError` otherwise."""
        (transfer,) = resolve(plan, self.block_size).transfers
        if plan.direction is Direction.BACKUP:
            check_bounds(transfer, self.layout.num_blocks, self.host_pages)
            device, host = transfer.src_pages, transfer.dst_pages
        else:
            check_bounds(transfer, self.host_pages, self.layout.num_blocks)
            host, device = transfer.src_pages, transfer.dst_pages
        return torch.tensor(device), torch.tensor(host)

    def copy_layer(self, plan: TransferPlan, layer: int, blocks: torch.Tensor, pages: torch.Tensor) -> None:
        """One layer of one plan (the caller checked its pages with `pages`)."""
        kv = self.layers[layer]
        if plan.direction is Direction.BACKUP:
            part = kv[:, blocks].transpose(0, 1) if self.layout.kv_first else kv[blocks]
            self.host[pages, layer] = part.to(self.host.device, non_blocking=True)
        else:
            part = self.host[pages, layer].to(kv.device, non_blocking=True)
            if self.layout.kv_first:
                kv[:, blocks] = part.transpose(0, 1)
            else:
                kv[blocks] = part

    def run(self, plan: TransferPlan, limit: int | None = None) -> None:
        """Copy the plan's pages (its first `limit` pages as the plan lists them, when given)."""
        if limit is not None and limit * self.block_size < plan.num_slots:
            # cut before `pages`: its checks put the pages into source order (connector fuzzer)
            (t,) = plan.transfers
            cut = max(0, limit) * self.block_size
            plan = TransferPlan(plan.op_id, plan.direction, (PoolTransfer(t.pool, t.src[:cut], t.dst[:cut]),))
        blocks, pages = self.pages(plan)
        for layer in range(len(self.layers)):
            self.copy_layer(plan, layer, blocks, pages)

    def page_buffer(self, page: int) -> torch.Tensor:
        """One host page's bytes (a storage read's destination or a write's source)."""
        return self.host[page]

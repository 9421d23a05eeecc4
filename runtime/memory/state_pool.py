"""Recurrent-state pools: the per-request, fixed-size state of a hybrid model's recurrent layers.

A Mamba / linear-attention layer keeps no per-token KV: it carries a state (e.g. a conv window
and an SSM state) that summarises every token so far. Its cache unit is a *state slot*: one
request's (or one tree node's snapshot of) the state of every recurrent layer.

- `StateComponent`: one tensor kind per layer (``conv``: ``[conv_dim, kernel]``, ``ssm``:
  ``[heads, head_dim, state]``, ...), with its own dtype (SSM states are often kept in float32).
- `StateShape`: the model's recurrent layers and their components.
- `StatePool`: one buffer per component, ``[L, S, *shape]`` (layer-major, like the KV pools), so
  one layer's state of one slot is one contiguous *row*; ``layer(name, l)`` is the ``[S, *shape]``
  view a model reads and writes.

The copy engines move state as rows, like KV page rows: `StatePool.component_pool(name)` is a
pool of one-slot pages with one part (no K/V split) that the engines take beside the KV pools
(a plan names it ``state.<name>``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from runtime.errors import ConfigError, LengthError
from runtime.memory.pools import _page_rows

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["StateComponent", "StateShape", "StatePool", "StateComponentPool", "STATE_POOL_PREFIX"]

STATE_POOL_PREFIX = "state."
"""A state component's pool name in a transfer plan: ``state.<component name>``."""


@dataclass(frozen=True)
class StateComponent:
    """One per-layer state tensor kind: ``shape`` per slot, stored as ``dtype``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ConfigError(f"StateComponent.name must be an identifier, got {self.name!r}")
        if (not isinstance(self.shape, tuple) or not self.shape
                or not all(type(n) is int and n > 0 for n in self.shape)):
            raise ConfigError(f"StateComponent {self.name}: shape must be a non-empty tuple of positive ints, "
                              f"got {self.shape!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ConfigError(f"StateComponent {self.name}: dtype must be a torch.dtype, got {self.dtype!r}")

    @property
    def elems(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def row_bytes(self) -> int:
        """Bytes of one layer's state of one slot."""
        return self.elems * self.itemsize


@dataclass(frozen=True)
class StateShape:
    """The recurrent state of a model: ``num_layers`` recurrent layers, each with every component."""

    num_layers: int
    components: tuple[StateComponent, ...]

    def __post_init__(self) -> None:
        if type(self.num_layers) is not int or self.num_layers <= 0:
            raise ConfigError(f"StateShape.num_layers must be a positive int, got {self.num_layers!r}")
        if not self.components or not all(isinstance(c, StateComponent) for c in self.components):
            raise ConfigError("StateShape.components must be a non-empty tuple of StateComponent")
        names = [c.name for c in self.components]
        if len(set(names)) != len(names):
            raise ConfigError(f"StateShape component names repeat: {names}")

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one state slot: every component of every recurrent layer."""
        return self.num_layers * sum(c.row_bytes for c in self.components)


@dataclass(frozen=True)
class _RowGeometry:
    """What the copy engines read of a pool's shape (`KVShape` offers the same names)."""

    num_layers: int
    token_elems: int
    itemsize: int
    parts: int = 1


class StateComponentPool:
    """One component of a `StatePool` as the copy engines see a pool: pages of one slot, one part,
    rows ``[1, L, S, W]`` (one layer's state of one slot)."""

    page_size = 1

    def __init__(self, pool: StatePool, component: StateComponent) -> None:
        self.component = component
        self.buffer = pool.buffers[component.name]
        self.num_slots = pool.num_slots
        self.num_pages = pool.num_slots
        self.device = pool.device
        self.pinned = pool.pinned
        self.layout = "layer_first"
        self.shape = _RowGeometry(pool.shape.num_layers, component.elems, component.itemsize)

    def page_rows(self) -> np.ndarray:
        return _page_rows(self.buffer, page_first=False, shape=self.shape, page_size=1)


class StatePool:
    """State slots on ``device`` (a device pool) or in (optionally pinned) host memory."""

    def __init__(self, shape: StateShape, num_slots: int, device: torch.device | str = "cpu",
                 *, pin_memory: bool = False) -> None:
        if type(num_slots) is not int or num_slots <= 0:
            raise ConfigError(f"StatePool num_slots must be a positive int, got {num_slots!r}")
        self.shape = shape
        self.num_slots = num_slots
        device = torch.device(device)
        self.pinned = bool(pin_memory) and device.type == "cpu"
        self.buffers: dict[str, torch.Tensor] = {
            c.name: torch.zeros((shape.num_layers, num_slots, *c.shape), dtype=c.dtype, device=device,
                                pin_memory=self.pinned)
            for c in shape.components
        }
        self.device = next(iter(self.buffers.values())).device  # with its index: "cuda" is "cuda:0" here

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def layer(self, name: str, layer: int) -> torch.Tensor:
        """Component ``name`` of recurrent layer ``layer``: ``[num_slots, *shape]`` (a view)."""
        return self.buffers[name][layer]

    def component_pools(self) -> Iterator[tuple[str, StateComponentPool]]:
        """``(plan pool name, pool)`` of every component, for the copy engines."""
        for c in self.shape.components:
            yield STATE_POOL_PREFIX + c.name, StateComponentPool(self, c)

    # ---- one slot as bytes (storage, tests) ---------------------------------------------

    def _check_slot(self, slot: int) -> int:
        slot = int(slot)
        if not 0 <= slot < self.num_slots:
            raise LengthError(f"state slot {slot} out of range [0, {self.num_slots})")
        return slot

    def read_slot(self, slot: int) -> torch.Tensor:
        """Slot ``slot`` in the canonical form: a flat uint8 tensor, per component (in the shape's
        order) its ``[L, *shape]`` bytes. A copy, on the CPU."""
        out = torch.empty(self.shape.bytes_per_slot, dtype=torch.uint8)
        self.read_slot_into(slot, out)
        return out

    def read_slot_into(self, slot: int, out: torch.Tensor) -> None:
        """`read_slot` into the first `bytes_per_slot` bytes of `out` (a flat, contiguous uint8 CPU
        tensor; storage writes a padded chunk buffer this way): one copy per component."""
        slot = self._check_slot(slot)
        if out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous() or out.numel() < self.shape.bytes_per_slot:
            raise LengthError(f"state slot output must be a flat contiguous uint8 tensor of at least "
                              f"{self.shape.bytes_per_slot} bytes, got {tuple(out.shape)} {out.dtype}")
        at = 0
        for c in self.shape.components:
            n = self.shape.num_layers * c.row_bytes
            out[at:at + n].view(c.dtype).view(self.shape.num_layers, *c.shape).copy_(self.buffers[c.name][:, slot])
            at += n

    def write_slot(self, slot: int, data: torch.Tensor) -> None:
        """Write slot ``slot`` from its canonical form (`read_slot`)."""
        slot = self._check_slot(slot)
        if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() != self.shape.bytes_per_slot:
            raise LengthError(f"state slot data must be {self.shape.bytes_per_slot} uint8 bytes, "
                              f"got {tuple(data.shape)} {data.dtype}")
        at = 0
        for c in self.shape.components:
            n = self.shape.num_layers * c.row_bytes
            part = data[at:at + n].view(c.dtype).reshape(self.shape.num_layers, *c.shape)
            self.buffers[c.name][:, slot].copy_(part)
            at += n

    def copy_slot(self, src: int, dst: int) -> None:
        """State ``src`` -> ``dst`` in this pool (a hit forks a node's snapshot into a request's slot)."""
        src, dst = self._check_slot(src), self._check_slot(dst)
        for b in self.buffers.values():
            b[:, dst].copy_(b[:, src])

    def __repr__(self) -> str:
        return f"StatePool(slots={self.num_slots}, device={self.device}, {self.shape})"

"""Every message type of the runtime: frozen, slotted dataclasses.

Index tensors in a message belong to that message (never a view of a node's or a request's
array: seed 001). An operation that must keep its meaning while the tree changes carries a
snapshot of what it covers (seed 002). Acks carry an op id and an outcome, never a live object.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch


class Direction(str, Enum):
    BACKUP = "device_to_host"
    LOAD = "host_to_device"


@dataclass(frozen=True, slots=True)
class PoolTransfer:
    """One pool's part of a copy: slot indices (int64, CPU, page-aligned, equal length) owned by this message."""

    pool: str
    src: torch.Tensor
    dst: torch.Tensor


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """A device->host backup or host->device load of whole pages, one `PoolTransfer` per pool."""

    op_id: int
    direction: Direction
    transfers: tuple[PoolTransfer, ...]

    @property
    def num_slots(self) -> int:
        return int(self.transfers[0].src.numel()) if self.transfers else 0

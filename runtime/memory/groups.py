"""Pool group declarations: what each kind of model state keeps, and which tiers and features it
has (docs/ARCHITECTURE.md, "Pool groups").

A model's cache is a set of pool groups. Each declares here its pools, the bytes one of its slots
holds and what it supports; `RuntimeConfig` refuses a combination a group does not support from
these declarations alone (no rule of a group is written in the config), and the tree core builds
one rule object per group (`runtime/tree/groups/`). TP is not a group: it is a fan-out of the copy
engine and a key space of storage, across every group alike.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Feature", "GroupSpec", "FULL", "SLIDING", "RECURRENT", "KINDS"]


class Feature(enum.Enum):
    """A tier or feature of the runtime a group may not support yet (the value: how the config
    names it in a refusal)."""

    STORAGE = "storage tier (storage_backend)"
    DECODE_OFFLOAD = "decode offload (decode_offload)"
    TENSOR_PARALLEL = "per-rank pools (tp_ranks > 1)"
    SESSIONS = "streaming sessions"


@dataclass(frozen=True)
class GroupSpec:
    """One group of a model's cache. `kind`: which rule it follows (`KINDS`); `field`: the config
    field that asks for it (named in refusals); `unit`: what one slot holds ("token": one token's
    KV of the group's layers, "snapshot": a recurrent state after a prefix); `pools`: the plan
    pool names its copies move (beside the token pool's own, which has none); `bytes_per_slot`;
    `supports`: the features it has; `alone_with`: the other kinds it cannot be combined with yet."""

    kind: str
    field: str
    unit: str
    pools: tuple[str, ...]
    bytes_per_slot: int
    supports: frozenset[Feature]
    alone_with: frozenset[str] = frozenset()

    def refusals(self, wanted: set[Feature], others: tuple["GroupSpec", ...]) -> list[str]:
        """Why this group cannot run with the features `wanted` beside the groups `others` (empty: it can)."""
        out = [f"{self.field} has no {f.value} yet" for f in Feature if f in wanted and f not in self.supports]
        out += [f"{self.field} with {o.field}: not yet" for o in others if o.kind in self.alone_with]
        return out

    @classmethod
    def of(cls, kind: str, field: str, unit: str, pools: tuple[str, ...], bytes_per_slot: int) -> "GroupSpec":
        """The spec of a group of `kind`, with what that kind supports (`SUPPORTS`, `ALONE_WITH`)."""
        return cls(kind, field, unit, pools, bytes_per_slot, SUPPORTS[kind], ALONE_WITH.get(kind, frozenset()))


# The kinds, with what each supports. Full attention (MHA / GQA, MLA) has every tier.
FULL = "full"
SLIDING = "sliding"
RECURRENT = "recurrent"
KINDS = (FULL, SLIDING, RECURRENT)
SUPPORTS: dict[str, frozenset[Feature]] = {
    FULL: frozenset(Feature),
    # its rule covers the device and host tiers: storage pages and decode offload not yet
    SLIDING: frozenset({Feature.SESSIONS}),
    # the state rule covers the device, host and storage tiers
    RECURRENT: frozenset({Feature.STORAGE}),
}
ALONE_WITH: dict[str, frozenset[str]] = {SLIDING: frozenset({RECURRENT})}

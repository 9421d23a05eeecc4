"""PoolGroup: the hooks the tree core calls on each group of a model's cache.

A model's cache is a set of pool groups (`runtime.memory.groups` declares each: pools, bytes per
slot, what it supports). `Residency` holds one rule object per group and calls every group's
hook where a group may have a say: the core iterates its groups and never asks which exist. A
group overrides only the hooks its rule needs; the rest keep the defaults below (no cut, no
room needed, nothing to copy). A new kind of model state is one class here (its rule) plus its
declaration. The core calls a hook only on the groups that override it (`Hooked`).

The hooks, by where the core calls them:

- matching: `usable_end` (a hit is cut back to where the group's state is whole), `note_cut`;
- admission: `room` (device pages: each group's own pool must reach them), `admission_room`,
  `reserve` / `cancel` / `grant` (what an admission takes of the group's own slots; `cancel` is
  called on the groups that reserved), `admitted`;
- requests: `grows_in_place`, `after_insert`, `check_rewind` / `rewind`, `release`;
- the tree: `on_split`, `before_evict` (the group gives back what it can first),
  `drop_device` / `drop_host` (a node loses a copy), `orphan_load`;
- copies: `start_backup` / `end_backup`, `start_load` / `end_load` (each returns the plan's
  transfers of the group's pools, and keeps what it needs by op id);
- stats: `stats` (counters, `COUNTERS`), `counts` (sizes, `COUNTS`).

Tree and ledger changes a group makes are its own slots' (its ledger, its records): the tree's
nodes and the token ledgers change only in `Residency`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Protocol

import numpy as np

from runtime.memory.groups import GroupSpec
from runtime.memory.owners import Owner
from runtime.messages import PoolTransfer
from runtime.tree.nodes import MatchResult, Node
from runtime.tree.records import RequestRecord

__all__ = ["PoolGroup", "DryRun", "Hooked"]


class DryRun(Protocol):
    """`Residency.freeable_now` bound to one admission's kept nodes: the device pages an eviction
    would free at once (at least `need`), each node weighed by `weigh` (default: its pages)."""

    def __call__(self, need: int, weigh: Callable[[Node, int], int] | None = None) -> int: ...


class PoolGroup(Protocol):
    spec: GroupSpec
    stats: dict[str, int]
    COUNTERS: ClassVar[tuple[str, ...]] = ()  # its `stats` names (every group kind's are always reported)
    COUNTS: ClassVar[tuple[str, ...]] = ()  # its `counts` names

    # -- matching ----------------------------------------------------------------
    def usable_end(self, look: MatchResult, host_len: int) -> int:
        """Tokens of the match `look` (its device part, then `host_len` host-only tokens) a hit may use."""
        return look.device_len + host_len

    def note_cut(self, cut: int) -> None:
        """An admission's look was cut by `cut` tokens in all (0: not cut); counted at `admitted`."""

    # -- admission -----------------------------------------------------------------
    def room(self, pages: int, look: MatchResult | None, dry_run: DryRun) -> bool:
        """Whether `pages` more device pages of this group's pool can be had now (free, or freed at
        once by an eviction: `dry_run`), beside the token pool's own."""
        return True

    def admission_room(self, look: MatchResult, host_len: int) -> bool:
        """Whether an admission of `look` (loading `host_len` tokens) can have the group's own slots."""
        return True

    def reserve(self, rid: Hashable, owner: Owner, host_nodes: list[Node]) -> Any:
        """Take an admission's slots of the group (CapacityError: none; nothing taken). The value is
        handed back to `cancel`, `grant` and the load's `start_load`."""
        return None

    def cancel(self, rid: Hashable, owner: Owner, host_nodes: list[Node], reserved: Any) -> None:
        """An admission refused after `reserve`: give back what it took."""

    def grant(self, lock_node: Node | None, reserved: Any) -> Mapping[str, Any]:
        """The admission's `AdmitResult` fields this group fills in."""
        return {}

    def admitted(self) -> None:
        """An admission succeeded (count what its look noted)."""

    # -- requests ------------------------------------------------------------------
    def grows_in_place(self, node: Node, first_slot: int) -> bool:
        """Whether a request's insert may grow its own leaf `node` with pages from `first_slot` on."""
        return True

    def after_insert(self, rec: RequestRecord, split: Callable[[Node, int], Node]) -> list[Node]:
        """A request's insert reached `rec.cached_len`: the group hands what the request holds for
        positions the tree now covers to the nodes; returns new nodes split off for it (`split`)."""
        return []

    def check_rewind(self, rec: RequestRecord, new_len: int) -> None:
        """LengthError (nothing changed) if the group cannot take the request back to `new_len`."""

    def rewind(self, rec: RequestRecord, new_len: int) -> None:
        """The request forgets its tokens past `new_len`."""

    def release(self, rid: Hashable, owner: Owner) -> None:
        """A live request leaves: free the group's slots it holds."""

    # -- the tree ------------------------------------------------------------------
    def on_split(self, lower: Node, upper: Node) -> None:
        """A split gave `upper` the first part of `lower` (the group's records follow)."""

    def before_evict(self, target_free: int) -> None:
        """An eviction wants `target_free` device pages free: give back what the group can first."""

    def drop_device(self, node: Node) -> None:
        """`node` loses its device copy."""

    def drop_host(self, node: Node) -> None:
        """`node` loses its host copy."""

    def orphan_load(self, chain: list[Node]) -> None:
        """A load's chain loses its device copies (a load above it failed) before its own ack."""

    # -- copies --------------------------------------------------------------------
    def start_backup(self, op_id: int, node: Node, device: np.ndarray, host: np.ndarray) -> tuple[PoolTransfer, ...]:
        """A backup of `node` (`device` -> `host` pages) starts: the group's transfers."""
        return ()

    def end_backup(self, op_id: int, chain: list[Node], ok: bool) -> None:
        """The backup's ack: `chain` its nodes, `ok` whether it landed."""

    def start_load(self, op_id: int, host_nodes: list[Node], reserved: Any) -> tuple[PoolTransfer, ...]:
        """A load into the host-only chain's fresh device copies starts: the group's transfers."""
        return ()

    def end_load(self, op_id: int, orphaned: bool) -> None:
        """The load's ack (`orphaned`: its nodes lost their device copies before it)."""

    # -- sizes -----------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        """Sizes of the group's live state (`COUNTS`)."""
        return {}


@dataclass(frozen=True)
class Hooked:
    """Per hook, the groups whose rule overrides it (in the model's group order): the core calls
    only those, so a hook no group has a say in costs nothing (full attention alone overrides
    `room`). A value record, made once per model (`of`)."""

    usable_end: tuple[PoolGroup, ...]
    note_cut: tuple[PoolGroup, ...]
    room: tuple[PoolGroup, ...]
    admission_room: tuple[PoolGroup, ...]
    reserve: tuple[PoolGroup, ...]
    grant: tuple[PoolGroup, ...]
    admitted: tuple[PoolGroup, ...]
    grows_in_place: tuple[PoolGroup, ...]
    after_insert: tuple[PoolGroup, ...]
    check_rewind: tuple[PoolGroup, ...]
    rewind: tuple[PoolGroup, ...]
    release: tuple[PoolGroup, ...]
    on_split: tuple[PoolGroup, ...]
    before_evict: tuple[PoolGroup, ...]
    drop_device: tuple[PoolGroup, ...]
    drop_host: tuple[PoolGroup, ...]
    orphan_load: tuple[PoolGroup, ...]
    start_backup: tuple[PoolGroup, ...]
    end_backup: tuple[PoolGroup, ...]
    start_load: tuple[PoolGroup, ...]
    end_load: tuple[PoolGroup, ...]

    @classmethod
    def of(cls, groups: tuple[PoolGroup, ...]) -> "Hooked":
        def overriding(name: str) -> tuple[PoolGroup, ...]:
            return tuple(g for g in groups if getattr(type(g), name) is not getattr(PoolGroup, name))
        return cls(**{f.name: overriding(f.name) for f in fields(cls)})

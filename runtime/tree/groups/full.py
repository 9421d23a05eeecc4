"""FullAttention: the token pool's own group (MHA / GQA K and V, or MLA's latent, per layer).

Its rule is the radix tree's, kept by `Residency` (every token of a cached prefix is on device or
host with its node): a hit is never cut, and its one say at admission is whether the token pool
can give the device pages asked for, free or by an eviction that frees them at once.
"""

from __future__ import annotations

from collections.abc import Callable

from runtime.memory.groups import GroupSpec
from runtime.tree.groups.base import DryRun, PoolGroup
from runtime.tree.nodes import MatchResult

__all__ = ["FullAttention"]


class FullAttention(PoolGroup):
    def __init__(self, spec: GroupSpec, free_pages: Callable[[], int], evictable_pages: Callable[[], int]) -> None:
        """`free_pages`: the token pool's free pages (its own, apart from any paired pool's);
        `evictable_pages`: the device pages of unlocked tree nodes."""
        self.spec = spec
        self.stats: dict[str, int] = {}
        self._free = free_pages
        self._evictable = evictable_pages

    def room(self, pages: int, look: MatchResult | None, dry_run: DryRun) -> bool:
        need = pages - self._free()
        if need <= 0:
            return True
        if need > self._evictable():  # not even eventually
            return False
        return dry_run(need) >= need

"""The sliding-window layers' device slots: a ledger of their own, addressed through the full slots.

A model with sliding-window layers keeps their K/V in a pool of its own (`swa_tokens` slots).
Every full-attention page allocated for tokens gets a sliding page too; `SwaSlots.map` says where
(full slot -> sliding slot, -1: none; SGLang's `full_to_swa_index_mapping`), so the model reads
and writes a sliding layer at ``swa_pool[map[full_slots]]``.

A sliding page has exactly one holder: the full page it is mapped from, whoever owns that full
page. Ownership moves (a request's pages adopted by the tree, a split, a session) therefore change
nothing here; only the full page's allocation (`PairedLedger.alloc`) takes a sliding page and
its free gives it back. The tree's drop rule (`runtime/tree/groups/sliding.py`) gives back the sliding
pages of full pages no match can need any more (`give_back`): the full page stays, its map
entries become -1.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from runtime.errors import CapacityError, InvariantViolation
from runtime.memory.ledger import SlotLedger
from runtime.memory.owners import Owner, Tier
from runtime.trace import SlotTracer

__all__ = ["SwaSlots", "PairedLedger", "SWA_POOL"]

SWA_POOL = "swa"  # the plan pool of the sliding layers (device `rt.swa_pool`, host `rt.host_swa_pool`)


class SwaSlots:
    """The sliding pool's pages: which full page holds each (`holder`), the full -> sliding slot
    `map`, and the free-page stack. Changed only by `PairedLedger` and the tree's drop rule."""

    def __init__(self, device_slots: int, swa_slots: int, page_size: int) -> None:
        if swa_slots <= 0 or swa_slots % page_size:
            raise CapacityError(f"swa_slots must be a positive multiple of page_size {page_size}, got {swa_slots}")
        self.page_size = page_size
        self.num_pages = swa_slots // page_size
        # read by the model adapter (through a tensor sharing this memory); an entry a running
        # request's window reads never changes while it runs (docs/ARCHITECTURE.md, "Pool groups")
        self.map = np.full(device_slots, -1, dtype=np.int64)
        self.holder = np.full(self.num_pages, -1, dtype=np.int64)  # sliding page -> full page
        self._stack = np.arange(self.num_pages - 1, -1, -1, dtype=np.int64)
        self._top = self.num_pages
        self._offsets = np.arange(page_size, dtype=np.int64)

    def num_free_pages(self) -> int:
        return self._top

    def present(self, full_pages: np.ndarray) -> np.ndarray:
        """Whether each full page still has its sliding page (bool per page)."""
        return self.map[full_pages * self.page_size] >= 0

    def take(self, full_pages: np.ndarray) -> None:
        """Sliding pages for freshly allocated full pages (the caller checked there are enough)."""
        n = len(full_pages)
        if n == 0:
            return
        top = self._top
        swa = self._stack[top - n: top][::-1]
        self._top = top - n
        self.holder[swa] = full_pages
        self.map[self._expand(full_pages)] = self._expand(swa)

    def give_back(self, full_pages: np.ndarray) -> int:
        """Free the sliding pages of `full_pages` that have one; returns how many."""
        first = self.map[full_pages * self.page_size]
        have = first >= 0
        n = int(np.count_nonzero(have))
        if n:
            swa = first[have] // self.page_size
            self.holder[swa] = -1
            top = self._top
            self._stack[top: top + n] = swa[::-1]
            self._top = top + n
            self.map[self._expand(full_pages[have])] = -1
        return n

    def check(self, allocated: np.ndarray) -> None:
        """`map` and `holder` describe one bijection between held sliding pages and full pages
        that have one, aligned slot by slot; free and held pages partition the pool; only an
        allocated full page (`allocated`: bool per full page) holds one. Raises InvariantViolation."""
        ps = self.page_size
        free = self._stack[: self._top]
        held = np.flatnonzero(self.holder >= 0)
        if len(np.unique(free)) != len(free) or np.intersect1d(free, held).size or len(free) + len(held) != self.num_pages:
            raise InvariantViolation(f"swa: free ({len(free)}) and held ({len(held)}) pages do not partition "
                                     f"the {self.num_pages} pages")
        rows = self.map.reshape(-1, ps)
        mapped = np.flatnonzero(rows[:, 0] >= 0)
        if np.any((rows[mapped] - rows[mapped, :1]) != self._offsets) or np.any(rows[mapped, 0] % ps) or np.any(
                rows[np.flatnonzero(rows[:, 0] < 0)] != -1):
            raise InvariantViolation("swa: a full page maps to slots that are not one whole sliding page")
        swa_of = rows[mapped, 0] // ps
        if len(np.unique(swa_of)) != len(swa_of):
            raise InvariantViolation("swa: one sliding page mapped from two full pages")
        if not np.array_equal(np.sort(swa_of), held) or not np.array_equal(self.holder[swa_of], mapped):
            raise InvariantViolation("swa: map and holders disagree")
        if not allocated[mapped].all():
            bad = mapped[~allocated[mapped]][:8].tolist()
            raise InvariantViolation(f"swa: free full pages {bad} still hold sliding pages")

    def _expand(self, pages: np.ndarray) -> np.ndarray:
        return (pages[:, None] * self.page_size + self._offsets).reshape(-1)


class PairedLedger(SlotLedger):
    """The device ledger of a model with sliding layers: allocating a full page takes a sliding
    page for it and freeing one gives it back (`SwaSlots`), so no caller of the ledger changes.
    `num_free_pages` is the pages both pools can give (a new page needs one of each)."""

    def __init__(self, num_slots: int, page_size: int, tier: Tier, tracer: SlotTracer | None, swa: SwaSlots) -> None:
        super().__init__(num_slots, page_size, tier, tracer)
        self.swa = swa

    def num_free_pages(self) -> int:
        return min(self._top, self.swa.num_free_pages())

    def num_free_slots(self) -> int:
        return self.num_free_pages() * self.page_size

    def full_free_pages(self) -> int:
        return self._top

    def pins_of(self, pages: np.ndarray) -> np.ndarray:
        return self._pins[pages]

    def allocated(self) -> np.ndarray:
        """Bool per full page: owned by someone (for the invariant checker)."""
        return self._codes != 0

    def alloc(self, num_pages: int, owner: Owner, **ctx: Any) -> np.ndarray:
        if isinstance(num_pages, (int, np.integer)) and num_pages > self.swa.num_free_pages():
            raise CapacityError(f"swa: need {num_pages} pages, {self.swa.num_free_pages()} free")
        slots = super().alloc(num_pages, owner, **ctx)
        self.swa.take(self._trusted_pages(slots))
        return slots

    def alloc_held(self, codes: np.ndarray, **ctx: Any) -> np.ndarray:
        if len(codes) > self.swa.num_free_pages():
            raise CapacityError(f"swa: need {len(codes)} pages, {self.swa.num_free_pages()} free")
        slots = super().alloc_held(codes, **ctx)
        self.swa.take(self._trusted_pages(slots))
        return slots

    def free(self, slots: np.ndarray, owner: Owner, *, trusted: bool = False, **ctx: Any) -> None:
        super().free(slots, owner, trusted=trusted, **ctx)  # validates first: raises before any change
        self.swa.give_back(self._trusted_pages(np.asarray(slots, dtype=np.int64).reshape(-1)))

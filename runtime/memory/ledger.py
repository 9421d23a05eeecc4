"""`SlotLedger`: the single record of who owns each slot of one pool and how many copies pin it.

One ledger per pool (device or host). Everything is whole pages: slot indices come in and go
out as int64 numpy arrays of page-aligned slots (each page's ``page_size`` slots consecutive,
starting at a multiple of ``page_size``).

Cost model: ``alloc``, ``free``, ``assign``, ``pin`` and ``unpin`` cost O(pages touched) and
never scan the pool; per-owner page counts are kept incrementally. ``owned_slots``,
``snapshot`` and ``check`` are O(pool) debug/test helpers.

Storage:
- ``_codes[page]``: int64 owner code of the page, 0 = free. Owners are interned to small
  codes; an owner's code is dropped (and later reused) when it owns no page and nobody holds
  it, so short-lived owners do not leak. A code leaves the ledger only through `hold`: its
  holder (a request table row) keeps it valid until `unhold`, so a code never names a
  different owner while anyone outside has it.
- ``_count[code]`` / ``_holds[code]``: pages per code and holds per code (numpy, so one
  decode step's allocation for N owners is a few array operations).
- ``_pins[page]``: number of in-flight copies that pin the page.
- ``_stack[:_top]``: the free pages (LIFO).

Errors: every misuse raises a typed error before any state change (all-or-nothing) and emits no
trace event: `CapacityError` (too few free pages, which callers refuse with) or an `InternalError`
(`OwnershipError`, `PinnedSlotError`, `SlotMisuseError`: the ledger's arguments are the runtime's
own, so a misuse is a bug of the runtime, never a caller's input). Each successful mutating call
emits exactly one trace event.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.errors import (
    CapacityError,
    InvariantViolation,
    OwnershipError,
    PinnedSlotError,
    SlotMisuseError,
)
from runtime.memory.owners import Owner, Tier
from runtime.trace import SlotTracer

__all__ = ["SlotLedger", "LedgerSnapshot"]

_EMPTY = np.empty(0, dtype=np.int64)
_EMPTY.flags.writeable = False
_I64 = np.dtype(np.int64)


@dataclass(frozen=True, eq=False)
class LedgerSnapshot:
    """Raw copies of a ledger's state (for the invariant checker and before/after comparisons).

    ``page_codes[p]`` is the owner code of page ``p`` (0 = free) and ``owners`` maps codes to
    owners; ``pins[p]`` is the pin count of page ``p``; ``free_pages`` is the free stack,
    bottom to top; ``page_counts`` maps each live code to its page count.
    """

    num_slots: int
    page_size: int
    tier: Tier
    page_codes: np.ndarray
    pins: np.ndarray
    free_pages: np.ndarray
    owners: dict[int, Owner]
    page_counts: dict[int, int]

    @property
    def num_pages(self) -> int:
        return len(self.page_codes)

    def owner_of_page(self, page: int) -> Owner | None:
        code = int(self.page_codes[page])
        return None if code == 0 else self.owners[code]

    def page_owners(self) -> list[Owner | None]:
        """Owner of every page (O(pool) Python objects: tests only)."""
        owners = self.owners
        return [owners[c] if c else None for c in self.page_codes.tolist()]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LedgerSnapshot):
            return NotImplemented
        return (
            self.num_slots == other.num_slots
            and self.page_size == other.page_size
            and self.tier == other.tier
            and np.array_equal(self.page_codes, other.page_codes)
            and np.array_equal(self.pins, other.pins)
            and np.array_equal(self.free_pages, other.free_pages)
            and self.owners == other.owners
            and self.page_counts == other.page_counts
        )

    __hash__ = None  # type: ignore[assignment]


class SlotLedger:
    """Owner and pin count per page of one pool, plus its free-page stack."""

    def __init__(self, num_slots: int, page_size: int, tier: Tier, tracer: SlotTracer | None = None) -> None:
        if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size < 1:
            raise SlotMisuseError(f"page_size must be a positive int, got {page_size!r}")
        if isinstance(num_slots, bool) or not isinstance(num_slots, (int, np.integer)) or num_slots < 0:
            raise SlotMisuseError(f"num_slots must be a non-negative int, got {num_slots!r}")
        if num_slots % page_size:
            raise SlotMisuseError(f"num_slots {num_slots} is not a multiple of page_size {page_size}")
        self.num_slots = int(num_slots)
        self.page_size = int(page_size)
        self.num_pages = self.num_slots // self.page_size
        self.tier = Tier(tier)
        self._tier_name = self.tier.value
        self._tracer = tracer
        n = self.num_pages
        self._codes = np.zeros(n, dtype=np.int64)
        self._pins = np.zeros(n, dtype=np.int32)
        # Free stack, top at the end: a fresh ledger hands out pages 0, 1, 2, ... in order.
        self._stack = np.arange(n - 1, -1, -1, dtype=np.int64)
        self._top = n
        # Scratch for O(k) duplicate detection (no sort): see `_pages`.
        self._scratch = np.zeros(n, dtype=np.int64)
        self._arange = np.arange(n, dtype=np.int64)
        self._offsets = np.arange(self.page_size, dtype=np.int64)
        # Lookup tables that make validation a couple of gathers (see `_pages`): the page of
        # every slot and the slots of every page (page size 1: both are the identity).
        ps = self.page_size
        self._page_of_slot = np.arange(self.num_slots, dtype=np.int64) // ps if ps > 1 else self._arange
        self._page_slots = np.arange(self.num_slots, dtype=np.int64).reshape(n, ps) if ps > 1 else None
        self._pinned = 0  # total pin count over all pages: frees skip the pin check while it is 0
        # Owner interning.
        self._next_code = 1
        self._free_codes: list[int] = []
        self._code_of: dict[Owner, int] = {}
        self._owner_of: dict[int, Owner] = {}
        self._count = np.zeros(64, dtype=np.int64)
        self._holds = np.zeros(64, dtype=np.int64)

    # ------------------------------------------------------------------ queries

    def num_free_pages(self) -> int:
        return self._top

    def num_free_slots(self) -> int:
        return self._top * self.page_size

    def owner_of(self, slot: int) -> Owner | None:
        code = int(self._codes[self._slot_page(slot)])
        return None if code == 0 else self._owner_of[code]

    def owners_of(self, slots: np.ndarray) -> list[Owner | None]:
        """Owner of each page of ``slots`` (one entry per page, in order)."""
        pages = self._pages(slots, unique=False)
        owner_of = self._owner_of
        return [owner_of[c] if c else None for c in self._codes[pages].tolist()]

    def pin_count(self, slot: int) -> int:
        return int(self._pins[self._slot_page(slot)])

    def pages_owned_by(self, owner: Owner) -> int:
        code = self._code_of.get(owner)
        return 0 if code is None else int(self._count[code])

    def held_code(self, owner: Owner) -> int | None:
        """``owner``'s code while it is held (`hold`), else None."""
        code = self._code_of.get(owner)
        return code if code is not None and self._holds[code] else None

    def held_owners(self) -> set[Owner]:
        """The owners held now (O(owners): for the invariant checker)."""
        holds = self._holds
        return {owner for code, owner in self._owner_of.items() if holds[code]}

    def owned_slots(self, owner: Owner) -> np.ndarray:
        """Every slot of ``owner``, ascending (O(pool): debug/test helper)."""
        code = self._code_of.get(owner)
        if code is None:
            return _EMPTY.copy()
        return self._expand(np.flatnonzero(self._codes == code).astype(np.int64))

    def snapshot(self) -> LedgerSnapshot:
        return LedgerSnapshot(
            num_slots=self.num_slots,
            page_size=self.page_size,
            tier=self.tier,
            page_codes=self._codes.copy(),
            pins=self._pins.copy(),
            free_pages=self._stack[: self._top].copy(),
            owners=dict(self._owner_of),
            page_counts={c: int(self._count[c]) for c in self._owner_of},
        )

    # ---------------------------------------------------------------- mutations

    def alloc(self, num_pages: int, owner: Owner, **ctx: Any) -> np.ndarray:
        """Take ``num_pages`` free pages for ``owner``; returns their slots (int64)."""
        if type(num_pages) is not int and (
                isinstance(num_pages, bool) or not isinstance(num_pages, (int, np.integer))) or num_pages < 0:
            raise SlotMisuseError(f"num_pages must be a non-negative int, got {num_pages!r}")
        if type(owner) is not Owner and not isinstance(owner, Owner):
            raise OwnershipError(f"alloc needs an Owner, got {owner!r}")
        n = int(num_pages)
        top = self._top
        if n > top:
            raise CapacityError(f"{self._tier_name}: need {n} pages, {top} free")
        if n == 0:
            slots = _EMPTY.copy()
        else:
            pages = self._stack[top - n : top][::-1]
            self._top = top - n
            code = self._code_of.get(owner)
            if code is None:
                code = self._intern(owner)
            self._codes[pages] = code
            self._count[code] += n
            ps_table = self._page_slots
            slots = pages.copy() if ps_table is None else ps_table[pages].reshape(-1)
        t = self._tracer
        if t is not None and t.active:
            t.emit("alloc", self._tier_name, slots=slots, owner=owner, **ctx)
        return slots

    def alloc_held(self, codes: np.ndarray, **ctx: Any) -> np.ndarray:
        """One free page for each owner code in ``codes`` (a decode step's requests that start a
        page), as a few array operations: returns their slots, page i's ``page_size`` slots for
        ``codes[i]``. Every code must be held (`hold`): that is what keeps it naming its owner."""
        n = len(codes)
        top = self._top
        if n > top:
            raise CapacityError(f"{self._tier_name}: need {n} pages, {top} free")
        if n == 0:
            return _EMPTY.copy()
        if codes.dtype != _I64 or codes.ndim != 1:
            raise OwnershipError(f"alloc_held needs a 1-D int64 array of owner codes, got {codes.dtype}")
        try:  # code 0 is never held; a negative code would wrap, so the minimum is checked too
            held = self._holds[codes].all() and codes.min() > 0
        except IndexError:
            held = False
        if not held:
            raise OwnershipError("alloc_held of an owner code that is not held")
        pages = self._stack[top - n: top][::-1]
        self._top = top - n
        self._codes[pages] = codes
        np.add.at(self._count, codes, 1)
        ps_table = self._page_slots
        slots = pages.copy() if ps_table is None else ps_table[pages].reshape(-1)
        t = self._tracer
        if t is not None and t.active:
            ps = self.page_size
            owner_of = self._owner_of
            for i, code in enumerate(codes.tolist()):
                t.emit("alloc", self._tier_name, slots=slots[i * ps:(i + 1) * ps], owner=owner_of[code], **ctx)
        return slots

    def hold(self, owner: Owner) -> int:
        """Keep ``owner``'s code valid, pages or none, until `unhold`; returns the code (for
        `alloc_held`). Holds nest."""
        if not isinstance(owner, Owner):
            raise OwnershipError(f"hold needs an Owner, got {owner!r}")
        code = self._code_of.get(owner)
        if code is None:
            code = self._intern(owner)
        self._holds[code] += 1
        return code

    def unhold(self, owner: Owner) -> None:
        """Give back one hold of ``owner`` (its code is dropped once it owns no page either)."""
        code = self._code_of.get(owner) if isinstance(owner, Owner) else None
        if code is None or not self._holds[code]:
            raise SlotMisuseError(f"{self._tier_name}: unhold of {owner!r}, which is not held")
        self._holds[code] -= 1
        if not self._holds[code] and not self._count[code]:
            self._drop(code)

    def free(self, slots: np.ndarray, owner: Owner, *, trusted: bool = False, **ctx: Any) -> None:
        """Return pages of ``owner`` to the free stack. Pinned pages always raise.

        ``trusted``: see `assign`."""
        pages = self._trusted_pages(slots) if trusted else self._pages(slots)
        n = len(pages)
        if n:
            code = self._require_owner(pages, owner, "free")
            if self._pinned and np.count_nonzero(pins := self._pins[pages]):
                bad = int(pages[np.flatnonzero(pins)[0]])
                raise PinnedSlotError(
                    f"{self._tier_name}: free of pinned page {bad} (slot {bad * self.page_size}, "
                    f"{int(self._pins[bad])} pins) by {owner}"
                )
            self._codes[pages] = 0
            top = self._top
            self._stack[top : top + n] = pages[::-1]
            self._top = top + n
            self._uncount(code, n)
        t = self._tracer
        if t is not None and t.active:
            t.emit("free", self._tier_name, slots=slots, owner=owner, **ctx)

    def assign(self, slots: np.ndarray, from_owner: Owner, to_owner: Owner, *, trusted: bool = False,
               **ctx: Any) -> None:
        """Hand pages from ``from_owner`` to ``to_owner``. Pins stay with the pages.

        ``trusted``: the caller built ``slots`` only from arrays this ledger's `alloc` returned,
        cut at page boundaries, each page once (the tree actor's own request and node slot
        arrays): the shape, range and duplicate checks are skipped (they cost as much as the
        hand-over itself); the owner check always runs."""
        if not isinstance(to_owner, Owner):
            raise OwnershipError(f"assign needs an Owner to hand over to, got {to_owner!r}")
        pages = self._trusted_pages(slots) if trusted else self._pages(slots)
        n = len(pages)
        if n:
            from_code = self._require_owner(pages, from_owner, "assign")
            to_code = self._code_of.get(to_owner)
            if to_code != from_code:
                if to_code is None:
                    to_code = self._intern(to_owner)
                self._codes[pages] = to_code
                self._count[to_code] += n
                self._uncount(from_code, n)
        t = self._tracer
        if t is not None and t.active:
            t.emit("assign", self._tier_name, slots=slots, owner=from_owner, to=to_owner, **ctx)

    def pin(self, slots: np.ndarray, op_id: int, *, trusted: bool = False, **ctx: Any) -> None:
        """Add one pin (an in-flight copy ``op_id``) to each page; pages must be owned.
        ``trusted``: see `assign`."""
        pages = self._trusted_pages(slots) if trusted else self._pages(slots)
        if len(pages):
            codes = self._codes[pages]
            if np.count_nonzero(codes) != len(codes):
                bad = int(pages[np.flatnonzero(codes == 0)[0]])
                raise OwnershipError(f"{self._tier_name}: pin (op {op_id}) of free page {bad}")
            self._pins[pages] += 1
            self._pinned += len(pages)
        t = self._tracer
        if t is not None and t.active:
            t.emit("pin", self._tier_name, slots=slots, op=op_id, **ctx)

    def unpin(self, slots: np.ndarray, op_id: int, *, trusted: bool = False, **ctx: Any) -> None:
        """Remove one pin from each page; every page must be pinned. ``trusted``: see `assign`."""
        pages = self._trusted_pages(slots) if trusted else self._pages(slots)
        if len(pages):
            pins = self._pins[pages]
            if np.count_nonzero(pins) != len(pins):
                bad = int(pages[np.flatnonzero(pins == 0)[0]])
                raise SlotMisuseError(f"{self._tier_name}: unpin (op {op_id}) of unpinned page {bad}")
            self._pins[pages] = pins - 1
            self._pinned -= len(pages)
        t = self._tracer
        if t is not None and t.active:
            t.emit("unpin", self._tier_name, slots=slots, op=op_id, **ctx)

    # -------------------------------------------------------------------- check

    def check(self) -> None:
        """Recompute everything from the raw arrays; raise `InvariantViolation` on a mismatch.

        O(pool). Uses none of the incremental bookkeeping it verifies.
        """
        n = self.num_pages
        codes = self._codes
        pins = self._pins
        problems: list[str] = []
        if not 0 <= self._top <= n:
            raise InvariantViolation(f"{self._tier_name} ledger: free stack top {self._top} outside [0, {n}]")
        stack = self._stack[: self._top]
        if len(stack) and (stack.min() < 0 or stack.max() >= n):
            problems.append("free stack holds a page index out of range")
        else:
            in_stack = np.bincount(stack, minlength=n) if n else np.zeros(0, dtype=np.int64)
            dup = np.flatnonzero(in_stack > 1)
            if len(dup):
                problems.append(f"free stack holds pages more than once: {dup[:8].tolist()}")
            unowned = codes == 0
            listed = in_stack > 0
            missing = np.flatnonzero(unowned & ~listed)
            if len(missing):
                problems.append(f"unowned pages not on the free stack (leaked): {missing[:8].tolist()}")
            owned_listed = np.flatnonzero(~unowned & listed)
            if len(owned_listed):
                problems.append(f"owned pages on the free stack: {owned_listed[:8].tolist()}")
        if (pins < 0).any():
            problems.append(f"negative pin counts at pages {np.flatnonzero(pins < 0)[:8].tolist()}")
        pinned_free = np.flatnonzero((codes == 0) & (pins != 0))
        if len(pinned_free):
            problems.append(f"free pages pinned: {pinned_free[:8].tolist()}")
        if (codes < 0).any():
            problems.append("negative owner codes")
        # Per-owner counts, recomputed from the per-page codes.
        live, counts = np.unique(codes[codes > 0], return_counts=True)
        actual = dict(zip(live.tolist(), counts.tolist()))
        kept = {c: int(self._count[c]) for c in self._owner_of if self._count[c]}
        if actual != kept:
            problems.append(f"per-owner page counts differ: recomputed {_head(actual)}, kept {_head(kept)}")
        held = {c for c in self._owner_of if self._holds[c]}
        if set(self._owner_of) != set(actual) | held:
            problems.append("owner table does not match the codes in use or held")
        dead = np.ones(len(self._count), dtype=bool)
        dead[list(self._owner_of)] = False
        dead[0] = False
        if self._count[dead].any() or self._holds[dead].any() or (self._holds < 0).any():
            problems.append("page counts or holds kept for codes no owner has")
        if set(self._free_codes) & set(self._owner_of):
            problems.append("a code in use is also free for reuse")
        if len(self._code_of) != len(self._owner_of) or any(
            self._owner_of.get(c) != o for o, c in self._code_of.items()
        ):
            problems.append("owner<->code tables disagree")
        if any(c >= self._next_code or c <= 0 for c in self._owner_of):
            problems.append("owner code outside the issued range")
        if problems:
            raise InvariantViolation(f"{self._tier_name} ledger: " + "; ".join(problems))

    # ---------------------------------------------------------------- internals

    def _intern(self, owner: Owner) -> int:
        code = self._code_of.get(owner)
        if code is None:
            if self._free_codes:
                code = self._free_codes.pop()
            else:
                code = self._next_code
                self._next_code = code + 1
                if code >= len(self._count):
                    grow = len(self._count)
                    self._count = np.concatenate((self._count, np.zeros(grow, dtype=np.int64)))
                    self._holds = np.concatenate((self._holds, np.zeros(grow, dtype=np.int64)))
            self._code_of[owner] = code
            self._owner_of[code] = owner
        return code

    def _uncount(self, code: int, n: int) -> None:
        count = self._count
        count[code] -= n
        if not count[code] and not self._holds[code]:
            self._drop(code)

    def _drop(self, code: int) -> None:
        del self._code_of[self._owner_of.pop(code)]
        self._free_codes.append(code)

    def _require_owner(self, pages: np.ndarray, owner: Owner, what: str) -> int:
        code = self._code_of.get(owner) if isinstance(owner, Owner) else None
        codes = self._codes[pages]
        if code is None or codes.tobytes() != code.to_bytes(8, "little") * len(codes):
            idx = 0 if code is None else int(np.flatnonzero(codes != code)[0])
            bad = int(pages[idx])
            actual = self._owner_of.get(int(codes[idx]))
            raise OwnershipError(
                f"{self._tier_name}: {what} of page {bad} (slot {bad * self.page_size}) by {owner}, "
                f"owned by {actual if actual is not None else 'nobody (free)'}"
            )
        return code

    def _slot_page(self, slot: int) -> int:
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)):
            raise SlotMisuseError(f"slot must be an int, got {slot!r}")
        if not 0 <= slot < self.num_slots:
            raise SlotMisuseError(f"slot {slot} outside [0, {self.num_slots})")
        return int(slot) // self.page_size

    def _expand(self, pages: np.ndarray) -> np.ndarray:
        if self.page_size == 1:
            return pages
        return (pages[:, None] * self.page_size + self._offsets).reshape(-1)

    def _trusted_pages(self, slots: np.ndarray) -> np.ndarray:
        """Page indices of a whole-page slot array built from this ledger's own `alloc` results."""
        if self.page_size == 1:
            return slots
        return self._page_of_slot[slots[:: self.page_size]] if len(slots) else _EMPTY

    def _pages(self, slots: Iterable[int] | np.ndarray, unique: bool = True) -> np.ndarray:
        """Validate page-aligned slot indices; return their page indices (int64, one per page).

        O(len(slots)) with a constant number of numpy calls: the page of each page's first
        slot is gathered from a slot->page table (an index past the pool raises; a negative
        one wraps and is caught by the comparison below), the slots those pages really hold
        are gathered from a page->slots table and compared byte for byte with the input
        (so every slot is checked: aligned, consecutive, in range), and duplicates are found
        by scattering positions into a scratch array and reading them back.
        """
        if type(slots) is not np.ndarray:
            slots = np.asarray(slots)
            if slots.size == 0:
                slots = _EMPTY
        if slots.ndim != 1:
            raise SlotMisuseError(f"slots must be a 1-D array, got shape {slots.shape}")
        k = len(slots)
        if k == 0:
            return _EMPTY
        if slots.dtype is not _I64:
            if slots.dtype.kind not in "iu":
                raise SlotMisuseError(f"slots must be integers, got dtype {slots.dtype}")
            # uint64 values >= 2**63 wrap to negatives and fail the comparison below.
            slots = slots.astype(np.int64)
        ps = self.page_size
        try:
            if ps == 1:
                pages = self._page_of_slot[slots]  # the identity: a gather is cheaper than a reduction
                ok = pages.tobytes() == slots.tobytes()
            else:
                if k % ps:
                    raise SlotMisuseError(f"{k} slots is not a whole number of pages (page_size {ps})")
                pages = self._page_of_slot[slots[::ps]]
                ok = self._page_slots[pages].tobytes() == slots.tobytes()
        except IndexError:
            ok = False
        if not ok:
            if ps == 1 or (slots.min() >= 0 and slots.max() < self.num_slots):
                if ps > 1:
                    raise SlotMisuseError(
                        f"slots are not whole pages (page_size {ps}, each page consecutive and aligned)")
            raise SlotMisuseError(f"slot index outside [0, {self.num_slots})")
        if unique and len(pages) > 1:
            # O(k) duplicate check without a sort: scatter positions, read back; a repeated page
            # reads back a later position.
            if len(pages) > self.num_pages:  # more pages than the pool has: some repeat
                raise SlotMisuseError("the same page appears more than once in one call")
            pos = self._arange[: len(pages)]
            scratch = self._scratch
            scratch[pages] = pos
            if scratch[pages].tobytes() != pos.tobytes():
                raise SlotMisuseError("the same page appears more than once in one call")
        return pages


def _head(d: dict[int, int], limit: int = 8) -> str:
    items = sorted(d.items())
    tail = ", ..." if len(items) > limit else ""
    return "{" + ", ".join(f"{k}: {v}" for k, v in items[:limit]) + tail + "}"

"""Stateful property test of `SlotLedger` against a plain Python model.

After every step: DESIGN invariants 1-3 as far as the ledger holds them (every page free or
owned by exactly one owner, free ∪ owned = all pages; pinned pages are not free; pin counts
equal the model's outstanding pins) plus `ledger.check()`. Misuse rules must raise their
typed error and change nothing.

Checked to be able to fail: with `SlotLedger.free` changed to skip its pin check, the
`free_pinned_raises` rule fails within the default examples (and so does `ledger.check()`
once the freed page stays pinned); with `assign` not moving the per-owner count,
`pages_owned_by` diverges from the model on the first hand-over.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from runtime.errors import CapacityError, OwnershipError, PinnedSlotError, SlotMisuseError
from runtime.memory.ledger import SlotLedger
from runtime.memory.owners import Owner, Tier

OWNERS = [
    Owner.request("a", 0),
    Owner.request("a", 1),  # same rid, next generation: a different owner
    Owner.request("b", 0),
    Owner.node(1),
    Owner.node(2),
    Owner.session("s"),
    Owner.prefetch("a", 0),
]


def slots_of(pages, ps):
    pages = np.asarray(sorted(pages) if isinstance(pages, set) else pages, dtype=np.int64)
    return (pages[:, None] * ps + np.arange(ps, dtype=np.int64)).reshape(-1)


class LedgerMachine(RuleBasedStateMachine):
    @initialize(num_pages=st.integers(0, 24), page_size=st.sampled_from([1, 2, 16]))
    def setup(self, num_pages, page_size):
        self.ps = page_size
        self.n = num_pages
        self.led = SlotLedger(num_pages * page_size, page_size, Tier.DEVICE)
        self.owner = {}  # page -> Owner (absent = free)
        self.pins = Counter()  # page -> outstanding pins
        self.ops: dict[int, list[int]] = {}  # op id -> pinned pages
        self.next_op = 1

    # ---- helpers

    def pages_of(self, owner):
        return sorted(p for p, o in self.owner.items() if o == owner)

    def pick(self, data, pages, min_size=1):
        if not pages:
            return []
        return data.draw(st.lists(st.sampled_from(pages), min_size=min_size, unique=True))

    def rejects(self, error, fn, *args):
        before = self.led.snapshot()
        try:
            fn(*args)
        except error:
            pass
        else:
            raise AssertionError(f"{fn.__name__}{args!r} did not raise {error.__name__}")
        assert self.led.snapshot() == before

    # ---- valid operations

    @rule(owner=st.sampled_from(OWNERS), k=st.integers(0, 6))
    def alloc(self, owner, k):
        free = self.n - len(self.owner)
        if k > free:
            self.rejects(CapacityError, self.led.alloc, k, owner)
            return
        s = self.led.alloc(k, owner)
        assert s.dtype == np.int64 and len(s) == k * self.ps
        pages = (s[:: self.ps] // self.ps).tolist() if k else []
        assert len(set(pages)) == k
        for p in pages:
            assert p not in self.owner, "alloc handed out an owned page"
            assert self.pins[p] == 0
            self.owner[p] = owner

    @rule(data=st.data(), owner=st.sampled_from(OWNERS))
    def free(self, data, owner):
        candidates = [p for p in self.pages_of(owner) if self.pins[p] == 0]
        pages = self.pick(data, candidates, min_size=0)
        self.led.free(slots_of(pages, self.ps), owner)
        for p in pages:
            del self.owner[p]

    @rule(data=st.data(), src=st.sampled_from(OWNERS), dst=st.sampled_from(OWNERS))
    def assign(self, data, src, dst):
        pages = self.pick(data, self.pages_of(src), min_size=0)
        self.led.assign(slots_of(pages, self.ps), src, dst)
        for p in pages:
            self.owner[p] = dst

    @rule(data=st.data())
    def pin(self, data):
        pages = self.pick(data, sorted(self.owner))
        if not pages:
            return
        op = self.next_op
        self.next_op += 1
        self.led.pin(slots_of(pages, self.ps), op)
        self.ops[op] = pages
        for p in pages:
            self.pins[p] += 1

    @precondition(lambda self: self.ops)
    @rule(data=st.data())
    def unpin(self, data):
        op = data.draw(st.sampled_from(sorted(self.ops)))
        pages = self.ops.pop(op)
        self.led.unpin(slots_of(pages, self.ps), op)
        for p in pages:
            self.pins[p] -= 1

    # ---- misuse: must raise and change nothing

    @rule(data=st.data(), owner=st.sampled_from(OWNERS))
    def free_pinned_raises(self, data, owner):
        pinned = [p for p in self.pages_of(owner) if self.pins[p] > 0]
        if not pinned:
            return
        extra = self.pick(data, [p for p in self.pages_of(owner) if p not in pinned], min_size=0)
        pages = self.pick(data, pinned) + extra
        self.rejects(PinnedSlotError, self.led.free, slots_of(pages, self.ps), owner)

    @rule(data=st.data(), owner=st.sampled_from(OWNERS), to=st.sampled_from(OWNERS))
    def foreign_pages_raise(self, data, owner, to):
        foreign = [p for p in range(self.n) if self.owner.get(p) != owner]
        if not foreign:
            return
        mine = self.pick(data, self.pages_of(owner), min_size=0)
        pages = mine + self.pick(data, foreign)
        slots = slots_of(pages, self.ps)
        self.rejects(OwnershipError, self.led.free, slots, owner)
        self.rejects(OwnershipError, self.led.assign, slots, owner, to)

    @rule(data=st.data())
    def pin_free_page_raises(self, data):
        free = [p for p in range(self.n) if p not in self.owner]
        if not free:
            return
        pages = self.pick(data, sorted(self.owner), min_size=0) + self.pick(data, free)
        self.rejects(OwnershipError, self.led.pin, slots_of(pages, self.ps), 999_999)

    @rule(data=st.data())
    def unpin_unpinned_raises(self, data):
        unpinned = [p for p in range(self.n) if self.pins[p] == 0]
        if not unpinned:
            return
        pinned = [p for p in range(self.n) if self.pins[p] > 0]
        pages = self.pick(data, pinned, min_size=0) + self.pick(data, unpinned)
        self.rejects(SlotMisuseError, self.led.unpin, slots_of(pages, self.ps), 999_999)

    @precondition(lambda self: self.owner)
    @rule(data=st.data())
    def duplicate_pages_raise(self, data):
        owner = data.draw(st.sampled_from(sorted(set(self.owner.values()), key=str)))
        pages = self.pages_of(owner)
        p = data.draw(st.sampled_from(pages))
        slots = slots_of(pages + [p], self.ps)
        self.rejects(SlotMisuseError, self.led.free, slots, owner)
        self.rejects(SlotMisuseError, self.led.assign, slots, owner, OWNERS[0])
        self.rejects(SlotMisuseError, self.led.pin, slots, 999_999)

    @precondition(lambda self: self.n > 0 and self.ps > 1)
    @rule(data=st.data())
    def misaligned_raises(self, data):
        start = data.draw(st.integers(1, self.n * self.ps - 1).filter(lambda x: x % self.ps))
        slots = np.arange(start, start + self.ps, dtype=np.int64)
        owner = self.owner.get(start // self.ps, OWNERS[0])
        self.rejects(SlotMisuseError, self.led.free, slots, owner)
        self.rejects(SlotMisuseError, self.led.pin, slots, 999_999)

    # ---- invariants

    @invariant()
    def matches_model(self):
        led = self.led
        snap = led.snapshot()
        owners = snap.page_owners()
        # 1. every page free or owned by exactly one owner (the model's); free ∪ owned = all
        assert owners == [self.owner.get(p) for p in range(self.n)]
        free = set(snap.free_pages.tolist())
        assert len(free) == len(snap.free_pages)
        assert free == set(range(self.n)) - set(self.owner)
        assert led.num_free_pages() == self.n - len(self.owner)
        assert led.num_free_slots() == led.num_free_pages() * self.ps
        # 2. pinned pages are not free
        assert all(p in self.owner for p, c in self.pins.items() if c)
        # 3. pin counts equal the outstanding pins
        assert snap.pins.tolist() == [self.pins[p] for p in range(self.n)]
        for o in OWNERS:
            assert led.pages_owned_by(o) == sum(1 for v in self.owner.values() if v == o)
        # interned owners are exactly the owners holding pages
        assert set(snap.owners.values()) == set(self.owner.values())
        led.check()

    def teardown(self):
        # Quiescence: complete every copy, release everything, the pool is whole again.
        if not hasattr(self, "led"):
            return
        for op, pages in sorted(self.ops.items()):
            self.led.unpin(slots_of(pages, self.ps), op)
        for o in set(self.owner.values()):
            self.led.free(slots_of(self.pages_of(o), self.ps), o)
        assert self.led.num_free_pages() == self.n
        assert self.led.snapshot().owners == {}
        self.led.check()


TestLedgerFast = LedgerMachine.TestCase
TestLedgerFast.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


class LedgerMachineLong(LedgerMachine):
    pass


TestLedgerLong = pytest.mark.slow(LedgerMachineLong.TestCase)
TestLedgerLong.settings = settings(
    max_examples=2000, stateful_step_count=100, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

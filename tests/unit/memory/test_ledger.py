"""Unit tests of `SlotLedger` (runtime/memory/ledger.py).

Every misuse must raise its typed error and leave `snapshot()` unchanged.

These tests were checked to be able to fail: with `free` changed to ignore pins,
`test_free_pinned_raises` and the pinned cases fail; with `_uncount` not dropping codes,
`test_owner_codes_are_dropped` fails; with the duplicate check removed, `test_duplicate_pages`
fails (and `check()` reports the duplicated free-stack entries).
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime.errors import (
    CapacityError,
    InternalError,
    InvariantViolation,
    OwnershipError,
    PinnedSlotError,
    SlotMisuseError,
    ValidationError,
)
from runtime.memory.ledger import LedgerSnapshot, SlotLedger
from runtime.memory.owners import Owner, Tier

PS = 4
R1 = Owner.request("r1", 0)
R2 = Owner.request("r2", 0)
R1_GEN1 = Owner.request("r1", 1)
N1 = Owner.node(1)
N2 = Owner.node(2)


def pages_to_slots(pages, ps=PS):
    pages = np.asarray(pages, dtype=np.int64)
    return (pages[:, None] * ps + np.arange(ps)).reshape(-1)


@pytest.fixture
def led() -> SlotLedger:
    return SlotLedger(num_slots=16 * PS, page_size=PS, tier=Tier.DEVICE)


def assert_rejects(led: SlotLedger, error: type[Exception], fn, *args, **kwargs):
    before = led.snapshot()
    with pytest.raises(error):
        fn(*args, **kwargs)
    assert led.snapshot() == before
    led.check()


class RecordingTracer:
    def __init__(self, active: bool = True) -> None:
        self.active = active
        self.events: list[dict] = []

    def emit(self, event, tier, slots=None, owner=None, **fields):
        self.events.append({"event": event, "tier": tier, "slots": None if slots is None else np.array(slots),
                            "owner": owner, **fields})


# ---------------------------------------------------------------------------- construction


def test_construction(led):
    assert (led.num_slots, led.page_size, led.num_pages, led.tier) == (64, PS, 16, Tier.DEVICE)
    assert led.num_free_pages() == 16
    assert led.num_free_slots() == 64
    led.check()


@pytest.mark.parametrize("num_slots,page_size", [(10, 4), (-4, 4), (16, 0), (16, -1), (16.0, 4)])
def test_construction_rejects(num_slots, page_size):
    with pytest.raises(SlotMisuseError):
        SlotLedger(num_slots, page_size, Tier.HOST)


def test_empty_pool():
    led = SlotLedger(0, 16, Tier.HOST)
    assert led.num_free_pages() == 0
    assert len(led.alloc(0, R1)) == 0
    with pytest.raises(CapacityError):
        led.alloc(1, R1)
    led.check()


# ---------------------------------------------------------------------------- alloc


def test_alloc_returns_whole_pages(led):
    s = led.alloc(3, R1)
    assert s.dtype == np.int64
    assert len(s) == 3 * PS
    grid = s.reshape(-1, PS)
    assert (grid[:, 0] % PS == 0).all()
    assert (grid == grid[:, :1] + np.arange(PS)).all()
    assert led.num_free_pages() == 13
    assert led.num_free_slots() == 13 * PS
    assert led.pages_owned_by(R1) == 3
    assert all(o == R1 for o in led.owners_of(s))
    for slot in s.tolist():
        assert led.owner_of(slot) == R1
        assert led.pin_count(slot) == 0
    led.check()


def test_alloc_zero(led):
    before = led.snapshot()
    s = led.alloc(0, R1)
    assert s.dtype == np.int64 and len(s) == 0
    assert led.snapshot() == before
    assert led.pages_owned_by(R1) == 0


def test_alloc_all_then_capacity(led):
    a = led.alloc(10, R1)
    b = led.alloc(6, R2)
    assert led.num_free_pages() == 0
    assert len(np.intersect1d(a, b)) == 0
    assert_rejects(led, CapacityError, led.alloc, 1, R1)


def test_alloc_capacity_changes_nothing(led):
    led.alloc(5, R1)
    assert_rejects(led, CapacityError, led.alloc, 12, R2)
    assert led.pages_owned_by(R2) == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, None])
def test_alloc_bad_count(led, bad):
    assert_rejects(led, SlotMisuseError, led.alloc, bad, R1)


def test_alloc_bad_owner(led):
    assert_rejects(led, OwnershipError, led.alloc, 1, "r1")
    assert_rejects(led, OwnershipError, led.alloc, 1, None)


def test_alloc_returns_fresh_array(led):
    s = led.alloc(2, R1)
    s[:] = 0  # caller scribbles on its array
    led.check()
    assert led.pages_owned_by(R1) == 2


def test_alloc_is_lifo(led):
    s = led.alloc(2, R1)
    led.free(s, R1)
    assert np.array_equal(led.alloc(2, R2), s)


def test_generations_are_distinct_owners(led):
    a = led.alloc(1, R1)
    b = led.alloc(1, R1_GEN1)
    assert led.pages_owned_by(R1) == 1 and led.pages_owned_by(R1_GEN1) == 1
    assert_rejects(led, OwnershipError, led.free, a, R1_GEN1)
    assert_rejects(led, OwnershipError, led.free, b, R1)


# ---------------------------------------------------------------------------- free


def test_free_roundtrip(led):
    s = led.alloc(4, R1)
    led.free(s[: 2 * PS], R1)
    assert led.pages_owned_by(R1) == 2
    assert led.num_free_pages() == 14
    assert led.owner_of(int(s[0])) is None
    assert led.owner_of(int(s[-1])) == R1
    led.free(s[2 * PS:], R1)
    assert led.num_free_pages() == 16
    assert led.pages_owned_by(R1) == 0
    led.check()


def test_free_non_contiguous_pages(led):
    s = led.alloc(6, R1)
    pick = pages_to_slots([s[0] // PS, s[3 * PS] // PS, s[5 * PS] // PS])
    led.free(pick, R1)
    assert led.pages_owned_by(R1) == 3
    led.check()


def test_free_empty(led):
    led.alloc(1, R1)
    before = led.snapshot()
    led.free(np.empty(0, dtype=np.int64), R1)
    led.free(np.empty(0, dtype=np.int64), R2)  # owner of nothing: empty free is a no-op
    assert led.snapshot() == before


def test_free_wrong_owner(led):
    a = led.alloc(2, R1)
    led.alloc(2, R2)
    assert_rejects(led, OwnershipError, led.free, a, R2)
    assert_rejects(led, OwnershipError, led.free, a, N1)  # unknown owner
    assert_rejects(led, OwnershipError, led.free, a, "r1")  # not an Owner


def test_free_mixed_owners_is_all_or_nothing(led):
    a = led.alloc(2, R1)
    b = led.alloc(2, R2)
    assert_rejects(led, OwnershipError, led.free, np.concatenate([a, b]), R1)


def test_free_of_free_pages(led):
    a = led.alloc(2, R1)
    led.free(a, R1)
    assert_rejects(led, OwnershipError, led.free, a, R1)  # double free
    never = pages_to_slots([15])
    assert_rejects(led, OwnershipError, led.free, never, R1)


def test_free_pinned_raises(led):
    a = led.alloc(3, R1)
    led.pin(a[PS: 2 * PS], op_id=7)
    assert_rejects(led, PinnedSlotError, led.free, a, R1)
    assert_rejects(led, PinnedSlotError, led.free, a[PS: 2 * PS], R1)
    led.free(a[:PS], R1)  # unpinned page of the same owner is fine
    led.unpin(a[PS: 2 * PS], op_id=7)
    led.free(a[PS:], R1)
    assert led.num_free_pages() == 16
    led.check()


def test_free_doubly_pinned_needs_both_unpins(led):
    a = led.alloc(1, R1)
    led.pin(a, 1)
    led.pin(a, 2)
    assert led.pin_count(int(a[0])) == 2
    led.unpin(a, 1)
    assert_rejects(led, PinnedSlotError, led.free, a, R1)
    led.unpin(a, 2)
    led.free(a, R1)
    led.check()


def test_duplicate_pages(led):
    a = led.alloc(3, R1)
    dup = np.concatenate([a, a[:PS]])
    assert_rejects(led, SlotMisuseError, led.free, dup, R1)
    assert_rejects(led, SlotMisuseError, led.assign, dup, R1, N1)
    assert_rejects(led, SlotMisuseError, led.pin, dup, 1)
    led.pin(a, 1)
    assert_rejects(led, SlotMisuseError, led.unpin, dup, 1)


# ---------------------------------------------------------------------------- slot validation


def misaligned_cases():
    return {
        "partial page": np.arange(PS - 1, dtype=np.int64),
        "unaligned start": np.arange(1, PS + 1, dtype=np.int64),
        "non consecutive": np.array([0, 1, 3, 2], dtype=np.int64),
        "out of range": pages_to_slots([16]),
        "negative": np.arange(-PS, 0, dtype=np.int64),
        "2-D": pages_to_slots([0, 1]).reshape(2, PS),
        "float": pages_to_slots([0]).astype(np.float64),
    }


@pytest.mark.parametrize("case", list(misaligned_cases()))
def test_bad_slots_raise_length_error(led, case):
    led.alloc(16, R1)
    led.pin(pages_to_slots([0, 1]), 1)
    bad = misaligned_cases()[case]
    assert_rejects(led, SlotMisuseError, led.free, bad, R1)
    assert_rejects(led, SlotMisuseError, led.assign, bad, R1, N1)
    assert_rejects(led, SlotMisuseError, led.pin, bad, 2)
    assert_rejects(led, SlotMisuseError, led.unpin, bad, 1)
    with pytest.raises(SlotMisuseError):
        led.owners_of(bad)


def test_accepts_lists_and_int32(led):
    a = led.alloc(2, R1)
    led.pin(a.tolist(), 1)
    led.unpin(a.astype(np.int32), 1)
    led.free(a.astype(np.uint32), R1)
    led.check()


@pytest.mark.parametrize("bad", [-1, 64, 1.0, None])
def test_slot_queries_validate(led, bad):
    with pytest.raises(SlotMisuseError):
        led.owner_of(bad)
    with pytest.raises(SlotMisuseError):
        led.pin_count(bad)


# ---------------------------------------------------------------------------- assign


def test_assign_hands_over(led):
    a = led.alloc(4, R1)
    led.assign(a[: 3 * PS], R1, N1, rid="r1", node=1)
    assert led.pages_owned_by(R1) == 1
    assert led.pages_owned_by(N1) == 3
    assert led.owners_of(a) == [N1, N1, N1, R1]
    # node -> node at a split
    led.assign(a[2 * PS: 3 * PS], N1, N2)
    assert led.owners_of(a) == [N1, N1, N2, R1]
    assert_rejects(led, OwnershipError, led.free, a[:PS], R1)
    led.free(a[:2 * PS], N1)
    assert led.pages_owned_by(N1) == 0
    led.check()


def test_assign_keeps_pins(led):
    a = led.alloc(2, R1)
    led.pin(a, 3)
    led.assign(a, R1, N1)
    assert led.pin_count(int(a[0])) == 1 and led.pin_count(int(a[-1])) == 1
    assert_rejects(led, PinnedSlotError, led.free, a, N1)
    led.unpin(a, 3)
    led.free(a, N1)
    led.check()


def test_assign_to_self_is_noop(led):
    a = led.alloc(2, R1)
    before = led.snapshot()
    led.assign(a, R1, R1)
    assert led.snapshot() == before


def test_assign_misuse(led):
    a = led.alloc(2, R1)
    b = led.alloc(2, R2)
    assert_rejects(led, OwnershipError, led.assign, a, R2, N1)  # wrong from
    assert_rejects(led, OwnershipError, led.assign, np.concatenate([a, b]), R1, N1)  # mixed
    assert_rejects(led, OwnershipError, led.assign, pages_to_slots([15]), R1, N1)  # free page
    assert_rejects(led, OwnershipError, led.assign, a, R1, "node")  # to is not an Owner
    assert led.pages_owned_by(N1) == 0


def test_assign_to_existing_owner_merges_counts(led):
    a = led.alloc(2, R1)
    b = led.alloc(3, R2)
    led.assign(a, R1, R2)
    assert led.pages_owned_by(R2) == 5
    led.free(np.concatenate([a, b]), R2)
    assert led.num_free_pages() == 16
    led.check()


# ---------------------------------------------------------------------------- pin / unpin


def test_pin_unpin(led):
    a = led.alloc(2, R1)
    led.pin(a, 1)
    led.pin(a[:PS], 2)
    assert [led.pin_count(int(x)) for x in a[::PS]] == [2, 1]
    assert all(led.pin_count(int(x)) == 2 for x in a[:PS])
    led.unpin(a, 1)
    assert [led.pin_count(int(x)) for x in a[::PS]] == [1, 0]
    led.unpin(a[:PS], 2)
    assert led.snapshot().pins.sum() == 0
    led.check()


def test_pin_free_page_raises(led):
    a = led.alloc(1, R1)
    assert_rejects(led, OwnershipError, led.pin, pages_to_slots([15]), 1)
    assert_rejects(led, OwnershipError, led.pin, np.concatenate([a, pages_to_slots([15])]), 1)


def test_unpin_unpinned_raises(led):
    a = led.alloc(2, R1)
    assert_rejects(led, SlotMisuseError, led.unpin, a, 1)
    led.pin(a[:PS], 1)
    assert_rejects(led, SlotMisuseError, led.unpin, a, 1)  # second page unpinned: all-or-nothing
    assert_rejects(led, SlotMisuseError, led.unpin, pages_to_slots([15]), 1)  # free page


def test_error_types():
    """A shortfall is a ValidationError (the ledger changed nothing; callers refuse with it); every
    other misuse (malformed slots, a page twice, an unpin of an unpinned page, an unhold of an
    owner not held, a slot freed or handed over by a non-owner or while pinned) is the runtime's
    own bug: the ledger's arguments are never a caller's."""
    assert issubclass(CapacityError, ValidationError)
    for e in (OwnershipError, PinnedSlotError, SlotMisuseError):
        assert issubclass(e, InternalError) and not issubclass(e, ValidationError)


# ---------------------------------------------------------------------------- owner bookkeeping


def test_owner_codes_are_dropped(led):
    for i in range(1000):
        owner = Owner.request(f"r{i}", i)
        s = led.alloc(2, owner)
        node = Owner.node(i)
        led.assign(s, owner, node)
        led.free(s, node)
    snap = led.snapshot()
    assert snap.owners == {} and snap.page_counts == {}
    assert len(led._code_of) == 0 and len(led._owner_of) == 0 and not led._count.any() and not led._holds.any()
    led.check()


def test_owned_slots(led):
    a = led.alloc(3, R1)
    led.alloc(2, R2)
    assert np.array_equal(led.owned_slots(R1), np.sort(a))
    assert led.owned_slots(N1).dtype == np.int64 and len(led.owned_slots(N1)) == 0
    assert led.pages_owned_by(N1) == 0


def test_owners_of_per_page(led):
    a = led.alloc(2, R1)
    assert led.owners_of(a) == [R1, R1]
    assert led.owners_of(pages_to_slots([15, 14])) == [None, None]
    assert led.owners_of(np.empty(0, dtype=np.int64)) == []


def test_page_size_one():
    led = SlotLedger(8, 1, Tier.HOST)
    a = led.alloc(3, R1)
    assert a.tolist() == [0, 1, 2]
    led.pin(a[1:2], 1)
    with pytest.raises(PinnedSlotError):
        led.free(a, R1)
    with pytest.raises(SlotMisuseError):
        led.free(np.array([0, 0]), R1)
    led.free(a[[0, 2]], R1)
    led.assign(a[1:2], R1, N1)
    led.unpin(a[1:2], 1)
    led.free(a[1:2], N1)
    assert led.num_free_pages() == 8
    led.check()


# ---------------------------------------------------------------------------- snapshot / check


def test_snapshot_is_a_copy(led):
    a = led.alloc(2, R1)
    snap = led.snapshot()
    assert isinstance(snap, LedgerSnapshot)
    led.pin(a, 1)
    led.free(led.alloc(1, R2), R2)
    assert snap != led.snapshot()
    assert snap.pins.sum() == 0
    assert snap.owner_of_page(int(a[0]) // PS) == R1
    assert snap.page_owners().count(R1) == 2
    assert snap.num_pages == 16


@pytest.mark.parametrize(
    "corrupt",
    [
        "leak",  # an unowned page missing from the free stack
        "dup_stack",  # free stack holds a page twice
        "owned_on_stack",
        "pinned_free",
        "bad_count",
        "stale_code",
        "negative_pin",
    ],
)
def test_check_detects_corruption(led, corrupt):
    a = led.alloc(3, R1)
    led.check()
    page = int(a[0]) // PS
    if corrupt == "leak":
        led._codes[page] = 0
    elif corrupt == "dup_stack":
        led._stack[led._top - 1] = led._stack[led._top - 2]
    elif corrupt == "owned_on_stack":
        led._stack[led._top] = page
        led._top += 1
    elif corrupt == "pinned_free":
        led._pins[led._stack[0]] = 1
    elif corrupt == "bad_count":
        led._count[led._code_of[R1]] += 1
    elif corrupt == "stale_code":
        led._codes[page] = 999
    elif corrupt == "negative_pin":
        led._pins[page] = -1
    with pytest.raises(InvariantViolation):
        led.check()


# ---------------------------------------------------------------------------- tracing


def test_one_event_per_call():
    tr = RecordingTracer()
    led = SlotLedger(64, PS, Tier.HOST, tracer=tr)
    a = led.alloc(3, R1, rid="r1")
    led.pin(a, 11, rid="r1")
    led.assign(a, R1, N1, node=1)
    led.unpin(a, 11)
    led.free(a, N1, node=1)
    names = [e["event"] for e in tr.events]
    assert names == ["alloc", "pin", "assign", "unpin", "free"]
    assert all(e["tier"] == "host" for e in tr.events)
    assert all(np.array_equal(e["slots"], a) for e in tr.events)
    assert tr.events[0]["owner"] == R1 and tr.events[0]["rid"] == "r1"
    assert tr.events[1]["op"] == 11
    assert tr.events[2]["owner"] == R1 and tr.events[2]["to"] == N1 and tr.events[2]["node"] == 1
    assert tr.events[3]["op"] == 11
    assert tr.events[4]["owner"] == N1


def test_no_event_on_error_or_inactive():
    tr = RecordingTracer()
    led = SlotLedger(64, PS, Tier.DEVICE, tracer=tr)
    a = led.alloc(1, R1)
    n = len(tr.events)
    with pytest.raises(OwnershipError):
        led.free(a, R2)
    with pytest.raises(CapacityError):
        led.alloc(100, R1)
    assert len(tr.events) == n
    tr.active = False
    led.free(a, R1)
    assert len(tr.events) == n


def test_real_tracer_writes_page_runs(tmp_path):
    from runtime.trace import SlotTracer

    events: list[dict] = []
    tracer = SlotTracer(PS, sinks=[events.append])
    led = SlotLedger(64, PS, Tier.DEVICE, tracer=tracer)
    a = led.alloc(3, R1, rid="r1")
    led.free(a, R1)
    assert events[0]["event"] == "alloc" and events[0]["pages"] == [[0, 3]]
    assert events[0]["owner"] == str(R1) and events[0]["rid"] == "r1" and events[0]["tier"] == "device"
    assert events[1]["event"] == "free"


# ---------------------------------------------------------------------------- holds (the request table)


def test_a_held_code_outlives_its_pages_and_is_reused_only_after_unhold(led):
    code = led.hold(R1)
    assert led.held_code(R1) == code and led.pages_owned_by(R1) == 0
    s = led.alloc(1, R1)
    led.free(s, R1)
    assert led.held_code(R1) == code  # no page, still held: the code still names R1
    led.check()
    led.unhold(R1)
    assert led.held_code(R1) is None and R1 not in led.snapshot().owners.values()
    assert led.hold(R2) == code  # reused only now
    led.check()


def test_alloc_held_gives_each_code_one_page(led):
    codes = np.array([led.hold(R1), led.hold(R2)], dtype=np.int64)
    slots = led.alloc_held(codes, reason="decode")
    assert len(slots) == 2 * PS
    assert led.owners_of(slots) == [R1, R2]
    assert led.pages_owned_by(R1) == led.pages_owned_by(R2) == 1
    led.check()
    led.unhold(R1)
    assert led.pages_owned_by(R1) == 1  # pages keep the code alive
    led.free(slots[:PS], R1)
    assert led.held_code(R1) is None
    led.check()


@pytest.mark.parametrize("bad", ["not_held", "zero", "past_end", "float"])
def test_alloc_held_refuses_codes_that_are_not_held_and_changes_nothing(led, bad):
    held = led.hold(R1)
    other = led.alloc(1, R2)  # R2 has a code, but it is not held
    assert led.owners_of(other) == [R2]  # R2's code is held + 1
    codes = {"not_held": np.array([held, held + 1], dtype=np.int64),
             "zero": np.array([0], dtype=np.int64),
             "past_end": np.array([10 ** 6], dtype=np.int64),
             "float": np.array([float(held)])}[bad]
    before = led.snapshot()
    with pytest.raises(OwnershipError):
        led.alloc_held(codes)
    assert led.snapshot() == before


def test_alloc_held_beyond_the_free_pages_is_a_capacity_error(led):
    code = led.hold(R1)
    before = led.snapshot()
    with pytest.raises(CapacityError):
        led.alloc_held(np.full(led.num_pages + 1, code, dtype=np.int64))
    assert led.snapshot() == before


def test_unhold_of_an_owner_not_held_raises(led):
    led.alloc(1, R1)
    before = led.snapshot()
    with pytest.raises(SlotMisuseError):
        led.unhold(R1)
    with pytest.raises(SlotMisuseError):
        led.unhold(R2)
    assert led.snapshot() == before

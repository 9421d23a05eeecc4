"""TiersOnlyCore: the host tier for an engine that owns device memory, built with no event loop.

Every test runs the tiers-only invariant checker after each operation (`step`)."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.errors import ArgumentError, InvariantViolation, LengthError, StateError, UnknownRequestError
from runtime.integrations.vllm.invariants import check_tiers_only
from runtime.messages import Direction
from runtime.integrations.vllm.core import TierLoad, TiersOnlyCore


def loaded(ld: TierLoad):
    """(plan, tokens) of a load."""
    return ld.plan, ld.tokens

PS = 4


def core(host_pages: int = 16, blocks: int = 32) -> TiersOnlyCore:
    return TiersOnlyCore(PS, host_pages * PS, blocks)


def toks(n: int, base: int = 0) -> np.ndarray:
    return np.arange(base, base + n, dtype=np.int32)


def step(c: TiersOnlyCore, result=None):
    check_tiers_only(c)
    return result


def state(c: TiersOnlyCore) -> tuple:
    host = c.residency.host
    return (host.snapshot().page_codes.tobytes(), host.snapshot().pins.tobytes(), c.residency.tree.num_nodes,
            dict(c.copies), {r: (set(v.copies), v.finished) for r, v in c.requests.items()})


def backed_up(c: TiersOnlyCore, rid, tokens, blocks, computed=None) -> np.ndarray:
    """Back up `tokens` from `blocks` and ack it; returns the host slots the plan filled."""
    plan = c.backup(rid, tokens, None, len(tokens) if computed is None else computed, blocks)
    step(c)
    assert plan is not None and plan.direction is Direction.BACKUP
    step(c, c.apply_ack(plan.op_id, None))
    step(c, c.finish(rid))
    return plan.transfers[0].dst.numpy()


def test_a_backed_up_prefix_is_a_host_hit_loaded_into_the_new_blocks():
    c = core()
    prompt = toks(13)
    assert step(c, c.lookup(prompt, None, 0).host) == 0
    plan = c.backup("a", prompt, None, 13, [5, 6, 7, 8])
    step(c)
    # whole pages of the computed tokens only: 3 pages from blocks 5, 6, 7
    assert plan.transfers[0].src.tolist() == list(range(20, 32))
    assert c.finish("a") is True  # the engine keeps the blocks while the backup reads them
    assert c.backing_up("a")
    step(c, c.apply_ack(plan.op_id, None))
    assert not c.backing_up("a") and not c.requests
    host = plan.transfers[0].dst.numpy()
    # another request with the same prefix, nothing of it on device: 12 tokens (len - 1 = 13,
    # whole pages: 12); with one device page already: 8 more
    again = toks(14)
    assert c.lookup(again, None, 0).host == 12 and c.lookup(again, None, 4).host == 8
    load, got = loaded(c.load("b", again, None, 4, 8, [9, 10, 11, 12]))
    step(c)
    assert got == 8 and load.direction is Direction.LOAD
    assert load.transfers[0].src.tolist() == host[4:12].tolist()
    assert load.transfers[0].dst.tolist() == list(range(40, 48))
    assert c.loading("b") and c.backup("b", again, None, 12, [9, 10, 11, 12]) is None  # (its blocks wait for KV)
    assert c.finish("b") is True  # finished mid-load (an abort): the engine keeps the blocks it writes
    step(c, c.apply_ack(load.op_id, None))
    check_tiers_only(c, quiescent=True)


def test_a_backup_copies_only_the_pages_the_tier_lacks_and_namespaces_stay_apart():
    c = core()
    backed_up(c, "a", toks(8), [0, 1])
    plan = c.backup("b", toks(16), None, 16, [2, 3, 4, 5])
    step(c)
    assert plan.transfers[0].src.tolist() == list(range(16, 24))  # blocks 4 and 5: pages 3 and 4
    step(c, c.apply_ack(plan.op_id, None))
    assert c.lookup(toks(17), None, 0).host == 16
    assert c.lookup(toks(17), ("tenant", 2), 0).host == 0
    assert c.backup("c", toks(16), None, 16, [6, 7, 8, 9]) is None  # all there already
    step(c, c.finish("b"))
    check_tiers_only(c, quiescent=True)


def test_a_prefix_that_diverges_inside_a_cached_node_splits_it_and_each_half_owns_its_pages():
    """Found driving vLLM's scheduler: without the split hand-over the upper half's host pages
    stayed with the lower node (the checker says so)."""
    c = core()
    backed_up(c, "a", toks(16), [0, 1, 2, 3])
    other = np.concatenate((toks(8), toks(8, base=900)))
    load, got = loaded(c.load("b", np.concatenate((other, [1])), None, 0, 8, [4, 5, 6]))
    step(c)
    assert got == 8
    step(c, c.apply_ack(load.op_id, None))
    plan = c.backup("b", other, None, 16, [4, 5, 6, 7])
    step(c)
    assert plan.transfers[0].src.tolist() == list(range(24, 32))  # only the diverging half
    step(c, c.apply_ack(plan.op_id, None))
    assert c.lookup(np.concatenate((other, [1])), None, 0).host == 16 and c.lookup(toks(17), None, 0).host == 16
    step(c, c.finish("b"))
    check_tiers_only(c, quiescent=True)


def test_a_failed_backup_frees_its_host_pages_and_caches_nothing():
    c = core()
    plan = c.backup("a", toks(8), None, 8, [0, 1])
    free = c.residency.host.num_free_pages()
    step(c, c.apply_ack(plan.op_id, "copy fault"))
    assert c.residency.host.num_free_pages() == free + 2
    assert c.lookup(toks(9), None, 0).host == 0 and c.stats["backup_errors"] == 1
    step(c, c.finish("a"))
    check_tiers_only(c, quiescent=True)


def test_host_room_evicts_unlocked_copies_least_recent_first_never_a_path_being_loaded():
    c = core(host_pages=4)
    backed_up(c, "a", toks(8, base=100), [0, 1])
    backed_up(c, "b", toks(8, base=200), [2, 3])
    load, got = loaded(c.load("r", toks(9, base=100), None, 0, 8, [4, 5, 6]))  # a's pages are being read
    step(c)
    assert got == 8
    # the tier is full: c's backup may only evict b's pages (a's are locked by the load)
    plan = c.backup("c", toks(8, base=300), None, 8, [7, 8])
    step(c)
    assert plan is not None
    assert c.lookup(toks(9, base=200), None, 0).host == 0 and c.lookup(toks(9, base=100), None, 0).host == 8
    # nothing else can go: the next backup is skipped, changing nothing
    before = state(c)
    assert c.backup("d", toks(8, base=400), None, 8, [9, 10]) is None
    assert state(c) == before and c.stats["tokens_backup_skipped"] == 8
    for op in (load.op_id, plan.op_id):
        step(c, c.apply_ack(op, None))
    for rid in ("r", "c"):
        step(c, c.finish(rid))
    check_tiers_only(c, quiescent=True)


def test_a_load_covers_only_what_the_tier_still_holds():
    c = core()
    backed_up(c, "a", toks(8), [0, 1])
    load, got = loaded(c.load("b", toks(17), None, 0, 16, [2, 3, 4, 5, 6]))
    step(c)
    assert got == 8 and load.transfers[0].dst.tolist() == list(range(8, 16))
    step(c, c.apply_ack(load.op_id, "copy fault"))
    assert c.stats["load_errors"] == 1
    assert c.lookup(toks(9), None, 0).host == 8  # a failed load leaves the host copy as it was
    step(c, c.finish("b"))
    check_tiers_only(c, quiescent=True)


@pytest.mark.parametrize("call, error", [
    (lambda c: c.lookup(toks(9), None, 3).host, LengthError),  # not whole pages
    (lambda c: c.lookup(np.zeros((2, 2), np.int32), None, 0).host, LengthError),  # (the façade's token check)
    (lambda c: c.lookup([-1, 2], None, 0).host, ArgumentError),
    (lambda c: c.load("x", toks(9), None, 0, 12, [0, 1, 2]), LengthError),  # past len - 1
    (lambda c: c.load("x", toks(9), None, 0, 8, [0]), ArgumentError),  # too few blocks
    (lambda c: c.load("x", toks(9), None, 0, 8, [0, 99]), ArgumentError),  # block past the engine's
    (lambda c: c.load("x", toks(9), None, 0, 8, ["a", "b"]), ArgumentError),
    (lambda c: c.backup("x", toks(8), None, 9, [0, 1]), LengthError),
    (lambda c: c.backup("x", toks(8), None, 8, [0, -1]), ArgumentError),
    (lambda c: c.backup("done", toks(16, base=50), None, 16, [0, 1, 2, 3]), StateError),  # finished
    (lambda c: c.apply_ack(12345, None), UnknownRequestError),
])
def test_bad_input_is_a_typed_error_that_changes_nothing(call, error):
    c = core()
    backed_up(c, "a", toks(8), [0, 1])
    plan = c.backup("done", toks(8, base=50), None, 8, [2, 3])
    c.finish("done")  # finished with its backup in flight: no new copy may start for it
    before = state(c)
    with pytest.raises(error):
        call(c)
    assert state(c) == before
    step(c, c.apply_ack(plan.op_id, None))
    check_tiers_only(c, quiescent=True)


def test_the_checker_catches_a_backup_page_freed_under_its_copy():
    """The checker is not vacuous: a backup's destination page handed back to the free list
    while the copy runs (the seed 000 class, host side) is caught."""
    c = core()
    plan = c.backup("a", toks(8), None, 8, [0, 1])
    op = c.copies[plan.op_id]
    host = c.residency.host
    host._pins[op.host[0] // PS] = 0  # what an unpin-and-free under the copy leaves behind
    host._pinned -= 1
    host.free(op.host[:PS], op.owner)
    with pytest.raises(InvariantViolation, match="pins|owned"):
        check_tiers_only(c)


def test_a_held_hit_is_cut_to_the_host_room_and_released_on_every_path():
    """`reserve` holds the host path and pages for the storage part; what no room can be had
    for is cut and counted; `release`, `finish` and `load` each end the hold, and a held hit
    loads in full even when backups that evict come between the report and the load."""
    from runtime.storage.hashing import KVIdentity

    c = core(host_pages=6)
    stored: set[bytes] = set()
    c.enable_storage(KVIdentity("m", "0", "float32", 2, 2, 8, "test"),
                     lambda keys: next((i for i, k in enumerate(keys) if k not in stored), len(keys)))
    prompt = toks(33)  # 8 whole pages before the last token
    stored.update(c.page_keys(prompt, None))
    backed_up(c, "a", toks(8), [0, 1])  # 2 host pages of the prompt's first 8 tokens
    hit = step(c, c.reserve("r", prompt, None, 0))
    # host 2 pages + storage: 4 free pages of the 6, the prompt's own 2 locked: 6 pages wanted, 4 had
    assert (hit.host, hit.storage) == (8, 16) and c.stats["hits_cut"] == 1 and c.stats["tokens_hit_cut"] == 8
    assert c.counts()["host_pages_held"] == 4 and c.residency.host.num_free_pages() == 0
    c.release("r")
    step(c)
    assert c.counts()["host_pages_held"] == 0 and c.residency.host.num_free_pages() == 4
    hit = step(c, c.reserve("r", prompt, None, 0))
    # another request's backup wants host room: nothing held is evicted for it
    assert c.backup("b", toks(8, base=500), None, 8, [8, 9]) is None
    ld = step(c, c.load("r", prompt, None, 0, hit.total, list(range(10, 19))))
    assert ld.tokens == hit.total and not c.holds
    assert c.reserve("z", toks(9, base=700), None, 0).total == 0 and not c.holds  # (a miss holds nothing)
    step(c, c.reserve("f", prompt, None, 0))
    c.finish("f")  # (aborted while waiting: its hold goes with it)
    step(c)
    assert "f" not in c.holds


def test_a_lookup_asks_storage_only_from_the_last_page_known_stored_and_heals():
    """With a backend that evicts a chain's tail first, a lookup asks for the last of the leading
    pages known stored and the pages after it; when that page is gone (the directory wiped),
    nothing known is trusted and every page is asked for. (Checked against a variant that counts
    the last known page as found whatever storage answers: the wiped lookup then reports 24 tokens.)"""
    from runtime.storage.hashing import KVIdentity

    c = core()
    stored: set[bytes] = set()
    asked: list[list[bytes]] = []

    def exists(keys: list[bytes]) -> int:
        asked.append(list(keys))
        return next((i for i, k in enumerate(keys) if k not in stored), len(keys))

    c.enable_storage(KVIdentity("m", "0", "float32", 2, 2, 8, "test"), exists, evicts_tails_first=True)
    prompt = toks(33)  # 8 whole pages before the last token
    keys = c.page_keys(prompt, None)
    stored.update(keys[:7])
    c.storage.known.update(keys[:6])  # (as the acks of its writes leave it)
    assert c.lookup(prompt, None, 0).storage == 28 and asked == [keys[5:]]
    stored.clear()
    asked.clear()
    assert c.lookup(prompt, None, 0).total == 0 and asked == [keys[5:], keys] and not c.storage.known
    assert c.lookup(prompt, None, 0).total == 0 and asked[-1] == keys

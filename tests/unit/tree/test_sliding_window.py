"""The sliding-window rule on the loop-free core (docs/ARCHITECTURE.md, "Pool groups").

Sliding layers keep K/V in a pool of their own (`swa_tokens`), addressed through the full slots
(`SwaSlots.map`). A node's leading pages outside its end's window (`limit`: those ending at or
before end - W + 1) may give back their sliding page when that pool is short, before any whole
node is evicted; a match is cut back to the deepest page boundary whose window [e-W+1, e) has
every sliding page. The invariant checker (map and holders agree, drops a prefix of each node,
no live request's window dropped) runs after every step.

Here W = 6 and pages of 4 tokens: a node of n tokens may drop its first (n - 5) // 4 pages.
Broken variants checked by hand: `limit` one page larger (drops inside the window) fails
`test_a_running_requests_window_is_never_dropped` (the checker: "request 'b' (committed 32) reads
positions 24..27 in its sliding window, whose sliding KV was dropped"), and `usable_end`
returning `look.device_len` (no cut) fails `test_a_match_is_cut_back_to_a_present_window` ("request
'c' (committed 20) reads positions 12..15 in its sliding window, whose sliding KV was dropped").
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime.config import RuntimeConfig
from runtime.errors import CapacityError, ConfigError, InvariantViolation, LengthError
from runtime.invariants import check_invariants
from runtime.tree.cache import CacheCore
from runtime.tree.groups.sliding import SlidingWindow
from tests.tokens import toks

PS, W = 4, 6


def make_core(**changes) -> CacheCore:
    base = dict(num_layers=3, num_kv_heads=1, head_dim=2, page_size=PS, device_slots=128, host_tokens=0,
                sliding_layers="0,2", sliding_window=W, swa_tokens=48)
    base.update(changes)
    return CacheCore(RuntimeConfig(**base))


def run(core: CacheCore, rid: str, tokens: np.ndarray):
    res = core.admit(rid, tokens)
    check_invariants(core)
    core.finish(rid, tokens)
    check_invariants(core)
    return res


def dropped(core: CacheCore, tokens: np.ndarray) -> list[bool]:
    """Per page of the cached `tokens`: whether its sliding page was dropped."""
    look = core.residency.tree.match(tokens, None, split=False, touch=False)
    slots = np.concatenate([n.device for n in look.nodes])[: look.device_len]
    return (core.residency.group(SlidingWindow).swa.map[slots[::PS]] < 0).tolist()


@pytest.mark.parametrize("changes, field", [
    (dict(sliding_layers="0,x"), "sliding_layers"),
    (dict(sliding_layers="0,0"), "sliding_layers"),
    (dict(sliding_layers="3"), "sliding_layers"),
    (dict(sliding_layers="0,1,2"), "sliding_layers"),  # no full layer left
    (dict(sliding_window=0), "sliding_window"),
    (dict(swa_tokens=6), "swa_tokens"),
    (dict(host_tokens=64, storage_backend="file", storage_dir="/nonexistent"), "storage tier"),
    (dict(host_tokens=64, decode_offload=True), "decode offload"),
    (dict(sliding_layers="", swa_tokens=None), "sliding_window"),
    (dict(sliding_layers=(0, "2")), "sliding_layers"),
])
def test_config_names_the_bad_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        make_core(**changes)


def test_no_sliding_layers_keeps_the_plain_ledger():
    core = CacheCore(RuntimeConfig(num_layers=2, num_kv_heads=1, head_dim=2, page_size=PS, device_slots=64,
                                   host_tokens=0))
    assert not any(isinstance(g, SlidingWindow) for g in core.residency.groups) and type(core.residency.device).__name__ == "SlotLedger"
    assert RuntimeConfig(sliding_layers="1", sliding_window=4, host_tokens=0).swa_slots == 4096
    config = RuntimeConfig(num_layers=4, sliding_layers=(3, 0, 1), sliding_window=4, host_tokens=0)
    assert config.sliding_layers == "3,0,1" and config.sliding_layer_set == (0, 1, 3)
    assert RuntimeConfig.from_dict(config.to_dict()) == config
    assert RuntimeConfig.from_env({"HICACHE_SLIDING_LAYERS": "0,1", "HICACHE_SLIDING_WINDOW": "8",
                                   "HICACHE_HOST_TOKENS": "0", "HICACHE_NUM_LAYERS": "3"}).sliding_layer_set == (0, 1)


def test_every_allocated_page_gets_a_sliding_page_and_gives_it_back():
    core = make_core()
    swa = core.residency.group(SlidingWindow).swa
    res = core.admit("a", toks(30, 1))
    assert swa.num_free_pages() == 12 - 8 and (swa.map[res.slots.numpy()] >= 0).all()
    core.abort("a")
    check_invariants(core)
    assert swa.num_free_pages() == 12 and (swa.map == -1).all()


def test_sliding_pages_drop_outside_every_window_before_any_node_is_evicted():
    core = make_core()
    a = toks(32, 1)
    run(core, "a", a)  # a node of 32 tokens: its first (32 - 5) // 4 = 6 pages may drop
    assert core.residency.group(SlidingWindow).swa.num_free_pages() == 12 - 8
    run(core, "b", toks(28, 2))  # 7 pages: 3 sliding pages short
    stats = core.stats
    assert stats["swa_pages_dropped"] == 3 and stats["device_evicted_tokens"] == 0
    assert dropped(core, a) == [True] * 3 + [False] * 5  # a prefix, the oldest node first
    assert core.match_prefix(a)["device"] == 32  # its end's window [27, 32) is all there


def test_a_match_is_cut_back_to_a_present_window():
    core = make_core()
    a = toks(32, 1)
    run(core, "a", a)
    run(core, "b", toks(28, 2))  # drops pages 0..2 of a
    # e = 16 needs [11, 16): pages 2, 3 (page 2 dropped); e = 20 needs pages 3, 4: present
    assert core.match_prefix(a[:18])["device"] == 0
    assert core.match_prefix(a[:21])["device"] == 20
    with pytest.raises(CapacityError):  # a hit at 16, cut; 25 pages: refused
        core.admit("big", np.concatenate([a[:16], toks(84, 9)]))
    assert core.stats["swa_cut_backs"] == 0  # questions and refused admits are not counted
    res = run(core, "c", np.concatenate([a[:16], toks(8, 3)]))  # diverges at 16: a split there
    assert res.cached == 0 and core.stats["swa_cut_backs"] == 1 and core.stats["swa_cut_tokens"] == 16
    # c's pages came from a's lower half (split at 16: pages 4, 5 drop) and b: a's end still matches
    assert core.match_prefix(a)["device"] == 32 and core.match_prefix(a[:24])["device"] == 0


def test_a_split_makes_a_node_end_whose_dropped_window_is_cut():
    core = make_core(swa_tokens=44)
    a = toks(40, 1)
    run(core, "a", a)  # 10 pages; may drop its first 8
    run(core, "b", toks(24, 2))  # 6 pages, 1 free: pages 0..4 of a drop
    assert dropped(core, a)[:6] == [True] * 5 + [False]
    res = run(core, "c", np.concatenate([a[:20], toks(8, 3)]))  # hits 20 ([15, 20): pages 3, 4): cut
    assert res.cached == 0
    # the split at 20 made it a node end: its lower half [20, 40) keeps its own window
    nodes = core.residency.tree.match(a, None, split=False, touch=False).nodes
    assert [n.num_tokens for n in nodes][:2] == [20, 20]
    assert core.match_prefix(a)["device"] == 40 and core.match_prefix(a[:21])["device"] == 0


def test_whole_nodes_go_once_nothing_more_can_drop():
    core = make_core(swa_tokens=32)
    a = toks(24, 1)
    run(core, "a", a)  # 6 pages, first 4 droppable
    assert core.can_admit(toks(24, 2))  # 2 free + 4 droppable
    run(core, "b", toks(24, 2))
    assert core.stats["swa_pages_dropped"] == 4 and core.stats["device_evicted_tokens"] == 0
    assert core.can_admit(toks(32, 3))  # a's and b's rest by evicting a (LRU), then b
    run(core, "c", toks(32, 3))
    assert core.stats["device_evicted_tokens"] > 0
    assert core.match_prefix(a)["device"] == 0


def test_can_admit_and_admit_agree_under_sliding_pressure():
    core = make_core(swa_tokens=32)  # 8 sliding pages
    a = toks(24, 1)
    run(core, "a", a)  # 6 pages, first 4 droppable
    core.admit("b", toks(24, 2))  # 6 pages: 2 free + a's 4 dropped
    check_invariants(core)
    # nothing free or droppable; evicting a (unlocked) gives back its 2 kept pages
    assert not core.can_admit(toks(16, 3))
    with pytest.raises(CapacityError):
        core.admit("c", toks(16, 3))
    check_invariants(core)
    assert core.match_prefix(a)["device"] == 24  # nothing changed
    assert core.can_admit(toks(8, 4))
    core.admit("d", toks(8, 4))
    check_invariants(core)
    assert core.match_prefix(a)["device"] == 0 and core.stats["device_evicted_tokens"] == 24


def test_a_running_requests_window_is_never_dropped():
    core = make_core(swa_tokens=48)
    a = toks(32, 1)
    run(core, "a", a)
    b = core.admit("b", np.concatenate([a, toks(4, 2)]))  # hits 32, locks a's node: reads [27, 36)
    assert b.cached == 32
    check_invariants(core)
    # 12 - 8 (a) - 1 (b's own) = 3 free; 9 pages for c: all 6 droppable pages of a go
    core.admit("c", toks(36, 3))
    check_invariants(core)
    assert dropped(core, a) == [True] * 6 + [False] * 2
    # nothing free, nothing droppable, a locked: a page more would be b's window
    with pytest.raises(CapacityError):
        core.admit("d", toks(4, 4))
    check_invariants(core)
    assert "d" not in core.requests and dropped(core, a) == [True] * 6 + [False] * 2
    assert not core.can_admit(toks(4, 4))
    core.finish("b", np.concatenate([a, toks(4, 2)]))
    check_invariants(core)


def test_decode_steps_take_sliding_pages_and_drop_for_them():
    core = make_core(swa_tokens=40)
    run(core, "a", toks(32, 1))  # 8 pages, 6 droppable
    core.admit("b", toks(7, 2))  # 2 pages
    core.commit("b", 7)
    for _ in range(12):
        core.decode_step(("b",))
        check_invariants(core)
    assert core.stats["swa_pages_dropped"] > 0 and core.stats["device_evicted_tokens"] == 0


def test_the_checker_flags_a_drop_inside_a_running_window():
    core = make_core()
    a = toks(32, 1)
    run(core, "a", a)
    core.admit("b", np.concatenate([a, toks(4, 2)]))
    node = core.residency.tree.match(a, None, split=False, touch=False).nodes[-1]
    core.residency.group(SlidingWindow).swa.give_back(node.device[: 7 * PS: PS] // PS)  # page 6 holds 24..27
    with pytest.raises(InvariantViolation, match=r"request 'b' \(committed 32\) reads positions 24\.\.27"):
        check_invariants(core)


def test_the_checker_flags_drops_that_are_not_a_prefix_and_a_broken_map():
    core = make_core()
    a = toks(32, 1)
    run(core, "a", a)
    node = core.residency.tree.match(a, None, split=False, touch=False).nodes[-1]
    swa = core.residency.group(SlidingWindow).swa
    swa.give_back(node.device[PS: 2 * PS: PS] // PS)  # page 1 without page 0
    with pytest.raises(InvariantViolation, match="not a prefix"):
        check_invariants(core)
    swa.give_back(node.device[:1] // PS)
    check_invariants(core)
    swa.holder[np.flatnonzero(swa.holder >= 0)[0]] += 1
    with pytest.raises(InvariantViolation, match="swa"):
        check_invariants(core)


def take_plans(core: CacheCore):
    return [plan for plan, _ in core.take_effects().copies]


def ack(core: CacheCore) -> None:
    for op_id in sorted(core.copies.ops):
        if op_id in core.copies.ops:  # (a batch's backups are acked with its first)
            core.apply_ack(op_id, None)
            check_invariants(core)


def test_host_copies_keep_what_the_device_had_and_loads_bring_it_back():
    """Write-back: a and b drop sliding pages under pressure, then go to host (their backups copy
    the sliding rows of the pages that have them); a load of a brings back exactly those, its
    other pages stay without, and a hit through host is cut like a device one."""
    core = make_core(host_tokens=128, write_policy="write_back")
    sliding = core.residency.group(SlidingWindow)
    a, b = toks(32, 1), toks(28, 2)
    run(core, "a", a)
    run(core, "b", b)  # drops a's pages 0..2
    with pytest.raises(CapacityError):  # 10 pages: every droppable page, then a and b must go to host first
        core.admit("c", toks(40, 3))
    check_invariants(core)
    (plan,) = take_plans(core)  # both backups, one batch
    assert sliding.stats["swa_pages_dropped"] == 3 + 3 + 5
    # kv: every page of a (32) then b (28); swa: the last two pages of each only (6 and 5 dropped)
    kv, swa = plan.transfers
    assert (kv.pool, swa.pool) == ("kv", "swa") and len(kv.src) == 60 and len(swa.src) == 4 * PS
    kv_dst = kv.dst.numpy()
    assert (swa.dst.numpy() == np.concatenate((kv_dst[6 * PS: 8 * PS], kv_dst[-2 * PS:]))).all()
    ack(core)
    assert sorted(sliding.host_missing.values()) == [5, 6]
    core.admit("c", toks(40, 3))
    core.abort("c")
    check_invariants(core)
    assert core.match_prefix(a) == {"device": 0, "host": 32}
    assert core.match_prefix(a[:25]) == {"device": 0, "host": 0}  # [19, 24): pages 4, 5 have none
    res = core.admit("a2", np.concatenate([a, toks(4, 4)]))
    assert (res.cached_device, res.loaded_host) == (0, 32)
    (plan,) = take_plans(core)
    kv, swa = plan.transfers
    assert len(swa.src) == 2 * PS and (swa.src.numpy() == kv.src.numpy()[-2 * PS:]).all()
    assert (swa.dst.numpy() == sliding.swa.map[kv.dst.numpy()[-2 * PS:]]).all()
    assert dropped(core, a) == [True] * 6 + [False] * 2
    check_invariants(core)
    ack(core)
    core.abort("a2")
    check_invariants(core, quiescent=True)


def test_a_split_host_copy_hands_its_missing_prefix_to_the_upper_half():
    core = make_core(host_tokens=128, write_policy="write_back")
    a = toks(32, 1)
    run(core, "a", a)
    run(core, "b", toks(28, 2))
    with pytest.raises(CapacityError):
        core.admit("c", toks(40, 3))
    ack(core)
    core.admit("c", toks(40, 3))
    core.abort("c")
    run(core, "d", np.concatenate([a[:12], toks(8, 5)]))  # splits a's host copy at 12: 3 pages up, 5 below
    missing = {node.num_tokens: k for node, k in core.residency.group(SlidingWindow).host_missing.items()}
    assert missing[12] == 3 and missing[20] == 3


def test_the_checker_flags_a_missing_prefix_without_a_host_copy():
    core = make_core(host_tokens=128, write_policy="write_back")
    a = toks(32, 1)
    run(core, "a", a)
    node = core.residency.tree.match(a, None, split=False, touch=False).nodes[-1]
    core.residency.group(SlidingWindow).host_missing[node] = 2
    with pytest.raises(InvariantViolation, match="host pages without sliding KV"):
        check_invariants(core)


def test_a_request_whose_load_failed_is_not_held_to_its_window():
    """API fuzzer, seed 1 episode 178 (tests/fuzz/test_findings.py): a load that fails rolls its
    request's hit back (the loaded pages freed, their sliding pages with them); the request stays
    live, reading nothing, until released. The checker held its window to have sliding KV and,
    run by the tree actor after the ack, failed the runtime."""
    core = make_core(host_tokens=128, write_policy="write_back")
    a = toks(32, 1)
    run(core, "a", a)
    run(core, "b", toks(28, 2))
    with pytest.raises(CapacityError):  # a and b go to host
        core.admit("c", toks(40, 3))
    ack(core)
    core.admit("c", toks(40, 3))
    core.abort("c")
    res = core.admit("a2", np.concatenate([a, toks(4, 4)]))
    assert (res.cached_device, res.loaded_host) == (0, 32)
    (op_id,) = core.copies.ops
    core.apply_ack(op_id, "injected copy fault")
    rec = core.requests["a2"]
    window = rec.slot_range(32 - W + 1, 32)
    assert rec.failed is not None and (core.residency.group(SlidingWindow).swa.map[window] < 0).all()
    check_invariants(core)
    core.abort("a2")
    check_invariants(core, quiescent=True)


# -- a running request's own pages -----------------------------------------------------------

def decode_to(core: CacheCore, rid: str, length: int) -> None:
    """Decode steps until `rid` holds `length` tokens, the invariants checked after each."""
    while core.requests[rid].seq_len < length:
        core.decode_step((rid,))
        check_invariants(core)


def own_dropped(core: CacheCore, rid: str) -> list[bool]:
    """Per page of the request's own pages: whether its sliding page was dropped."""
    rec = core.requests[rid]
    return (core.residency.group(SlidingWindow).swa.map[rec.slot_range(rec.cached_len, rec.num_slots)[::PS]] < 0).tolist()


def test_a_request_longer_than_the_sliding_pool_decodes_to_the_end():
    # without its own pages dropping (the rule before a running request gave its pages back) the 7th page finds no sliding page
    before = make_core(swa_tokens=24)
    before.residency.group(SlidingWindow).requests = {}  # its running requests drop nothing
    before.admit("a", toks(8, 1))
    with pytest.raises(CapacityError, match="decode step needs 1 device pages"):
        decode_to(before, "a", 60)
    assert before.requests["a"].seq_len == 24

    core = make_core(swa_tokens=24)  # 6 sliding pages, 15 pages of its own
    core.admit("a", toks(8, 1))
    for length in range(9, 61):
        decode_to(core, "a", length)
        rec = core.requests["a"]
        flags = own_dropped(core, "a")
        k = flags.count(True)
        # a leading run, every dropped page outside the window read from committed_len - W + 1 on,
        # and only as many as the pool was short of
        assert flags == [True] * k + [False] * (len(flags) - k)
        assert k * PS <= max(0, rec.committed_len - W + 1)
        assert len(flags) - k == min(len(flags), 6)
    assert core.stats["swa_pages_dropped"] == 9 and core.stats["device_evicted_tokens"] == 0


def test_a_finished_long_request_gives_a_node_whose_matches_are_cut():
    core = make_core(swa_tokens=24)
    a = toks(8, 1)
    core.admit("a", a)
    decode_to(core, "a", 60)
    tokens = np.concatenate([a, toks(52, 2)])
    assert core.finish("a", tokens) == 60
    check_invariants(core, quiescent=True)
    assert dropped(core, tokens) == [True] * 9 + [False] * 6
    # its end's window [55, 60) kept: a full hit; an end inside the dropped pages: cut to 0
    assert core.match_prefix(np.concatenate([tokens, toks(4, 3)]))["device"] == 60
    assert core.match_prefix(np.concatenate([tokens[:20], toks(4, 3)]))["device"] == 0
    res = core.admit("b", np.concatenate([tokens[:44], toks(4, 3)]))  # 44's window [39, 44): pages 9, 10
    check_invariants(core)
    assert res.cached_device == 44 and core.stats["swa_cut_backs"] == 0


def test_a_cache_mid_decode_starts_a_node_where_its_dropped_pages_start():
    """A request's own leaf grows in place at a cache, unless its own pages dropped sliding KV: the
    merged node would hold dropped pages after present ones (the checker: "not a prefix")."""
    core = make_core(swa_tokens=24)
    a = toks(8, 1)
    core.admit("a", a)
    tokens = np.concatenate([a, toks(52, 2)])
    decode_to(core, "a", 30)
    core.cache("a", tokens[:29])
    check_invariants(core)
    decode_to(core, "a", 56)
    assert own_dropped(core, "a")[:2] == [True, True]
    core.cache("a", tokens[:55])
    check_invariants(core)
    decode_to(core, "a", 60)
    core.finish("a", tokens)
    check_invariants(core, quiescent=True)
    # [0, 28) at the first cache; [28, 52) at the second, grown in place to 60 at the finish
    nodes = core.residency.tree.match(tokens, None, split=False, touch=False).nodes
    assert [n.num_tokens for n in nodes] == [28, 32]
    assert core.match_prefix(tokens)["device"] == 60


def test_a_rewind_into_a_dropped_window_is_refused():
    core = make_core(swa_tokens=24)
    a = toks(8, 1)
    core.admit("a", a)
    decode_to(core, "a", 60)  # committed 59: pages 0..8 (positions 0..35) dropped
    with pytest.raises(LengthError, match="rewind to at least 41"):
        core.rewind("a", 40)
    rec = core.requests["a"]
    assert (rec.seq_len, rec.committed_len) == (60, 59)
    check_invariants(core)
    assert core.rewind("a", 41) == 41
    check_invariants(core)
    decode_to(core, "a", 48)
    core.finish("a", np.concatenate([a, toks(40, 2)]))
    check_invariants(core, quiescent=True)

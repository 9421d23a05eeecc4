"""The load-cost model at the admission (`reuse_cost="measured"`): a host hit loads only where
loading it beats recomputing it, by the load times the core measures and the prefills reported.
Built by hand, like tests/unit/tree/test_cache_core.py; the invariant checker runs after each step.

Checked to fail: with the cut in `Residency.usable_match` removed, `test_a_fast_prefill_recomputes_a_host_hit`
fails (the hit loads: loaded_host 16, not 0)."""

from __future__ import annotations

import numpy as np

from runtime.errors import CapacityError
from runtime.invariants import check_invariants
from runtime.messages import Direction
from tests.tokens import toks
from tests.unit.tree.test_cache_core import ack_all, cached_host_only, make_core


def _host_hit(**changes):
    core = make_core(**changes)
    p = toks(16, 1)
    cached_host_only(core, p)
    return core, np.concatenate((p, toks(5, 2)))


def test_the_default_loads_every_host_hit():
    core, prompt = _host_hit()
    for _ in range(20):
        core.observe_prefill(1_000_000, 1e-3)  # a prefill a thousand times faster than any load
    res = core.admit("r", prompt)
    assert res.loaded_host == 16
    assert core.stats["tokens_host_hit_recomputed"] == 0
    check_invariants(core)


def test_a_fast_prefill_recomputes_a_host_hit():
    core, prompt = _host_hit(reuse_cost="measured")
    for n in (16, 32, 64, 128, 256, 512, 1024, 2048):
        core.observe_prefill(n, n * 1e-9)  # ~1e9 tokens/s: recomputing 16 tokens costs nothing
    res = core.admit("r", prompt)
    assert (res.cached_device, res.loaded_host) == (0, 0)
    assert core.stats["tokens_host_hit_recomputed"] == 16
    assert not core.copies.ops  # no load was issued
    check_invariants(core)
    core.finish("r", prompt[:-1])
    check_invariants(core)


def test_a_refused_admission_counts_no_recomputed_hit():
    """(Counting at the look, as first written, counted the refused admission's cut too: 32, not 16.)"""
    core, prompt = _host_hit(reuse_cost="measured")
    for n in (16, 32, 64, 128, 256, 512, 1024, 2048):
        core.observe_prefill(n, n * 1e-9)
    av = core.available()
    core.admit("hog", toks(av["device_free"] + av["device_evictable"] - 16, 77))  # leaves too little room
    try:
        core.admit("r", prompt)
    except CapacityError:
        pass
    else:
        raise AssertionError("the admission should have been refused")
    assert core.stats["tokens_host_hit_recomputed"] == 0  # only an admitted request's cut counts
    core.abort("hog")
    core.admit("r", prompt)
    assert core.stats["tokens_host_hit_recomputed"] == 16
    check_invariants(core)


def test_a_slow_prefill_loads_and_the_load_is_measured():
    core, prompt = _host_hit(reuse_cost="measured")
    for n in (16, 32, 64, 128, 256, 512, 1024, 2048):
        core.observe_prefill(n, n * 1e-2)  # 100 tokens/s: any load wins
    res = core.admit("r", prompt)
    assert res.loaded_host == 16 and core.stats["tokens_host_hit_recomputed"] == 0
    before = core.residency.reuse.stats()["host_load_samples"]
    ack_all(core, Direction.LOAD)
    assert core.residency.reuse.stats()["host_load_samples"] == before + 1
    check_invariants(core)

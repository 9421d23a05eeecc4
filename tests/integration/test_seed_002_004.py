"""Regression scenarios for seed 002 (split during write-through) and seed 004 (host-leaf rule).

Each scenario also runs against a deliberately broken variant and must fail there; those
checks stay in the suite so the scenario can never silently stop catching the bug.
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime import CapacityError, RuntimeFailed
from runtime.errors import InvariantViolation
from runtime.fingerprint import fingerprint_kv, mismatches, prefix_hashes
from runtime.runtime import CacheRuntime
from runtime.tree.radix import RadixTree
from tests.integration.support import compute, fake_runtime, settle, small_config, toks, until


# -- seed 002 ------------------------------------------------------------------------------


async def _split_during_backup(rt, engine) -> dict:
    """A inserts 40 tokens and its backup is held in flight; B shares 16 of them and splits
    the node; then the backup completes."""
    a = toks(41, 1)
    res = await rt.admit("a", a)
    compute(rt, res.slots, a)
    await rt.finish("a", a[:40])
    await until(lambda: len(engine.pending()) == 1)
    op_id = engine.pending()[0]
    b = np.concatenate((a[:16], toks(20, 2)))
    res_b = await rt.admit("b", b)
    assert res_b.cached_device == 16  # the node was split at 16 while its backup is in flight
    engine.release(op_id)
    await settle(rt)
    compute(rt, res_b.slots, b, start=16)
    await rt.finish("b", b)
    return await rt.inspect(lambda core: [
        (n.num_tokens, None if n.host is None else n.host.copy(), core.residency.tree.path_tokens(n))
        for n in core.residency.tree.nodes()])


async def test_seed002_split_during_backup_keeps_every_page():
    async with fake_runtime(small_config(write_policy="write_through")) as (rt, engine):
        nodes = await _split_during_backup(rt, engine)
    a = toks(41, 1)[:40]
    a_nodes = [(n, host, path) for n, host, path in nodes if np.array_equal(path, a[: len(path)])]
    assert sorted(n for n, _, _ in a_nodes) == [16, 24]  # both halves of the original node
    for _, host, path in a_nodes:
        assert host is not None  # both halves are backed up
        assert _host_mismatch(rt, host, path) == []  # each half's host copy is its own KV


def _host_mismatch(rt: CacheRuntime, host_slots: np.ndarray, path: np.ndarray) -> list[int]:
    """Positions of the node's tokens whose host KV is not their prefix's fingerprint."""
    start = len(path) - len(host_slots)
    shape = rt.host_pool.shape
    want = fingerprint_kv(prefix_hashes(path)[start:], shape.num_layers, shape.num_kv_heads, shape.head_dim)
    got = rt.host_pool.read_slots(host_slots).float()
    return [i for i in range(len(host_slots)) if not bool((got[:, :, i] == want[:, :, i]).all())]


async def test_seed002_broken_variant_is_caught():
    """Broken variant: the ack uses the shrunken node alone (the original SGLang bug)."""
    with pytest.raises(RuntimeFailed) as info:
        async with fake_runtime(small_config(write_policy="write_through")) as (rt, engine):
            await rt.inspect(lambda core: setattr(core.residency.tree, "split_chain", lambda node, n: [node]))
            await _split_during_backup(rt, engine)
    assert isinstance(info.value.__cause__, (InvariantViolation, AssertionError, ValueError))


# -- seed 004 ------------------------------------------------------------------------------


async def _admit_retrying(rt: CacheRuntime, rid: str, tokens: np.ndarray):
    """Under write_back, eviction of a dirty node first copies it to host: retry after the copy."""
    for _ in range(200):
        try:
            return await rt.admit(rid, tokens)
        except CapacityError:
            await settle(rt)
    raise AssertionError("never admitted")


async def _write_back_cycle(rt: CacheRuntime) -> dict:
    # two system prompts in turn: each one's whole subtree (parent and children) goes to host
    systems = [toks(16, 40), toks(16, 41)]
    chats = [np.concatenate((systems[i // 3], toks(20, 50 + i))) for i in range(6)]
    served = {"host": 0}
    for round_ in range(3):
        for i, chat in enumerate(chats):
            res = await _admit_retrying(rt, f"r{round_}-{i}", chat)
            for r in res.readiness:
                await r.wait_all()
            served["host"] += res.loaded_host
            assert not mismatches(rt.device_pool, res.slots[: res.cached], chat)
            compute(rt, res.slots, chat, start=res.cached)
            await rt.finish(f"r{round_}-{i}", chat)
        await settle(rt)
    return served


async def test_seed004_write_back_evict_drop_reload_evict():
    # device holds ~2 chats, host ~4: write-back evictions, host drops, reloads, evictions again
    cfg = small_config(write_policy="write_back", device_slots=64, host_tokens=96)
    async with CacheRuntime.open(cfg) as rt:
        served = await _write_back_cycle(rt)
        st = await rt.stats()
    assert served["host"] > 0  # reloaded from host
    assert st["host"]["evicted_tokens"] > 0 and st["device"]["evicted_tokens"] > 0


async def test_seed004_broken_host_leaf_rule_is_caught(monkeypatch):
    """Broken variant: the rule asks whether the children are evicted from device instead of
    whether they hold a host copy. (The literal SGLang form, "no child evicted", cannot be told
    apart here: device residency is prefix-closed, so a host-only parent never has a child on
    device; the pure-tree property test covers that form.)"""

    def broken(node):
        return (node.device is None and node.host is not None and node.host_protect == 0
                and all(c.device is None for c in node.children.values()))

    monkeypatch.setattr(RadixTree, "_is_host_leaf", staticmethod(broken))
    cfg = small_config(write_policy="write_back", device_slots=64, host_tokens=96)
    with pytest.raises(RuntimeFailed) as info:
        async with CacheRuntime.open(cfg) as rt:
            await _write_back_cycle(rt)
    assert isinstance(info.value.__cause__, InvariantViolation)
    assert "host leaves" in str(info.value.__cause__)

"""Recurrent state through the whole runtime (CPU copy engine): snapshots are backed up to host
with their nodes' KV and loaded back with them, byte for byte, and a hit resumes from the state
of exactly its prefix (docs/ARCHITECTURE.md, "Recurrent state").

The "model" here writes, for each snapshot it is asked for, a state that encodes the prefix it
follows (its tokens' sum and length in every element of every component), so a state restored
from another prefix is caught by value. Broken variant checked by hand: a load plan that pairs
the chain's host snapshots with the wrong device slots (sources reversed) fails here with "a hit
resumed from another prefix's state" (and the invariant checker: "node 3 ends at 32 but holds
the state snapshot taken at 16").
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.errors import StateError
from runtime.invariants import check_invariants
from runtime.runtime import CacheRuntime
from runtime.tree.groups.recurrent import RecurrentStates
from tests.integration.support import compute, settle, small_config, toks

STATE = dict(state_layers=3, state_components="conv:6x3:float32,ssm:2x4x5:bfloat16", state_slots=6)


def prefix_state(pool, slot: int, tokens: np.ndarray) -> None:
    """The stand-in model's state after `tokens`: a value no other prefix here shares."""
    value = float(int(tokens.sum()) % 251 + len(tokens))
    for name in ("conv", "ssm"):
        for layer in range(3):
            pool.layer(name, layer)[slot].fill_(value + layer)


def holds_state_of(pool, slot: int, tokens: np.ndarray) -> bool:
    value = float(int(tokens.sum()) % 251 + len(tokens))
    return all(bool((pool.layer(name, layer)[slot] == value + layer).all())
               for name in ("conv", "ssm") for layer in range(3))


async def serve(rt: CacheRuntime, rid: str, tokens: np.ndarray, snaps: tuple[int, ...]):
    """Admit, check the resumed state, compute (KV fingerprints + snapshots), finish."""
    res = await rt.admit(rid, tokens)
    for r in res.readiness:
        await r.wait_all()
    pool = rt.state_pool
    if res.state_from is not None:
        assert holds_state_of(pool, res.state_from, tokens[: res.cached]), "a hit resumed from another prefix's state"
        pool.copy_slot(res.state_from, res.state_slot)  # what the engine does before its forward
    compute(rt, res.slots, tokens, start=res.cached)
    for p in snaps:
        if p > res.cached:
            prefix_state(pool, await rt.snapshot(rid, p), tokens[:p])
    await rt.finish(rid, tokens)
    return res


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
async def test_snapshots_go_to_host_and_come_back_with_their_kv(layout):
    config = small_config(copy_engine="cpu", device_slots=96, host_tokens=128, host_layout=layout, **STATE)
    async with CacheRuntime.open(config) as rt:
        a = toks(33, 1)
        b = np.concatenate((a[:16], toks(17, 2)))
        await serve(rt, "a", a, snaps=(16, 32))
        await settle(rt)
        await serve(rt, "b", b, snaps=(32,))
        await settle(rt)
        hit = await serve(rt, "a2", a, snaps=())
        assert hit.cached_device == 32  # on device: KV + state of a's 32 tokens
        # push everything off device: the next hits come from host, state included
        av = await rt.available()
        await rt.admit("big", toks(av["device_free"] + av["device_evictable"], 3))
        await rt.abort("big")
        await settle(rt)
        counts = await rt.inspect(lambda core: (len(core.residency.group(RecurrentStates).node_state),
                                                len(core.residency.group(RecurrentStates).host_state)))
        assert counts == (0, 3)
        res = await serve(rt, "b2", b, snaps=())  # host only: KV and the states at 16 and 32 load back
        assert (res.cached_device, res.loaded_host) == (0, 32) and res.state_from is not None
        res = await serve(rt, "c", np.concatenate((a[:20], toks(13, 4))), snaps=())
        assert (res.cached_device, res.loaded_host) == (16, 0)  # the state at 16 came back with b2's load
        await settle(rt)
        await rt.inspect(lambda core: check_invariants(core, quiescent=True))
        st = await rt.stats()
        assert st["state"]["hits"] == 4 and st["state"]["snapshots_kept"] == 3  # b, a2, b2, c
        # the byte counters count the states the copies moved beside the KV
        slot_bytes = rt.config.state_shape.bytes_per_slot
        kv_pages = await rt.inspect(lambda core: core.residency.host.num_pages - core.residency.host.num_free_pages())
        assert st["transfer"]["device_to_host_bytes"] == kv_pages * config.page_size * config.bytes_per_token + \
            3 * slot_bytes  # every backed-up page is still on host, each of the 3 snapshots too


async def test_snapshot_refused_without_recurrent_state():
    async with CacheRuntime.open(small_config(copy_engine="cpu")) as rt:
        res = await rt.admit("a", toks(9, 5))
        assert res.state_slot is None and rt.state_pool is None
        with pytest.raises(StateError):
            await rt.snapshot("a", 8)
        await rt.abort("a")


async def test_storage_with_recurrent_state_needs_host_state_slots(tmp_path):
    """Snapshots reach storage through their host copies: with no host state slots, the config
    refuses a storage backend, and one given to `open` or attached later is refused the same (the
    façade's one backend check); with them, both are taken."""
    from runtime.errors import ConfigError
    from runtime.storage.file_backend import FileBackend

    with pytest.raises(ConfigError, match="host_state_slots"):
        small_config(copy_engine="cpu", host_state_slots=0, storage_backend="file", storage_dir=str(tmp_path), **STATE)
    config = small_config(copy_engine="cpu", host_state_slots=0, **STATE)
    backend = FileBackend(str(tmp_path), config.page_size * config.bytes_per_token)
    try:
        with pytest.raises(ConfigError, match="host_state_slots"):
            CacheRuntime(config, storage=backend)
        async with CacheRuntime.open(config) as rt:
            with pytest.raises(ConfigError, match="host_state_slots"):
                await rt.attach_storage(backend)
            assert (await rt.stats())["storage"]["writes_issued"] == 0
        async with CacheRuntime.open(small_config(copy_engine="cpu", **STATE), storage=backend) as rt:
            await rt.detach_storage()  # (a StateError had no backend been taken)
            await rt.attach_storage(backend)
            await rt.detach_storage()
    finally:
        backend.close()


def test_state_pool_shapes_follow_the_config():
    config = small_config(copy_engine="cpu", **STATE)
    shape = config.state_shape
    assert [c.dtype for c in shape.components] == [torch.float32, torch.bfloat16]
    assert config.host_state_slot_count == 12

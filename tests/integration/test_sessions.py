"""Streaming sessions and speculative-decoding trims: one consistent KV record (seed 003)."""

from __future__ import annotations

import numpy as np
import pytest

from runtime import DuplicateRequestError, LengthError, StateError, UnknownRequestError
from runtime.runtime import CacheRuntime
from tests.integration.support import bad_positions, compute, quiescent_check, small_config, toks


async def _session_state(rt: CacheRuntime, sid: str):
    return await rt.inspect(lambda core: (core.sessions[sid].kv_len, core.sessions[sid].slots.copy(),
                                          core.residency.device.num_free_pages()))


async def _overshooting_turn(rt: CacheRuntime, sid: str, rid: str, tokens: np.ndarray, limit: int, accepted: int,
                             seed: int) -> np.ndarray:
    """A turn whose speculative decoding accepts `accepted` tokens where the limit is `limit`."""
    res = await rt.admit(rid, tokens, session=sid)
    assert bad_positions(rt.device_pool, res.slots[: res.cached_device], tokens) == []
    compute(rt, res.slots, tokens, start=res.cached_device)
    out = toks(accepted, seed)
    extra = await rt.extend(rid, accepted)  # draft slots
    full = np.concatenate((tokens, out))
    compute(rt, np.concatenate((res.slots.numpy(), extra.numpy())), full, start=len(tokens))
    await rt.commit(rid, len(full))
    await rt.finish(rid, full, finished_len=limit)
    return full[: len(tokens) + limit]


@pytest.mark.parametrize("page_size", [1, 16, 64])
async def test_seed003_overshoot_is_trimmed_and_next_turn_matches(page_size):
    cfg = small_config(page_size=page_size, device_slots=64 * 16, host_tokens=0)
    async with CacheRuntime.open(cfg) as rt:
        await rt.open_session("s")
        prompt = toks(3 * page_size + 5, 1)
        limit, accepted = page_size + 3, 2 * page_size + 6  # accepted runs past the limit
        kept = await _overshooting_turn(rt, "s", "t1", prompt, limit, accepted, seed=2)
        kv_len, slots, free_after = await _session_state(rt, "s")
        # the session's KV length equals its token count, in exactly the pages those tokens need
        assert kv_len == len(kept) == len(prompt) + limit
        assert len(slots) == -(-kv_len // page_size) * page_size
        # the trimmed whole pages are free again; the tail page shared with kept tokens is not
        owned = await rt.inspect(lambda core: core.residency.device.pages_owned_by(core.sessions["s"].owner))
        assert owned * page_size == len(slots)
        assert bad_positions(rt.device_pool, slots[:kv_len], kept) == []
        # next turn: the cached KV length equals its token count and its fingerprints match
        turn2 = np.concatenate((kept, toks(7, 3)))
        res = await rt.admit("t2", turn2, session="s")
        assert res.cached_device == len(kept)
        assert bad_positions(rt.device_pool, res.slots[: len(kept)], turn2) == []
        compute(rt, res.slots, turn2, start=len(kept))
        await rt.finish("t2", turn2)
        await rt.close_session("s")
        await quiescent_check(rt)
        assert free_after <= (await rt.available())["device_free"] // page_size


async def test_seed003_broken_variant_without_trim_fails():
    """Broken variant: finish ignores `finished_len` (the original bug). The next turn's tokens
    then no longer extend the session's tokens, so its cached KV cannot equal its token count."""
    cfg = small_config(page_size=16, device_slots=1024, host_tokens=0)
    async with CacheRuntime.open(cfg) as rt:
        await rt.inspect(lambda core: setattr(core, "_trimmed", lambda rec, tokens, n: core._check_kv_tokens(rec, tokens)))
        await rt.open_session("s")
        kept = await _overshooting_turn(rt, "s", "t1", toks(53, 1), 19, 38, seed=2)
        kv_len, _, _ = await _session_state(rt, "s")
        assert kv_len != len(kept)  # the overshoot stayed in the session
        with pytest.raises(StateError):
            await rt.admit("t2", np.concatenate((kept, toks(7, 3))), session="s")


async def test_over_allocation_then_partial_commit_and_rewind():
    async with CacheRuntime.open(small_config(host_tokens=0)) as rt:
        prompt = toks(10, 4)
        res = await rt.admit("a", prompt)
        compute(rt, res.slots, prompt)
        await rt.extend("a", 9)  # 9 draft tokens: seq 19 -> 5 pages of 4
        await rt.commit("a", 13)  # 3 accepted
        with pytest.raises(LengthError):
            await rt.commit("a", 12)  # never smaller than before
        before = (await rt.available())["device_free"]
        await rt.rewind("a", 13)  # drop the rejected drafts: pages past 16 are freed
        assert (await rt.available())["device_free"] == before + 4
        rec = await rt.inspect(lambda core: (core.requests["a"].seq_len, core.requests["a"].committed_len,
                                             len(core.requests["a"].slots)))
        assert rec == (13, 13, 16)
        with pytest.raises(LengthError):
            await rt.rewind("a", 20)
        await rt.abort("a")
        await quiescent_check(rt)


async def test_abort_of_a_turn_keeps_the_sessions_kv():
    async with CacheRuntime.open(small_config(host_tokens=0)) as rt:
        await rt.open_session("s")
        kept = await _overshooting_turn(rt, "s", "t1", toks(10, 5), 3, 3, seed=6)
        before = await _session_state(rt, "s")
        turn2 = np.concatenate((kept, toks(9, 7)))
        res = await rt.admit("t2", turn2, session="s")
        compute(rt, res.slots, turn2, start=len(kept))
        await rt.abort("t2")
        after = await _session_state(rt, "s")
        assert after[0] == before[0] and np.array_equal(after[1], before[1]) and after[2] == before[2]
        assert bad_positions(rt.device_pool, after[1][: after[0]], kept) == []
        await rt.close_session("s")
        await quiescent_check(rt)


async def test_session_errors_change_nothing():
    async with CacheRuntime.open(small_config(host_tokens=0)) as rt:
        await rt.open_session("s")
        with pytest.raises(DuplicateRequestError):
            await rt.open_session("s")
        with pytest.raises(UnknownRequestError):
            await rt.admit("x", toks(5, 8), session="nope")
        t = toks(9, 9)
        res = await rt.admit("t1", t, session="s")
        with pytest.raises(StateError):  # one turn at a time
            await rt.admit("t1b", t, session="s")
        with pytest.raises(StateError):  # closing with a turn in flight: nothing changes
            await rt.close_session("s")
        with pytest.raises(StateError):  # a turn's KV stays in its session, not the tree
            await rt.cache("t1", t)
        compute(rt, res.slots, t)
        await rt.finish("t1", t)
        with pytest.raises(StateError):  # a turn must extend the session's tokens
            await rt.admit("t2", toks(12, 10), session="s")
        assert await rt.close_session("s", insert=True) == 8  # its whole pages go into the tree
        look = await rt.match_prefix(t)
        assert look["device"] == 8
        await quiescent_check(rt)

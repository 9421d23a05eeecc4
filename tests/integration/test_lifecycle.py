"""Request lifecycle through CacheRuntime: prefix hits, host load-back, errors that change nothing.

Every runtime here runs with debug_invariants=True: the checker runs after every message.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from runtime import (
    CapacityError,
    DuplicateRequestError,
    LengthError,
    RuntimeClosed,
    RuntimeFailed,
    StateError,
    UnknownRequestError,
)
from runtime.messages import Admit, Cache, Extend, Finish
from runtime.runtime import CacheRuntime
from tests.integration.support import (
    bad_positions,
    compute,
    fake_runtime,
    quiescent_check,
    release_all,
    settle,
    small_config,
    toks,
    until,
)

rng = np.random.default_rng(0)


async def serve(rt: CacheRuntime, rid: str, tokens: np.ndarray, reply_len: int = 0, extra_key=None) -> dict:
    """One request the way a serving loop runs it, with fingerprints standing in for the model."""
    res = await rt.admit(rid, tokens, extra_key)
    for r in res.readiness:
        await r.wait_all()
    assert bad_positions(rt.device_pool, res.slots[: res.cached], tokens, extra_key) == []
    compute(rt, res.slots, tokens, extra_key, start=res.cached)
    full = tokens
    if reply_len:
        new = await rt.extend(rid, reply_len)
        full = np.concatenate((tokens, toks(reply_len, hash(rid) % 1000)))
        slots = np.concatenate((res.slots.numpy(), new.numpy()))
        compute(rt, slots, full, extra_key, start=len(tokens))
    await rt.finish(rid, full)
    return {"cached_device": res.cached_device, "loaded_host": res.loaded_host}


async def test_prefix_hit_serves_the_same_kv():
    async with CacheRuntime.open(small_config(write_policy="write_through_selective")) as rt:
        prompt = toks(40, 1)
        first = await serve(rt, "a", prompt, reply_len=5)
        assert first["cached_device"] == 0
        second = await serve(rt, "b", np.concatenate((prompt, toks(9, 2))))
        assert second["cached_device"] == 40  # the shared prompt: 10 whole pages
        st = await rt.stats()
        assert st["device"]["hit_tokens"] == 40 and st["requests"]["finished"] == 2
        await quiescent_check(rt)


async def test_namespaces_never_share():
    async with CacheRuntime.open(small_config()) as rt:
        prompt = toks(33, 3)
        await serve(rt, "a", prompt, extra_key="tenant-1")
        assert (await rt.match_prefix(prompt, "tenant-2")) == {"device": 0, "host": 0}
        r = await serve(rt, "b", prompt, extra_key="tenant-2")
        assert r["cached_device"] == 0
        r = await serve(rt, "c", prompt, extra_key="tenant-1")
        assert r["cached_device"] == 32


async def test_host_load_back_after_device_eviction():
    cfg = small_config(device_slots=128, host_tokens=512)
    async with CacheRuntime.open(cfg) as rt:
        prompts = [toks(60, 10 + i) for i in range(4)]
        for i, p in enumerate(prompts):
            await serve(rt, f"r{i}", p)
            await settle(rt)  # a node being backed up is locked by its copy: let write-through land
        # prompt 0 was evicted from device by the later ones; it comes back from host
        look = await rt.match_prefix(prompts[0])
        assert look["host"] > 0
        again = await serve(rt, "again", prompts[0])
        assert again["loaded_host"] > 0
        await settle(rt)
        st = await rt.stats()
        assert st["host"]["hit_tokens"] == again["loaded_host"] and st["copies"]["loads_issued"] >= 1
        await quiescent_check(rt)


async def test_bad_input_is_typed_and_changes_nothing():
    async with CacheRuntime.open(small_config()) as rt:
        await serve(rt, "warm", toks(20, 4))
        await rt.admit("big", toks(200, 6))  # holds most of the pool
        await settle(rt)

        def state(core):
            return core.residency.device.snapshot(), core.residency.host.snapshot(), core.residency.tree.num_nodes, len(core.requests)

        before = await rt.inspect(state)
        with pytest.raises(UnknownRequestError):
            await rt.extend("nope", 4)
        with pytest.raises(UnknownRequestError):
            await rt.finish("nope", [1, 2, 3])
        with pytest.raises(LengthError):
            await rt.admit("x", [])
        with pytest.raises(LengthError):
            await rt.admit("x", np.zeros(10_000, dtype=np.int32))  # oversize
        with pytest.raises(CapacityError):
            await rt.admit("x", toks(100, 7))
        with pytest.raises(LengthError):
            await rt.extend("big", 0)
        with pytest.raises(LengthError):
            await rt.commit("big", 10_000)
        assert await rt.inspect(state) == before
        await rt.abort("big")
        await quiescent_check(rt)


async def test_double_finish_and_duplicate_admit():
    async with CacheRuntime.open(small_config()) as rt:
        t = toks(12, 8)
        res = await rt.admit("a", t)
        with pytest.raises(DuplicateRequestError):
            await rt.admit("a", t)
        compute(rt, res.slots, t)
        await rt.finish("a", t)
        with pytest.raises(UnknownRequestError):
            await rt.finish("a", t)
        res = await rt.admit("b", t)
        with pytest.raises(LengthError):
            await rt.finish("b", np.concatenate((t, t)))  # more tokens than it has slots for
        with pytest.raises(StateError):
            await rt.cache("b", toks(12, 9))  # does not extend its cached prefix
        await rt.abort("b")
        await quiescent_check(rt)


async def test_batch_step_results_per_item():
    async with CacheRuntime.open(small_config()) as rt:
        t1, t2 = toks(10, 11), toks(14, 12)
        out = await rt.step([Admit("a", t1), Admit("b", t2), Extend("zzz", 3)])
        assert out[0].rid == "a" and out[1].rid == "b" and isinstance(out[2], UnknownRequestError)
        compute(rt, out[0].slots, t1)
        compute(rt, out[1].slots, t2)
        out = await rt.step([Finish("a", t1), Finish("b", t2), Finish("a", t1)])
        assert isinstance(out[2], UnknownRequestError)
        await quiescent_check(rt)


async def test_cancelled_admit_leaves_nothing_behind():
    async with CacheRuntime.open(small_config()) as rt:
        call = asyncio.ensure_future(rt.admit("c", toks(30, 13)))
        await asyncio.sleep(0)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await rt.available()  # the release message went after the admit; both are handled now
        await rt.available()
        await quiescent_check(rt)


async def test_calls_after_close_raise_closed():
    async with CacheRuntime.open(small_config()) as rt:
        pass
    with pytest.raises(RuntimeClosed):
        await rt.admit("a", [1, 2, 3])


async def test_crash_fails_runtime_and_exit_reraises():
    with pytest.raises(RuntimeFailed) as info:
        async with CacheRuntime.open(small_config()) as rt:
            def boom(core):
                raise RuntimeError("bug in a handler")

            with pytest.raises(RuntimeFailed):
                await rt.inspect(boom)
            with pytest.raises(RuntimeFailed):
                await rt.admit("a", [1, 2, 3])
    assert isinstance(info.value.__cause__, RuntimeError)


async def test_close_waits_for_copies_in_flight():
    async with fake_runtime(small_config()) as (rt, engine):
        await serve(rt, "a", toks(24, 14))
        await until(lambda: bool(engine.pending()))  # write-through backup held in flight
        closing = asyncio.ensure_future(rt.close())
        # the close waits for the copy once the tree actor holds its drain: "not done" is checked
        # there (a close that did not wait would be done by then, or never hold a drain)
        await until(lambda: closing.done() or bool(rt._tree.quiesce_waiters))
        assert not closing.done()
        for op in engine.pending():
            engine.release(op)
        await closing
        assert rt.closed


async def test_abort_during_load_keeps_the_load_safe():
    cfg = small_config(device_slots=64, host_tokens=256)
    async with fake_runtime(cfg) as (rt, engine):
        p0 = toks(28, 20)
        await serve(rt, "a", p0)
        await release_all(rt, engine)
        for i in range(3):  # push p0 off the device
            await serve(rt, f"f{i}", toks(28, 21 + i))
            await release_all(rt, engine)
        assert (await rt.match_prefix(p0))["host"] > 0
        res = await rt.admit("b", p0)
        assert res.loaded_host > 0
        await until(lambda: bool(engine.pending()))
        await rt.abort("b")  # load still in flight: its slots stay pinned and locked by the copy
        await rt.inspect(lambda core: None)
        await release_all(rt, engine)
        await quiescent_check(rt)
        again = await serve(rt, "c", p0)
        assert again["cached_device"] > 0  # the aborted request's load still landed on device


async def test_can_admit_does_not_count_the_requests_own_prefix_as_room():
    """The request's own cached prefix is evictable until its admission locks it, so it is no
    room for the request's new pages. (Before the fix, can_admit said yes here and admit failed
    only after splitting and touching the prefix.)"""
    config = small_config(device_slots=160, host_tokens=0)  # 40 pages of 4
    async with CacheRuntime.open(config) as rt:
        prefix = toks(100, 31)  # 25 pages, cached and unlocked
        await serve(rt, "p", prefix)
        await rt.admit("x", toks(40, 35))  # a live request holds 10 pages: 5 stay free
        want = {"device_free": 20, "device_evictable": 100}
        assert await rt.available() == want
        grown = np.concatenate((prefix, toks(32, 32)))  # its own prefix + 8 new pages
        assert not await rt.can_admit(grown)
        with pytest.raises(CapacityError):
            await rt.admit("g", grown)
        assert await rt.available() == want  # changed nothing
        fits = np.concatenate((prefix, toks(20, 33)))  # 5 new pages fit in the free 5
        assert await rt.can_admit(fits)
        await serve(rt, "f", fits)
        other = toks(60, 34)  # 15 pages: another prompt may evict the cached prefixes
        assert await rt.can_admit(other)
        await serve(rt, "o", other)
        await rt.abort("x")
        await quiescent_check(rt)


@pytest.mark.parametrize("batched", [False, True])
async def test_a_token_array_reused_by_the_caller_changes_nothing_cached(batched):
    """The façade copies the caller's token arrays as it builds each message, and the core keeps
    the message's arrays (it does not copy them again): a caller that reuses its buffer while
    the message waits in the mailbox cannot change what the tree caches. Checked against a
    façade that passes the caller's array through (`runtime.validation.tokens` returning it):
    the request took the reused buffer's tokens, and finishing with the prompt it was admitted
    with raised StateError, in both forms."""
    config = small_config(host_tokens=0)
    async with CacheRuntime.open(config) as rt:
        buffer = toks(8 * config.page_size, 41)
        prompt = buffer.copy()
        if batched:
            call = asyncio.create_task(rt.step([Admit("a", buffer), Cache("a", buffer)]))
        else:
            call = asyncio.create_task(rt.admit("a", buffer))
        await asyncio.sleep(0)  # the call has built and queued its message; the actor has not run
        buffer[:] = 7  # the caller's next request reuses the buffer
        await call
        await rt.finish("a", prompt)
        assert await rt.match_prefix(prompt) == {"device": len(prompt), "host": 0}
        assert await rt.match_prefix(buffer) == {"device": 0, "host": 0}
        await quiescent_check(rt)


def test_step_checks_an_array_given_to_several_items_once():
    """A prompt given to `Admit` and then `Cache` in one step is checked and copied once and the
    two sent items share the copy (a step's hot path); an equal but distinct array, or the same
    array in the next step, gets its own copy. Fails with `step_tokens` copying every time."""
    from runtime.validation import step_item, step_tokens

    prompt, twin = np.arange(64, dtype=np.int32), np.arange(64, dtype=np.int32)
    toks = step_tokens(1 << 31, 128)
    admit, cache, other = (step_item(m, toks) for m in (Admit("a", prompt), Cache("a", prompt), Cache("b", twin)))
    assert admit.tokens is cache.tokens and admit.tokens is not prompt
    assert other.tokens is not admit.tokens and np.array_equal(other.tokens, twin)
    again = step_item(Cache("a", prompt), step_tokens(1 << 31, 128))
    assert again.tokens is not admit.tokens and np.array_equal(again.tokens, prompt)


def test_step_rebuilds_token_items_keeping_every_other_field():
    """`step` checks each item and rebuilds the token-carrying ones by hand
    (`runtime.validation.STEP_ITEMS`, the batch hot path): every field but `tokens` must come over
    as it was and `tokens` must be a new array, for every item type `step` takes. Checked against a
    rebuild of Admit that drops `session`: fails on that field."""
    from runtime.messages import Abort, Commit
    from runtime.validation import STEP_ITEMS, step_tokens

    valid = {"rid": ("r", 7), "tokens": np.arange(5, dtype=np.int32), "extra_key": ("tenant", 3),
             "session": "s1", "priority": 5, "num_tokens": 2, "committed_len": 4, "finished_len": 1, "reply": None}
    assert set(STEP_ITEMS) == {Admit, Extend, Commit, Cache, Finish, Abort}
    for cls, check in STEP_ITEMS.items():
        values = {name: valid[name] for name in cls.__struct_fields__}
        new = check(cls(**values), step_tokens(1 << 31, 64))
        assert type(new) is cls
        for name, value in values.items():
            if name == "tokens":
                assert new.tokens is not value and np.array_equal(new.tokens, value)
                assert new.tokens.dtype == np.int32
            else:
                assert getattr(new, name) is value, (cls.__name__, name)

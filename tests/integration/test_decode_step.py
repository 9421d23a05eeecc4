"""`CacheRuntime.decode_step` through the façade: one message per decode step, the same result as
commit + extend(1) per request, all or nothing (the fuzzer drives it at random: `x_decode`)."""

from __future__ import annotations

import pytest
import torch

from runtime.errors import ArgumentError, CapacityError, UnknownRequestError
from tests.integration.support import fake_runtime, quiescent_check, small_config, toks


async def test_decode_step_gives_each_request_its_next_slot_and_commits():
    async with fake_runtime(small_config()) as (rt, engine):
        a = await rt.admit("a", toks(6, 1))
        b = await rt.admit("b", toks(9, 2))
        slots = {"a": a.slots.tolist(), "b": b.slots.tolist()}
        for _ in range(7):
            out = await rt.decode_step(["a", "b"])
            assert out.dtype == torch.int64 and out.shape == (2,)
            slots["a"].append(int(out[0]))
            slots["b"].append(int(out[1]))
        assert len(set(slots["a"]) | set(slots["b"])) == 13 + 16  # no slot handed out twice
        lens = await rt.inspect(lambda core: {r: (core.requests[r].seq_len, core.requests[r].committed_len)
                                              for r in ("a", "b")})
        assert lens == {"a": (13, 12), "b": (16, 15)}
        mapped = await rt.inspect(lambda core: {r: core.requests[r].slots[:core.requests[r].seq_len].tolist()
                                                for r in ("a", "b")})
        assert mapped == slots
        await rt.abort("a")
        await rt.abort("b")
        await quiescent_check(rt)


@pytest.mark.parametrize("rids, error", [(("a", "ghost"), UnknownRequestError), (["a", "a"], ArgumentError),
                                         ("a", ArgumentError), ([["a"]], UnknownRequestError)])
async def test_a_refused_decode_step_changes_nothing(rids, error):
    async with fake_runtime(small_config()) as (rt, engine):
        await rt.admit("a", toks(8, 3))
        before = await rt.inspect(lambda core: (core.requests["a"].seq_len, core.residency.device.snapshot()))
        with pytest.raises(error):
            await rt.decode_step(rids)
        assert await rt.inspect(lambda core: (core.requests["a"].seq_len, core.residency.device.snapshot())) == before
        assert not rt.failed


async def test_a_decode_step_short_of_pages_is_a_capacity_error_and_the_runtime_lives_on():
    async with fake_runtime(small_config(device_slots=16, host_tokens=16)) as (rt, engine):
        await rt.admit("a", toks(8, 4))
        await rt.admit("b", toks(8, 5))
        with pytest.raises(CapacityError):
            await rt.decode_step(["a", "b"])
        await rt.abort("b")
        assert (await rt.decode_step(["a"])).shape == (1,)

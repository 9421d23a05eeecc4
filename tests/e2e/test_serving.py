"""Differential test of the serving loop: KV served through the runtime's tiers gives the same
greedy output as transformers' own ``generate`` with no reuse (tiny random Llama, fp32).

Several concurrent multi-turn conversations share a system prompt; the device pool holds
only a few of them, so later turns hit the device (shared prefix) and load evicted history
back from the host tier. Every turn's tokens must equal ``generate``'s and every step's
logits must be within 1e-5. A planted bug (the loaded part of the slots off by one page)
must make the comparison fail, so the check is known to bite.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time

import pytest

pytest.importorskip("transformers")

from runtime.config import RuntimeConfig  # noqa: E402
from runtime.integrations.hf_llama import PagedKVModel, greedy_generate_reference  # noqa: E402
from runtime.integrations.serving import ServingError, ServingLoop  # noqa: E402
from runtime.runtime import CacheRuntime  # noqa: E402
from runtime.transfer.fake_engine import FakeCopyEngine  # noqa: E402
from tests.e2e.support import PAGE, TOL, ids, runtime_config  # noqa: E402

USERS, TURNS, NEW = 4, 3, 10
config = functools.partial(runtime_config, device_slots=256)  # model fixture: tests/e2e/conftest.py

async def chat(srv: ServingLoop, users: int = USERS, turns: int = TURNS, new: int = NEW) -> list:
    """Concurrent multi-turn conversations; returns (prompt, completion) per turn."""
    system = ids(40, 1)
    done = []

    async def user(u: int) -> None:
        history = list(system)
        for t in range(turns):
            history += ids(20 + 3 * u, 100 * u + t)
            c = await srv.generate(history, max_new_tokens=new, rid=f"u{u}")
            done.append((list(history), c))
            history += c.tokens
            await asyncio.sleep(0.001 * u)  # users think at different speeds

    await asyncio.gather(*(user(u) for u in range(users)))
    return done


def mismatches(ref_model, results, new: int = NEW) -> list[str]:
    bad = []
    for prompt, c in results:
        want, want_logits = greedy_generate_reference(ref_model, prompt, new, return_logits=True)
        if c.tokens != want:
            bad.append(f"{c.rid} @{len(prompt)}: tokens {c.tokens} != {want}")
            continue
        for step, (got, exp) in enumerate(zip(c.logits, want_logits, strict=True)):
            err = (got.to(exp.device) - exp).abs().max().item()
            if not err <= TOL:
                bad.append(f"{c.rid} @{len(prompt)} step {step}: logits off by {err:.2e}")
                break
    return bad


async def serve(model, cfg: RuntimeConfig, patch=None, **loop_kw):
    async with CacheRuntime.open(cfg) as rt:
        if patch is not None:
            patch(rt)
        async with ServingLoop(rt, PagedKVModel(model, rt.device_pool), eos_token_ids=[2], record_logits=True,
                               max_running=3, **loop_kw) as srv:
            results = await chat(srv)
        stats = await rt.stats()
    return results, stats, srv.stats


@pytest.mark.parametrize("policy,layerwise", [("write_through", True), ("write_through", False),
                                             ("write_back", True)])
async def test_outputs_equal_generate_with_device_and_host_hits(model, ref_model, policy, layerwise):
    results, rt_stats, loop_stats = await serve(model, config(model, write_policy=policy), layerwise=layerwise)
    assert len(results) == USERS * TURNS
    assert mismatches(ref_model, results) == []
    device = sum(c.metrics.device_tokens for _, c in results)
    host = sum(c.metrics.host_tokens for _, c in results)
    assert device > 0 and host > 0, (device, host)
    resumed = sum(c.metrics.resume_cached_tokens for _, c in results)
    recomputed = sum(c.metrics.recomputed_tokens + c.metrics.resume_recomputed_tokens for _, c in results)
    assert rt_stats["device"]["hit_tokens"] + rt_stats["host"]["hit_tokens"] == device + host + resumed
    assert rt_stats["requests"]["recomputed_tokens"] == recomputed
    assert rt_stats["device"]["evicted_tokens"] > 0 and rt_stats["copies"]["loads_issued"] > 0
    assert rt_stats["requests"]["live"] == 0 and loop_stats["finished"] == USERS * TURNS
    for _, c in results:
        m = c.metrics
        assert m.storage_tokens == 0 and m.ttft_s > 0 and m.generated_tokens == len(c.tokens)
        assert m.device_tokens + m.host_tokens + m.recomputed_tokens == m.prompt_tokens == len(c.prompt)
        assert m.latency_s >= m.ttft_s >= m.queue_s


async def test_load_off_by_one_page_is_caught(model, ref_model):
    """The planted bug: the slots `admit` returns for the host-loaded part point one page off."""
    shifted = []

    def off_by_one_page(rt):
        real = rt.admit
        n = rt.config.device_slots

        async def admit(rid, tokens, extra_key=None):
            res = await real(rid, tokens, extra_key)
            if res.loaded_host:
                lo, hi = res.cached_device, res.cached_device + res.loaded_host
                res.slots[lo:hi] = (res.slots[lo:hi] + PAGE) % n
                shifted.append(rid)
            return res

        rt.admit = admit

    results, _, _ = await serve(model, config(model), patch=off_by_one_page)
    assert shifted, "the scenario loaded nothing from host: the planted bug was never exercised"
    assert mismatches(ref_model, results) != []


async def test_forward_waits_for_each_layer_of_a_host_load(model, ref_model):
    """With the copy held in flight, the forward stops before the first unready layer and
    goes on layer by layer as the load's layers are released."""
    cfg = config(model, device_slots=128, host_tokens=512)
    layers = cfg.num_layers
    async with CacheRuntime.open(cfg, engine_factory=lambda pools: FakeCopyEngine(pools, auto_release=True)) as rt:
        engine = rt.engine
        paged = PagedKVModel(model, rt.device_pool)
        reached: list[int] = []
        seen = threading.Event()
        real_forward = paged.forward

        def forward(seqs, before_layer=None, **kw):
            def hook(i):
                reached.append(i)
                seen.set()
                if before_layer is not None:
                    before_layer(i)
            return real_forward(seqs, before_layer=hook, **kw)

        paged.forward = forward
        first = ids(70, 7)
        async with ServingLoop(rt, paged, record_logits=True) as srv:
            await srv.generate(first, max_new_tokens=2, rid="a")
            for k in range(3):  # push `first` off the device (its copy stays on host)
                await srv.generate(ids(70, 8 + k), max_new_tokens=2, rid=f"f{k}")
            assert (await rt.match_prefix(first))["host"] > 0
            engine.auto_release = False
            reached.clear()
            seen.clear()
            fut = await srv.submit(first + [5], max_new_tokens=3, rid="b")
            while not engine.pending():
                await asyncio.sleep(0.001)
            (op,) = engine.pending()
            await asyncio.to_thread(seen.wait, 5)
            await asyncio.sleep(0.05)
            assert reached == [0]  # blocked before layer 0: nothing of the load is ready
            for layer in range(layers - 1):
                engine.release(op, layers=layer)
                for _ in range(500):
                    if len(reached) >= layer + 2:
                        break
                    await asyncio.sleep(0.002)
                await asyncio.sleep(0.02)
                assert reached == list(range(layer + 2)), (layer, reached)
            engine.release(op)
            engine.auto_release = True  # the request's own write-through backup at finish
            c = await fut
            assert c.metrics.host_tokens > 0 and srv.stats["layer_wait_s"] > 0
    want, want_logits = greedy_generate_reference(ref_model, first + [5], 3, return_logits=True)
    assert c.tokens == want
    assert max((a - b).abs().max().item() for a, b in zip(c.logits, want_logits, strict=True)) <= TOL


async def test_failed_load_is_served_again_from_scratch(model, ref_model):
    cfg = config(model, device_slots=128, host_tokens=512)
    async with CacheRuntime.open(cfg, engine_factory=lambda pools: FakeCopyEngine(pools, auto_release=True)) as rt:
        engine = rt.engine
        async with ServingLoop(rt, PagedKVModel(model, rt.device_pool), record_logits=True) as srv:
            first = ids(70, 17)
            await srv.generate(first, max_new_tokens=2, rid="a")
            for k in range(3):
                await srv.generate(ids(70, 18 + k), max_new_tokens=2, rid=f"f{k}")
            assert (await rt.match_prefix(first))["host"] > 0
            engine.auto_release = False
            fut = await srv.submit(first + [9], max_new_tokens=4, rid="b")
            while not engine.pending():
                await asyncio.sleep(0.001)
            (op,) = engine.pending()
            engine.fail(op, OSError("planted copy failure"))
            engine.auto_release = True
            c = await fut
            assert srv.stats["load_failures"] == 1 and c.metrics.preemptions == 1
            assert c.metrics.host_tokens > 0 and c.metrics.resume_cached_tokens + c.metrics.resume_recomputed_tokens > 0
        assert (await rt.stats())["copies"]["failures"] == 1
    want, want_logits = greedy_generate_reference(ref_model, first + [9], 4, return_logits=True)
    assert c.tokens == want
    assert max((a - b).abs().max().item() for a, b in zip(c.logits, want_logits, strict=True)) <= TOL


async def test_a_prompt_larger_than_the_pool_fails_alone(model):
    cfg = config(model, device_slots=64, host_tokens=128)
    async with CacheRuntime.open(cfg) as rt:
        async with ServingLoop(rt, PagedKVModel(model, rt.device_pool)) as srv:
            big = await srv.submit(ids(100, 3), max_new_tokens=2)
            ok = await srv.submit(ids(20, 4), max_new_tokens=2)
            with pytest.raises(ServingError):
                await big
            assert len((await ok).tokens) == 2


@pytest.mark.parametrize("yield_after", [4, None])
async def test_a_mostly_cached_turn_does_not_wait_for_long_decodes(model, ref_model, yield_after):
    """Two long replies fill the device pool; a turn whose prompt is mostly cached arrives. With
    decodes yielding to waiting prefills (the default) its first token comes while both long
    replies are still running, and every output still equals `generate`'s (the yielded ones
    resume from their cached KV). ``yield_after=None`` (no yielding) is the broken variant: the
    turn then waits for a whole reply to finish, which the same timeline check catches."""
    # 13 pages: the earlier turn's 3 and the long replies' 4-5 each; the new turn needs 3 more
    cfg = config(model, device_slots=13 * PAGE, host_tokens=512)
    done: dict[str, float] = {}
    async with CacheRuntime.open(cfg) as rt:
        async with ServingLoop(rt, PagedKVModel(model, rt.device_pool), max_running=8,
                               yield_after=yield_after) as srv:
            history = ids(48, 30)
            await srv.generate(history, max_new_tokens=1, rid="earlier")
            longs = {rid: (ids(56, 31 + k), await srv.submit(ids(56, 31 + k), max_new_tokens=24, rid=rid))
                     for k, rid in enumerate(("long-a", "long-b"))}
            for rid, (_, fut) in longs.items():
                fut.add_done_callback(lambda _f, rid=rid: done.setdefault(rid, time.perf_counter()))
            for _ in range(5000):
                if srv.num_running == 2 and min(len(r.generated) for r in srv._running) >= 6:
                    break
                await asyncio.sleep(0.001)
            else:
                pytest.fail("the long replies never ran together")
            turn = history + ids(40, 32)
            t_submit = time.perf_counter()
            c = await srv.generate(turn, max_new_tokens=4, rid="turn")
            first_token_at = t_submit + c.metrics.ttft_s
            outs = {rid: await fut for rid, (_, fut) in longs.items()}
    assert c.metrics.cached_tokens >= 32
    before_both_long_replies_end = first_token_at < min(done.values())
    if yield_after is None:
        assert srv.stats["yields"] == 0 and not before_both_long_replies_end
    else:
        assert srv.stats["yields"] >= 1 and before_both_long_replies_end
    assert c.tokens == greedy_generate_reference(ref_model, turn, 4)
    for rid, (prompt, _) in longs.items():
        assert outs[rid].tokens == greedy_generate_reference(ref_model, prompt, 24), rid

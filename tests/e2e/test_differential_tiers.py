"""Differential test of the tiers that `test_serving.py` does not reach: storage prefetch, decode
offload and streaming sessions. Every turn of several concurrent multi-turn conversations
(tiny random Llama, fp32) must give the same greedy tokens as transformers' own ``generate``
with no reuse, and every step's logits must be within 1e-5; each scenario must actually have
served tokens from the tier it is about.

- storage: ``ServingLoop`` over a runtime with a file storage tier; between turns the copies
  settle and ``flush`` drops device and host, so later turns are prefetched from storage;
- decode offload: ``decode_offload=True``; ``finish`` keeps nothing on device, so later turns
  load the offloaded pages back from host;
- sessions: the runtime driven directly (``ServingLoop`` has no sessions): each conversation
  is a session, every turn ``admit(session=)`` reuses the session's KV on device; the
  sessions' turns decode together as one ragged batch per step.
"""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from runtime.config import RuntimeConfig  # noqa: E402
from runtime.integrations.hf_llama import (  # noqa: E402
    PagedKVModel,
    PagedSeq,
    greedy_generate_reference,
    kv_geometry,
    tiny_llama,
)
from runtime.integrations.serving import ServingLoop  # noqa: E402
from runtime.messages import Commit, Extend  # noqa: E402
from runtime.runtime import CacheRuntime  # noqa: E402

TOL = 1e-5
PAGE = 16
USERS, TURNS, NEW = 3, 3, 8


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def ref_model(model):
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    return ref


def config(model, **kw) -> RuntimeConfig:
    layers, kv_heads, head_dim = kv_geometry(model.config)
    base = dict(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, page_size=PAGE,
                device_slots=512, host_tokens=2048, write_policy="write_through", debug_invariants=True)
    base.update(kw)
    return RuntimeConfig(**base)


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


SYSTEM = ids(40, 1)


def user_msg(u: int, t: int) -> list[int]:
    return ids(20 + 3 * u, 100 * u + t)


def mismatches(ref_model, results) -> list[str]:
    """results: (rid, prompt, tokens, logits) per turn."""
    bad = []
    for rid, prompt, tokens, logits in results:
        want, want_logits = greedy_generate_reference(ref_model, prompt, NEW, return_logits=True)
        if tokens != want:
            bad.append(f"{rid} @{len(prompt)}: tokens {tokens} != {want}")
            continue
        for step, (got, exp) in enumerate(zip(logits, want_logits, strict=True)):
            err = (got - exp).abs().max().item()
            if not err <= TOL:
                bad.append(f"{rid} @{len(prompt)} step {step}: logits off by {err:.2e}")
                break
    return bad


async def settle(rt: CacheRuntime, timeout: float = 10.0) -> None:
    """Until no copy, storage op or offload is in flight."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    busy = lambda core: len(core.ops) + len(core.storage_ops) + len(getattr(core, "offload_retired", ()))  # noqa: E731
    while await rt.inspect(busy):
        assert loop.time() < deadline, "copies still in flight"
        await asyncio.sleep(0.002)


async def serve_turns(rt: CacheRuntime, model, between_turns=None) -> list:
    """USERS concurrent conversations through a ServingLoop, turn by turn in lockstep."""
    histories = [list(SYSTEM) for _ in range(USERS)]
    results, metrics = [], []
    async with ServingLoop(rt, PagedKVModel(model, rt.device_pool), eos_token_ids=[2], record_logits=True,
                           max_running=USERS) as srv:
        for t in range(TURNS):
            async def user(u: int) -> None:
                histories[u] += user_msg(u, t)
                c = await srv.generate(histories[u], max_new_tokens=NEW, rid=f"u{u}")
                results.append((f"u{u}t{t}", list(histories[u]), c.tokens, c.logits))
                metrics.append((t, c.metrics))
                histories[u] += c.tokens

            await asyncio.gather(*(user(u) for u in range(USERS)))
            if between_turns is not None and t < TURNS - 1:
                await between_turns()
    return results, metrics


async def test_storage_prefetch_equals_generate(model, ref_model, tmp_path):
    cfg = config(model, storage_backend="file", storage_dir=str(tmp_path / "kv"))
    async with CacheRuntime.open(cfg) as rt:
        async def drop_device_and_host() -> None:
            await settle(rt)
            assert await rt.flush() > 0
            assert (await rt.match_prefix(SYSTEM + [5] * PAGE)) == {"device": 0, "host": 0}

        results, metrics = await serve_turns(rt, model, drop_device_and_host)
        stats = await rt.stats()
    assert mismatches(ref_model, results) == []
    later = [m for t, m in metrics if t > 0]
    storage = sum(m.storage_tokens for m in later)
    assert storage > 0 and stats["tokens_storage_hit"] > 0, (storage, stats["tokens_storage_hit"])
    assert all(m.storage_tokens > 0 for m in later), [m.storage_tokens for m in later]  # own history
    for _, m in metrics:
        assert m.device_tokens + m.host_tokens + m.storage_tokens + m.recomputed_tokens == m.prompt_tokens


async def test_decode_offload_reload_equals_generate(model, ref_model):
    cfg = config(model, decode_offload=True)
    async with CacheRuntime.open(cfg) as rt:
        results, metrics = await serve_turns(rt, model, lambda: settle(rt))
        stats = await rt.stats()
    assert mismatches(ref_model, results) == []
    assert stats["offloads_issued"] > 0 and stats["offload_host_tokens_kept"] > 0, stats
    reloaded = sum(m.host_tokens for t, m in metrics if t > 0)
    assert reloaded > 0 and stats["loads_issued"] > 0, (reloaded, stats["loads_issued"])


async def test_streaming_sessions_equal_generate(model, ref_model):
    """Each conversation a session; the turns of all sessions run as one ragged batch per step."""
    served, results = [], []
    async with CacheRuntime.open(config(model)) as rt:
        paged = PagedKVModel(model, rt.device_pool)
        sids = [f"s{u}" for u in range(USERS)]
        for sid in sids:
            await rt.open_session(sid)
        histories = [list(SYSTEM) for _ in range(USERS)]
        for t in range(TURNS):
            for u in range(USERS):
                histories[u] += user_msg(u, t)
            rids = [f"{sid}t{t}" for sid in sids]
            admitted = await asyncio.gather(*(rt.admit(rid, np.asarray(h, dtype=np.int32), session=sid)
                                              for rid, h, sid in zip(rids, histories, sids, strict=True)))
            slots, starts = [], []
            for res in admitted:
                for r in res.readiness:
                    await r.wait_all()
                if t > 0:
                    served.append(res.cached_device)
                slots.append(res.slots.to(torch.long))
                starts.append(res.cached_device + res.loaded_host)
            outs = [[] for _ in range(USERS)]
            logits = [[] for _ in range(USERS)]
            live = list(range(USERS))
            while live:
                ctxs = {u: histories[u] + outs[u] for u in live}
                lg = paged.forward([PagedSeq(slots=slots[u], start=starts[u], input_ids=ctxs[u][starts[u]:])
                                    for u in live]).logits
                for row, u in enumerate(live):
                    logits[u].append(lg[row].detach().clone())
                    outs[u].append(int(lg[row].argmax()))
                live = [u for u in live if outs[u][-1] != 2 and len(outs[u]) < NEW]
                for u in live:
                    starts[u] = len(ctxs[u])
                step = await rt.step([item for u in live for item in (Commit(rids[u], starts[u]), Extend(rids[u], 1))])
                for k, u in enumerate(live):
                    slots[u] = torch.cat((slots[u], step[2 * k + 1].to(torch.long)))
            for u in range(USERS):
                results.append((rids[u], list(histories[u]), outs[u], logits[u]))
                kv = await rt.finish(rids[u], np.asarray(histories[u] + outs[u][:-1], dtype=np.int32))
                assert kv == len(histories[u]) + len(outs[u]) - 1
                histories[u] += outs[u]
        for sid in sids:
            await rt.close_session(sid)
        stats = await rt.stats()
    assert mismatches(ref_model, results) == []
    assert len(served) == USERS * (TURNS - 1) and all(n > 0 for n in served), served
    assert stats["live_requests"] == 0

"""Differential test of MLA through the runtime: a tiny random DeepSeek-V3 (fp32) whose cache is
one latent per token per layer (`kv_layout="mla"`, runtime.integrations.hf_mla), served by a
``ServingLoop`` over one runtime with a small device pool, a host pool and a file storage tier.

Three users chat concurrently, turn by turn (each turn's prompt is the whole conversation so far):

- turn 1 finds the previous turn's KV on device (device hits);
- before turn 2 a long filler request takes the device pool, so its LRU eviction drops the users'
  prefixes from device (their host copies stay: write-through) and turn 2 loads them back;
- before turn 3 the copies settle and ``flush`` drops device and host, so turn 3 is prefetched
  from storage.

On a GPU (``HICACHE_TEST_DEVICE=cuda``, as the other end-to-end tests) the model and device pool
are there and the CUDA copy engine moves the latents. Every turn's greedy tokens must equal transformers' own ``generate`` (its own KV cache, no reuse),
every step's logits within 1e-4, and each tier must have served tokens (asserted per turn).
``test_latents_loaded_one_page_off_are_caught`` runs the same scenario with host->device loads
that read the host page after the right one and requires the comparison to fail.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("transformers")

from runtime.config import RuntimeConfig  # noqa: E402
from runtime.integrations.hf_mla import PagedMLAModel, mla_geometry  # noqa: E402
from runtime.integrations.serving import ServingLoop  # noqa: E402
from runtime.runtime import CacheRuntime, make_engine  # noqa: E402
from tests.e2e.support import DEVICE, PAGE, ids  # noqa: E402
from tests.e2e.test_differential_tiers import LoadOffByOnePage, settle  # noqa: E402
from tests.e2e.test_differential_tiers import mismatches as tier_mismatches  # noqa: E402

TOL = 1e-4
USERS, TURNS, NEW = 3, 4, 6
SYSTEM = ids(40, 1)
FILLER = ids(300, 99)  # shares nothing with the users' conversations


def mla_config(model, tmp_path) -> RuntimeConfig:
    # 24 device pages: the three conversations' KV (about 5 pages each by turn 2) and little else,
    # so the filler's 20 pages evict them
    layers, width = mla_geometry(model.config)
    return RuntimeConfig(num_layers=layers, num_kv_heads=1, head_dim=width, kv_layout="mla", page_size=PAGE,
                         device=DEVICE, device_slots=384, host_tokens=2048, write_policy="write_through",
                         debug_invariants=True, storage_backend="file", storage_dir=str(tmp_path / "kv"))


def user_msg(u: int, t: int) -> list[int]:
    return ids(16 + 3 * u, 100 * u + t)


async def serve(model, tmp_path, wrap_engine=None):
    """The scenario of the module doc. Returns (results, metrics per turn, stats): results as
    ``mismatches`` takes them, metrics as (turn, TurnMetrics)."""
    cfg = mla_config(model, tmp_path)
    factory = (lambda pools: wrap_engine(make_engine(cfg, *pools["kv"]), cfg)) if wrap_engine else None
    results, metrics = [], []
    async with CacheRuntime.open(cfg, engine_factory=factory) as rt:
        assert rt.device_pool.shape.parts == 1 and len(rt.device_pool.latent) == cfg.num_layers
        async with ServingLoop(rt, PagedMLAModel(model, rt.device_pool), eos_token_ids=[2], record_logits=True,
                               max_running=USERS) as srv:
            async def between_turns(t: int) -> None:
                await settle(rt)
                if t == 1:  # the filler takes the device pool: the users' prefixes go to host only
                    c = await srv.generate(FILLER, max_new_tokens=NEW, rid="filler")
                    results.append(("filler", list(FILLER), c.tokens, c.logits))
                    await settle(rt)
                elif t == 2:
                    assert await rt.flush() > 0
                    assert (await rt.match_prefix(SYSTEM + [5] * PAGE)) == {"device": 0, "host": 0}

            turn_done = asyncio.Barrier(USERS)

            async def conversation(u: int) -> None:
                """User u's turns; after each, the last user to finish it runs `between_turns` while
                the others wait at the barrier."""
                history = list(SYSTEM)
                for t in range(TURNS):
                    history += user_msg(u, t)
                    c = await srv.generate(history, max_new_tokens=NEW, rid=f"u{u}")
                    results.append((f"u{u}t{t}", list(history), c.tokens, c.logits))
                    metrics.append((t, c.metrics))
                    history += c.tokens
                    if await turn_done.wait() == 0:
                        await between_turns(t)
                    await turn_done.wait()

            await asyncio.gather(*(conversation(u) for u in range(USERS)))
        stats = await rt.stats()
    return results, metrics, stats


def mismatches(ref_model, results) -> list[str]:
    return tier_mismatches(ref_model, results, NEW, TOL)


async def test_mla_every_tier_equals_generate(deepseek, ref_deepseek, tmp_path):
    results, metrics, stats = await serve(deepseek, tmp_path)
    assert len(results) == USERS * TURNS + 1
    assert mismatches(ref_deepseek, results) == []
    by_turn = {t: [m for turn, m in metrics if turn == t] for t in range(TURNS)}
    assert all(m.device_tokens > 0 for m in by_turn[1]), [m.device_tokens for m in by_turn[1]]
    assert all(m.host_tokens > 0 for m in by_turn[2]), [(m.device_tokens, m.host_tokens) for m in by_turn[2]]
    assert all(m.storage_tokens > 0 for m in by_turn[3]), [m.storage_tokens for m in by_turn[3]]
    for _, m in metrics:
        assert m.device_tokens + m.host_tokens + m.storage_tokens + m.recomputed_tokens == m.prompt_tokens
    assert stats["device"]["evicted_tokens"] > 0 and stats["copies"]["loads_issued"] > 0
    assert stats["storage"]["written_pages"] > 0 and stats["storage"]["hit_tokens"] > 0
    assert stats["requests"]["live"] == 0 and stats["copies"]["failures"] == 0


async def test_latents_loaded_one_page_off_are_caught(deepseek, ref_deepseek, tmp_path):
    """The planted bug: host->device loads read the host page after the right one. Turn 2's
    load-backs (and what storage prefetch stages through host for turn 3) then give other latents,
    and the comparison with generate must flag those turns."""
    engines: list[LoadOffByOnePage] = []

    def broken(inner, cfg):
        engines.append(LoadOffByOnePage(inner, cfg))
        return engines[-1]

    results, metrics, _ = await serve(deepseek, tmp_path, broken)
    assert engines and engines[0].loads > 0, "nothing was loaded: the planted bug was never exercised"
    bad = {line.split()[0] for line in mismatches(ref_deepseek, results)}
    loaded = {f"u{m.rid[1:]}t{t}" for t, m in metrics if m.host_tokens + m.storage_tokens > 0}
    assert loaded and loaded <= bad, (sorted(loaded), sorted(bad))

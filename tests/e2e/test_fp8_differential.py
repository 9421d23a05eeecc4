"""fp8 KV through the runtime: a tiny random Llama (fp32 weights) whose device, host and storage
pools hold its K/V as ``float8_e4m3fn`` (with per-layer scales, as a calibrated checkpoint has
them) or ``float8_e5m2`` (scales of 1), served by a ``ServingLoop`` over one runtime.

Three users chat concurrently, turn by turn: turn 1 finds the previous turn's KV on device; before
turn 2 a filler as long as the device pool evicts the conversations to host (write-through keeps
their host copies) and turn 2 loads them back; before turn 3 ``flush`` drops device and host, so
turn 3 is prefetched from storage. Each tier must have served tokens (asserted).

The reference is the same adapter over a fresh fp8 pool of its own that prefills each whole
prompt and decodes, with no cache and no reuse: quantization happens once, when a token's K/V is
written, so a page that went device -> host -> storage -> host -> device and back must give the
same bits, and the tokens must be equal and every step's logits within 1e-3 (measured on this
CPU: 2e-6 to 1.2e-5 through the three tiers; up to 2.7e-4 where fp32 noise of a batched forward
flips one fp8 rounding). Against transformers' own fp32 generate no such check is possible (fp8
rounding moves logits by ~0.3).

``test_pages_quantized_under_other_scales_are_caught``: a second instance whose scales differ
(a recalibration) shares the storage directory. With the same ``weight_version`` it is served the
first instance's bytes and reads them under its own scales: the comparison with its reference
fails. With ``weight_version=KVScales.version()`` (docs/ARCHITECTURE.md, "KV dtypes") it finds
nothing in storage and is right.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from runtime.integrations.hf_llama import KVScales, PagedKVModel, PagedSeq, calibrate_kv_scales  # noqa: E402
from runtime.runtime import CacheRuntime  # noqa: E402
from tests.e2e.support import DEVICE, ids, runtime_config  # noqa: E402
from tests.e2e.test_differential_tiers import NEW, evict_to_host, serve_turns, settle  # noqa: E402
from tests.e2e.test_differential_tiers import mismatches as tier_mismatches  # noqa: E402

# fp32 noise between a ragged batch and one sequence (~1e-6) can flip one fp8 rounding, which moves
# a logit by up to ~3e-4 (measured); a page read under wrong scales changes the tokens
TOL = 1e-3
DEVICE_SLOTS = 384
FP8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def scales_for(model, kv_dtype: str) -> KVScales | None:
    # e4m3 with calibrated scales (the common checkpoint case), e5m2 without (values cast as they are)
    return calibrate_kv_scales(model, ids(256, 77), FP8[kv_dtype]) if kv_dtype == "float8_e4m3fn" else None


def paged_reference(model, prompt: list[int], new: int, dtype: torch.dtype, scales: KVScales | None):
    """Greedy tokens and their logits from the adapter over a fresh pool: prefill, then decode."""
    layers = model.config.num_hidden_layers
    geometry = (len(prompt) + new, model.config.num_key_value_heads, model.config.head_dim)
    pool = SimpleNamespace(k=[torch.zeros(geometry, dtype=dtype, device=DEVICE) for _ in range(layers)],
                           v=[torch.zeros(geometry, dtype=dtype, device=DEVICE) for _ in range(layers)])
    paged = PagedKVModel(model, pool, kv_scales=scales)
    tokens, logits, step_ids, start = [], [], list(prompt), 0
    for _ in range(new):
        out = paged([PagedSeq(list(range(start + len(step_ids))), start, step_ids)])
        lg = out.logits[0]
        tok = int(lg.argmax())
        tokens.append(tok)
        logits.append(lg)
        if tok == 2:  # eos, as the serving loop stops
            break
        start, step_ids = start + len(step_ids), [tok]
    return tokens, logits


def mismatches(model, results, dtype: torch.dtype, scales: KVScales | None) -> list[str]:
    def reference(m, prompt, new, return_logits):
        return paged_reference(m, prompt, new, dtype, scales)

    return tier_mismatches(model, results, NEW, TOL, reference)


async def serve(model, cfg, scales: KVScales | None, *, tiers: bool = True):
    """The module doc's three turns (``tiers=False``: one turn, nothing evicted or flushed)."""
    async with CacheRuntime.open(cfg) as rt:
        assert rt.device_pool.k[0].dtype == FP8[cfg.kv_dtype]

        async def between_turns(t: int, srv) -> None:
            if t == 0:
                await evict_to_host(rt, srv, DEVICE_SLOTS)
            else:
                await settle(rt)
                assert await rt.flush() > 0

        paged = PagedKVModel(model, rt.device_pool, kv_scales=scales)
        results, metrics = await serve_turns(rt, model, between_turns if tiers else None, paged=paged,
                                             turns=3 if tiers else 1)
        await settle(rt)
        stats = await rt.stats()
    return results, metrics, stats


@pytest.mark.parametrize("kv_dtype", sorted(FP8))
async def test_fp8_every_tier_equals_the_no_reuse_reference(model, tmp_path, kv_dtype):
    scales = scales_for(model, kv_dtype)
    cfg = runtime_config(model, device_slots=DEVICE_SLOTS, kv_dtype=kv_dtype, storage_backend="file",
                         storage_dir=str(tmp_path / "kv"))
    results, metrics, stats = await serve(model, cfg, scales)
    assert mismatches(model, results, FP8[kv_dtype], scales) == []
    per_turn = {t: [m for tt, m in metrics if tt == t] for t in range(3)}
    assert sum(m.device_tokens for m in per_turn[0] + per_turn[1]) > 0
    assert all(m.host_tokens > 0 for m in per_turn[1]), [m.host_tokens for m in per_turn[1]]
    assert all(m.storage_tokens > 0 for m in per_turn[2]), [m.storage_tokens for m in per_turn[2]]
    assert stats["storage"]["hit_tokens"] > 0


async def test_pages_quantized_under_other_scales_are_caught(model, tmp_path):
    kv_dtype = "float8_e4m3fn"
    scales = scales_for(model, kv_dtype)
    # a recalibration: other scales, the same model and checkpoint
    other = KVScales(tuple(2 * x for x in scales.k), tuple(2 * x for x in scales.v))
    base = dict(device_slots=DEVICE_SLOTS, kv_dtype=kv_dtype, storage_backend="file", storage_dir=str(tmp_path / "kv"))
    first = runtime_config(model, **base)
    results, _, _ = await serve(model, first, scales, tiers=False)
    assert mismatches(model, results, FP8[kv_dtype], scales) == []

    # the same weight_version: served the first instance's bytes, read under other scales
    results, metrics, _ = await serve(model, first, other, tiers=False)
    assert sum(m.storage_tokens for _, m in metrics) > 0
    assert mismatches(model, results, FP8[kv_dtype], other) != []

    # the scales folded into the identity: nothing in storage is theirs
    versioned = first.replace(weight_version=other.version())
    results, metrics, _ = await serve(model, versioned, other, tiers=False)
    assert sum(m.storage_tokens for _, m in metrics) == 0
    assert mismatches(model, results, FP8[kv_dtype], other) == []

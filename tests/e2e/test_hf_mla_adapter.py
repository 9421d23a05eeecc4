"""The DeepSeek-V3 MLA adapter (runtime.integrations.hf_mla): one latent per token in the pool.

Differential against transformers' own forward / generate on the same weights (fp32, a tiny random
DeepSeek-V3 with q_lora_rank, interleaved RoPE, YaRN's mscale and a MoE layer). The pool starts
filled with NaN, so reading a slot that was never written, or a padded row writing, shows.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from runtime.integrations.hf_llama import PagedSeq, greedy_generate_reference  # noqa: E402
from runtime.integrations.hf_mla import PagedMLAModel, mla_geometry, mla_shape, tiny_deepseek_v3  # noqa: E402
from runtime.memory.pools import DevicePool, KVShape  # noqa: E402

TOL = 1e-4
NUM_SLOTS = 512


@pytest.fixture(scope="module")
def model():
    return tiny_deepseek_v3(seed=0)


@pytest.fixture(scope="module")
def ref_model():
    return tiny_deepseek_v3(seed=0)  # the same weights, never hooked


def nan_pool(model) -> DevicePool:
    pool = DevicePool(mla_shape(model), NUM_SLOTS, 16)
    pool.buffer.fill_(float("nan"))
    return pool


def ref_logits(ref_model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return ref_model(ids[None], use_cache=False).logits[0]


def rand_ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed))


def test_geometry_and_shape(model):
    assert mla_geometry(model.config) == (3, 48)
    assert mla_shape(model) == KVShape(3, 1, 48, torch.float32, parts=1)
    assert mla_shape(model, torch.bfloat16).bytes_per_token == 3 * 48 * 2
    # the model has what the adapter must replicate: a MoE layer, q LoRA, interleaved RoPE, mscale
    cfg = model.config
    assert cfg.first_k_dense_replace < cfg.num_hidden_layers and cfg.q_lora_rank and cfg.rope_interleave
    attn = model.model.layers[0].self_attn
    assert attn.scaling > attn.qk_head_dim ** -0.5


def test_prefill_writes_the_latent_transformers_caches(model, ref_model):
    """Prefill logits equal the model's own; each written slot holds exactly the latent that
    transformers' DynamicCache holds for that position (normalized c_kv ‖ rotated k_pe)."""
    pool = nan_pool(model)
    pm = PagedMLAModel(model, pool)
    ids = rand_ids(40, 0)
    slots = torch.randperm(NUM_SLOTS, generator=torch.Generator().manual_seed(1))[:40]
    out = pm([PagedSeq(slots, 0, ids)], return_all_logits=True)
    assert (out.all_logits[0] - ref_logits(ref_model, ids)).abs().max().item() < TOL
    with torch.inference_mode():
        cache = ref_model(ids[None], use_cache=True).past_key_values
    for layer in range(3):
        c_kv, k_pe = cache.layers[layer].keys[0, 0], cache.layers[layer].values[0, 0]  # [n, rank], [n, rope]
        stored = pool.latent[layer][slots, 0]
        assert torch.allclose(stored, torch.cat((c_kv, k_pe), dim=-1), atol=1e-6)
    assert int(torch.isfinite(pool.buffer).all(-1).all(-1).sum()) == 3 * 40  # no other slot written
    # a hooked model still runs its own forward (transformers' attention and cache)
    with torch.inference_mode():
        own = model(ids[None]).logits[0]
    assert (own - ref_logits(ref_model, ids)).abs().max().item() < TOL


def test_ragged_batch_with_a_cached_prefix_matches_forward(model, ref_model):
    """One batch: an extend over a 16-token prefix cached by an earlier forward, a fresh prefill and
    a decode step over a 25-token prefix: every new position's logits within 1e-4."""
    pool = nan_pool(model)
    pm = PagedMLAModel(model, pool)
    specs = [(16, 37), (0, 9), (25, 26)]  # (cached, total)
    seqs_ids = [rand_ids(total, 10 + i) for i, (_, total) in enumerate(specs)]
    perm = torch.randperm(NUM_SLOTS, generator=torch.Generator().manual_seed(7)).tolist()
    slots, at = [], 0
    for _, total in specs:
        slots.append(perm[at:at + total])
        at += total
    for (cached, _), ids, sl in zip(specs, seqs_ids, slots):
        if cached:
            pm([PagedSeq(sl[:cached], 0, ids[:cached])])
    out = pm([PagedSeq(sl, cached, ids[cached:]) for (cached, _), ids, sl in zip(specs, seqs_ids, slots)],
             return_all_logits=True)
    for (cached, _), ids, got, last in zip(specs, seqs_ids, out.all_logits, out.logits):
        want = ref_logits(ref_model, ids)[cached:]
        assert (got - want).abs().max().item() < TOL
        assert (last - want[-1]).abs().max().item() < TOL


def test_prefix_then_decode_equals_generate(model, ref_model):
    pool = nan_pool(model)
    pm = PagedMLAModel(model, pool)
    prompt, n_new = rand_ids(33, 2), 12
    slots = list(range(100, 100 + len(prompt) + n_new))
    want, want_logits = greedy_generate_reference(ref_model, prompt, n_new, return_logits=True)
    pm([PagedSeq(slots[:16], 0, prompt[:16])])
    logits = pm([PagedSeq(slots[:len(prompt)], 16, prompt[16:])]).logits[0]
    tokens, total = [], len(prompt)
    for step in range(len(want)):
        assert (logits - want_logits[step]).abs().max().item() < TOL, step
        tokens.append(int(logits.argmax()))
        total += 1
        logits = pm([PagedSeq(slots[:total], total - 1, tokens[-1:])]).logits[0]
    assert tokens == want


def test_wrong_pools_are_refused(model):
    with pytest.raises(ValueError, match="latent layers"):
        PagedMLAModel(model, DevicePool(KVShape(3, 1, 48, torch.float32), 64, 16))  # K and V: no latent
    with pytest.raises(ValueError, match="expected"):
        PagedMLAModel(model, DevicePool(KVShape(3, 1, 40, torch.float32, parts=1), 64, 16))
    with pytest.raises(ValueError, match="latent layers"):
        PagedMLAModel(model, DevicePool(KVShape(2, 1, 48, torch.float32, parts=1), 64, 16))

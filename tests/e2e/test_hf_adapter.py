"""The Hugging Face Llama adapter (runtime.integrations.hf_llama): attention through the pool.

Differential against transformers' own forward/generate on the same weights (fp32, tiny
random model). Pools start filled with NaN so reading a slot that was never written, or
writing a padded row, shows up as NaN or as a changed slot.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

pytest.importorskip("transformers")

from runtime.integrations.hf_llama import (  # noqa: E402
    ATTN_NAME,
    KVScales,
    PagedKVModel,
    PagedSeq,
    calibrate_kv_scales,
    greedy_generate_reference,
    kv_geometry,
)
from tests.e2e.support import PAGE, TOL, batch_or_singly  # noqa: E402

NUM_SLOTS = 512


class StandInPool:
    """Same data attributes as runtime.memory.pools.DevicePool (k[l] / v[l]: [slots, H, D])."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, num_slots: int, dtype=torch.float32) -> None:
        self.buffer = torch.zeros((2, layers, num_slots, kv_heads, head_dim), dtype=dtype)
        self.k = [self.buffer[0, i] for i in range(layers)]
        self.v = [self.buffer[1, i] for i in range(layers)]


def make_pool(kind: str, model, num_slots: int = NUM_SLOTS, dtype=torch.float32):
    layers, kv_heads, head_dim = kv_geometry(model.config)
    if kind == "device_pool":
        pools = pytest.importorskip("runtime.memory.pools")
        pool = pools.DevicePool(pools.KVShape(layers, kv_heads, head_dim, dtype), num_slots, PAGE, "cpu")
    else:
        pool = StandInPool(layers, kv_heads, head_dim, num_slots, dtype)
    for t in (*pool.k, *pool.v):
        t.fill_(float("nan"))
    return pool


def ref_logits(ref_model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return ref_model(ids[None], use_cache=False).logits[0]


def rand_ids(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g)


def rand_slots(n: int, seed: int, num_slots: int = NUM_SLOTS) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randperm(num_slots, generator=g)[:n]


@pytest.mark.parametrize("pool_kind", ["stand_in", "device_pool"])
def test_prefill_matches_model_forward(model, ref_model, pool_kind):
    pool = make_pool(pool_kind, model)
    pm = PagedKVModel(model, pool)
    ids, slots = rand_ids(48, 0), rand_slots(48, 0)
    out = pm([PagedSeq(slots, 0, ids)], return_all_logits=True)
    ref = ref_logits(ref_model, ids)
    assert out.logits.shape == (1, model.config.vocab_size)
    assert torch.isfinite(out.all_logits[0]).all()
    assert (out.all_logits[0] - ref).abs().max().item() < TOL
    assert (out.logits[0] - ref[-1]).abs().max().item() < TOL
    # exactly the request's slots were written
    written = torch.isfinite(pool.k[0]).all(dim=(1, 2)).nonzero().squeeze(1)
    assert sorted(written.tolist()) == sorted(slots.tolist())
    # a model in paged mode still runs its own forward (SDPA fallback)
    assert model.config._attn_implementation == ATTN_NAME
    with torch.inference_mode():
        own = model(ids[None]).logits[0]
    assert (own - ref).abs().max().item() < TOL


def test_prefix_extend_decode_matches_generate(model, ref_model):
    pool = make_pool("stand_in", model)
    pm = PagedKVModel(model, pool)
    prompt = rand_ids(40, 1)
    n_new = 24
    slots = rand_slots(len(prompt) + n_new, 1)
    ref_tokens, ref_step_logits = greedy_generate_reference(ref_model, prompt, n_new, return_logits=True)
    assert len(ref_tokens) >= 8

    # cached prefix of 16, then the rest of the prompt as an extend (start > 0)
    pm([PagedSeq(slots[:16], 0, prompt[:16])])
    out = pm([PagedSeq(slots[: len(prompt)], 16, prompt[16:])], return_all_logits=True)
    full = ref_logits(ref_model, prompt)
    assert (out.all_logits[0] - full[16:]).abs().max().item() < TOL

    tokens, total = [], len(prompt)
    logits = out.logits[0]
    for step in range(len(ref_tokens)):
        assert (logits - ref_step_logits[step]).abs().max().item() < TOL, step
        tok = int(logits.argmax())
        tokens.append(tok)
        if step + 1 == len(ref_tokens):
            break
        total += 1
        logits = pm([PagedSeq(slots[:total], total - 1, [tok])]).logits[0]
    assert tokens == ref_tokens


@pytest.mark.parametrize("pool_kind", ["stand_in", "device_pool"])
def test_ragged_batch_equals_one_by_one(model, ref_model, pool_kind):
    # (cached prefix, total length) per sequence: extend, fresh prefill, decode step
    specs = [(10, 30), (0, 7), (25, 26)]
    seqs_ids = [rand_ids(total, 10 + i) for i, (_, total) in enumerate(specs)]
    perm = torch.randperm(NUM_SLOTS, generator=torch.Generator().manual_seed(7))
    seqs_slots, at = [], 0
    for _, total in specs:
        seqs_slots.append(perm[at : at + total])
        at += total

    def run(batched: bool):
        pool = make_pool(pool_kind, model)
        pm = PagedKVModel(model, pool)
        for (cached, _), ids, slots in zip(specs, seqs_ids, seqs_slots):
            if cached:
                pm([PagedSeq(slots[:cached], 0, ids[:cached])])
        batch = [PagedSeq(slots, cached, ids[cached:]) for (cached, _), ids, slots in zip(specs, seqs_ids, seqs_slots)]
        return pool, *batch_or_singly(pm, batch, batched=batched)

    pool_b, last_b, all_b = run(batched=True)
    pool_s, last_s, all_s = run(batched=False)
    assert torch.isfinite(last_b).all()
    assert (last_b - last_s).abs().max().item() < TOL
    for i, ((cached, total), ids) in enumerate(zip(specs, seqs_ids)):
        assert all_b[i].shape == (total - cached, model.config.vocab_size)
        assert (all_b[i] - all_s[i]).abs().max().item() < TOL
        assert (all_b[i] - ref_logits(ref_model, ids)[cached:]).abs().max().item() < TOL
    # same pool contents; padded rows wrote nothing (slots of no sequence are still NaN)
    used = torch.cat(seqs_slots)
    unused = torch.ones(NUM_SLOTS, dtype=torch.bool)
    unused[used] = False
    for layer in range(len(pool_b.k)):
        for a, b in ((pool_b.k[layer], pool_s.k[layer]), (pool_b.v[layer], pool_s.v[layer])):
            assert (a[used] - b[used]).abs().max().item() < TOL
            assert torch.isnan(a[unused]).all()


def test_before_layer_order_and_just_in_time_load(model, ref_model):
    layers = model.config.num_hidden_layers
    pool = make_pool("stand_in", model)
    pm = PagedKVModel(model, pool)
    ids, slots = rand_ids(40, 3), rand_slots(40, 3)
    calls: list[int] = []
    pm([PagedSeq(slots[:32], 0, ids[:32])], before_layer=calls.append)
    assert calls == list(range(layers))

    # "host" copy of the prefix KV; wipe it from the pool; the hook loads layer i just before
    # layer i reads it, as a layer-wise host->device load would.
    host_k = [pool.k[i][slots[:32]].clone() for i in range(layers)]
    host_v = [pool.v[i][slots[:32]].clone() for i in range(layers)]
    for t in (*pool.k, *pool.v):
        t.fill_(float("nan"))
    calls.clear()

    def load_layer(i: int) -> None:
        calls.append(i)
        if i + 1 < layers:  # later layers are not loaded yet
            assert torch.isnan(pool.k[i + 1][slots[0]]).all()
        pool.k[i][slots[:32]] = host_k[i]
        pool.v[i][slots[:32]] = host_v[i]

    other_ids, other_slots = rand_ids(5, 4), rand_slots(NUM_SLOTS, 3)[40:45]
    out = pm(
        [PagedSeq(slots, 32, ids[32:]), PagedSeq(other_slots, 0, other_ids)],
        before_layer=load_layer,
        return_all_logits=True,
    )
    assert calls == list(range(layers))  # once per layer per forward, in order, also for a batch
    assert (out.all_logits[0] - ref_logits(ref_model, ids)[32:]).abs().max().item() < TOL
    assert (out.all_logits[1] - ref_logits(ref_model, other_ids)).abs().max().item() < TOL


def test_bad_batches_are_rejected(model):
    pm = PagedKVModel(model, make_pool("stand_in", model))
    with pytest.raises(ValueError):
        pm([PagedSeq([0, 1, 2], 1, [5])])  # 1 + 1 != 3 slots
    with pytest.raises(ValueError):
        pm([PagedSeq([0, 1], 2, [])])  # no new tokens
    with pytest.raises(ValueError):
        pm([PagedSeq([0, 1], 0, [5, 6]), PagedSeq([1, 2], 0, [5, 6])])  # slot 1 written twice
    with pytest.raises(IndexError):
        pm([PagedSeq([0, NUM_SLOTS], 0, [5, 6])])
    with pytest.raises(ValueError):
        PagedKVModel(model, StandInPool(4, 2, 16, 64))  # wrong head_dim


def test_low_precision_pool_casts(model, ref_model):
    pool = make_pool("stand_in", model, dtype=torch.bfloat16)
    pm = PagedKVModel(model, pool)
    ids, slots = rand_ids(32, 5), rand_slots(33, 5)
    pm([PagedSeq(slots[:32], 0, ids)])
    out = pm([PagedSeq(slots[:33], 32, [7])])
    ref = ref_logits(ref_model, torch.cat([ids, torch.tensor([7])]))[-1]
    assert out.logits.dtype == torch.float32
    assert (out.logits[0] - ref).abs().max().item() < 5e-2


def test_fp8_pool_with_scales(model):
    """An fp8 pool holds K/V / scale and attention reads fp8 * scale: the pool's bytes are the
    scaled values' fp8 encodings, and scales are refused where they mean nothing."""
    layers = model.config.num_hidden_layers
    scales = calibrate_kv_scales(model, rand_ids(64, 3).tolist())
    assert len(scales.k) == layers and all(0 < x < 1 for x in scales.k + scales.v)
    assert scales.version() == calibrate_kv_scales(model, rand_ids(64, 3).tolist()).version()
    assert scales.version() != KVScales(tuple(2 * x for x in scales.k), scales.v).version()
    pool = make_pool("stand_in", model, dtype=torch.float8_e4m3fn)
    fp32 = make_pool("stand_in", model)
    ids, slots = rand_ids(32, 5), rand_slots(32, 5)
    got = PagedKVModel(model, pool, kv_scales=scales)([PagedSeq(slots, 0, ids)]).logits
    exact = PagedKVModel(model, fp32)([PagedSeq(slots, 0, ids)]).logits
    assert (got - exact).abs().max().item() < 1.0  # fp8 rounding (~0.3 here); reads without the scales: 4.8
    # layer 0's K/V depend on the embeddings alone (later layers see fp8 attention's outputs)
    for got, exact, scale in ((pool.k[0], fp32.k[0], scales.k[0]), (pool.v[0], fp32.v[0], scales.v[0])):
        want = (exact[slots] / scale).to(torch.float8_e4m3fn)
        assert torch.equal(got[slots].view(torch.uint8), want.view(torch.uint8))
    with pytest.raises(ValueError):
        PagedKVModel(model, fp32, kv_scales=scales)  # an fp32 pool has no scales
    with pytest.raises(ValueError):
        PagedKVModel(model, pool, kv_scales=KVScales(scales.k[:1], scales.v[:1]))  # one layer of four
    with pytest.raises(ValueError):
        KVScales((1.0, 0.0), (1.0, 1.0))


@pytest.mark.slow
def test_smollm2_smoke(tmp_path_factory):
    pytest.importorskip("gguf")
    from runtime.integrations.hf_llama import load_smollm2, smollm2_package_dir

    try:
        smollm2_package_dir()
    except (ModuleNotFoundError, FileNotFoundError) as e:
        pytest.skip(str(e))
    cache = os.environ.get("HICACHE_MODEL_CACHE") or str(tmp_path_factory.mktemp("models"))
    model, tok = load_smollm2(cache)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    prompt = tok(text, return_tensors="pt").input_ids[0]
    n_new = 8
    layers, kv_heads, head_dim = kv_geometry(model.config)
    pool = StandInPool(layers, kv_heads, head_dim, 256)
    pm = PagedKVModel(model, pool)
    slots = torch.arange(len(prompt) + n_new)
    logits = pm([PagedSeq(slots[: len(prompt)], 0, prompt)]).logits[0]
    tokens, total = [], len(prompt)
    for _ in range(n_new):
        tok_id = int(logits.argmax())
        tokens.append(tok_id)
        if tok_id == tok.eos_token_id:
            break
        total += 1
        logits = pm([PagedSeq(slots[:total], total - 1, [tok_id])]).logits[0]
    answer = tok.decode(tokens, skip_special_tokens=True)
    assert "paris" in answer.lower()
    ref = greedy_generate_reference(model, prompt, len(tokens))
    assert tokens[: len(ref)] == ref


def test_llama3_8b_random_builds_in_place_and_runs_paged():
    """The serving benchmark's Llama-3-8B-size model, scaled down (its builder, its config's other
    fields): made on the meta device and filled in place, deterministic in the seed, rotary
    frequencies computed (not left as uninitialized memory), and the paged forward matches
    transformers' own on it (float32 here; bf16 on the GPU)."""
    from runtime.integrations.hf_llama import LLAMA3_8B_CONFIG, llama3_8b_random

    small = dict(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=512)
    m = llama3_8b_random("cpu", seed=3, dtype=torch.float32, **small)
    again = llama3_8b_random("cpu", seed=3, dtype=torch.float32, **small)
    assert m.config.rms_norm_eps == LLAMA3_8B_CONFIG["rms_norm_eps"] and m.config.num_key_value_heads == 2
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), again.parameters()))
    assert all(torch.isfinite(p).all() for p in m.parameters())
    rotary = m.model.rotary_emb
    expect = type(rotary)(m.config)
    assert torch.equal(rotary.inv_freq, expect.inv_freq) and torch.equal(rotary.original_inv_freq, expect.inv_freq)
    ref = copy.deepcopy(m)
    ref.set_attn_implementation("sdpa")
    pool = make_pool("stand_in", m)
    ids, slots = rand_ids(40, 1), rand_slots(40, 1)
    out = PagedKVModel(m, pool)([PagedSeq(slots, 0, ids)], return_all_logits=True)
    assert (out.all_logits[0] - ref_logits(ref, ids)).abs().max().item() < TOL

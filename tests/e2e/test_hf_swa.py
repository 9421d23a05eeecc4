"""The sliding-window adapter (runtime.integrations.hf_swa): a tiny random Gemma 3 text model
(layers sliding, sliding, full, sliding; window 20) with its K/V in the pool.

Differential against transformers' own forward/generate on the same weights (fp32), prompts
longer than the window; also a Mistral config (every layer sliding). The window rule: a forward
computing positions ``start ..`` of a sequence reads, in the sliding layers, only positions
``start - W + 1 ..``: NaN in every slot before that (sliding layers only) leaves the outputs
bit-identical, while one slot at the first position inside the window, zeroed as if its KV had
been dropped, fails the same logit comparison the differential tests use. With the runtime's
sliding pool (``swa_pool``, ``swa_map``) the sliding layers are read and written through the map,
and a window that would read an unmapped (dropped) slot raises.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from runtime.integrations.hf_llama import TINY_CONFIG, PagedSeq, greedy_generate_reference, random_model  # noqa: E402
from runtime.integrations.hf_swa import (  # noqa: E402
    PagedSWAModel,
    kv_shape,
    sliding_layers,
    tiny_gemma3,
    window_start,
)
from tests.e2e.test_hf_adapter import make_pool, rand_ids, rand_slots, ref_logits  # noqa: E402

TOL = 1e-4  # max abs logit difference from transformers' own forward (fp32)
WINDOW = 20
SLIDING, FULL = (0, 1, 3), (2,)


@pytest.fixture(scope="module")
def model():
    return tiny_gemma3(seed=0, window=WINDOW)


@pytest.fixture(scope="module")
def ref_model(model):
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")  # transformers' own attention, masks and sliding-window cache
    return ref


def off_by(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got - want).abs().max().item()


def test_layers_windows_and_shape(model, ref_model):
    assert sliding_layers(model) == {layer: WINDOW for layer in SLIDING}
    shape = kv_shape(model)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype) == (4, 2, 32, torch.float32)
    assert [window_start(s, WINDOW) for s in (0, 18, 19, 20, 45)] == [0, 0, 0, 1, 26]
    # the window matters for these prompts: the same weights with a window longer than the prompt differ
    ids = rand_ids(50, 0)
    wide = tiny_gemma3(seed=0, window=4096)
    wide.set_attn_implementation("sdpa")
    got, want = ref_logits(wide, ids), ref_logits(ref_model, ids)
    assert off_by(got[WINDOW:], want[WINDOW:]) > 1e-2 and off_by(got[:WINDOW], want[:WINDOW]) < TOL


@pytest.mark.parametrize("pool_kind", ["stand_in", "device_pool"])
def test_prefill_longer_than_window_matches_forward(model, ref_model, pool_kind):
    pool = make_pool(pool_kind, model)
    pm = PagedSWAModel(model, pool)
    ids, slots = rand_ids(70, 1), rand_slots(70, 1)
    out = pm([PagedSeq(slots, 0, ids)], return_all_logits=True)
    ref = ref_logits(ref_model, ids)
    assert torch.isfinite(out.all_logits[0]).all()
    assert off_by(out.all_logits[0], ref) < TOL
    # a model in paged mode still runs its own forward (SDPA fallback, sliding masks included)
    with torch.inference_mode():
        own = model(ids[None]).logits[0]
    assert off_by(own, ref) < TOL


def test_cached_prefix_extend_decode_matches_generate(model, ref_model):
    prefix_extend_decode(model, ref_model)


def prefix_extend_decode(model, ref_model) -> None:
    """A cached prefix longer than the window, the rest of the prompt as an extend, then greedy
    decoding: logits of every step and the tokens equal transformers' own ``generate``."""
    pm = PagedSWAModel(model, make_pool("stand_in", model))
    prompt, n_new = rand_ids(45, 2), 12
    slots = rand_slots(len(prompt) + n_new, 2)
    want, want_logits = greedy_generate_reference(ref_model, prompt, n_new, return_logits=True)
    assert len(want) == n_new
    pm([PagedSeq(slots[:24], 0, prompt[:24])])  # cached prefix longer than the window
    out = pm([PagedSeq(slots[: len(prompt)], 24, prompt[24:])], return_all_logits=True)
    assert off_by(out.all_logits[0], ref_logits(ref_model, prompt)[24:]) < TOL
    tokens, total, logits = [], len(prompt), out.logits[0]
    for step in range(n_new):
        assert off_by(logits, want_logits[step]) < TOL, step
        tokens.append(int(logits.argmax()))
        total += 1
        logits = pm([PagedSeq(slots[:total], total - 1, tokens[-1:])]).logits[0]
    assert tokens == want


# (cached prefix, total length) per sequence: extend past the window, fresh prefill longer than
# the window, decode step far past it, extend whose window starts inside the prefix, short prefill
SPECS = [(30, 61), (0, 33), (44, 45), (25, 38), (0, 7)]


def ragged_setup(model, pool_kind: str = "stand_in"):
    """A pool with each sequence's cached prefix written, and the ragged batch of the rest."""
    ids = [rand_ids(total, 10 + i) for i, (_, total) in enumerate(SPECS)]
    perm = torch.randperm(512, generator=torch.Generator().manual_seed(7))
    slots, at = [], 0
    for _, total in SPECS:
        slots.append(perm[at : at + total])
        at += total
    pool = make_pool(pool_kind, model)
    pm = PagedSWAModel(model, pool)
    for (cached, _), i, s in zip(SPECS, ids, slots, strict=True):
        if cached:
            pm([PagedSeq(s[:cached], 0, i[:cached])])
    batch = [PagedSeq(s, cached, i[cached:]) for (cached, _), i, s in zip(SPECS, ids, slots, strict=True)]
    return pool, pm, slots, batch


@pytest.fixture(scope="module")
def ragged_ref(ref_model) -> list[torch.Tensor]:
    """transformers' logits of the ragged batch's new positions, per sequence."""
    return [ref_logits(ref_model, rand_ids(total, 10 + i))[cached:] for i, (cached, total) in enumerate(SPECS)]


def batch_errors(ragged_ref, out) -> list[float]:
    return [off_by(got, want) for got, want in zip(out.all_logits, ragged_ref, strict=True)]


@pytest.mark.parametrize("pool_kind", ["stand_in", "device_pool"])
def test_ragged_batch_with_cached_prefix_matches_forward(model, ragged_ref, pool_kind):
    _, pm, _, batch = ragged_setup(model, pool_kind)
    out = pm(batch, return_all_logits=True)
    assert torch.isfinite(out.logits).all()
    assert max(batch_errors(ragged_ref, out)) < TOL


def poison(pool, layers, slots: torch.Tensor, value: float) -> None:
    for layer in layers:
        pool.k[layer][slots] = value
        pool.v[layer][slots] = value


def test_kv_outside_every_window_is_never_read(model):
    """NaN in the sliding layers' slots of every position before each sequence's window start
    leaves every output bit-identical; the same NaN in the full layer reaches the outputs (the
    full layers do read them, so the comparison can fail)."""
    pool, pm, slots, batch = ragged_setup(model)
    before = pool.buffer.clone()
    clean = pm(batch, return_all_logits=True)
    # transformers' convention, written out here (not through the adapter's window_start)
    outside = torch.cat([s[: max(0, seq.start - WINDOW + 1)] for s, seq in zip(slots, batch, strict=True)])
    assert outside.numel() > 20  # 11 + 0 + 25 + 6 + 0 positions

    pool.buffer.copy_(before)
    poison(pool, SLIDING, outside, float("nan"))
    out = pm(batch, return_all_logits=True)
    assert torch.equal(out.logits, clean.logits)
    assert all(torch.equal(a, b) for a, b in zip(out.all_logits, clean.all_logits, strict=True))

    pool.buffer.copy_(before)
    poison(pool, FULL, outside, float("nan"))
    assert not torch.isfinite(pm(batch).logits).all()


@pytest.mark.parametrize("layer", SLIDING)
def test_kv_dropped_inside_the_window_is_caught(model, ragged_ref, layer):
    """The broken variant "SWA KV dropped inside the window": the K/V of one sliding layer at the
    first position inside a sequence's window (``start - W + 1``, the off-by-one edge) is zeroed.
    The differential comparison flags that sequence and no other."""
    pool, pm, slots, batch = ragged_setup(model)
    victim = 0  # cached 30: its window starts at position 11
    edge = batch[victim].start - WINDOW + 1
    poison(pool, [layer], slots[victim][edge : edge + 1], 0.0)
    errors = batch_errors(ragged_ref, pm(batch, return_all_logits=True))
    assert errors[victim] > TOL, errors
    assert max(e for b, e in enumerate(errors) if b != victim) < TOL, errors


def test_unsupported_configs_are_rejected(model):
    pool = make_pool("stand_in", model)
    no_window = SimpleNamespace(num_hidden_layers=2, sliding_window=None, layer_types=["sliding_attention"] * 2)
    with pytest.raises(ValueError, match="sliding_window"):
        sliding_layers(no_window)
    for override in (dict(attn_logit_softcapping=50.0), dict(final_logit_softcapping=30.0)):
        with pytest.raises(ValueError, match="softcapping"):
            PagedSWAModel(tiny_gemma3(seed=0, window=WINDOW, **override), pool)


def test_mistral_all_layers_sliding_matches_generate():
    """Not Gemma-specific: a Mistral config has no ``layer_types``, its ``sliding_window`` makes
    every layer sliding (``sliding_layers``), and the same flow equals ``generate``."""
    from transformers import MistralConfig, MistralForCausalLM

    model = random_model(MistralForCausalLM, MistralConfig(**(TINY_CONFIG | dict(sliding_window=WINDOW))), 0,
                         torch.float32)
    assert sliding_layers(model) == {layer: WINDOW for layer in range(4)}
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    prefix_extend_decode(model, ref)


def test_sliding_layers_through_a_pool_of_their_own(model, ref_model):
    """With ``swa_pool`` / ``swa_map`` (the runtime's sliding pool, `sliding_layers`): the full
    layer in a one-layer pool, the sliding ones in a three-layer pool of fewer slots, read and
    written at ``swa_map[slots]``. A continuation equals the forward with every slot before its
    window unmapped (-1, as the tree drops them); a window reading an unmapped slot raises."""
    from runtime.memory.pools import DevicePool, KVShape

    full = DevicePool(KVShape(1, 2, 32, torch.float32), 128, 16)
    swa = DevicePool(KVShape(3, 2, 32, torch.float32), 96, 16)
    for t in (*full.k, *full.v, *swa.k, *swa.v):
        t.fill_(float("nan"))
    swa_map = torch.full((128,), -1, dtype=torch.long)
    ids, slots = rand_ids(70, 2), rand_slots(70, 2, num_slots=128)
    swa_map[slots] = torch.randperm(96, generator=torch.Generator().manual_seed(3))[:70]  # any injective map
    pm = PagedSWAModel(model, full, swa_pool=swa, swa_map=swa_map)
    first = pm([PagedSeq(slots[:50], 0, ids[:50])], return_all_logits=True).all_logits[0]
    swa_map[slots[: window_start(50, WINDOW)]] = -1  # outside the continuation's window
    rest = pm([PagedSeq(slots, 50, ids[50:])], return_all_logits=True).all_logits[0]
    assert off_by(torch.cat([first, rest]), ref_logits(ref_model, ids)) < TOL
    swa_map[slots[window_start(60, WINDOW)]] = -1  # the first position of the next forward's window
    with pytest.raises(LookupError, match=f"reads position {window_start(60, WINDOW)}"):
        pm([PagedSeq(slots[:61], 60, ids[60:61])])
    with pytest.raises(ValueError, match="go together"):
        PagedSWAModel(model, full, swa_pool=swa)

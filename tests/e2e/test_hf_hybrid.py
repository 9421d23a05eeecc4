"""The hybrid adapter (runtime.integrations.hf_hybrid): Bamba's attention K/V in the device pool,
its Mamba2 conv and SSM states in a state pool.

Differential against transformers' own forward / generate on the same weights (fp32, tiny
random model built twice from one seed; the reference uses its own cache, no reuse). Pools
start filled with NaN, so reading a KV slot or a state slot that was never written shows up.
HICACHE_TEST_DEVICE=cuda puts the models and both pools on the GPU.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from runtime.errors import ValidationError  # noqa: E402
from runtime.integrations.hf_hybrid import (  # noqa: E402
    CONV,
    SSM,
    HybridSeq,
    PagedHybridModel,
    attention_kv_shape,
    state_shape,
)
from runtime.integrations.hf_llama import greedy_generate_reference  # noqa: E402
from runtime.memory.pools import DevicePool  # noqa: E402
from runtime.memory.state_pool import StatePool  # noqa: E402
from tests.e2e.support import DEVICE, PAGE, batch_or_singly  # noqa: E402

TOL = 1e-4  # max abs logit difference from transformers' own forward (fp32)
KV_SLOTS = 512
STATE_SLOTS = 16


def make_adapter(model) -> PagedHybridModel:
    kv = DevicePool(attention_kv_shape(model), KV_SLOTS, PAGE, DEVICE)
    states = StatePool(state_shape(model), STATE_SLOTS, DEVICE)
    kv.buffer.fill_(float("nan"))
    for b in states.buffers.values():
        b.fill_(float("nan"))
    return PagedHybridModel(model, kv, states)


def ref_logits(ref, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return ref(ids[None].to(DEVICE), use_cache=False, logits_to_keep=0).logits[0]


def rand_ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed))


def rand_slots(n: int, seed: int) -> torch.Tensor:
    return torch.randperm(KV_SLOTS, generator=torch.Generator().manual_seed(1000 + seed))[:n]


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def written_states(pm: PagedHybridModel) -> set[int]:
    conv = pm.state_pool.buffers[CONV]  # [L, S, ...]
    return set(torch.isfinite(conv.flatten(2)).all(dim=2).all(dim=0).nonzero().flatten().tolist())


def test_greedy_decode_matches_generate(bamba, ref_bamba):
    pm = make_adapter(bamba)
    prompt, n_new = rand_ids(40, 1), 12
    slots = rand_slots(len(prompt) + n_new, 1)
    ref_tokens, ref_step_logits = greedy_generate_reference(ref_bamba, prompt, n_new, return_logits=True)
    assert len(ref_tokens) == n_new

    out = pm([HybridSeq(slots[: len(prompt)], 0, prompt, state_slot=3)], return_all_logits=True)
    assert diff(out.all_logits[0], ref_logits(ref_bamba, prompt)) < TOL
    tokens, total, logits = [], len(prompt), out.logits[0]
    for step in range(n_new):
        assert diff(logits, ref_step_logits[step]) < TOL, step
        tokens.append(int(logits.argmax()))
        if step + 1 == n_new:
            break
        total += 1
        logits = pm([HybridSeq(slots[:total], total - 1, [tokens[-1]], state_slot=3)]).logits[0]
    assert tokens == ref_tokens
    # the prefill started from zeros (the NaN in slot 3 was never read); only slot 3 was written
    assert written_states(pm) == {3}


def test_layers_hook_and_own_forward(bamba, ref_bamba):
    pm = make_adapter(bamba)
    assert (pm.attention_layers, pm.recurrent_layers) == ((1, 3), (0, 2))
    ids = rand_ids(21, 2)
    seen: list[int] = []
    pm([HybridSeq(rand_slots(21, 2), 0, ids, state_slot=0)], before_layer=seen.append)
    assert seen == [0, 1, 2, 3]
    # outside an adapter forward the model is transformers' own (its Mamba2 path, SDPA attention),
    # and so is a deep copy, whose mixers are its own (not the original's)
    twin = copy.deepcopy(bamba)
    with torch.no_grad():
        for prm in bamba.model.layers[0].mamba.parameters():
            prm.add_(1.0)  # detune the original: the copy must not run these weights
        try:
            with torch.inference_mode():
                twin_logits = twin(ids[None].to(DEVICE), logits_to_keep=0).logits[0]
        finally:
            for prm in bamba.model.layers[0].mamba.parameters():
                prm.sub_(1.0)
        with torch.inference_mode():
            own = bamba(ids[None].to(DEVICE), logits_to_keep=0).logits[0]
    assert diff(own, ref_logits(ref_bamba, ids)) < TOL
    assert diff(twin_logits, own) < TOL


def test_ragged_batch_equals_single_runs(bamba, ref_bamba):
    # (cached prefix, total, snapshot position or None) per sequence: extend from the request's
    # own state, fresh prefill with a snapshot inside, one-token decode with a snapshot at its end
    # (one recurrent batch with the next row), fresh one-token prompt
    specs = [(16, 37, None), (0, 23, 16), (25, 26, 26), (0, 1, None)]
    seqs_ids = [rand_ids(total, 10 + i) for i, (_, total, _) in enumerate(specs)]
    perm = torch.randperm(KV_SLOTS, generator=torch.Generator().manual_seed(7))
    seqs_slots, at = [], 0
    for _, total, _ in specs:
        seqs_slots.append(perm[at : at + total])
        at += total
    snap_slots = {1: 9, 2: 10}

    def run(batched: bool):
        pm = make_adapter(bamba)
        for i, ((cached, _, _), ids, slots) in enumerate(zip(specs, seqs_ids, seqs_slots)):
            if cached:
                pm([HybridSeq(slots[:cached], 0, ids[:cached], state_slot=i)])
        batch = [
            HybridSeq(slots, cached, ids[cached:], state_slot=i, snapshots=((snap, snap_slots[i]),) if snap else ())
            for i, ((cached, _, snap), ids, slots) in enumerate(zip(specs, seqs_ids, seqs_slots))
        ]
        return pm, *batch_or_singly(pm, batch, batched=batched)

    pm_b, last_b, all_b = run(batched=True)
    pm_s, last_s, all_s = run(batched=False)
    assert torch.isfinite(last_b).all()
    assert diff(last_b, last_s) < TOL
    for i, ((cached, total, _), ids) in enumerate(zip(specs, seqs_ids)):
        assert all_b[i].shape == (total - cached, bamba.config.vocab_size)
        assert diff(all_b[i], all_s[i]) < TOL
        assert diff(all_b[i], ref_logits(ref_bamba, ids)[cached:]) < TOL
    # same states in both runs, each sequence's in its own slot, the snapshot in its slot
    assert written_states(pm_b) == written_states(pm_s) == {0, 1, 2, 3, 9, 10}
    alone = make_adapter(bamba)  # a snapshot at 16 is the state a 16-token prefill leaves
    alone([HybridSeq(seqs_slots[1][:16], 0, seqs_ids[1][:16], state_slot=0)])
    for name in (CONV, SSM):
        states = pm_b.state_pool.buffers[name]
        assert diff(states[:, :4], pm_s.state_pool.buffers[name][:, :4]) < TOL
        assert diff(states[:, 9], alone.state_pool.buffers[name][:, 0]) < 1e-5
        assert torch.equal(states[:, 10], states[:, 2])  # a snapshot at the end is the final state


def _snapshot_run(pm: PagedHybridModel, ids: torch.Tensor, slots: torch.Tensor, state_slot: int,
                  snaps: tuple[tuple[int, int], ...]) -> torch.Tensor:
    return pm([HybridSeq(slots, 0, ids, state_slot=state_slot, snapshots=snaps)], return_all_logits=True).all_logits[0]


def test_resume_from_snapshot(bamba, ref_bamba):
    pm = make_adapter(bamba)
    p = 16
    first, perm = rand_ids(40, 3), rand_slots(61, 3)
    slots = perm[:40]
    full = _snapshot_run(pm, first, slots, 0, ((p, 1), (32, 2)))
    assert diff(full, ref_logits(ref_bamba, first)) < TOL

    # a new request: the same first p tokens (KV slots shared, as a tree hit gives them), another
    # tail; it resumes from the snapshot at p into its own state slot
    other = torch.cat([first[:p], rand_ids(20, 4)])
    other_slots = torch.cat([slots[:p], perm[40:60]])
    out = pm([HybridSeq(other_slots, p, other[p:], state_slot=5, state_from=1)], return_all_logits=True)
    assert diff(out.all_logits[0], ref_logits(ref_bamba, other)[p:]) < TOL
    # the first prompt's own tail from the snapshot at 32 (slot 2 is only read)
    again = pm([HybridSeq(slots, 32, first[32:], state_slot=6, state_from=2)], return_all_logits=True)
    assert diff(again.all_logits[0], full[32:]) < TOL
    # and the request's state continues: one decode step from its own slot
    nxt = int(out.logits[0].argmax())
    step = pm([HybridSeq(torch.cat([other_slots, perm[60:]]), len(other), [nxt], state_slot=5)])
    assert diff(step.logits[0], ref_logits(ref_bamba, torch.cat([other, torch.tensor([nxt])]))[-1]) < TOL


def test_broken_resume_is_caught(bamba, ref_bamba):
    """KV of one prefix with the state of another (either way round) gives other logits: the
    differential comparison fails, so a runtime that mixed them could not pass it."""
    pm = make_adapter(bamba)
    p = 16
    first, perm = rand_ids(40, 5), rand_slots(40 + p, 5)
    slots, stranger_slots = perm[:40], perm[40:]
    stranger = rand_ids(p, 6)  # same length, other tokens
    _snapshot_run(pm, first, slots, 0, ((p, 1),))
    _snapshot_run(pm, stranger, stranger_slots, 2, ((p, 3),))
    want = ref_logits(ref_bamba, first)[p:]

    right = pm([HybridSeq(slots, p, first[p:], state_slot=4, state_from=1)], return_all_logits=True)
    assert diff(right.all_logits[0], want) < TOL
    wrong_state = pm([HybridSeq(slots, p, first[p:], state_slot=5, state_from=3)], return_all_logits=True)
    assert diff(wrong_state.all_logits[0], want) > 100 * TOL
    wrong_kv = torch.cat([stranger_slots, slots[p:]])
    wrong_kv_out = pm([HybridSeq(wrong_kv, p, first[p:], state_slot=6, state_from=1)], return_all_logits=True)
    assert diff(wrong_kv_out.all_logits[0], want) > 100 * TOL


def test_invalid_batches_change_nothing(bamba):
    pm = make_adapter(bamba)
    ids, slots = rand_ids(24, 8), rand_slots(24, 8)
    pm([HybridSeq(slots[:16], 0, ids[:16], state_slot=0, snapshots=((16, 1),))])
    kv_before = pm.kv_pool.buffer.clone()
    states_before = {k: v.clone() for k, v in pm.state_pool.buffers.items()}
    good = HybridSeq(slots, 16, ids[16:], state_slot=0)
    bad = [
        [HybridSeq(slots, 16, ids[16:], state_slot=STATE_SLOTS)],  # state slot out of range
        [HybridSeq(slots, 16, ids[16:], state_slot=True)],  # not an int
        [HybridSeq(slots, 0, ids, state_slot=2, state_from=1)],  # state_from on a prefill
        [HybridSeq(slots, 16, ids[16:], state_slot=2, snapshots=((16, 3),))],  # snapshot not after start
        [HybridSeq(slots, 16, ids[16:], state_slot=2, snapshots=((25, 3),))],  # snapshot past the end
        [HybridSeq(slots, 16, ids[16:], state_slot=2, snapshots=((20, 3), (18, 4)))],  # not increasing
        [HybridSeq(slots, 16, ids[16:], state_slot=2, snapshots=((20, 2),))],  # snapshot into its own slot
        [HybridSeq(slots, 16, ids[16:], state_slot=2, snapshots=[(20, 3)])],  # not a tuple
        [HybridSeq(slots, 16, ids[16:], state_slot=2, snapshots=((20.0, 3),))],  # not an int position
        [good, HybridSeq(rand_slots(8, 9), 0, ids[:8], state_slot=0)],  # two rows write state slot 0
        [good, HybridSeq(rand_slots(20, 9), 16, ids[:4], state_slot=5, state_from=0)],  # reads a slot written
        [HybridSeq(slots, 15, ids[16:], state_slot=0)],  # start + new != slots
        [HybridSeq(slots, 16, ids[16:].float(), state_slot=0)],  # float token ids
        [HybridSeq(slots, 16, [512] * 8, state_slot=0)],  # token id out of range
        [HybridSeq(torch.cat([slots[:16], torch.tensor([KV_SLOTS] * 8)]), 16, ids[16:], state_slot=0)],
        [HybridSeq(torch.cat([slots[:16], slots[16:17].repeat(8)]), 16, ids[16:], state_slot=0)],  # KV slot twice
        [],
    ]
    for batch in bad:
        with pytest.raises(ValidationError):
            pm(batch)
    assert torch.equal(pm.kv_pool.buffer.isnan(), kv_before.isnan())
    assert torch.equal(pm.kv_pool.buffer.nan_to_num(), kv_before.nan_to_num())
    for k, v in pm.state_pool.buffers.items():
        assert torch.equal(v.nan_to_num(), states_before[k].nan_to_num()) and torch.equal(v.isnan(), states_before[k].isnan())
    # and the adapter still runs; numpy and 0-d tensor integers are integers
    pm([HybridSeq(slots, np.int64(16), ids[16:], state_slot=torch.tensor(0), snapshots=((np.int32(20), 1),))])


def test_pools_must_fit_the_model(bamba):
    from runtime.errors import ConfigError
    from runtime.memory.pools import KVShape
    from runtime.memory.state_pool import StateComponent, StateShape

    good_kv = DevicePool(attention_kv_shape(bamba), 64, PAGE, DEVICE)
    all_layers = DevicePool(KVShape(4, 2, 16, torch.float32), 64, PAGE, DEVICE)  # every layer, not the attention ones
    states = StatePool(state_shape(bamba), 4, DEVICE)
    with pytest.raises(ConfigError):
        PagedHybridModel(bamba, all_layers, states)
    small_ssm = StateShape(2, (state_shape(bamba).components[0], StateComponent(SSM, (4, 32, 8))))
    with pytest.raises(ConfigError):
        PagedHybridModel(bamba, good_kv, StatePool(small_ssm, 4, DEVICE))
    PagedHybridModel(bamba, good_kv, states)

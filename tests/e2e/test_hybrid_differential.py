"""Differential test of a hybrid model (tiny random Bamba: Mamba2, attention, Mamba2, attention;
fp32) through the runtime: concurrent multi-turn conversations via ``ServingLoop``, whose
attention KV lives in the runtime's device pool and whose recurrent states live in its state pool
(running requests' slots and the tree's snapshots, docs/ARCHITECTURE.md "Recurrent state").
Every turn's greedy tokens equal transformers' own ``generate`` with no reuse and every step's
logits are within 1e-4 (``test_differential_tiers.mismatches``).

Turns run in lockstep; between them the copies settle, then
- after turn 0: nothing, so turn 1 hits its history on device: KV and the state snapshot the
  loop asked for at the last page boundary of the history, together;
- after turn 1: a filler request as long as the device pool evicts the conversations' nodes
  (write-through: their host copies, snapshots included, stay), so turn 2 loads its history
  back from host, KV and state in one load.
Each tier's served tokens and the state hits are asserted > 0. No storage tier: states are not
stored yet (the config refuses it).

Broken variant: a hit that resumes from the snapshot of another node than its KV's
(`RecurrentStates.hit_state` answering with the deepest other snapshot) makes every resumed turn
differ from ``generate`` (`test_state_from_another_node_is_caught`).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from runtime.config import RuntimeConfig  # noqa: E402
from runtime.integrations.hf_hybrid import PagedHybridModel, runtime_fields  # noqa: E402
from runtime.integrations.serving import ServingLoop  # noqa: E402
from runtime.runtime import CacheRuntime  # noqa: E402
from runtime.tree.recurrent import RecurrentStates  # noqa: E402
from tests.e2e.support import DEVICE, PAGE  # noqa: E402
from tests.e2e.test_differential_tiers import evict_to_host, mismatches, serve_turns, settle  # noqa: E402

TOL = 1e-4
TURNS = 3
DEVICE_SLOTS = 512


async def serve(bamba):
    cfg = RuntimeConfig(**runtime_fields(bamba), page_size=PAGE, device=DEVICE, device_slots=DEVICE_SLOTS,
                        host_tokens=2048, write_policy="write_through", debug_invariants=True, state_slots=24)
    async with CacheRuntime.open(cfg) as rt:
        async def between_turns(t: int, srv: ServingLoop) -> None:
            await settle(rt)
            if t == 1:
                await evict_to_host(rt, srv, DEVICE_SLOTS)

        paged = PagedHybridModel(bamba, rt.device_pool, rt.state_pool)
        results, metrics = await serve_turns(rt, bamba, between_turns, paged=paged, turns=TURNS)
        await settle(rt)
        stats = await rt.stats()
    assert stats["copies"]["failures"] == 0 and stats["requests"]["live"] == 0
    return results, metrics, stats


async def test_hybrid_conversations_equal_generate(bamba, ref_bamba):
    results, metrics, stats = await serve(bamba)
    assert mismatches(ref_bamba, results, tol=TOL) == []
    by_turn = {t: [m for u, m in metrics if u == t] for t in range(TURNS)}
    assert all(m.device_tokens > 0 for m in by_turn[1]), [m.device_tokens for m in by_turn[1]]
    assert all(m.host_tokens > 0 for m in by_turn[2]), [m.host_tokens for m in by_turn[2]]
    for _, m in metrics:
        assert m.device_tokens + m.host_tokens + m.storage_tokens + m.recomputed_tokens == m.prompt_tokens
    assert stats["state"]["hits"] >= 6 and stats["state"]["snapshots_kept"] > 0, stats["state"]


async def test_state_from_another_node_is_caught(bamba, ref_bamba, monkeypatch):
    def other_snapshot(self, node):
        if node is None:
            return None
        others = [slot for n, slot in self.node_state.items() if n is not node]
        return others[-1] if others else self.node_state[node]

    monkeypatch.setattr(RecurrentStates, "hit_state", other_snapshot)
    results, metrics, _ = await serve(bamba)
    bad = {line.split()[0] for line in mismatches(ref_bamba, results, tol=TOL)}
    resumed = {rid for (rid, *_), (_, m) in zip(results, metrics, strict=True) if m.device_tokens + m.host_tokens}
    assert len(resumed) == 6 and resumed <= bad, (resumed, bad)  # every turn that resumed: device hits and host loads

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
Each tier's served tokens and the state hits are asserted > 0.

Storage tier (`test_storage_prefetch_equals_generate`): the same conversations over a runtime with
a file storage tier; between turns the copies settle (every backup written through, its snapshot
with it) and ``flush`` drops device and host, so turns 1 and 2 are prefetched from storage: KV
and the snapshot at the deepest stored boundary, read together (docs/ARCHITECTURE.md, "Recurrent
state"). Every later turn's storage-served tokens and the state storage hits are asserted > 0.

Broken variants: a hit that resumes from the snapshot of another node than its KV's
(`RecurrentStates.hit_state` answering with the deepest other snapshot) makes every resumed turn
differ from ``generate`` (`test_state_from_another_node_is_caught`); a storage lookup that asks,
at each page boundary, for the snapshot stored at the boundary one page shallower (its key
derivation fed the previous page's hash), so the read attaches a shallower prefix's state to the
KV it cut to, makes every turn prefetched from storage differ
(`test_storage_state_of_a_shallower_boundary_is_caught`; checked by running it: with the
derivation as built it finds no mismatch and its assertion fails, with the shift every turn it
prefetched mismatches: 5 of the 6 later turns; the sixth found no snapshot to cut to).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from runtime.config import RuntimeConfig  # noqa: E402
from runtime.integrations.hf_hybrid import PagedHybridModel, runtime_fields  # noqa: E402
from runtime.integrations.serving import ServingLoop  # noqa: E402
from runtime.runtime import CacheRuntime  # noqa: E402
from runtime.tree.groups.recurrent import RecurrentStates  # noqa: E402
from tests.e2e.support import DEVICE, PAGE  # noqa: E402
from runtime.messages import StateBlob  # noqa: E402
from tests.e2e.test_differential_tiers import SYSTEM, evict_to_host, mismatches, serve_turns, settle  # noqa: E402

TOL = 1e-4
TURNS = 3
DEVICE_SLOTS = 512


def hybrid_config(bamba, **changes) -> RuntimeConfig:
    return RuntimeConfig(**runtime_fields(bamba), page_size=PAGE, device=DEVICE, device_slots=DEVICE_SLOTS,
                         host_tokens=2048, write_policy="write_through", debug_invariants=True, state_slots=24,
                         **changes)


async def serve(bamba, storage_dir=None):
    """The conversations; with `storage_dir`, a file storage tier there and device and host flushed
    between turns, else a filler evicting the conversations to host after turn 1."""
    extra = dict(storage_backend="file", storage_dir=str(storage_dir)) if storage_dir is not None else {}
    async with CacheRuntime.open(hybrid_config(bamba, **extra)) as rt:
        async def between_turns(t: int, srv: ServingLoop) -> None:
            await settle(rt)
            if storage_dir is not None:
                assert await rt.flush() > 0
                assert (await rt.match_prefix(SYSTEM + [5] * PAGE)) == {"device": 0, "host": 0}
            elif t == 1:
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


async def test_storage_prefetch_equals_generate(bamba, ref_bamba, tmp_path):
    results, metrics, stats = await serve(bamba, tmp_path / "kv")
    assert mismatches(ref_bamba, results, tol=TOL) == []
    later = [m for t, m in metrics if t > 0]
    assert all(m.storage_tokens > 0 for m in later), [m.storage_tokens for m in later]  # own history, from storage
    for _, m in metrics:
        assert m.device_tokens + m.host_tokens + m.storage_tokens + m.recomputed_tokens == m.prompt_tokens
    assert stats["state"]["storage_writes"] > 0 and stats["state"]["storage_hits"] >= len(later), stats["state"]
    assert stats["storage"]["hit_tokens"] >= sum(m.storage_tokens for m in later)


async def test_storage_state_of_a_shallower_boundary_is_caught(bamba, ref_bamba, tmp_path, monkeypatch):
    def shallower(self, keys):  # the snapshot after page j - 1 asked for (and read) as the one after page j
        return tuple(StateBlob(-1, (), j, page=keys[j - 2]) for j in range(len(keys), 1, -1))

    monkeypatch.setattr(RecurrentStates, "blobs_to_look_up", shallower)
    results, metrics, _ = await serve(bamba, tmp_path / "kv")
    bad = {line.split()[0] for line in mismatches(ref_bamba, results, tol=TOL)}
    from_storage = {rid for (rid, *_), (_, m) in zip(results, metrics, strict=True) if m.storage_tokens}
    # (5 of the 6 later turns: the sixth finds no stored snapshot one page above a boundary it asks at)
    assert len(from_storage) >= 5 and from_storage <= bad, (from_storage, bad)

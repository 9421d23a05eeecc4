"""Tensor-parallel shards in storage: 2 and 4 simulated ranks on CPU, each its own runtime and
pools, sharing one file storage directory (docs/ARCHITECTURE.md, "Tensor parallelism").

Every rank serves the same prompt (one instance's ranks see the same requests) and writes its own
shard's KV: the fingerprint oracle with the rank folded into its seed, so rank r's heads differ
from every other rank's for the same tokens. After each rank's backups are written through and
its device and host tiers are flushed, a storage prefetch must bring each rank its own shard: the
whole prefix from storage, every position equal to that rank's fingerprint.

The broken variant (the storage identity without the shard, as before it existed) makes this
fail: every rank then addresses the same page hashes, rank 0's pages land first, and rank r >= 1
finds them at its first admit and is served rank 0's heads (had it written first, its write would
have found rank 0's pages present and kept them: pages are immutable). `test_identity_without_the_shard_reads_another_ranks_heads` runs that variant and asserts
that the oracle flags it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from runtime.config import RuntimeConfig
from runtime.errors import CapacityError
from runtime.fingerprint import write_fingerprints
from runtime.invariants import check_invariants
from runtime.runtime import CacheRuntime
from runtime.storage.file_backend import FileBackend
from runtime.storage.hashing import KVIdentity, page_hashes
from runtime.memory.pools import DevicePool, HostPool
from runtime.transfer.fake_engine import FakeCopyEngine
from runtime.transfer.sharded import ShardedCopyEngine, pool_geometry
from tests.integration.support import bad_positions, compute, settle, small_config, toks, until

N = 40  # tokens written through to storage (10 pages of 4)


@dataclasses.dataclass(frozen=True)
class RankResult:
    first_cached: int  # tokens the first admit found (before this rank wrote anything: must be 0)
    stored_pages: int  # pages of the prompt under this rank's own keys after its write-through
    cached: int  # tokens the admit after the flush found (all from storage)
    storage_hits: int
    bad: list[int]  # positions whose KV is not this rank's shard, over both admits' cached parts


def rank_config(rank: int, size: int) -> RuntimeConfig:
    return small_config(copy_engine="cpu", host_tokens=256, tp_rank=rank, tp_size=size)


def shard_seed(rank: int, size: int) -> tuple:
    """The fingerprint's namespace for rank `rank`'s heads: the runtime's namespace stays None."""
    return ("tp-shard", rank, size)


async def cached_admit(rt: CacheRuntime, rid: str, prompt):
    """Admit and wait until what it found (loaded from host or storage) is on device."""
    res = await rt.admit(rid, prompt)
    for readiness in res.readiness:
        await readiness.wait_all()
    await settle(rt)
    return res


def mla_rank_config(rank: int, size: int, host_layout: str = "layer_first") -> RuntimeConfig:
    """An MLA rank: one latent of 16 per token per layer, the same on every rank."""
    return small_config(copy_engine="cpu", host_tokens=256, tp_rank=rank, tp_size=size, kv_layout="mla",
                        num_kv_heads=1, head_dim=16, host_layout=host_layout)


def latent_seed(rank: int, size: int) -> tuple:
    """MLA's latent does not depend on the rank: one fingerprint namespace for all of them."""
    return ("latent",)


async def run_ranks(directory: Path, size: int, prompt, make_config=rank_config, seed=shard_seed) -> list[RankResult]:
    """One instance of `size` ranks over one storage directory: each rank serves `prompt` (its
    own shard's KV, `seed(rank, size)`'s fingerprint), writes it through, flushes its tiers and
    admits the prompt again."""
    configs = [make_config(r, size) for r in range(size)]
    async with AsyncExitStack() as stack:
        backends = [FileBackend(directory, c.page_size * c.bytes_per_token) for c in configs]
        for fb in backends:
            stack.callback(fb.close)
        ranks = [await stack.enter_async_context(CacheRuntime.open(c, storage=fb))
                 for c, fb in zip(configs, backends)]
        first = []
        for r, (rt, c, fb) in enumerate(zip(ranks, configs, backends)):  # rank order: rank 0 writes first
            res = await cached_admit(rt, "a", prompt)
            compute(rt, res.slots, prompt, seed(r, size), start=res.cached)
            bad = bad_positions(rt.device_pool, res.slots[:res.cached], prompt[:res.cached], seed(r, size))
            await rt.finish("a", prompt[:N])
            await settle(rt)
            keys = page_hashes(prompt[:N], c.page_size, None, KVIdentity.from_config(c))
            first.append((res.cached, fb.exists_prefix(keys), bad))
        for rt in ranks:
            assert await rt.flush() > 0
        results = []
        for r, rt in enumerate(ranks):
            res = await cached_admit(rt, "b", prompt)
            bad = bad_positions(rt.device_pool, res.slots[:res.cached], prompt[:res.cached], seed(r, size))
            hits = (await rt.stats())["storage"]["hit_tokens"]
            await rt.abort("b")
            await settle(rt)
            await rt.inspect(lambda core: check_invariants(core, quiescent=True))
            first_cached, stored, first_bad = first[r]
            results.append(RankResult(first_cached, stored, res.cached, hits, sorted(set(first_bad + bad))))
        return results


@pytest.mark.parametrize("size", [2, 4])
async def test_each_rank_reads_back_its_own_shard(tmp_path, size):
    prompt = toks(N + 1, 7)
    results = await run_ranks(tmp_path, size, prompt)
    pages = N // rank_config(0, size).page_size
    assert results == [RankResult(0, pages, N, N, []) for _ in range(size)]
    # one file per page per rank: no rank's write was taken for another's
    assert len(list(tmp_path.glob("*/*.kv"))) == size * pages


async def test_instances_of_other_sizes_share_nothing(tmp_path):
    """A 4-rank instance over the directory a 2-rank instance filled finds none of its pages
    there (rank 0 of 2 holds other heads than rank 0 of 4), then stores and reads its own."""
    prompt = toks(N + 1, 8)
    await run_ranks(tmp_path, 2, prompt)
    config = rank_config(0, 4)
    fb = FileBackend(tmp_path, config.page_size * config.bytes_per_token)
    try:
        keys = page_hashes(prompt[:N], config.page_size, None, KVIdentity.from_config(config))
        assert fb.exists_prefix(keys) == 0
    finally:
        fb.close()
    results = await run_ranks(tmp_path, 4, prompt)
    assert all(r.cached == N and r.bad == [] for r in results)


async def test_identity_without_the_shard_reads_another_ranks_heads(tmp_path, monkeypatch):
    """Broken variant: the storage identity drops the shard. The scenario above then fails: every
    rank after rank 0 is served rank 0's heads from storage (all its positions are wrong) at its
    first admit already, and again after the flush."""
    with_shard = KVIdentity.from_config
    monkeypatch.setattr(KVIdentity, "from_config",
                        staticmethod(lambda config: dataclasses.replace(with_shard(config), shard="")))
    prompt = toks(N + 1, 9)
    results = await run_ranks(tmp_path, 2, prompt)
    assert results[0] == RankResult(0, N // rank_config(0, 2).page_size, N, N, [])
    assert (results[1].first_cached, results[1].cached) == (N, N) and results[1].bad == list(range(N))
    assert len(list(tmp_path.glob("*/*.kv"))) == N // rank_config(0, 2).page_size  # one copy, rank 0's


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("size", [2, 4])
async def test_mla_ranks_are_served_rank_0s_replicated_latent(tmp_path, size, host_layout):
    """MLA (`kv_layout="mla"`): every rank holds the same latent, so the shard is "replicated" and
    storage holds one copy. Rank 0 writes it; every later rank finds the whole prefix in storage at
    its first admit (computing nothing) and writes nothing of its own; after the flush every rank
    reads the one copy back. MHA ranks on the same scenario never are (the tests above). Both host
    layouts: storage reads are staged (layer_first) or land in the pool's page rows (page_first)."""
    prompt = toks(N + 1, 10)
    results = await run_ranks(tmp_path, size, prompt, functools.partial(mla_rank_config, host_layout=host_layout),
                              latent_seed)
    pages = N // mla_rank_config(0, size).page_size
    assert results[0] == RankResult(0, pages, N, N, [])
    assert results[1:] == [RankResult(N, pages, N, 2 * N, []) for _ in range(size - 1)]
    assert len(list(tmp_path.glob("*/*.kv"))) == pages  # one copy, rank 0's


async def test_mla_and_mha_pages_of_the_same_size_never_match(tmp_path):
    """An MHA runtime whose pages have the MLA runtime's byte size (K and V of 1 x 8 against a latent
    of 16) finds none of the MLA pages in the directory they share, and stores and reads its own."""
    prompt = toks(N + 1, 11)
    mla = mla_rank_config(0, 1)
    mha = rank_config(0, 1).replace(num_kv_heads=1)
    assert mla.bytes_per_token == mha.bytes_per_token
    pages = N // mla.page_size
    assert await run_ranks(tmp_path, 1, prompt, lambda r, n: mla, latent_seed) == [RankResult(0, pages, N, N, [])]
    assert await run_ranks(tmp_path, 1, prompt, lambda r, n: mha, shard_seed) == [RankResult(0, pages, N, N, [])]
    assert len(list(tmp_path.glob("*/*.kv"))) == 2 * pages


# -- one control plane: one tree, every rank's pools ------------------------------------------------


def _control_plane(size: int, ranks: list):
    """The engine factory of an instance of `size` ranks under one control plane: rank 0's pools are
    the runtime's, ranks 1.. get pools of the same geometry; one fake engine per rank (the test
    completes each rank's copies when it likes), all behind one `ShardedCopyEngine`."""
    def factory(pools):
        all_pools = [pools] + [{name: (DevicePool(d.shape, d.num_slots, d.page_size),
                                       HostPool(h.shape, h.num_slots, h.page_size, h.layout))
                                for name, (d, h) in pools.items()} for _ in range(size - 1)]
        ranks.extend((p, FakeCopyEngine(p)) for p in all_pools)
        return ShardedCopyEngine([e for _, e in ranks], [pool_geometry(p) for p in all_pools])
    return factory


async def _release(engine: FakeCopyEngine, wait: bool = True) -> None:
    """Complete the rank's copies in flight (`wait`: once the transfer actor has submitted one)."""
    if wait:
        await until(lambda: bool(engine.pending()))
    for op_id in engine.pending():
        engine.release(op_id)
    await asyncio.sleep(0.01)  # the bridge sees the completions


@pytest.mark.parametrize("size", [2, 4])
async def test_one_control_plane_waits_for_every_rank(size):
    """One tree decides for `size` ranks, each with its own pools and its own copy timing: a backup
    counts (a host copy, a device page evictable) only once every rank copied it, and a load is
    ready only once every rank's is; each rank's pools then hold its own heads."""
    ranks: list = []
    cfg = small_config(device_slots=48, host_tokens=128, write_policy="write_through")
    async with CacheRuntime.open(cfg, engine_factory=_control_plane(size, ranks)) as rt:
        try:
            await _serve_over_ranks(rt, cfg, ranks, size)
        finally:  # close waits for every copy (a fake engine's close blocks): complete them on every rank
            for _, engine in ranks:
                await _release(engine, wait=False)
            closing = asyncio.ensure_future(rt.close())
            while not closing.done():
                for _, engine in ranks:
                    await _release(engine, wait=False)
            await closing


async def _serve_over_ranks(rt: CacheRuntime, cfg: RuntimeConfig, ranks: list, size: int) -> None:
    prompt = toks(N + 1, 11)
    assert rt.device_pool is ranks[0][0]["kv"][0] and len(ranks) == size
    res = await rt.admit("a", prompt)
    for r, (pools, _) in enumerate(ranks):  # each rank's model computes its own heads
        write_fingerprints(pools["kv"][0], res.slots, prompt, shard_seed(r, size))
    await rt.finish("a", prompt[:N])  # write-through: one backup plan, on every rank
    for _, engine in ranks[:-1]:
        await _release(engine)
    host_nodes = lambda core: sum(n.host is not None for n in core.residency.tree.nodes())  # noqa: E731
    assert await rt.inspect(host_nodes) == 0  # the last rank has not copied: no host copy yet
    with pytest.raises(CapacityError):  # ...nor a device page that may go: the node is locked
        await rt.admit("big", toks(cfg.device_slots - 4, 12))
    await _release(ranks[-1][1])
    await settle(rt)
    assert await rt.inspect(host_nodes) > 0
    await rt.admit("big", toks(cfg.device_slots - 4, 12))  # evicts the device copies now
    await rt.abort("big")
    res = await rt.admit("b", prompt)
    assert res.loaded_host == N and res.readiness
    for _, engine in reversed(ranks[1:]):  # every rank but rank 0, the last first
        await _release(engine)
        assert not res.readiness[0].all_ready()
    await _release(ranks[0][1])
    await res.readiness[0].wait_all()
    for r, (pools, _) in enumerate(ranks):
        device = pools["kv"][0]
        assert bad_positions(device, res.slots[:N], prompt[:N], shard_seed(r, size)) == []
        if size > 1:  # and not another rank's heads
            other = shard_seed((r + 1) % size, size)
            assert len(bad_positions(device, res.slots[:N], prompt[:N], other)) == N
    await rt.abort("b")
    await settle(rt)
    await rt.inspect(lambda core: check_invariants(core, quiescent=True))

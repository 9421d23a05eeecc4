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

The second half runs one runtime over every rank (`tp_ranks`, one control plane): each rank's
pools, copies, storage keys and load readiness its own, one tree deciding for all of them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from runtime.config import RuntimeConfig
from runtime.errors import ArgumentError, CapacityError
from runtime.fingerprint import write_fingerprints
from runtime.invariants import check_invariants
from runtime.runtime import CacheRuntime
from runtime.storage.file_backend import FileBackend
from runtime.storage.hashing import KVIdentity, page_hashes, tp_shard
from runtime.transfer.fake_engine import FakeCopyEngine
from runtime.tree.tiers.storage import StorageTier
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
# `tp_ranks=n`: one runtime drives n ranks, each with device and host pools of its own
# (`rt.device_pools[r]`, `rt.host_pools[r]`), one copy engine per rank behind a ShardedCopyEngine,
# and each rank's storage I/O under its own keys (`SubmitStorage.rank_keys`).


def plane_config(size: int, **changes) -> RuntimeConfig:
    return small_config(copy_engine="cpu", host_tokens=256, tp_ranks=size, tp_size=size, **changes)


def rank_keys(config: RuntimeConfig, rank: int, prompt) -> list[bytes]:
    """Rank `rank`'s page keys of `prompt[:N]`, from its shard (worked out here, not by the runtime)."""
    identity = dataclasses.replace(KVIdentity.from_config(config), shard=tp_shard(rank, config.tp_ranks))
    return page_hashes(prompt[:N], config.page_size, None, identity)


async def checked(rt: CacheRuntime, quiescent: bool = False) -> None:
    await rt.inspect(lambda core: check_invariants(core, quiescent=quiescent))


async def store_and_reload(rt: CacheRuntime, prompt, seed=shard_seed, lose=None) -> tuple[int, list[list[int]]]:
    """Serve `prompt` on every rank (each rank's model writes `seed(r, n)`'s fingerprint into its
    own device pool), write it through to storage, flush, then `lose()` (if given: drop stored
    pages) and admit it again. Returns the tokens that admit found and, per rank, the positions
    whose KV in that rank's device pool is not `seed(r, n)`'s."""
    n = rt.config.tp_ranks
    res = await cached_admit(rt, "a", prompt)
    assert res.cached == 0
    for r, pool in enumerate(rt.device_pools):
        write_fingerprints(pool, res.slots, prompt, seed(r, n))
    await rt.finish("a", prompt[:N])  # write-through: one backup plan on every rank, then the storage write
    await settle(rt)
    await checked(rt)
    assert await rt.flush() > 0
    await checked(rt, quiescent=True)
    if lose is not None:
        lose()
    res = await cached_admit(rt, "b", prompt)
    bad = [bad_positions(pool, res.slots[:res.cached], prompt[:res.cached], seed(r, n))
           for r, pool in enumerate(rt.device_pools)]
    await checked(rt)
    await rt.abort("b")
    await settle(rt)
    await checked(rt, quiescent=True)
    return res.cached, bad


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("size", [2, 4])
async def test_one_control_plane_stores_and_reads_every_ranks_shard(tmp_path, size, host_layout):
    """Write-through, flush, prefetch: every rank's shard is stored under its own keys (one file per
    page per rank) and read back into that rank's pools only, the whole prefix from storage."""
    cfg = plane_config(size, host_layout=host_layout)
    prompt = toks(N + 1, 21)
    pages = N // cfg.page_size
    with FileBackend(tmp_path, cfg.page_size * cfg.bytes_per_token) as fb:
        async with CacheRuntime.open(cfg, storage=fb) as rt:
            assert rt.device_pools[0] is rt.device_pool and rt.host_pools[0] is rt.host_pool
            assert len({id(p) for p in rt.device_pools + rt.host_pools}) == 2 * size
            cached, bad = await store_and_reload(rt, prompt)
            assert cached == N and bad == [[]] * size
            stats = await rt.stats()
            assert stats["storage"]["hit_tokens"] == N
            assert stats["storage"]["written_bytes"] == size * N * cfg.bytes_per_token  # every rank's shard
            # (a copy plan runs on every rank: its bytes are every rank's, as storage's are)
            assert stats["transfer"]["device_to_host_bytes"] == size * N * cfg.bytes_per_token
            assert stats["transfer"]["host_to_device_bytes"] == size * N * cfg.bytes_per_token
            for r in range(size):
                assert fb.exists_prefix(rank_keys(cfg, r, prompt)) == pages
        assert len(list(tmp_path.glob("*/*.kv"))) == size * pages


@pytest.mark.parametrize("size", [2, 4])
async def test_a_page_counts_only_when_every_rank_has_it(tmp_path, size):
    """One rank's page gone from storage: the hit stops there for every rank (a lookup's count is
    the minimum over ranks), and what is read is still each rank's own."""
    cfg = plane_config(size)
    prompt = toks(N + 1, 22)
    lost = 6  # page index
    with FileBackend(tmp_path, cfg.page_size * cfg.bytes_per_token) as fb:
        async with CacheRuntime.open(cfg, storage=fb) as rt:
            lose = lambda: fb.remove([rank_keys(cfg, size - 1, prompt)[lost]])  # noqa: E731
            cached, bad = await store_and_reload(rt, prompt, lose=lose)
            assert cached == lost * cfg.page_size and bad == [[]] * size


async def test_clear_storage_removes_every_ranks_shard(tmp_path):
    """`clear_storage` under one control plane removes every rank's pages, not rank 0's alone."""
    cfg = plane_config(2)
    prompt = toks(N + 1, 25)
    pages = N // cfg.page_size
    with FileBackend(tmp_path, cfg.page_size * cfg.bytes_per_token) as fb:
        async with CacheRuntime.open(cfg, storage=fb) as rt:
            assert await store_and_reload(rt, prompt) == (N, [[], []])
            assert len(list(tmp_path.glob("*/*.kv"))) == 2 * pages
            assert await rt.clear_storage() == 2 * pages
            await checked(rt, quiescent=True)
        assert list(tmp_path.glob("*/*.kv")) == []


async def test_a_rank_reading_another_ranks_shard_is_caught(tmp_path, monkeypatch):
    """Broken variant: every rank is given rank 0's key list. Rank 0 writes its shard, then rank
    1's write finds those pages stored with another tag (other bytes: not its page) and replaces
    them, and after the flush every rank reads rank 1's heads: the oracle flags every position of
    rank 0."""
    def rank_0s_keys(self, tokens, extra_key, keys, pages):
        return (tuple(keys),) * len(self.ranks) if self.ranks and keys else ()
    monkeypatch.setattr(StorageTier, "keys_per_rank", rank_0s_keys)
    cfg = plane_config(2)
    prompt = toks(N + 1, 23)
    with FileBackend(tmp_path, cfg.page_size * cfg.bytes_per_token) as fb:
        async with CacheRuntime.open(cfg, storage=fb) as rt:
            cached, bad = await store_and_reload(rt, prompt)
    assert cached == N and bad == [list(range(N)), []]
    assert len(list(tmp_path.glob("*/*.kv"))) == N // cfg.page_size  # one copy: rank 1's


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("size", [2, 4])
async def test_one_control_plane_mla_stores_one_copy_every_rank_reads(tmp_path, size, host_layout):
    """MLA: the latent is the same on every rank (one key list, shard "replicated"): rank 0 writes
    the one copy and after the flush every rank reads it into its own pools."""
    cfg = plane_config(size, kv_layout="mla", num_kv_heads=1, head_dim=16, host_layout=host_layout)
    prompt = toks(N + 1, 24)
    with FileBackend(tmp_path, cfg.page_size * cfg.bytes_per_token) as fb:
        async with CacheRuntime.open(cfg, storage=fb) as rt:
            cached, bad = await store_and_reload(rt, prompt, latent_seed)
            assert cached == N and bad == [[]] * size
            stats = await rt.stats()
            assert stats["storage"]["written_bytes"] == N * cfg.bytes_per_token  # one copy
            assert stats["storage"]["read_bytes"] == size * N * cfg.bytes_per_token  # read by every rank
    assert len(list(tmp_path.glob("*/*.kv"))) == N // cfg.page_size


async def _release(engine: FakeCopyEngine, wait: bool = True) -> None:
    """Complete the rank's copies in flight (`wait`: once the transfer actor has submitted one)."""
    if wait:
        await until(lambda: bool(engine.pending()))
    for op_id in engine.pending():
        engine.release(op_id)


@pytest.mark.parametrize("size", [2, 4])
async def test_one_control_plane_waits_for_every_rank(size):
    """One tree decides for `size` ranks, each with its own pools and its own copy timing: a backup
    counts (a host copy, a device page evictable) only once every rank copied it; a load is ready
    for rank r once rank r's copy is (`readiness.rank(r)`) and for the instance once every rank's
    is; each rank's pools then hold its own heads."""
    cfg = small_config(device_slots=48, host_tokens=128, write_policy="write_through", tp_ranks=size, tp_size=size)
    async with CacheRuntime.open(cfg, engine_factory=FakeCopyEngine) as rt:
        engines = rt.engine.engines
        try:
            await _serve_over_ranks(rt, cfg, engines, size)
        finally:  # close waits for every copy (a fake engine's close blocks): complete them on every rank
            for engine in engines:
                await _release(engine, wait=False)
            closing = asyncio.ensure_future(rt.close())
            while not closing.done():
                for engine in engines:
                    await _release(engine, wait=False)
                await asyncio.sleep(0.001)  # (a poll: let the close and the copies go on)
            await closing


async def _serve_over_ranks(rt: CacheRuntime, cfg: RuntimeConfig, engines, size: int) -> None:
    prompt = toks(N + 1, 11)
    assert len(engines) == size and all(isinstance(e, FakeCopyEngine) for e in engines)
    handles = []  # the one-plane completions the transfer actor watches
    submit = rt.engine.submit
    rt.engine.submit = lambda plan: handles.append(submit(plan)) or handles[-1]
    res = await rt.admit("a", prompt)
    for r, pool in enumerate(rt.device_pools):  # each rank's model computes its own heads
        write_fingerprints(pool, res.slots, prompt, shard_seed(r, size))
    await rt.finish("a", prompt[:N])  # write-through: one backup plan, on every rank
    for engine in engines[:-1]:
        await _release(engine)
    # every rank but the last copied: the backup's completion is not done (checked on the handle
    # the bridge polls, not after a sleep), so it cannot have been acked
    assert len(handles) == 1 and not handles[0].done.query()
    host_nodes = lambda core: sum(n.host is not None for n in core.residency.tree.nodes())  # noqa: E731
    assert await rt.inspect(host_nodes) == 0  # the last rank has not copied: no host copy yet
    with pytest.raises(CapacityError):  # ...nor a device page that may go: the node is locked
        await rt.admit("big", toks(cfg.device_slots - 4, 12))
    await _release(engines[-1])
    await settle(rt)
    await checked(rt)
    assert await rt.inspect(host_nodes) > 0
    await rt.admit("big", toks(cfg.device_slots - 4, 12))  # evicts the device copies now
    await rt.abort("big")
    res = await rt.admit("b", prompt)
    assert res.loaded_host == N and res.readiness
    readiness = res.readiness[0]
    for r in reversed(range(size)):  # the last rank first
        assert not readiness.rank(r).all_ready()
        await _release(engines[r])
        await readiness.rank(r).wait_all()  # rank r's own layers: ready now
        assert all(not readiness.rank(q).all_ready() for q in range(r))  # ...and no lower rank's
        assert readiness.all_ready() == (r == 0)  # the instance's: once every rank's is
    await readiness.wait_all()
    with pytest.raises(ArgumentError):
        readiness.rank(size)
    for r, pool in enumerate(rt.device_pools):
        assert bad_positions(pool, res.slots[:N], prompt[:N], shard_seed(r, size)) == []
        other = shard_seed((r + 1) % size, size)  # and not another rank's heads
        assert len(bad_positions(pool, res.slots[:N], prompt[:N], other)) == N
    await rt.abort("b")
    await settle(rt)
    await checked(rt, quiescent=True)


async def test_one_rank_keeps_its_own_pools_and_engine():
    """tp_ranks=1 (the default): the pools are the runtime's own and the engine is not sharded."""
    cfg = small_config(device_slots=48, host_tokens=128)
    async with CacheRuntime.open(cfg, engine_factory=FakeCopyEngine) as rt:
        assert rt.device_pools == (rt.device_pool,) and rt.host_pools == (rt.host_pool,)
        assert isinstance(rt.engine, FakeCopyEngine)

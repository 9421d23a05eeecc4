"""Recurrent state in the storage tier (CPU copy engine, file backend in tmp_path): a node's host
snapshot is written with its KV, a prefetch is cut to the deepest boundary whose snapshot is
stored, and the node ending there adopts the snapshot read with the KV (docs/ARCHITECTURE.md,
"Recurrent state"; docs/STORAGE.md, "State snapshots").

The stand-in model (`tests/integration/test_recurrent_state.py`) writes, for each snapshot, a
state that encodes the prefix it follows, so a state restored from another prefix is caught by
value. The state here (1,752 bytes) is 2 chunks of the 1,024-byte KV page, the last one padded.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from runtime.invariants import check_invariants
from runtime.runtime import CacheRuntime
from runtime.storage.backend import FaultPlan, FaultyBackend
from runtime.storage.file_backend import FileBackend
from runtime.storage.hashing import KVIdentity, page_hashes
from runtime.storage.state_blobs import StateBlobFormat
from runtime.tree.groups.recurrent import RecurrentStates
from tests.integration.support import compute, small_config, toks
from tests.integration.test_recurrent_state import serve as serve_checked

STATE = dict(state_layers=3, state_components="conv:6x3:float32,ssm:2x4x16:float32", state_slots=6)
SNAPS = (16, 32)


def config(**changes):
    return small_config(copy_engine="cpu", host_tokens=256, **STATE, **changes)


def file_backend(path, cfg) -> FileBackend:
    return FileBackend(str(path), cfg.page_size * cfg.bytes_per_token)


def state_keys(cfg, tokens: np.ndarray, position: int) -> tuple[bytes, ...]:
    """The chunk keys of the snapshot after `tokens[:position]`."""
    hashes = page_hashes(tokens[:position], cfg.page_size, None, KVIdentity.from_config(cfg))
    return StateBlobFormat.of(cfg.state_shape, cfg.page_size * cfg.bytes_per_token).keys(hashes[-1])


async def settle(rt: CacheRuntime) -> None:
    """Until no copy and no storage op is in flight; then the quiescent invariants."""
    for _ in range(5000):
        if not await rt.inspect(lambda core: core.in_flight()):
            await rt.inspect(lambda core: check_invariants(core, quiescent=True))
            return
        await asyncio.sleep(0.002)
    raise AssertionError("copies or storage ops still in flight")


async def serve(rt: CacheRuntime, rid: str, tokens: np.ndarray, snaps: tuple[int, ...] = SNAPS):
    """Admit (waiting for its prefetch), check the resumed state, compute, snapshot, finish; settle."""
    res = await serve_checked(rt, rid, tokens, snaps)
    await settle(rt)
    return res


async def write_a(path, a: np.ndarray) -> dict:
    """A first runtime serves `a` with snapshots at 16 and 32, writes through to storage, closes."""
    cfg = config()
    async with CacheRuntime.open(cfg, storage=file_backend(path, cfg)) as rt:
        await serve(rt, "a", a)
        return await rt.stats()


def test_chunks_of_this_state():
    cfg = config()
    fmt = StateBlobFormat.of(cfg.state_shape, cfg.page_size * cfg.bytes_per_token)
    assert (fmt.state_bytes, fmt.page_bytes, fmt.chunks) == (1752, 1024, 2)


async def test_fresh_runtime_resumes_from_the_stored_snapshot(tmp_path):
    a = toks(33, 1)
    st = await write_a(tmp_path, a)
    assert st["state"]["storage_writes"] == 2 and st["state"]["storage_write_failures"] == 0
    cfg = config()
    async with CacheRuntime.open(cfg, storage=file_backend(tmp_path, cfg)) as rt:
        res = await serve(rt, "a2", a, snaps=())
        # KV and state of a's 32 tokens, from storage (via host), resumed from the snapshot at 32
        assert (res.cached_device, res.loaded_host, res.loaded_storage) == (0, 32, 32) and res.state_from is not None
        st = await rt.stats()
        assert st["state"]["storage_hits"] == 1 and st["state"]["storage_misses"] == 0
        assert st["storage"]["hit_tokens"] == 32
        # the snapshot read is not written again, nor are its pages
        assert st["state"]["storage_writes"] == 0
        # a flush, and the same runtime reads it again
        assert await rt.flush() > 0
        res = await serve(rt, "a3", a, snaps=())
        assert (res.loaded_storage, res.state_from is not None) == (32, True)


@pytest.mark.parametrize("damage", ["missing", "short"])
async def test_a_damaged_state_chunk_cuts_the_hit_back(tmp_path, damage):
    """The last chunk of the snapshot at 32 is gone, or a file of the wrong length: the lookup
    finds no whole snapshot there and the prefetch ends at 16, whose snapshot is whole."""
    a = toks(33, 2)
    await write_a(tmp_path, a)
    cfg = config()
    fb = file_backend(tmp_path, cfg)
    last = state_keys(cfg, a, 32)[-1]
    if damage == "missing":
        assert fb.remove([last]) == 1
    else:
        path = fb._path(last)[2]
        with open(path, "r+b") as f:
            f.truncate(100)
    async with CacheRuntime.open(cfg, storage=fb) as rt:
        res = await serve(rt, "a2", a, snaps=())
        assert (res.loaded_host, res.loaded_storage) == (16, 16) and res.state_from is not None
        st = await rt.stats()
        assert st["state"]["storage_hits"] == 1
        # both snapshots' chunks gone: no hit at all (never KV without its state)
        await rt.flush()
        fb.remove([state_keys(cfg, a, 16)[0]])
        res = await serve(rt, "a3", a, snaps=())
        assert (res.cached, res.loaded_storage, res.state_from) == (0, 0, None)
        assert (await rt.stats())["state"]["storage_misses"] == 1


@pytest.mark.parametrize("mode", ["raise", "miss"])
async def test_a_failed_state_read_frees_every_slot(tmp_path, mode):
    """The KV pages of the read arrive but its state does not (the second get_batch of the read:
    the state's, fails): nothing is adopted, every host page and host state slot is free again."""
    a = toks(33, 3)
    await write_a(tmp_path, a)
    cfg = config()
    # (FaultyBackend has no get_prefix: a read is exists_prefix + get_batch of the KV, then the state's)
    fb = FaultyBackend(file_backend(tmp_path, cfg), FaultPlan(fail_at={2}, mode=mode, methods={"get_batch"}))
    async with CacheRuntime.open(cfg, storage=fb) as rt:
        free = lambda core: (core.residency.host.num_free_pages(),  # noqa: E731
                             core.residency.group(RecurrentStates).host_ledger.num_free_pages())
        before = await rt.inspect(free)
        res = await rt.admit("a2", a)
        assert (res.cached, res.loaded_storage, res.state_from) == (0, 0, None)
        await rt.abort("a2")
        await settle(rt)
        assert await rt.inspect(free) == before
        st = await rt.stats()
        assert st["state"]["storage_hits"] == 0 and st["storage"]["hit_tokens"] == 0
        # the next read (no fault) brings KV and state
        res = await serve(rt, "a3", a, snaps=())
        assert (res.loaded_storage, res.state_from is not None) == (32, True)


async def test_cancelled_prefetch_frees_its_state_slot(tmp_path):
    """An abort of a prepared rid while its read (KV and state) is held: at the read's ack the host
    pages and the host state slot go back free."""
    a = toks(33, 4)
    await write_a(tmp_path, a)
    cfg = config()
    fb = FaultyBackend(file_backend(tmp_path, cfg), FaultPlan(hold_at={1}, methods={"get_batch"}))
    async with CacheRuntime.open(cfg, storage=fb) as rt:
        states_free = lambda core: core.residency.group(RecurrentStates).host_ledger.num_free_pages()  # noqa: E731
        before = await rt.inspect(states_free)
        assert await rt.prepare("p", a) > 0
        for _ in range(2000):  # until the read (with its state slot) is issued and held
            if await rt.inspect(states_free) < before:
                break
            await asyncio.sleep(0.002)
        await rt.inspect(check_invariants)  # the read's state slot: held by the prefetch, pinned by the read
        await rt.abort("p")
        fb.release()
        await settle(rt)
        assert await rt.inspect(states_free) == before
        assert (await rt.stats())["state"]["storage_hits"] == 0


async def test_a_snapshot_found_missing_is_written_again(tmp_path):
    """The runtime that wrote both snapshots learns at its next lookup that the one at 32 lost a
    chunk (another process or a size cap removed it): no longer known stored, so the next write
    of that node stores it again; a clear still removes every chunk it wrote."""
    a = toks(33, 5)
    cfg = config()
    fb = file_backend(tmp_path, cfg)
    async with CacheRuntime.open(cfg, storage=fb) as rt:
        await serve(rt, "a", a)
        other = file_backend(tmp_path, cfg)
        assert other.remove([state_keys(cfg, a, 32)[-1]]) == 1
        other.close()
        await rt.flush()
        res = await serve(rt, "a2", a)  # the hit ends at 16; the snapshot at 32 is taken again and written
        assert res.loaded_storage == 16
        assert (await rt.stats())["state"]["storage_writes"] == 3
        assert fb.exists_prefix(list(state_keys(cfg, a, 32))) == 2
        await rt.clear_storage()
        assert fb.exists_prefix(list(state_keys(cfg, a, 16))) == 0 and fb.exists_prefix(list(state_keys(cfg, a, 32))) == 0


async def test_clear_removes_the_snapshot_a_fresh_runtime_found(tmp_path):
    """A fresh runtime's prefetch finds and reads a's KV and the snapshot at 32: both are stored
    pages it found, so its clear removes both (it removed the KV alone, leaving the chunks as
    stray files that no hit could reach); the snapshot at 16, which it never asked for, stays."""
    a = toks(33, 7)
    await write_a(tmp_path, a)
    cfg = config()
    fb = file_backend(tmp_path, cfg)
    async with CacheRuntime.open(cfg, storage=fb) as rt:
        res = await serve(rt, "a2", a, snaps=())
        assert res.loaded_storage == 32 and res.state_from is not None
        assert await rt.clear_storage() == 8 + 2  # a's 8 KV pages, the 2 chunks of the snapshot at 32
        keys = page_hashes(a[:32], cfg.page_size, None, KVIdentity.from_config(cfg))
        assert fb.exists_prefix(keys) == 0 and fb.exists_prefix(list(state_keys(cfg, a, 32))) == 0
        assert fb.exists_prefix(list(state_keys(cfg, a, 16))) == 2

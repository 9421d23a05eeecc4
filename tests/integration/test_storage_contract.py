"""The storage side of the caller contract, through the public API: a backend whose results are out of
contract is a miss (never adopted as KV), and a backend call that never returns cannot hold
`close()` forever."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from runtime.runtime import CacheRuntime
from runtime.storage.backend import FaultPlan, FaultyBackend
from runtime.storage.file_backend import FileBackend
from tests.integration.support import PassThroughBackend, compute, small_config, toks

N = 40  # tokens written through to storage (10 pages of 4)


def cfg(**changes: Any):
    base = dict(copy_engine="cpu", host_tokens=256, host_layout="page_first", prefetch_policy="wait_complete")
    base.update(changes)
    return small_config(**base)


class LyingReads(PassThroughBackend):
    """A FileBackend whose get_prefix reads nothing and reports `lie(len(keys))` pages."""

    def __init__(self, inner: FileBackend, lie) -> None:
        super().__init__(inner)
        self.lie = lie
        self.exists_is_local = False

    def get_prefix(self, keys, dests, tags=None):
        return self.lie(len(keys))


async def settle(rt: CacheRuntime, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while await rt.inspect(lambda core: core.in_flight()):
        assert loop.time() < deadline, "copies or storage ops still in flight"
        await asyncio.sleep(0.002)


@pytest.mark.parametrize("lie", [lambda n: -1, lambda n: n + 3, lambda n: None],
                         ids=["minus-one", "more-than-asked", "none"])
async def test_a_read_count_out_of_contract_loads_nothing_from_storage(tmp_path, lie):
    """Pages written by one runtime, read by a fresh one through a backend whose get_prefix
    returns a count out of contract: nothing is taken from storage (0 tokens, no host hit), the
    backend error is counted, and the tree is consistent. Before the fix the host pages that nothing
    was read into were adopted as a storage hit (tokens_storage_hit 36 for -1, 40 for n+3), and
    None was an uncounted plain read failure (no storage_backend_errors)."""
    from runtime.invariants import check_invariants

    config = cfg()
    page_bytes = config.page_size * config.bytes_per_token
    a = toks(N + 1, 5)
    writer = FileBackend(tmp_path, page_bytes)
    async with CacheRuntime.open(config, storage=writer) as rt:
        res = await rt.admit("w", a)
        compute(rt, res.slots, a)
        await rt.finish("w", a[:N])
        await settle(rt)
        assert (await rt.stats())["storage"]["written_pages"] == N // config.page_size
    writer.close()

    liar = LyingReads(FileBackend(tmp_path, page_bytes), lie)
    try:
        async with CacheRuntime.open(config, storage=liar) as rt:
            res = await rt.admit("r", a)  # wait_complete: the admit waits for the read's ack
            for r in res.readiness:
                await r.wait_all()
            await settle(rt)
            st = await rt.stats()
            assert st["storage"]["hit_tokens"] == 0 and st["storage"]["read_pages"] == 0
            assert res.cached == 0 and await rt.match_prefix(a) == {"device": 0, "host": 0}
            assert st["storage"]["backend_errors"] == 1 and st["storage"]["read_failures"] == 1
            await rt.abort("r")
            await settle(rt)
            await rt.inspect(lambda core: check_invariants(core, quiescent=True))
    finally:
        liar.close()


async def test_close_is_bounded_when_the_backend_never_returns(tmp_path):
    """Every backend call is held until the end of the test; with storage_timeout_s=0.2 a runtime
    that started a storage lookup (prepare) still closes within a few seconds, and the held
    thread ends when the backend is released. Before the fix there was no deadline at all (RuntimeConfig
    took no storage_timeout_s: TypeError)."""
    config = cfg(storage_timeout_s=0.2, prefetch_policy="timeout")
    page_bytes = config.page_size * config.bytes_per_token
    fb = FaultyBackend(FileBackend(tmp_path, page_bytes), FaultPlan(hold_at=frozenset(range(1, 10_000))))
    loop = asyncio.get_running_loop()
    closed_in: list[float] = []

    async def session() -> None:
        async with CacheRuntime.open(config, storage=fb) as rt:
            assert await rt.prepare("p", toks(N + 1, 6)) > 0  # a lookup, held in the backend
            assert await asyncio.to_thread(fb.wait_held, 1, 5.0)
            t0 = loop.time()
        closed_in.append(loop.time() - t0)

    try:
        await asyncio.wait_for(session(), 8.0)
        assert closed_in and closed_in[0] < 5.0
    finally:
        fb.release()
        fb.close()


async def test_an_admit_waiting_on_a_hung_lookup_goes_on_at_the_deadline(tmp_path):
    """wait_complete: an admit waits for its own storage lookup; the backend never returns, and at
    storage_timeout_s (0.2 s) the admit goes on without it (nothing from storage) instead of waiting
    forever; the runtime still closes. Checked failing with the tree's StorageOverdue handler
    removed (the admit hangs: TimeoutError)."""
    config = cfg(storage_timeout_s=0.2, prefetch_policy="wait_complete")
    page_bytes = config.page_size * config.bytes_per_token
    fb = FaultyBackend(FileBackend(tmp_path, page_bytes), FaultPlan(hold_at=frozenset(range(1, 10_000))))
    try:
        async def session() -> None:
            async with CacheRuntime.open(config, storage=fb) as rt:
                a = toks(N + 1, 7)
                res = await asyncio.wait_for(rt.admit("w", a), 3.0)
                assert res.cached == 0 and res.loaded_storage == 0
                st = await rt.stats()
                assert st["storage"]["calls_running"] == 1  # still in flight: its pages stay pinned
                await rt.abort("w")

        await asyncio.wait_for(session(), 8.0)
    finally:
        fb.release()
        fb.close()


async def test_ops_in_flight_at_close_are_settled_as_abandoned(tmp_path):
    """Writes held in the backend past their deadline when the runtime closes: close returns (the
    drain does not wait for overdue ops), every op submitted is settled (done + failed + skipped +
    abandoned: the backend's probes too),
    none is left in flight, and a held call that returns after the close changes no counter and
    acks nobody. Checked failing without the transfer actor's abandonment (ops stayed in
    `storage_inflight` after close, and their late return counted them done too)."""
    config = cfg(storage_timeout_s=0.2, prefetch_policy="timeout")
    page_bytes = config.page_size * config.bytes_per_token
    fb = FaultyBackend(FileBackend(tmp_path, page_bytes), FaultPlan(hold_at=frozenset(range(1, 10_000)),
                                                                    methods=frozenset({"set_batch"})))
    try:
        async with CacheRuntime.open(config, storage=fb) as rt:
            for i in range(3):
                a = toks(N + 1, 20 + i)
                res = await rt.admit(f"r{i}", a)
                compute(rt, res.slots, a)
                await rt.finish(f"r{i}", a[:N])
            assert await asyncio.to_thread(fb.wait_held, 1, 5.0)
        transfer = rt._transfer
        c = dict(transfer.counters)
        assert c["storage_ops_abandoned"] >= 1 and not transfer.storage.inflight
        assert c["storage_ops_submitted"] == c["storage_ops_done"] + c["storage_ops_failed"] + c["storage_ops_skipped"] \
            + c["storage_ops_abandoned"]
        fb.release()  # the held calls return now, after the close
        await asyncio.sleep(0.3)
        assert transfer.counters == c and not transfer.storage.abandoned
    finally:
        fb.release()
        fb.close()

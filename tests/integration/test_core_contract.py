"""The caller contract of the tree actor's core, one regression per behaviour.

Each test says how it failed before the fix (the test run against the runtime before it).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from runtime import CapacityError
from runtime.errors import StateError
from runtime.invariants import check_invariants
from tests.integration.support import (
    bad_positions,
    compute,
    fake_runtime,
    release_all,
    settle,
    small_config,
    toks,
    until,
)


# -- slots never change under the caller ----------------------------------------------------


async def test_cache_of_a_duplicate_prefix_keeps_the_callers_slots():
    """A and B share a 16-token system prompt and are admitted before either is cached; A
    finishes (its prefix enters the tree); B caches after a prefill chunk. B's slots must stay
    B's: a third request admitted next must not be given any of them, and B's KV must still
    be B's. Before the fix B's prefix slots were freed as duplicates and handed to C."""
    cfg = small_config(device_slots=64, write_policy="write_through_selective", write_through_threshold=99)
    async with fake_runtime(cfg) as (rt, _):
        system = toks(16, 1)
        a = np.concatenate((system, toks(9, 2)))
        b = np.concatenate((system, toks(9, 3)))
        ra = await rt.admit("a", a)
        rb = await rt.admit("b", b)
        assert ra.cached == 0 and rb.cached == 0
        compute(rt, ra.slots, a)
        compute(rt, rb.slots, b)
        await rt.finish("a", a[:24])
        assert await rt.cache("b", b[:20]) == 20
        c = toks(20, 4)
        rc = await rt.admit("c", c)
        compute(rt, rc.slots, c)
        assert not set(rb.slots.tolist()) & set(rc.slots.tolist())
        assert bad_positions(rt.device_pool, rb.slots, b) == []
        await rt.inspect(check_invariants)
        await rt.finish("b", b[:24])
        await rt.finish("c", c)
        await rt.inspect(lambda core: check_invariants(core, quiescent=True))


# -- the token record only grows -------------------------------------------------------------


async def test_cache_cannot_shorten_the_record_then_finish_with_other_tokens():
    """`cache(rid, fewer tokens)` must not shorten the request's record: a later finish with
    tokens that contradict the admitted prompt is a StateError and inserts nothing. Before the fix
    the record was shortened and P's KV went into the tree under tokens X."""
    async with fake_runtime(small_config(write_policy="write_through_selective", write_through_threshold=99)) as (rt, _):
        p = toks(24, 5)
        res = await rt.admit("r", p)
        compute(rt, res.slots, p)
        assert await rt.cache("r", p[:8]) == 8
        x = np.concatenate((p[:8], toks(16, 6)))
        with pytest.raises(StateError):
            await rt.finish("r", x)
        assert (await rt.match_prefix(x))["device"] == 8
        assert await rt.finish("r", p) == 24
        await rt.inspect(check_invariants)


# -- a validation error changes nothing --------------------------------------------------------


async def test_cache_of_a_duplicate_pinned_by_an_offload_is_not_a_half_change():
    """Decode offload: B caches past a prefix that duplicates A's cached one while B's own
    offload of that prefix is in flight (it pins B's duplicate slots).
    Before the fix this raised PinnedSlotError after a node had adopted B's slots (one page, two
    owners); now no duplicate is freed while B is live, so the call succeeds whole."""
    cfg = small_config(decode_offload=True, offload_stride=8, host_tokens=256)
    async with fake_runtime(cfg) as (rt, engine):
        system = toks(16, 7)
        a = np.concatenate((system, toks(9, 8)))
        b = np.concatenate((system, toks(9, 9)))
        ra = await rt.admit("a", a)
        rb = await rt.admit("b", b)
        compute(rt, ra.slots, a)
        compute(rt, rb.slots, b)
        await rt.cache("a", a[:16])  # A's prefix is on device in the tree
        await rt.commit("b", 16)
        for _ in range(1000):  # B's offload of [0, 16) is in flight: it pins B's slots
            if await rt.inspect(lambda core: any(op.rid == "b" for op in core.offload.ops.values())):
                break
            await asyncio.sleep(0.001)
        assert await rt.cache("b", b[:24]) == 24
        await rt.inspect(check_invariants)
        assert bad_positions(rt.device_pool, rb.slots, b) == []
        await release_all(rt, engine)
        await rt.finish("a", a[:24])
        await rt.finish("b", b[:24])
        await release_all(rt, engine)
        await rt.inspect(lambda core: check_invariants(core, quiescent=True))


# -- the tier-closure rule ----------------------------------------------------------------------


async def test_flush_never_leaves_a_node_without_a_copy_above_a_host_child():
    """Write-back: P (device + host) -> X (device only) -> H (host only, evicted under X).
    flush() must not drop X's device copy while H hangs under it with no copy of X left. Before
    the fix flush dropped it and then failed deleting P (TreeError, the runtime failed)."""
    cfg = small_config(write_policy="write_back", device_slots=64, host_tokens=256)
    async with fake_runtime(cfg) as (rt, engine):
        p = toks(8, 10)
        x = np.concatenate((p, toks(8, 11)))
        h = np.concatenate((x, toks(9, 12)))
        pp = np.concatenate((p, toks(1, 13)))
        r = await rt.admit("p", pp)
        await release_all(rt, engine)  # P may come from storage: its load lands first
        for x in r.readiness:
            await x.wait_all()
        compute(rt, r.slots, pp)
        await rt.finish("p", p)

        def backup_p(core):  # P gets a host copy (write_back only copies on eviction)
            node = core.residency.tree.match(p, None, split=False, touch=False).nodes[-1]
            assert core.copies.backup(node)

        await rt.inspect(backup_p)
        await release_all(rt, engine)
        xx = np.concatenate((x, toks(1, 14)))
        rx = await rt.admit("x", xx)
        rh = await rt.admit("h", h)  # both hit P, so neither grows P in place
        compute(rt, rx.slots, xx)
        compute(rt, rh.slots, h)
        await rt.finish("x", x)  # X = [8, 16)
        await rt.finish("h", h[:24])  # H = [16, 24); this insert touched P, X and H at one clock

        def evict_h(core):  # H alone goes to host (write-back of the deepest leaf)
            node = core.residency.tree.match(h[:24], None, split=False, touch=False).nodes[-1]
            assert node.num_tokens == 8 and core.copies.backup(node, evict_after=True)

        await rt.inspect(evict_h)
        await release_all(rt, engine)
        shape = await rt.inspect(lambda core: [(n.num_tokens, n.device is not None, n.host is not None)
                                               for n in core.residency.tree.nodes()])
        assert sorted(shape) == [(8, False, True), (8, True, False), (8, True, True)]
        await rt.flush()
        await release_all(rt, engine)
        assert not rt.failed
        await rt.inspect(check_invariants)
        await rt.flush()
        await release_all(rt, engine)
        await rt.inspect(lambda core: check_invariants(core, quiescent=True))


# -- can_admit and admit agree ------------------------------------------------------------------


async def test_can_admit_agrees_with_admit_under_write_back():
    """Write-back: the device pool is full of cached pages with no host copy. can_admit and an
    admit right after it must agree. Before the fix can_admit said yes (it counted leaves whose
    eviction only starts a backup) and admit raised CapacityError."""
    cfg = small_config(write_policy="write_back", device_slots=32, host_tokens=256)
    async with fake_runtime(cfg) as (rt, engine):
        for i in range(3):
            t = toks(9, 20 + i)
            r = await rt.admit(f"r{i}", t)
            compute(rt, r.slots, t)
            await rt.finish(f"r{i}", t[:8])
        new = toks(21, 30)
        said = await rt.can_admit(new)
        try:
            await rt.admit("new", new)
            got = True
        except CapacityError:
            got = False
        assert said == got
        await release_all(rt, engine)
        # once the write-backs land, both say yes
        assert await rt.can_admit(new)
        if not got:
            await rt.admit("new", new)
        await rt.abort("new")
        await release_all(rt, engine)
        await rt.inspect(lambda core: check_invariants(core, quiescent=True))


# -- retry after a cancelled deferred admit -----------------------------------------------------


async def test_retry_after_a_cancelled_waiting_admit(tmp_path):
    """Storage prefetch with wait_complete: a caller whose admit is cancelled while it waits for
    the read, retrying the same rid at once, must be admitted (not DuplicateRequestError). Before
    the fix the cancelled waiter was admitted first and the retry failed."""
    from runtime.storage.backend import FaultPlan, FaultyBackend
    from runtime.storage.file_backend import FileBackend

    cfg = small_config(storage_backend="file", storage_dir=str(tmp_path), prefetch_policy="wait_complete",
                       host_tokens=256)
    t = toks(33, 40)
    async with fake_runtime(cfg) as (rt, engine):
        r = await rt.admit("w", t)
        compute(rt, r.slots, t)
        await rt.finish("w", t[:32])
        await release_all(rt, engine)
    page_bytes = cfg.page_size * cfg.bytes_per_token
    backend = FaultyBackend(FileBackend(str(tmp_path), page_bytes), FaultPlan(hold_at=frozenset(range(100))))
    try:
        async with CacheRuntimeWithEngine(cfg, backend) as (rt, engine):
            task = asyncio.ensure_future(rt.admit("r", t))
            await until(lambda: backend.calls >= 1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            retry = asyncio.ensure_future(rt.admit("r", t))
            await asyncio.sleep(0.01)
            backend.release()
            res = await asyncio.wait_for(retry, 5)
            assert res.rid == "r"
            await release_all(rt, engine)
            await rt.abort("r")
            await release_all(rt, engine)
            stats = await rt.stats()
            assert stats["requests"]["live"] == 0
    finally:
        backend.release()
        backend.close()


def CacheRuntimeWithEngine(cfg, backend):  # noqa: N802 - reads like the context manager it makes
    from contextlib import asynccontextmanager

    from runtime.runtime import CacheRuntime
    from runtime.transfer.fake_engine import FakeCopyEngine

    @asynccontextmanager
    async def run():
        async with CacheRuntime.open(cfg, engine_factory=FakeCopyEngine, storage=backend) as rt:
            engine = rt.engine
            try:
                yield rt, engine
            finally:
                closing = asyncio.ensure_future(rt.close())
                while not closing.done():
                    for op_id in engine.pending():
                        engine.release(op_id)
                    await asyncio.sleep(0.001)
                await closing

    return run()


# -- state bounded by live state ------------------------------------------------------------------


async def test_read_only_questions_and_unique_rids_leave_no_state():
    """match_prefix/can_admit of never-seen namespaces create no tree root; unique rids leave no
    per-rid entry; flush drops roots that hold nothing. Before the fix every namespace ever looked
    at kept a root and every rid ever admitted kept a generations entry."""
    async with fake_runtime(small_config(write_policy="write_through_selective", write_through_threshold=99)) as (rt, _):
        for i in range(50):
            await rt.match_prefix(toks(8, i), f"ns{i}")
            await rt.can_admit(toks(8, i), f"ns-c{i}")
        for i in range(50):
            t = toks(9, 100 + i)
            r = await rt.admit(f"u{i}", t, f"k{i}")
            compute(rt, r.slots, t, f"k{i}")
            await rt.finish(f"u{i}", t[:8])
        await rt.flush()
        sizes = await rt.inspect(lambda core: (len(core.residency.tree.roots()), len(getattr(core, "generations", {}))))
        assert sizes[0] <= 1 and sizes[1] == 0


# -- a prefetch keeps its anchor -----------------------------------------------------------------


async def test_prefetch_keeps_the_prefix_its_pages_hang_under(tmp_path):
    """P (8 tokens) is cached on host only, the host pool is full (P and a newer Q), and storage
    holds the next 16 tokens of T = P + S. Admitting T reads S into host pages; making room must
    not evict P (the prefix S hangs under). Before the fix P was evicted (it is older than Q), the
    read pages were dropped as "prefix gone" and storage served 0 tokens."""
    cfg = small_config(storage_backend="file", storage_dir=str(tmp_path), prefetch_policy="wait_complete",
                       device_slots=32, host_tokens=32)
    p, s, q = toks(8, 50), toks(16, 51), toks(24, 52)
    t = np.concatenate((p, s, toks(1, 53)))
    async with fake_runtime(cfg) as (rt, engine):  # A: T's pages go to storage
        r = await rt.admit("t", t)
        compute(rt, r.slots, t)
        await rt.finish("t", t[:24])
        await release_all(rt, engine)
    async with fake_runtime(cfg) as (rt, engine):  # B: a fresh process over the same storage
        pp = np.concatenate((p, toks(1, 54)))
        r = await rt.admit("p", pp)
        await release_all(rt, engine)  # P may come from storage: its load lands first
        for x in r.readiness:
            await x.wait_all()
        compute(rt, r.slots, pp)
        await rt.finish("p", p)
        await release_all(rt, engine)  # P backed up on host
        qq = np.concatenate((q, toks(1, 55)))
        r = await rt.admit("q", qq)  # evicts P's device copy (backed up)
        compute(rt, r.slots, qq)
        await rt.finish("q", q)
        await release_all(rt, engine)  # Q backed up: the host pool is full
        await rt.admit("r", toks(25, 56))  # evicts Q's device copy
        await rt.abort("r")
        shape = await rt.inspect(lambda core: sorted((n.num_tokens, n.device is None, n.host is not None)
                                                     for n in core.residency.tree.nodes()))
        assert shape == [(8, True, True), (24, True, True)]
        res = await rt.admit("t", t)
        assert res.loaded_storage == 16 and res.cached == 24
        await release_all(rt, engine)
        assert bad_positions(rt.device_pool, res.slots[:24], t[:24]) == []
        await rt.abort("t")
        await release_all(rt, engine)
        await rt.inspect(lambda core: check_invariants(core, quiescent=True))


# -- a failed load takes back only what hangs on it -------------------------------------------


async def _host_only_chain(rt, engine, x, y):
    """Cache x then x+y (two nodes, backed up to host), then push both off device with a large
    unrelated request (aborted): the tree holds them host-only."""
    for rid, t in (("x", x), ("xy", np.concatenate((x, y)))):
        full = np.concatenate((t, toks(1, 90)))
        res = await rt.admit(rid, full)
        compute(rt, res.slots, full)
        await rt.finish(rid, t)
    await release_all(rt, engine)
    av = await rt.available()
    big = toks(av["device_free"] + av["device_evictable"], 91)
    await rt.admit("big", big)
    await rt.abort("big")
    assert await rt.match_prefix(np.concatenate((x, y))) == {"device": 0, "host": len(x) + len(y)}


@pytest.mark.parametrize("second", ["released_first", "released_after", "failed"])
async def test_a_failed_load_takes_back_the_loads_started_under_it(second):
    """X (16 tokens) and its child Y (8) are host-only. `c` matches X: its load starts. `d`
    matches X (on device, still loading) and Y: Y's load starts under X's. X's load fails: Y's
    device copy must go too (residency is prefix-closed), its slots staying with its load until
    that one's ack, whether Y's copy completed before, completes after or fails. c and d learn it
    (TransferError), X and Y stay cached on host, nothing leaks. On the code before this fix the
    rollback failed the runtime (TreeError: detach_device ... device children=1)."""
    from runtime.errors import TransferError

    async with fake_runtime(small_config(device_slots=64, host_tokens=256)) as (rt, engine):
        x, y = toks(16, 20), toks(8, 21)
        await _host_only_chain(rt, engine, x, y)
        c = np.concatenate((x, toks(3, 22)))
        rc = await rt.admit("c", c)
        assert rc.loaded_host == 16
        await until(lambda: len(engine.pending()) == 1)
        load_x = engine.pending()[0]
        d = np.concatenate((x, y, toks(3, 23)))
        rd = await rt.admit("d", d)
        assert (rd.cached_device, rd.loaded_host) == (16, 8)
        await until(lambda: len(engine.pending()) == 2)
        load_y = [op for op in engine.pending() if op != load_x][0]
        if second == "released_first":
            engine.release(load_y)
        engine.fail(load_x, RuntimeError("injected"))
        await asyncio.sleep(0.01)
        await rt.inspect(check_invariants)
        if second == "released_after":
            engine.release(load_y)
        elif second == "failed":
            engine.fail(load_y, RuntimeError("injected"))
        await settle(rt)
        for rid, t in (("c", c), ("d", d)):
            with pytest.raises(TransferError):
                await rt.finish(rid, t)
        await release_all(rt, engine)
        assert await rt.match_prefix(np.concatenate((x, y, toks(1, 24)))) == {"device": 0, "host": 24}
        await rt.inspect(lambda core: check_invariants(core, quiescent=True))


async def test_an_insert_stops_at_a_node_still_loading():
    """`e` was admitted before X was cached and computed X itself; X is then loaded for `c`
    (in flight) when e caches X + Z: e's KV may not hang under X's load (its failure takes X's
    device copy back), so the insert stops above X and e keeps its pages; cache says so (0).
    After X's load fails, e finishes with its own KV intact. Before the fix the rollback failed
    the runtime (TreeError: detach_device ... device children=1). `c` caching before its load is
    done is refused (StateError) and changes nothing."""
    async with fake_runtime(small_config(device_slots=64, host_tokens=256)) as (rt, engine):
        x, y = toks(16, 30), toks(8, 31)
        e = np.concatenate((x, toks(9, 32)))
        re = await rt.admit("e", e)
        compute(rt, re.slots, e)
        await _host_only_chain(rt, engine, x, y)
        c = np.concatenate((x, toks(3, 33)))
        rc = await rt.admit("c", c)
        compute(rt, rc.slots, c, start=16)
        with pytest.raises(StateError):
            await rt.cache("c", c)
        assert await rt.cache("e", e[:24]) == 0
        await until(lambda: bool(engine.pending()))
        engine.fail(engine.pending()[0], RuntimeError("injected"))
        await settle(rt)
        assert bad_positions(rt.device_pool, re.slots, e) == []
        assert await rt.finish("e", e) == 24
        assert (await rt.match_prefix(e))["device"] == 24
        await rt.abort("c")
        await release_all(rt, engine)
        await rt.inspect(lambda core: check_invariants(core, quiescent=True))

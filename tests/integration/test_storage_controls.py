"""Storage controls through the runtime: `clear_storage`, `attach_storage` /
`detach_storage` at run time, each while storage ops are in flight and under a concurrent load
with fingerprinted KV and the invariant checker on; and `admit(..., priority=)` with the
`priority` eviction policy."""

from __future__ import annotations

import asyncio
import contextlib
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runtime.errors import ArgumentError, CapacityError, ConfigError, StateError, UnknownRequestError
from runtime.messages import Admit
from runtime.runtime import CacheRuntime
from runtime.storage.backend import FaultPlan, FaultyBackend
from runtime.storage.file_backend import FileBackend
from runtime.storage.hashing import KVIdentity, page_hashes
from tests.integration.support import bad_positions, compute, small_config, toks, until
from tests.integration.test_storage_tier import N, backend, cfg, quiescent, readmit_ok, serve, settle_all, stored_pages

PAGES = N // 4  # pages of N tokens (page_size 4)


async def no_leak(rt: CacheRuntime) -> None:
    """Nothing in flight, invariant 7 holds, and after a flush every device and host slot is free."""
    await quiescent(rt)
    await rt.flush()
    free = await rt.available()
    assert free["device_free"] == rt.config.device_slots
    assert free["host_free"] == rt.config.host_slots


# -- clear_storage -------------------------------------------------------------------------------


async def test_clear_removes_our_pages_and_no_later_admit_hits_them(tmp_path):
    """Two runtimes of different models share one directory: a clear removes exactly the clearing
    runtime's pages (their hashes encode its identity), returns their count, and a later admit of
    the same tokens gets no storage hit; the other model's pages stay readable."""
    ca, cb = cfg(model_id="model-a"), cfg(model_id="model-b")
    fa, fb = backend(tmp_path, ca), backend(tmp_path, cb)
    a = toks(N + 1, 1)
    async with CacheRuntime.open(ca, storage=fa) as ra, CacheRuntime.open(cb, storage=fb) as rb:
        await serve(ra, "a", a)
        await serve(rb, "b", a)  # the same tokens under the other model: other page hashes
        assert stored_pages(fa, ca, a) == stored_pages(fb, cb, a) == PAGES
        assert await ra.clear_storage() == PAGES
        assert stored_pages(fa, ca, a) == 0 and stored_pages(fb, cb, a) == PAGES
        assert await ra.inspect(lambda core: len(core.storage.known)) == 0
        await ra.flush()
        assert await readmit_ok(ra, "a2", a) == 0  # nothing on device, host or in storage
        assert (await ra.stats())["storage"]["hit_tokens"] == 0
        assert await ra.clear_storage() == 0  # nothing known stored any more
        await rb.flush()
        assert await readmit_ok(rb, "b2", a) == N  # the other model's pages were kept
        # the tier works on after a clear: the next backups are written again
        await serve(ra, "a3", a)
        assert stored_pages(fa, ca, a) == PAGES
        await no_leak(ra)
        await no_leak(rb)
    fa.close()
    fb.close()


async def test_clear_removes_pages_a_lookup_put_in_doubt(tmp_path):
    """A page evicted from the backend behind the runtime's back: the next lookup stops there, so
    it and the pages after it are no longer known stored (written again next time), but those after
    it are still on disk, and a clear removes them too. (Checked failing with `_gone` forgetting
    them outright, as before `StoredPages.doubtful`: pages 4..9 stayed in the directory.)"""
    config = cfg()
    fb = backend(tmp_path, config)
    a = toks(N + 1, 7)
    keys = page_hashes(a[:N], config.page_size, None, KVIdentity.from_config(config))
    async with CacheRuntime.open(config, storage=fb) as rt:
        await serve(rt, "a", a)
        assert stored_pages(fb, config, a) == PAGES
        assert fb.remove([keys[3]]) == 1  # evicted by someone else
        await rt.flush()
        assert await readmit_ok(rt, "a2", a) == 3 * config.page_size  # the lookup stops at page 3
        assert await rt.inspect(lambda core: sorted(core.storage.doubtful)) == sorted(keys[3:])
        await rt.clear_storage()
        assert sum(fb.exists_prefix([k]) for k in keys) == 0  # pages 4.. are gone as well
        await no_leak(rt)
    fb.close()



async def held_at_head(rt: CacheRuntime, control: asyncio.Task) -> None:
    """Wait until `control` (a clear or detach task) is done, or heads the tree actor's storage
    controls with the tier paused: then it waits for the storage ops in flight. Checking "not done"
    at that point cannot pass vacuously on a slow machine: a control that did not wait would be
    done, or gone from the queue, by then (the wait times out)."""
    tree = rt._tree
    await until(lambda: control.done() or (bool(tree.controls) and tree.core.storage.attached
                                           and tree.core.storage.paused and bool(tree.core.storage.ops)))

async def test_clear_waits_for_a_write_in_flight(tmp_path):
    """A clear issued while a write is held in the backend waits for it, then removes its pages
    too (a write landing after the clear would leave a page the clear promised gone)."""
    config = cfg()
    inner = backend(tmp_path, config)
    fb = FaultyBackend(inner, FaultPlan(hold_at=frozenset({1}), methods=frozenset({"set_batch"})))
    a = toks(N + 1, 2)
    async with CacheRuntime.open(config, storage=fb) as rt:
        res = await rt.admit("a", a)
        compute(rt, res.slots, a)
        await rt.finish("a", a[:N])
        assert await asyncio.to_thread(fb.wait_held, 1)
        clear = asyncio.create_task(rt.clear_storage())
        await held_at_head(rt, clear)
        assert not clear.done()
        assert await rt.inspect(lambda core: core.storage.paused)
        fb.release()
        assert await clear == PAGES
        assert stored_pages(inner, config, a) == 0
        assert not await rt.inspect(lambda core: core.storage.paused)
        await rt.flush()
        assert await readmit_ok(rt, "a2", a) == 0
        await no_leak(rt)
    fb.close()


async def test_clear_while_a_prefetch_reads(tmp_path):
    """A clear issued while a prefetch's read is held: the read lands (its pages become host
    copies, fingerprint-exact), then the pages are removed; a later prefetch finds nothing."""
    config = cfg(prefetch_policy="best_effort")
    inner = backend(tmp_path, config)
    fb = FaultyBackend(inner, FaultPlan(hold_at=frozenset({2}), methods=frozenset({"get_batch"}) | {"exists_prefix"}))
    a = toks(N + 1, 3)
    async with CacheRuntime.open(config, storage=fb) as rt:
        await serve(rt, "a", a)  # (no read call yet: holds count exists_prefix/get_batch calls)
        await rt.flush()
        assert await rt.prepare("p", a) == N  # call 1: the lookup; call 2: the read, held
        assert await asyncio.to_thread(fb.wait_held, 1)
        clear = asyncio.create_task(rt.clear_storage())
        await held_at_head(rt, clear)
        assert not clear.done()
        fb.release()
        assert await clear == PAGES
        assert (await rt.match_prefix(a))["host"] == N  # the read landed before the clear went on
        assert await readmit_ok(rt, "p", a) == N  # from host, fingerprint-exact
        await rt.flush()
        assert await rt.prepare("q", a) == N and await readmit_ok(rt, "q", a) == 0
        await no_leak(rt)
    fb.close()


async def test_clear_refusals(tmp_path):
    config = cfg()
    async with CacheRuntime.open(config) as rt:  # no storage tier
        with pytest.raises(StateError):
            await rt.clear_storage()

    class NoRemove:  # a backend without remove(keys)
        def __init__(self, inner):
            self.inner, self.page_bytes = inner, inner.page_bytes

        def __getattr__(self, name):
            if name == "remove":
                raise AttributeError(name)
            return getattr(self.inner, name)

    fb = backend(tmp_path, config)
    a = toks(N + 1, 4)
    async with CacheRuntime.open(config, storage=NoRemove(fb)) as rt:
        await serve(rt, "a", a)
        with pytest.raises(StateError, match="remove"):
            await rt.clear_storage()
        assert await rt.inspect(lambda core: len(core.storage.known)) == PAGES  # nothing changed
        assert stored_pages(fb, config, a) == PAGES
        await no_leak(rt)
    fb.close()


# -- attach / detach -------------------------------------------------------------------------------


async def test_attach_and_detach_at_run_time(tmp_path):
    """Start without storage, attach one, write through it, detach it (the tier is off: nothing
    written, nothing read, the rest works), attach again and read what was written before."""
    config = cfg()
    fb = backend(tmp_path, config)
    a, b = toks(N + 1, 5), toks(N + 1, 6)
    async with CacheRuntime.open(config) as rt:
        assert rt.storage is None
        with pytest.raises(StateError):
            await rt.detach_storage()  # none attached: an error, nothing changed
        await serve(rt, "a0", a)
        assert stored_pages(fb, config, a) == 0
        await rt.attach_storage(fb)
        assert rt.storage is fb
        with pytest.raises(StateError):
            await rt.attach_storage(fb)  # attached already
        await serve(rt, "b", b)
        assert stored_pages(fb, config, b) == PAGES
        await rt.detach_storage()
        assert rt.storage is None and await rt.inspect(lambda core: core.storage.attached) is False
        await rt.flush()
        await serve(rt, "a", a)  # without the tier: no write
        assert stored_pages(fb, config, a) == 0
        await rt.flush()
        assert await rt.prepare("b2", b) == 0 and await readmit_ok(rt, "b2", b) == 0  # nor any read
        st = await rt.stats()
        await rt.attach_storage(fb)
        await rt.flush()
        assert await readmit_ok(rt, "b3", b) == N  # written before the detach, read after the attach
        assert (await rt.stats())["storage"]["hit_tokens"] == st["storage"]["hit_tokens"] + N
        await no_leak(rt)
        await rt.detach_storage()
    assert not fb.stats().get("closed", False)
    fb.close()


async def test_attach_refusals_change_nothing(tmp_path):
    config = cfg()
    async with CacheRuntime.open(config) as rt:
        with pytest.raises(ConfigError, match="bytes"):
            await rt.attach_storage(FileBackend(tmp_path / "x", 4096))  # another page size
        with pytest.raises(ConfigError, match="lacks"):
            await rt.attach_storage(object())
        assert rt.storage is None and await rt.inspect(lambda core: core.storage.attached) is False
    no_host = small_config(host_tokens=0, write_policy="write_back")
    async with CacheRuntime.open(no_host) as rt:
        with pytest.raises(ConfigError, match="host tier"):
            await rt.attach_storage(backend(tmp_path, no_host))


async def test_detach_drains_a_held_write_and_a_held_read(tmp_path):
    """Detach while a write and a prefetch read are held in the backend: it waits for both (the
    write lands and is stored, the read's pages land in host), then the tier goes; nothing leaks."""
    config = cfg(prefetch_policy="best_effort")
    inner = backend(tmp_path, config)
    a, b = toks(N + 1, 7), toks(N + 1, 8)
    async with CacheRuntime.open(config) as rt:
        fb = FaultyBackend(inner, FaultPlan(hold_at=frozenset({2, 3}), methods=frozenset({"set_batch", "get_batch"})))
        await rt.attach_storage(fb)
        await serve(rt, "a", a)  # set_batch: call 1
        await rt.flush()
        assert await rt.prepare("p", a) == N  # get_batch (the read): call 2, held
        assert await asyncio.to_thread(fb.wait_held, 1)
        res = await rt.admit("b", b)
        compute(rt, res.slots, b)
        await rt.finish("b", b[:N])  # its backup lands; its write (set_batch: call 3) is held
        assert await asyncio.to_thread(fb.wait_held, 2)
        detach = asyncio.create_task(rt.detach_storage())
        await held_at_head(rt, detach)
        assert not detach.done()
        assert await rt.inspect(lambda core: core.storage.paused)
        fb.release()
        await detach
        assert rt.storage is None
        assert (await rt.match_prefix(a))["host"] == N
        assert await readmit_ok(rt, "p", a) == N
        await no_leak(rt)
    assert stored_pages(inner, config, a) == stored_pages(inner, config, b) == PAGES  # the held write landed
    inner.close()


# -- under load ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
async def test_controls_under_load(tmp_path, seed):
    """Eight workers admit, compute fingerprinted KV and finish over a small prompt set (shared
    prefixes, so device, host and storage hits all happen, with evictions) while a controller
    clears, detaches and attaches the tier at random. Every admit's cached prefix must hold its
    prefix's fingerprint (no wrong hit), the invariant checker runs after every message, and at
    the end nothing is in flight, pinned or leaked."""
    config = cfg(device_slots=96, host_tokens=192, prefetch_policy="wait_complete", storage_timeout_s=5.0)
    fb = backend(tmp_path, config)
    rng = random.Random(seed)
    base = [toks(N + 1, 100 + i) for i in range(6)]
    prompts = [np.concatenate([p[: rng.choice([8, 16, 24])], toks(12, 200 + i)]) for i, p in
               enumerate(rng.choices(base, k=24))] + base
    hits = {"storage": 0, "served": 0}
    stop = asyncio.Event()

    async def worker(w: int) -> None:
        r = random.Random(seed * 100 + w)
        i = 0
        while not stop.is_set():
            i += 1
            rid = f"w{w}-{i}"
            t = r.choice(prompts)
            if r.random() < 0.3:
                await rt.prepare(rid, t)
            try:
                res = await rt.admit(rid, t)
            except CapacityError:  # under pressure: drop a prepared rid's record, back off
                with contextlib.suppress(UnknownRequestError):
                    await rt.abort(rid)
                await asyncio.sleep(0.002)
                continue
            for rd in res.readiness:
                await rd.wait_all()
            assert bad_positions(rt.device_pool, res.slots[:res.cached], t[:res.cached]) == [], rid
            hits["storage"] += res.loaded_storage
            hits["served"] += 1
            compute(rt, res.slots, t, start=res.cached)
            await asyncio.sleep(0)
            await rt.finish(rid, t)

    async def controller() -> None:
        r = random.Random(seed + 7)
        for k in range(12):
            await asyncio.sleep(r.uniform(0.005, 0.03))
            while hits["served"] < 5 * k:  # paced by the workers' progress, not the clock (a loaded machine)
                await asyncio.sleep(0.002)
            op = r.choice(["clear", "clear", "detach", "flush"])
            if op == "clear" and rt.storage is not None:
                await rt.clear_storage()
            elif op == "detach" and rt.storage is not None:
                await rt.detach_storage()
                await asyncio.sleep(r.uniform(0.005, 0.02))
                await rt.attach_storage(fb)
            else:
                await rt.flush()
        stop.set()

    async with CacheRuntime.open(config, storage=fb) as rt:
        await asyncio.gather(controller(), *(worker(w) for w in range(8)))
        await settle_all(rt)
        st = await rt.stats()
        assert hits["served"] > 50 and st["storage"]["written_pages"] > 0
        assert st["storage"]["errors"] == 0 and st["storage"]["backend_errors"] == 0
        # a last clear leaves no page of ours in storage: a fresh runtime on the directory finds none
        await rt.clear_storage()
        assert all(stored_pages(fb, config, p) == 0 for p in prompts)
        await no_leak(rt)
    fb.close()


# -- priority ------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["priority", "lru"])
async def test_priority_keeps_a_system_prompt_on_device(policy):
    """A system prompt admitted with priority 5, then ordinary traffic that fills the device pool
    several times over: under the priority policy the prompt stays device-resident; under LRU
    (priority ignored) the same trace evicts it."""
    config = small_config(device_slots=64, host_tokens=0, write_policy="write_back", eviction_policy=policy)
    system = toks(16, 900)
    async with CacheRuntime.open(config) as rt:
        res = await rt.admit("sys", system, priority=5)
        compute(rt, res.slots, system)
        await rt.finish("sys", system)
        for i in range(12):
            t = toks(24, 1000 + i)
            res = await rt.step([Admit(f"r{i}", t)])
            compute(rt, res[0].slots, t)
            await rt.finish(f"r{i}", t)
        on_device = (await rt.match_prefix(system))["device"]
        assert on_device == (16 if policy == "priority" else 0)


async def test_priority_is_validated():
    config = small_config(eviction_policy="priority")
    t = toks(8, 1)
    async with CacheRuntime.open(config) as rt:
        for bad in (-1, True, 1.5, "1", 1 << 63):
            with pytest.raises(ArgumentError, match="priority"):
                await rt.admit("a", t, priority=bad)
        out = await rt.step([Admit("a", t, priority=-2), Admit("b", t, priority=3)])
        assert isinstance(out[0], ArgumentError) and out[1].rid == "b"
        compute(rt, out[1].slots, t)
        await rt.finish("b", t)
        prio = await rt.inspect(lambda core: [n.priority for n in core.residency.tree.nodes() if n.parent is not None])
        assert prio and set(prio) == {3}
        assert await rt.inspect(lambda core: "a" not in core.requests)


_LOADED_AT_OPEN = """
import asyncio, sys
from runtime.runtime import CacheRuntime
from runtime.storage import hash_chain
from runtime.storage.file_backend import FileBackend
from tests.integration.test_storage_tier import cfg

async def main() -> None:
    config = cfg()
    backend = FileBackend(sys.argv[1], config.page_size * config.bytes_per_token)
    async with CacheRuntime.open(config, storage=backend):
        print(len(hash_chain._chain.signatures))
    backend.close()

asyncio.run(main())
"""


def test_page_hash_code_is_loaded_at_open_not_in_an_actor_turn(tmp_path):
    """A runtime with a storage tier loads the page hash's compiled code (up to a second of CPU)
    off the loop at `open`, not inside the tree actor's turn of the first admit that hashes a page.
    A fresh process, since one load serves the whole process. Checked failing (0 signatures) with
    the load at open removed."""
    out = subprocess.run([sys.executable, "-c", _LOADED_AT_OPEN, str(tmp_path)], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) >= 1

"""The storage tier through the runtime: write-through after host backups, prefetch on
prepare/admit (policies), abort at each prefetch stage, faults, seed 002 storage variant,
namespace/identity isolation and two processes sharing one directory."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from runtime.errors import ConfigError, StateError
from runtime.runtime import CacheRuntime
from runtime.storage.backend import FaultPlan, FaultyBackend
from runtime.storage.file_backend import FileBackend
from runtime.storage.hashing import KVIdentity, page_hashes
from tests.integration.support import bad_positions, compute, small_config, toks

N = 40  # tokens backed up (10 pages of 4)


def cfg(**changes):
    base = dict(copy_engine="cpu", host_tokens=256)
    base.update(changes)
    return small_config(**base)


def backend(path, config) -> FileBackend:
    return FileBackend(path, config.page_size * config.bytes_per_token)


async def settle_all(rt: CacheRuntime, timeout: float = 10.0) -> None:
    """Until no copy and no storage op is in flight."""
    deadline = asyncio.get_running_loop().time() + timeout
    while await rt.inspect(lambda core: core.in_flight()):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("copies or storage ops still in flight")
        await asyncio.sleep(0.002)


async def quiescent(rt: CacheRuntime) -> None:
    from runtime.invariants import check_invariants

    await settle_all(rt)
    await rt.inspect(lambda core: check_invariants(core, quiescent=True))


async def serve(rt: CacheRuntime, rid, tokens, extra_key=None) -> None:
    """Admit, compute the fingerprint KV, finish with the first N tokens; wait for the backups."""
    res = await rt.admit(rid, tokens, extra_key)
    compute(rt, res.slots, tokens, extra_key)
    await rt.finish(rid, tokens[:N])
    await settle_all(rt)


async def readmit_ok(rt: CacheRuntime, rid, tokens, extra_key=None) -> int:
    """Admit again; check the cached prefix's device KV is the prefix's fingerprint; abort."""
    res = await rt.admit(rid, tokens, extra_key)
    for r in res.readiness:
        await r.wait_all()
    await settle_all(rt)
    cached = res.cached
    assert bad_positions(rt.device_pool, res.slots[:cached], tokens[:cached], extra_key) == []
    await rt.abort(rid)
    return cached


def stored_pages(fb, config, tokens, extra_key=None) -> int:
    keys = page_hashes(tokens[:N], config.page_size, extra_key, KVIdentity.from_config(config))
    return fb.exists_prefix(keys)


# -- round trip ------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])  # page_first reads straight into the pool
async def test_round_trip_through_storage(tmp_path, layout):
    config = cfg(host_layout=layout)
    fb = backend(tmp_path, config)
    a = toks(N + 1, 1)
    async with CacheRuntime.open(config, storage=fb) as rt:
        await serve(rt, "a", a)
        assert stored_pages(fb, config, a) == N // config.page_size
        assert await rt.flush() > 0
        assert await rt.match_prefix(a) == {"device": 0, "host": 0}
        assert await readmit_ok(rt, "a2", a) == N  # wait_complete: the admit waits for storage
        st = await rt.stats()
        assert st["storage"]["hit_tokens"] == N
        assert st["storage"]["written_pages"] == N // config.page_size
        assert st["storage"]["written_bytes"] == N * config.bytes_per_token
        assert st["storage"]["read_bytes"] == N * config.bytes_per_token
        assert st["storage"]["write_failed_pages"] == 0 and st["storage"]["errors"] == 0
        await quiescent(rt)
    fb.close()


async def test_read_path_calls(tmp_path):
    """A lookup of pages the local backend lacks is answered by one inline probe on the event loop
    (no worker thread, no host pages, no get); a hit is that probe, one lookup pass on a worker,
    then one get_prefix pass into the host pages taken for what the lookup found."""
    config = cfg(host_layout="page_first")
    fb = backend(tmp_path, config)
    a, b = toks(N + 1, 21), toks(N + 1, 22)
    async with CacheRuntime.open(config, storage=fb) as rt:
        res = await rt.admit("cold", b)  # storage is empty: the admit does not wait on a thread
        assert res.cached == 0
        assert rt._transfer.storage._pool is None  # no storage op reached a worker thread
        s = fb.stats()
        assert (s["exists_calls"], s["get_calls"]) == (1, 0)
        await rt.abort("cold")
        await serve(rt, "a", a)
        await rt.flush()
        before = fb.stats()
        assert await readmit_ok(rt, "a2", a) == N
        s = fb.stats()
        assert (s["exists_calls"] - before["exists_calls"], s["get_calls"] - before["get_calls"]) == (2, 1)
        assert s["pages_read"] - before["pages_read"] == N // config.page_size
        st = await rt.stats()
        # lookups: cold, serve's cold admit of a, the hit; reads: only the hit
        assert (st["storage"]["lookups_issued"], st["storage"]["reads_issued"]) == (3, 1)
        await quiescent(rt)
    fb.close()


async def test_lookup_miss_evicts_no_host_copy(tmp_path):
    """Host pages are taken (evicting host copies) only for what storage holds: a prompt storage
    lacks leaves the host tier alone. (Checked against the previous core, which took host pages
    for every page beyond the hit before asking storage: it evicted all 40 host tokens of `a`.)"""
    config = cfg(device_slots=64, host_tokens=128)  # 16 device pages, 32 host pages
    fb = backend(tmp_path, config)
    async with CacheRuntime.open(config, storage=fb) as rt:
        a, b = toks(N + 1, 23), toks(N + 1, 25)
        await serve(rt, "a", a)
        await serve(rt, "b", b)  # a's device copy is evicted: a lives on host (10 of 32 pages)
        assert await rt.match_prefix(a[:N]) == {"device": 0, "host": N}
        res = await rt.admit("cold", toks(61, 24))  # 15 pages beyond the hit, none in storage
        await rt.abort("cold")
        st = await rt.stats()
        assert st["host"]["evicted_tokens"] == 0
        assert await rt.match_prefix(a[:N]) == {"device": 0, "host": N}
        assert res.cached == 0 and st["storage"]["reads_issued"] == 0
        await quiescent(rt)
    fb.close()


async def test_storage_from_config_file_backend(tmp_path):
    config = cfg(storage_backend="file", storage_dir=str(tmp_path))
    a = toks(N + 1, 2)
    async with CacheRuntime.open(config) as rt:
        await serve(rt, "a", a)
        await rt.flush()
        assert await readmit_ok(rt, "b", a) == N
        await quiescent(rt)


def test_storage_config_validation():
    with pytest.raises(ConfigError):
        cfg(storage_backend="disk")
    with pytest.raises(ConfigError):
        cfg(storage_backend="file")  # no directory
    with pytest.raises(ConfigError):
        cfg(storage_backend="file", storage_dir="kv-store", host_tokens=0)
    with pytest.raises(ConfigError):
        cfg(prefetch_policy="eager")
    with pytest.raises(ConfigError):
        cfg(prefetch_threshold=-1)
    c = cfg()
    assert c.prefetch_timeout(0) == 2.0 and c.prefetch_timeout(10_000) == 3.0
    assert c.prefetch_timeout(10_000_000) == 30.0


async def test_backend_page_size_must_match(tmp_path):
    config = cfg()
    with pytest.raises(ConfigError):
        async with CacheRuntime.open(config, storage=FileBackend(tmp_path, 1234)):
            pass


# -- isolation -------------------------------------------------------------------------------


async def test_namespace_and_identity_isolation(tmp_path):
    config = cfg()
    a = toks(N + 1, 3)
    async with CacheRuntime.open(config, storage=backend(tmp_path, config)) as rt:
        await serve(rt, "a", a)
        await rt.flush()
        assert await readmit_ok(rt, "x", a, extra_key="other") == 0
        assert (await rt.stats())["storage"]["hit_tokens"] == 0
        await quiescent(rt)
    for other in (cfg(kv_dtype="float16"), cfg(weight_version="1")):
        async with CacheRuntime.open(other, storage=backend(tmp_path, other)) as rt:
            assert await readmit_ok(rt, "y", a) == 0
            assert (await rt.stats())["storage"]["hit_tokens"] == 0
            await quiescent(rt)


# -- seed 002, storage variant ---------------------------------------------------------------


async def test_seed002_split_during_storage_write_keeps_every_page(tmp_path):
    config = cfg()
    inner = backend(tmp_path, config)
    fb = FaultyBackend(inner, FaultPlan(hold_at={1}, methods={"set_batch"}))
    a = toks(N + 1, 4)
    async with CacheRuntime.open(config, storage=fb) as rt:
        res = await rt.admit("a", a)
        compute(rt, res.slots, a)
        await rt.finish("a", a[:N])
        assert await asyncio.to_thread(fb.wait_held, 1, 5.0)  # the storage write is held in flight
        b = np.concatenate((a[:16], toks(20, 5)))
        res_b = await rt.admit("b", b)
        assert res_b.cached_device == 16  # the node was split at 16 during the write
        n_nodes = await rt.inspect(lambda core: sum(1 for n in core.residency.tree.nodes() if n.host_protect > 0))
        assert n_nodes == 2  # both halves protected from host eviction while the write runs
        fb.release()
        await settle_all(rt)
        assert stored_pages(inner, config, a) == N // config.page_size  # every original page landed
        await rt.abort("b")
        await rt.flush()
        assert await readmit_ok(rt, "c", a) == N
        await quiescent(rt)


# -- prefetch policies -----------------------------------------------------------------------


async def _stored(tmp_path, config, a) -> None:
    async with CacheRuntime.open(config, storage=backend(tmp_path, config)) as rt:
        await serve(rt, "w", a)


async def stored_then_held(tmp_path, config, seed: int) -> tuple[np.ndarray, FaultyBackend]:
    """A prompt whose prefix another runtime stored, and a backend whose first read blocks
    until `release()`."""
    a = toks(N + 1, seed)
    await _stored(tmp_path, config, a)
    return a, FaultyBackend(backend(tmp_path, config), FaultPlan(hold_at={1}, methods={"get_batch"}))


async def test_best_effort_uses_what_has_arrived(tmp_path):
    config = cfg(prefetch_policy="best_effort")
    a, fb = await stored_then_held(tmp_path, config, 6)
    async with CacheRuntime.open(config, storage=fb) as rt:
        assert await rt.prepare("r", a) == N
        assert await asyncio.to_thread(fb.wait_held, 1, 5.0)
        res = await rt.admit("r", a)  # nothing arrived yet: no wait
        assert res.cached == 0
        await rt.abort("r")
        fb.release()
        await settle_all(rt)  # the read lands into the tree anyway
        assert await rt.match_prefix(a) == {"device": 0, "host": N}
        assert await readmit_ok(rt, "r2", a) == N
        await quiescent(rt)


async def test_wait_complete_waits_for_a_held_read(tmp_path):
    config = cfg(prefetch_policy="wait_complete")
    a, fb = await stored_then_held(tmp_path, config, 7)
    async with CacheRuntime.open(config, storage=fb) as rt:
        admit = asyncio.ensure_future(rt.admit("r", a))
        assert await asyncio.to_thread(fb.wait_held, 1, 5.0)
        await asyncio.sleep(0.05)
        assert not admit.done()
        fb.release()
        res = await admit
        assert res.loaded_host == N
        await settle_all(rt)
        assert bad_positions(rt.device_pool, res.slots[:N], a[:N]) == []
        await rt.abort("r")
        await quiescent(rt)


async def test_timeout_policy_gives_up_then_lands(tmp_path):
    config = cfg(prefetch_policy="timeout", prefetch_timeout_base_s=0.05, prefetch_timeout_per_1k_s=0.0)
    a, fb = await stored_then_held(tmp_path, config, 8)
    async with CacheRuntime.open(config, storage=fb) as rt:
        t0 = asyncio.get_running_loop().time()
        res = await rt.admit("r", a)
        assert res.cached == 0 and asyncio.get_running_loop().time() - t0 < 2.0
        fb.release()
        await settle_all(rt)
        await rt.abort("r")
        assert await readmit_ok(rt, "r2", a) == N  # the late read still became a host copy
        await quiescent(rt)


async def test_threshold_skips_short_prefetches(tmp_path):
    config = cfg(prefetch_threshold=N + 4)
    a = toks(N + 1, 9)
    await _stored(tmp_path, config, a)
    async with CacheRuntime.open(config, storage=backend(tmp_path, config)) as rt:
        assert await rt.prepare("r", a) == 0
        assert await readmit_ok(rt, "r", a) == 0
        await quiescent(rt)


# -- abort at each stage ---------------------------------------------------------------------


@pytest.mark.parametrize("stage", ["exists_prefix", "get_batch", "landed", "waiting_admit"])
async def test_abort_at_each_prefetch_stage_leaks_nothing(tmp_path, stage):
    config = cfg()
    a = toks(N + 1, 10)
    await _stored(tmp_path, config, a)
    method = "get_batch" if stage in ("landed", "waiting_admit") else stage
    fb = FaultyBackend(backend(tmp_path, config), FaultPlan(hold_at={1, 2, 3}, methods={method}))
    async with CacheRuntime.open(config, storage=fb) as rt:
        for round_ in range(3):
            rid = f"r{round_}"
            if stage == "waiting_admit":
                admit = asyncio.ensure_future(rt.admit(rid, a))
                assert await asyncio.to_thread(fb.wait_held, 1, 5.0)
                await rt.abort(rid)
                with pytest.raises(StateError):
                    await admit
            else:
                assert await rt.prepare(rid, a) == N
                if stage == "landed":
                    fb.release()
                    await settle_all(rt)
                    fb.rearm()
                else:
                    assert await asyncio.to_thread(fb.wait_held, 1, 5.0)
                await rt.abort(rid)
            fb.release()
            await quiescent(rt)
            fb.rearm()
            await rt.flush()
        fb.release()
        assert await readmit_ok(rt, "after", a) == N  # prefetch still works afterwards
        await quiescent(rt)


# -- faults ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["raise", "miss"])
async def test_failing_backend_is_a_miss_and_leaks_nothing(tmp_path, mode):
    config = cfg()
    fb = FaultyBackend(backend(tmp_path, config), FaultPlan(fail_rate=1.0, mode=mode, seed=3))
    a = toks(N + 1, 11)
    async with CacheRuntime.open(config, storage=fb) as rt:
        await serve(rt, "a", a)
        st = await rt.stats()
        assert st["storage"]["written_pages"] == 0 and st["storage"]["write_failed_pages"] == N // config.page_size
        await rt.flush()
        assert await readmit_ok(rt, "b", a) == 0
        assert not rt.failed
        await quiescent(rt)


async def test_flaky_pages_never_read_wrong(tmp_path):
    config = cfg()
    fb = FaultyBackend(backend(tmp_path, config), FaultPlan(page_fail_rate=0.3, stall_rate=0.3, stall_s=0.01, seed=7))
    async with CacheRuntime.open(config, storage=fb) as rt:
        for i in range(6):
            a = toks(N + 1, 100 + i)
            await serve(rt, f"a{i}", a)
            await rt.flush()
            cached = await readmit_ok(rt, f"b{i}", a)  # checks the fingerprints of what came back
            assert cached % config.page_size == 0
        assert not rt.failed
        await quiescent(rt)


# -- two processes ---------------------------------------------------------------------------


def test_two_processes_share_a_directory(tmp_path):
    config = cfg(storage_backend="file", storage_dir=str(tmp_path))
    a = toks(N + 1, 12)
    script = textwrap.dedent(f"""
        import asyncio, numpy as np
        from runtime.runtime import CacheRuntime
        from tests.integration.test_storage_tier import cfg, serve, toks
        async def main():
            config = cfg(storage_backend="file", storage_dir={str(tmp_path)!r})
            async with CacheRuntime.open(config) as rt:
                await serve(rt, "a", toks({N + 1}, 12))
                st = await rt.stats()
                assert st["storage"]["written_pages"] == {N // config.page_size}, st
        asyncio.run(main())
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", script], cwd=root, check=True, timeout=120)

    async def main():
        async with CacheRuntime.open(config) as rt:
            assert await readmit_ok(rt, "b", a) == N
            assert (await rt.stats())["storage"]["hit_tokens"] == N
            await quiescent(rt)

    asyncio.run(main())


# -- slot trace ------------------------------------------------------------------------------


async def test_storage_slot_trace_audits_clean(tmp_path):
    from runtime.audit import audit

    path = tmp_path / "trace.jsonl"
    config = cfg(trace_path=str(path))
    a = toks(N + 1, 13)
    fb = FaultyBackend(backend(tmp_path / "store", config), FaultPlan(hold_at={2}, methods={"get_batch"}))
    async with CacheRuntime.open(config, storage=fb) as rt:
        await serve(rt, "a", a)
        await rt.flush()
        assert await readmit_ok(rt, "b", a) == N  # get_batch call 1
        await rt.flush()
        assert await rt.prepare("c", a) == N  # call 2, held  # cancelled mid-read: its pages are freed at the ack
        assert await asyncio.to_thread(fb.wait_held, 1, 5.0)
        await rt.abort("c")
        fb.release()
        await quiescent(rt)
    report = audit(str(path))
    assert report.clean, report.summary()


async def test_cancelled_waiting_admit_releases_everything(tmp_path):
    config = cfg()
    a, fb = await stored_then_held(tmp_path, config, 14)
    async with CacheRuntime.open(config, storage=fb) as rt:
        admit = asyncio.ensure_future(rt.admit("r", a))
        assert await asyncio.to_thread(fb.wait_held, 1, 5.0)
        admit.cancel()
        with pytest.raises(asyncio.CancelledError):
            await admit
        fb.release()
        await settle_all(rt)
        for _ in range(100):  # the abandoned admission is released through the mailbox
            if not await rt.inspect(lambda core: len(core.requests)):
                break
            await asyncio.sleep(0.005)
        await quiescent(rt)
        assert await readmit_ok(rt, "r", a) == N


async def test_batch_admit_never_waits(tmp_path):
    from runtime.messages import Admit

    config = cfg()
    a, fb = await stored_then_held(tmp_path, config, 15)
    async with CacheRuntime.open(config, storage=fb) as rt:
        assert await rt.prepare("r", a) == N
        assert await asyncio.to_thread(fb.wait_held, 1, 5.0)
        (res,) = await rt.step([Admit("r", a)])
        assert res.cached == 0
        await rt.abort("r")  # the detached read is not cancelled: it lands into the tree
        fb.release()
        await settle_all(rt)
        assert await rt.match_prefix(a) == {"device": 0, "host": N}
        await quiescent(rt)


# -- two processes, one capped directory -----------------------------------------------------


def dir_bytes(directory) -> int:
    """Bytes of every page and temporary file in a file-backend directory (the state file aside)."""
    total = 0
    for root, _dirs, files in os.walk(directory):
        for name in files:
            if name == ".hicache-state":
                continue
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except FileNotFoundError:  # evicted or renamed while walking
                pass
    return total


class SamplingFileBackend(FileBackend):
    """A FileBackend that, after each write, measures the whole directory under its lock."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.max_seen = 0
        self.samples = 0

    def set_batch(self, keys, srcs, tags=None):
        ok = super().set_batch(keys, srcs, tags)
        with self._dir.lock():
            self.max_seen = max(self.max_seen, dir_bytes(self.directory))
            self.samples += 1
        return ok


CAP_PAGES = 6  # the cap holds six page files of the small config


def _cap_child(directory: str, cap: int, seed: int, go: str, out: str) -> None:
    """One process: its own runtime on the shared capped directory, serving 3-page prefixes."""
    import json
    import time

    async def main():
        config = cfg()
        fb = SamplingFileBackend(directory, config.page_size * config.bytes_per_token, cap_bytes=cap)
        while not os.path.exists(go):  # start together with the other process
            time.sleep(0.005)
        async with CacheRuntime.open(config, storage=fb) as rt:
            for i in range(24):
                a = toks(13, seed * 1000 + i)
                res = await rt.admit(i, a)
                compute(rt, res.slots, a)
                await rt.finish(i, a[:12])
                await settle_all(rt)
                await rt.flush()
            st = await rt.stats()
            await quiescent(rt)
        s = fb.stats()
        with open(out, "w") as f:
            json.dump({"max_seen": fb.max_seen, "samples": fb.samples, "written": st["storage"]["written_pages"],
                       "evicted": s["evicted_pages"], "used": s["used_bytes"]}, f)
        fb.close()

    asyncio.run(main())


def test_file_cap_holds_across_two_processes(tmp_path):
    import json
    import threading
    import time

    config = cfg()
    page_bytes = config.page_size * config.bytes_per_token
    store = tmp_path / "store"
    probe = FileBackend(store, page_bytes)  # creates the directory; learns the file size
    file_bytes = probe.stats()["file_bytes"]
    cap = CAP_PAGES * file_bytes + file_bytes // 2
    go = tmp_path / "go"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    procs = [subprocess.Popen([sys.executable, "-c",
                               "from tests.integration.test_storage_tier import _cap_child; "
                               f"_cap_child({str(store)!r}, {cap}, {seed}, {str(go)!r}, {str(tmp_path / f'out{seed}')!r})"],
                              cwd=root) for seed in (1, 2)]
    seen, stop = [0], threading.Event()

    def watch():  # a third observer: the directory under the backends' lock, all the time
        while not stop.is_set():
            with probe._dir.lock():
                seen[0] = max(seen[0], dir_bytes(store))
            time.sleep(0.001)

    t = threading.Thread(target=watch)
    t.start()
    go.touch()
    try:
        for p in procs:
            assert p.wait(timeout=120) == 0
    finally:
        stop.set()
        t.join()
    results = [json.loads((tmp_path / f"out{seed}").read_text()) for seed in (1, 2)]
    for r in results:
        assert r["samples"] > 0 and r["written"] > 0
        assert r["max_seen"] <= cap, (r, cap)
    assert 0 < seen[0] <= cap, (seen[0], cap)  # (0: the observer never ran)
    assert sum(r["written"] for r in results) > CAP_PAGES  # more than fits: eviction had to make room
    assert sum(r["evicted"] for r in results) > 0
    assert dir_bytes(store) <= cap and probe.used_bytes() <= cap
    probe.close()


# -- a writer killed mid-write ---------------------------------------------------------------

KILL_TOKENS = 256  # 16 pages of 256 KiB per request: long enough writes to be killed inside


def kill_cfg():
    return cfg(num_layers=8, num_kv_heads=4, head_dim=64, page_size=16, device_slots=1024, host_tokens=1024)


def _kill_child(directory: str, progress: str) -> None:
    """Serve request after request (write-through to storage) until killed; log each one started."""

    async def main():
        config = kill_cfg()
        fb = FileBackend(directory, config.page_size * config.bytes_per_token)
        async with CacheRuntime.open(config, storage=fb) as rt:
            for i in range(10_000):
                a = toks(KILL_TOKENS + 1, 5000 + i)
                with open(progress, "a") as f:
                    f.write(f"{i}\n")
                res = await rt.admit(i, a)
                for r in res.readiness:  # pages an earlier attempt stored load first
                    await r.wait_all()
                compute(rt, res.slots, a)
                await rt.finish(i, a[:KILL_TOKENS])
                await settle_all(rt, timeout=60)
                await rt.flush()

    asyncio.run(main())


def test_writer_killed_mid_write_leaves_no_readable_partial_page(tmp_path):
    import signal
    import time

    config = kill_cfg()
    store = tmp_path / "store"
    store.mkdir()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    served = 0
    tmp_left = 0
    for attempt in range(3):
        progress = tmp_path / f"progress{attempt}"
        p = subprocess.Popen([sys.executable, "-c",
                              "from tests.integration.test_storage_tier import _kill_child; "
                              f"_kill_child({str(store)!r}, {str(progress)!r})"], cwd=root)
        deadline = time.monotonic() + 60
        killed = False
        try:
            while time.monotonic() < deadline and p.poll() is None:
                # kill once a page write is under way (a temporary file exists) and a few requests are in
                if progress.exists() and len(progress.read_text().split()) >= 3 + attempt and \
                        any(n.endswith(".tmp") for _r, _d, fs in os.walk(store) for n in fs):
                    os.kill(p.pid, signal.SIGKILL)
                    killed = True
                    break
        finally:
            if not killed and p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        assert killed, "the writer never got to a storage write"
        tmp_left += sum(1 for _r, _d, fs in os.walk(store) for n in fs if n.endswith(".tmp"))
        served = max(served, len(progress.read_text().split()))
    assert tmp_left > 0  # at least one kill landed inside a page write

    async def main():
        fb = FileBackend(store, config.page_size * config.bytes_per_token, cleanup_on_open=False)
        assert any(n.endswith(".tmp") for _r, _d, fs in os.walk(store) for n in fs) or tmp_left
        hits = 0
        async with CacheRuntime.open(config, storage=fb) as rt:
            for i in range(served):
                a = toks(KILL_TOKENS + 1, 5000 + i)
                cached = await readmit_ok(rt, f"r{i}", a)  # whole pages or misses; fingerprints right
                assert cached % config.page_size == 0
                hits += cached
                await rt.flush()
            assert (await rt.stats())["storage"]["hit_tokens"] == hits
            await quiescent(rt)
        assert hits > 0  # pages written before the kills are read back
        s = fb.stats()
        assert s["pages_read"] == hits // config.page_size
        fb.cleanup()  # the dead writers' temporary files go
        assert not any(n.endswith(".tmp") for _r, _d, fs in os.walk(store) for n in fs)
        fb.close()

    asyncio.run(main())


# -- other ways into the host tier write through too -------------------------------------------


async def test_decode_offload_writes_through_to_storage(tmp_path):
    """Decode offload's host copies live on in storage: after a flush the conversation comes
    back from storage. (Before the fix, only host backups wrote to storage: 0 pages here.)"""
    config = cfg(decode_offload=True, write_policy="write_back")
    fb = backend(tmp_path, config)
    a = toks(N + 1, 21)
    async with CacheRuntime.open(config, storage=fb) as rt:
        res = await rt.admit("a", a)
        compute(rt, res.slots, a)
        await rt.commit("a", len(a))
        await rt.finish("a", a[:N])
        await settle_all(rt)
        st = await rt.stats()
        assert st["offload"]["issued"] > 0 and st["storage"]["writes_issued"] > 0
        assert stored_pages(fb, config, a) == N // config.page_size
        assert await rt.flush() > 0
        assert await readmit_ok(rt, "a2", a) == N
        assert (await rt.stats())["storage"]["hit_tokens"] == N
        await quiescent(rt)
    fb.close()


async def test_closed_session_inserted_with_write_through_is_backed_up(tmp_path):
    config = cfg(write_policy="write_through")
    fb = backend(tmp_path, config)
    a = toks(N + 1, 22)
    async with CacheRuntime.open(config, storage=fb) as rt:
        await rt.open_session("s")
        res = await rt.admit("t1", a, session="s")
        compute(rt, res.slots, a)
        await rt.finish("t1", a)
        await rt.close_session("s", insert=True)
        await settle_all(rt)
        assert (await rt.stats())["copies"]["backups_issued"] > 0
        assert stored_pages(fb, config, a) == N // config.page_size
        assert await rt.match_prefix(a[:N]) == {"device": N, "host": 0}
        await quiescent(rt)
    fb.close()

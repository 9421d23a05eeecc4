"""A storage outage degrades the tier and never accumulates (runtime/actors/backend_gate.py):
lookups that never return release what they hold at their deadline, a backend that stops
answering goes down (no op issued; one probe with backoff) and comes back by itself, a file
backend's directory replaced and restored the same. The Mooncake master's death and restart:
tests/integration/test_mooncake_master_kill.py."""

from __future__ import annotations

import asyncio
import os
import threading

import numpy as np

from runtime.errors import CapacityError
from runtime.runtime import CacheRuntime
from runtime.storage.backend import FaultPlan, FaultyBackend, StorageError
from runtime.storage.file_backend import FileBackend
from tests.integration.support import PassThroughBackend, bad_positions, compute, small_config, toks

TIMEOUT_S = 0.3  # storage_timeout_s


def cfg(**changes):
    # (a device pool that holds every prompt of `workload`: no CapacityError unless something pins it)
    base = dict(copy_engine="cpu", host_tokens=256, device_slots=512, storage_timeout_s=TIMEOUT_S)
    base.update(changes)
    return small_config(**base)


def file_backend(path, config) -> FileBackend:
    return FileBackend(path, config.page_size * config.bytes_per_token)


async def until(pred, timeout: float = 10.0, step: float = 0.01) -> float:
    """Await `pred()` (an async predicate) true; returns the seconds it took."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while not await pred():
        assert loop.time() - t0 < timeout, "condition not met in time"
        await asyncio.sleep(step)
    return loop.time() - t0


async def serve(rt: CacheRuntime, rid, prompt, attempt: int = 0) -> int:
    """Admit (after a prepare), check the cached KV, compute the rest, finish; the tokens cached."""
    if not attempt:
        await rt.prepare(rid, prompt)
    res = await rt.admit(rid, prompt)
    for r in res.readiness:
        await r.wait_all()
    assert bad_positions(rt.device_pool, res.slots[:res.cached], prompt[:res.cached]) == []
    compute(rt, res.slots, prompt, start=res.cached)
    await rt.finish(rid, prompt[:len(prompt) - 1])
    return res.cached


async def health(rt: CacheRuntime) -> str:
    return (await rt.stats())["storage"]["health"]


async def test_lookups_that_never_return_leave_the_whole_device_pool_to_flush(tmp_path):
    """Every lookup held forever: each ends its prefetch at its deadline and releases its anchor
    (the cached prefix it matched, device part locked), so once the requests finished, `flush()`
    frees the whole device pool and an admit needing all of it succeeds, as without storage.
    (Checked failing with the overdue lookup keeping its anchor, as before: `flush()` left the
    anchors' pages locked and the big admit got CapacityError.)"""
    config = cfg(prefetch_policy="best_effort", device_slots=128)
    fb = FaultyBackend(file_backend(tmp_path, config), FaultPlan(hold_at=frozenset(range(1, 10_000)),
                                                                 methods=frozenset({"exists_prefix"})))
    try:
        async with CacheRuntime.open(config, storage=fb) as rt:
            base = toks(41, 1)
            await serve(rt, "a", base)  # cached on device: the next prompts' lookups anchor under it
            for i in range(3):
                prompt = np.concatenate([base[:40], toks(25, 10 + i)])
                assert await serve(rt, f"b{i}", prompt) == 40
            assert await asyncio.to_thread(fb.wait_held, 3, 5.0)
            await asyncio.sleep(TIMEOUT_S * 2)  # past every lookup's deadline
            st = await rt.stats()
            assert st["storage"]["ops_overdue"] >= 3 and st["storage"]["overdue_ops"] >= 3
            await rt.flush()
            assert (await rt.available())["device_free"] == config.device_slots
            whole = toks(config.device_slots, 99)
            res = await rt.admit("whole", whole)
            assert len(res.slots) == config.device_slots
            await rt.abort("whole")
            fb.release()  # (the held calls return; their late answers change nothing)
    finally:
        fb.release()


class Outage(PassThroughBackend):
    """A backend that stops answering on `kill()`: a call then hangs `hang_s` and fails (as a
    Mooncake client's call to a dead master does), until `revive()`."""

    def __init__(self, inner, hang_s: float) -> None:
        super().__init__(inner)
        self.exists_is_local = False
        self.hang_s = hang_s
        self.answering = threading.Event()
        self.answering.set()
        self.lock = threading.Lock()
        self.running = self.most_running = self.calls_while_dead = 0

    def kill(self) -> None:
        self.answering.clear()

    def revive(self) -> None:
        self.answering.set()

    def _call(self, call):
        with self.lock:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        try:
            if not self.answering.is_set():
                with self.lock:
                    self.calls_while_dead += 1
                if not self.answering.wait(self.hang_s):
                    raise StorageError("no answer")
            return call()
        finally:
            with self.lock:
                self.running -= 1

    def exists_prefix(self, keys):
        return self._call(lambda: self.inner.exists_prefix(keys))

    def get_prefix(self, keys, dests, tags=None):
        return self._call(lambda: self.inner.get_prefix(keys, dests, tags))

    def get_batch(self, keys, dests, tags=None):
        return self._call(lambda: self.inner.get_batch(keys, dests, tags))

    def set_batch(self, keys, srcs, tags=None):
        return self._call(lambda: self.inner.set_batch(keys, srcs, tags))


async def workload(rt: CacheRuntime, n: int, seed: int, out: dict) -> None:
    """`n` requests over six prompts (shared, so that storage has what they ask for), flushing
    now and then so that the next admits look storage up and read it back."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        prompt = toks(65, 1000 + int(rng.integers(6)))
        for attempt in range(100):
            try:
                out["cached"] += await serve(rt, f"w{seed}-{i}", prompt, attempt)
                break
            except CapacityError:  # (the caller's contract: retry once write-backs made room)
                out["capacity"] += 1
                await asyncio.sleep(0.005)
        if rng.random() < 0.2:
            await rt.flush()
        await asyncio.sleep(0)


async def test_a_backend_that_stops_answering_goes_down_then_comes_back(tmp_path):
    """Killed under load: ops overdue at most the calls running then plus one probe per backoff
    period; no more calls in flight than the limit; while down no op is issued (the host tier
    serves) and callers see no CapacityError; revived: healthy again and storage hits back within
    5 s, with no restart; one log line per change."""
    config = cfg(storage_max_inflight_ops=3, prefetch_policy="timeout")
    backend = Outage(file_backend(tmp_path, config), hang_s=1.0)
    out = {"cached": 0, "capacity": 0}
    async with CacheRuntime.open(config, storage=backend) as rt:
        await workload(rt, 30, 1, out)
        assert await health(rt) == "healthy"
        backend.kill()
        killed = await rt.stats()
        await workload(rt, 60, 2, out)
        await until(lambda: _is(rt, "down"), timeout=10)
        st = await rt.stats()
        s = st["storage"]
        probes = s["probes"]
        # never more overdue than calls could run at once (the in-flight limit), plus the probes
        assert s["ops_overdue"] - killed["storage"]["ops_overdue"] <= config.storage_max_inflight_ops + probes
        assert backend.most_running <= config.storage_max_inflight_ops + 1  # (+1: a probe may wait on a dead call)
        issued = s["lookups_issued"], s["writes_issued"], s["reads_issued"]
        await workload(rt, 40, 3, out)  # down: the host tier and device serve, nothing is issued
        s = (await rt.stats())["storage"]
        assert (s["lookups_issued"], s["writes_issued"], s["reads_issued"]) == issued
        assert out["capacity"] == 0
        backend.revive()
        back_in = await until(lambda: _is(rt, "healthy"), timeout=5)
        hits = s["hit_tokens"]
        await rt.flush()
        await workload(rt, 20, 4, out)
        s = (await rt.stats())["storage"]
        assert s["hit_tokens"] > hits and s["health_changes"] >= 2, (back_in, s)
        assert (await rt.stats())["storage"]["health_level"] == 0


async def _is(rt: CacheRuntime, state: str) -> bool:
    return await health(rt) == state


async def test_a_file_directory_replaced_and_restored_goes_down_and_comes_back(tmp_path):
    """The storage directory replaced by a regular file (unmounted, as far as the runtime can
    tell): lookups fail rather than miss and writes store nothing, so the tier goes down; the
    directory put back: healthy again and storage hits resume within 5 s, the runtime untouched.
    (Healthy once writes are seen storing again: the probes are lookups, so the requests after the
    return bring the write channel back; the tier is degraded until then.)"""
    directory = tmp_path / "store"
    config = cfg(prefetch_policy="wait_complete", write_policy="write_through")
    out = {"cached": 0, "capacity": 0}
    async with CacheRuntime.open(config, storage=file_backend(directory, config)) as rt:
        await workload(rt, 20, 1, out)
        await until(lambda: _settled(rt))  # (every prompt's pages written before the directory goes)
        os.rename(directory, tmp_path / "away")
        directory.write_bytes(b"not a directory")
        await rt.flush()
        await workload(rt, 20, 2, out)
        await until(lambda: _is(rt, "down"), timeout=10)
        before = (await rt.stats())["storage"]["hit_tokens"]
        directory.unlink()
        os.rename(tmp_path / "away", directory)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await until(lambda: _not_down(rt), timeout=5)  # a probe (a lookup) served: lookups go out again
        await rt.flush()
        await workload(rt, 20, 3, out)  # hits from storage; its write-throughs store again
        assert (await rt.stats())["storage"]["hit_tokens"] > before
        await until(lambda: _is(rt, "healthy"), timeout=max(0.1, 5 - (loop.time() - t0)))
        assert out["capacity"] == 0


async def _settled(rt: CacheRuntime) -> bool:
    return not await rt.inspect(lambda core: core.in_flight())


async def _not_down(rt: CacheRuntime) -> bool:
    return await health(rt) != "down"


class Unreachable(Outage):
    """An `Outage` that can tell it is gone (`reachable()`, as Mooncake's master check), and whose
    calls hang long: the runtime should not wait for them to know."""

    def reachable(self) -> bool:
        return self.answering.is_set()


async def test_a_backend_that_says_it_is_gone_goes_down_before_any_deadline(tmp_path):
    """Calls hang 5 s, the deadline is 3 s: a backend that answers `reachable()` False is down
    within about the watch's 0.25 s, its running calls overdue at once (their admissions go on)
    and requests are served meanwhile. (Checked failing without the watch: down only at the 3 s
    deadline.)"""
    config = cfg(storage_timeout_s=3.0, prefetch_policy="wait_complete")
    backend = Unreachable(file_backend(tmp_path, config), hang_s=5.0)
    out = {"cached": 0, "capacity": 0}
    async with CacheRuntime.open(config, storage=backend) as rt:
        await workload(rt, 20, 1, out)
        backend.kill()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        served = asyncio.create_task(workload(rt, 30, 2, out))
        took = await until(lambda: _is(rt, "down"), timeout=10)
        await served
        assert took < 1.5, took
        assert loop.time() - t0 < 3.0  # (the requests did not wait for a deadline)
        backend.revive()
        await until(lambda: _is(rt, "healthy"), timeout=5)

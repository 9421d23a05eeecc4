"""Shared helpers for integration tests: a runtime on the fake copy engine, waiting, checks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import numpy as np

from runtime.config import RuntimeConfig
from runtime.fingerprint import mismatches, write_fingerprints
from runtime.invariants import check_invariants
from runtime.runtime import CacheRuntime
from runtime.transfer.fake_engine import FakeCopyEngine
from tests.tokens import toks  # noqa: F401 (re-exported: the integration tests import it from here)


def small_config(**changes: Any) -> RuntimeConfig:
    base = dict(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, device_slots=256, host_tokens=512,
                write_policy="write_through", debug_invariants=True)
    base.update(changes)
    return RuntimeConfig(**base)


@asynccontextmanager
async def fake_runtime(config: RuntimeConfig) -> AsyncIterator[tuple[CacheRuntime, FakeCopyEngine]]:
    """A runtime whose copies stay in flight until the test releases them."""
    async with CacheRuntime.open(config, engine_factory=FakeCopyEngine) as rt:
        engine = rt.engine
        assert isinstance(engine, FakeCopyEngine)
        try:
            yield rt, engine
        finally:
            # close waits for every copy: keep releasing the fake ones until it is done
            closing = asyncio.ensure_future(rt.close())
            while not closing.done():
                for op_id in engine.pending():
                    engine.release(op_id)
                await asyncio.sleep(0.001)
            await closing


async def until(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.001)


async def settle(rt: CacheRuntime) -> None:
    """Wait until the tree actor has no copy in flight (the engine must release them)."""
    for _ in range(5000):
        if not await rt.inspect(lambda core: core.in_flight()):
            return
        await asyncio.sleep(0.001)
    raise AssertionError("copies still in flight")


async def release_all(rt: CacheRuntime, engine: FakeCopyEngine) -> None:
    for _ in range(100):
        pending = engine.pending()
        if not pending and not await rt.inspect(lambda core: core.in_flight()):
            return
        for op_id in pending:
            engine.release(op_id)
        await asyncio.sleep(0.002)
    raise AssertionError("copies never settled")


async def quiescent_check(rt: CacheRuntime) -> None:
    """Invariant 7: once the copies land, nothing is pinned, in flight or leaked."""
    await settle(rt)
    await rt.inspect(lambda core: check_invariants(core, quiescent=True))


def compute(rt: CacheRuntime, slots: Any, tokens: Any, extra_key: Any = None, start: int = 0) -> None:
    """Stand in for the model: write the fingerprint KV of tokens[start:len(slots)]."""
    write_fingerprints(rt.device_pool, np.asarray(slots), np.asarray(tokens), extra_key, start)


def bad_positions(pool: Any, slots: Any, tokens: Any, extra_key: Any = None) -> list[int]:
    return mismatches(pool, np.asarray(slots), np.asarray(tokens), extra_key)


class PassThroughBackend:
    """A storage backend that hands every call to `inner`: a test's fault wrapper subclasses it and
    overrides only the calls it changes."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.page_bytes = inner.page_bytes
        self.exists_is_local = getattr(inner, "exists_is_local", False)

    def exists_prefix(self, keys):
        return self.inner.exists_prefix(keys)

    def get_prefix(self, keys, dests, tags=None):
        return self.inner.get_prefix(keys, dests, tags)

    def get_batch(self, keys, dests, tags=None):
        return self.inner.get_batch(keys, dests, tags)

    def set_batch(self, keys, srcs, tags=None):
        return self.inner.set_batch(keys, srcs, tags)

    def close(self) -> None:
        self.inner.close()

    def stats(self) -> dict:
        return self.inner.stats()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

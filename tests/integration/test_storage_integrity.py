"""Page integrity end to end, through the public API: the storage tier tags a page as it leaves
the host pool and checks the tag once the bytes landed in the host pool, so a transport that
changes bytes after the backend returns serves no wrong page; with a `storage_key`, pages
written without it (a forger who can write the directory or the pool) are refused. Both are
counted in `stats()` and the Prometheus metrics.

The scenarios take a backend factory: the file backend here, Mooncake in
tests/unit/storage/test_mooncake_backend.py (its private network namespace)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.registry import CollectorRegistry

from runtime.config import RuntimeConfig
from runtime.runtime import CacheRuntime
from runtime.storage.backend import write_pages
from runtime.storage.file_backend import FileBackend
from runtime.storage.hashing import KVIdentity, page_hashes
from runtime.storage.integrity import PageSeal
from tests.integration.support import PassThroughBackend, bad_positions
from tests.integration.test_storage_tier import N, cfg, quiescent, serve, settle_all, toks

KEY = "correct horse battery staple 0001"
OTHER_KEY = "correct horse battery staple 0002"
Factory = Callable[[RuntimeConfig], Any]


class FlippingTransport(PassThroughBackend):
    """A backend whose transport lies: every page the inner backend read is changed (one byte
    flipped) after the inner call returned, in the caller's buffer (the host pool's page rows on
    the zero-copy path). Everything else (register_buffer, remove, stats) passes through."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.flipped = 0

    def _flip(self, dests: Any, n: int) -> None:
        for d in list(dests)[:n]:
            row = np.asarray(memoryview(d.numpy() if hasattr(d, "numpy") else d).cast("B"))
            row[len(row) // 2] ^= 0x40
            self.flipped += 1

    def get_prefix(self, keys, dests, tags=None):
        n = self.inner.get_prefix(keys, dests, tags)
        self._flip(dests, n)
        return n

    def get_batch(self, keys, dests, tags=None):
        got = self.inner.get_batch(keys, dests, tags)
        self._flip([d for d, ok in zip(dests, got) if ok], len(dests))
        return got


async def served(rt: CacheRuntime, rid: str, tokens: np.ndarray) -> tuple[int, list[int]]:
    """Admit `tokens` (wait_complete: after the storage read); the cached tokens and the cached
    positions whose device KV is not the prefix's fingerprint (wrong pages served); abort."""
    res = await rt.admit(rid, tokens)
    for r in res.readiness:
        await r.wait_all()
    await settle_all(rt)
    bad = bad_positions(rt.device_pool, res.slots[:res.cached], tokens[:res.cached])
    await rt.abort(rid)
    return res.cached, bad


def rejected_metric(registry: CollectorRegistry) -> float:
    text = generate_latest(registry).decode()
    [line] = [ln for ln in text.splitlines() if ln.startswith("hicache_storage_rejected_pages_total ")]
    return float(line.split()[1])


async def lying_transport(make: Factory, layout: str) -> None:
    config = cfg(host_layout=layout, prefetch_policy="wait_complete")
    pages = N // config.page_size
    a = toks(N + 1, 91)
    storage = make(config)  # (one client: a Mooncake client's segment goes when it closes)
    liar = FlippingTransport(storage)
    registry = CollectorRegistry()
    try:
        async with CacheRuntime.open(config, storage=storage) as rt:
            await serve(rt, "w", a)
            assert (await rt.stats())["storage"]["written_pages"] == pages
        async with CacheRuntime.open(config, storage=liar, metrics_registry=registry) as rt:
            for i in range(3):  # each admit reads the first page again (rejected ones were removed)
                cached, bad = await served(rt, f"r{i}", a)
                assert bad == [] and cached == 0
            st = await rt.stats()
            assert liar.flipped >= 1 and st["storage"]["rejected_pages"] >= 1
            assert st["storage"]["hit_tokens"] == 0 and st["storage"]["read_pages"] == 0
            await rt.refresh_metrics()
            assert rejected_metric(registry) == st["storage"]["rejected_pages"]
            await quiescent(rt)
    finally:
        liar.close()


async def forged_pages(make: Factory, layout: str) -> None:
    """A forger who can write the storage, but has not the key: pages of the right layout and the
    right page keys, holding another prefix's KV, tagged unkeyed or under another key."""
    config = cfg(host_layout=layout, prefetch_policy="wait_complete", storage_key=KEY)
    pages = N // config.page_size
    a, b = toks(N + 1, 92), toks(N + 1, 93)
    ka = page_hashes(a[:N], config.page_size, None, KVIdentity.from_config(config))
    registry = CollectorRegistry()
    storage = make(config)
    try:
        async with CacheRuntime.open(config, storage=storage, metrics_registry=registry) as rt:
            await serve(rt, "b", b)  # b's pages, honestly written, are what the forger copies
            kb = page_hashes(b[:N], config.page_size, None, KVIdentity.from_config(config))
            bufs = [np.zeros(storage.page_bytes, np.uint8) for _ in kb]
            assert list(storage.get_batch(kb, bufs)) == [True] * pages
            for forger in (PageSeal(), PageSeal(OTHER_KEY)):
                await rt.flush()
                storage.remove(ka)  # (the forger can write the storage: what is there goes first)
                assert write_pages(storage, ka, bufs, forger) == (True,) * pages
                cached, bad = await served(rt, f"forged-{forger.keyed}", a)
                assert bad == [] and cached == 0  # 0 forged pages served
                assert storage.exists_prefix(ka) == 0  # the refused first page was removed
            st = await rt.stats()
            assert st["storage"]["rejected_pages"] >= 2 and st["storage"]["hit_tokens"] == 0
            await rt.refresh_metrics()
            assert rejected_metric(registry) == st["storage"]["rejected_pages"]
            # the runtime's own pages, tagged with the key, are served
            await serve(rt, "a", a)
            await rt.flush()
            assert await served(rt, "a2", a) == (N, [])
            assert (await rt.stats())["storage"]["hit_tokens"] == N
            await quiescent(rt)
    finally:
        storage.close()


def file_factory(path) -> Factory:
    return lambda config: FileBackend(path, config.page_size * config.bytes_per_token)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
async def test_a_lying_transport_serves_no_wrong_page(tmp_path, layout):
    """Bytes flipped after the backend returned (in the pool rows, page_first): every read page is
    refused, counted (stats and metrics), never served. With the check disabled (`verified`
    accepting every page) this fails: the flipped pages are served (bad positions)."""
    await lying_transport(file_factory(tmp_path), layout)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
async def test_pages_written_without_the_key_are_refused(tmp_path, layout):
    """With a storage_key, pages planted with the right layout and page keys but tagged without the
    key (unkeyed, or another key) are refused and counted; the runtime's own pages are served.
    On the unkeyed trailer (the backend's own checksum) 10 of 10 forged pages were served; with the
    seal ignoring the key (`PageSeal(None)` in the runtime) this fails the same way."""
    await forged_pages(file_factory(tmp_path), layout)


async def test_a_page_written_with_the_key_is_read_by_another_instance_with_it(tmp_path):
    """Two runtimes sharing a directory and a key share pages; a runtime without the key (or
    another key) refuses them."""
    config = cfg(prefetch_policy="wait_complete", storage_key=KEY)
    a = toks(N + 1, 94)
    make = file_factory(tmp_path)
    fb = make(config)
    async with CacheRuntime.open(config, storage=fb) as rt:
        await serve(rt, "w", a)
    fb.close()
    for reader, want in ((config, N), (config.replace(storage_key=None), 0),
                         (config.replace(storage_key=OTHER_KEY), 0)):
        fb = make(reader)
        async with CacheRuntime.open(reader, storage=fb) as rt:
            assert await served(rt, "r", a) == (want, [])
            assert (await rt.stats())["storage"]["rejected_pages"] == (0 if want else 1)
        fb.close()
        if not want:  # the refused page was removed: write it again for the next reader
            fb = make(config)
            async with CacheRuntime.open(config, storage=fb) as rt:
                await serve(rt, "w", a)
            fb.close()


def test_the_key_is_never_shown():
    config = cfg(storage_key=KEY)
    seal = PageSeal(KEY)
    for text in (repr(config), str(config), repr(seal)):
        assert KEY not in text and "horse" not in text
    assert repr(seal) == "PageSeal(keyed=True)"
    with pytest.raises(TypeError):
        import pickle

        pickle.dumps(seal)

"""Every pool dtype (float32, float16, bfloat16, float8_e4m3fn, float8_e5m2) through the runtime:
KV moves device -> host -> storage (file backend) -> host -> device and the fingerprint oracle,
rounding through the pool's dtype, finds every position right; a page of another prefix planted in
storage is flagged in that dtype; the dtype is part of the storage identity (pages of two dtypes of
one byte size are never shared) and the backends' page bytes follow it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.config import KV_DTYPES
from runtime.errors import ConfigError
from runtime.runtime import CacheRuntime, make_storage
from runtime.storage import mooncake_backend
from runtime.storage.backend import write_pages
from runtime.storage.hashing import KVIdentity, page_hashes
from runtime.storage.integrity import PageSeal
from tests.integration.support import bad_positions, toks
from tests.integration.test_storage_tier import N, backend, cfg, quiescent, readmit_ok, serve, settle_all, stored_pages

DTYPES = sorted(KV_DTYPES)


async def readmit(rt: CacheRuntime, rid: str, tokens: np.ndarray) -> list[int]:
    """Admit, wait for the loads, return the cached prefix's fingerprint mismatches; abort."""
    res = await rt.admit(rid, tokens)
    for r in res.readiness:
        await r.wait_all()
    await settle_all(rt)
    assert res.cached == N
    bad = bad_positions(rt.device_pool, res.slots[:N], tokens[:N])
    await rt.abort(rid)
    return bad


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("dtype", DTYPES)
async def test_every_dtype_through_every_tier_and_a_planted_page_is_caught(tmp_path, dtype, layout):
    config = cfg(kv_dtype=dtype, host_layout=layout)
    itemsize = torch.empty((), dtype=KV_DTYPES[dtype]).element_size()
    assert config.bytes_per_token == 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize
    fb = backend(tmp_path, config)
    a, b = toks(N + 1, 31), toks(N + 1, 32)
    pages = N // config.page_size
    async with CacheRuntime.open(config, storage=fb) as rt:
        await serve(rt, "a", a)
        await serve(rt, "b", b)
        # storage is written from the host copies: device -> host -> storage happened
        assert stored_pages(fb, config, a) == stored_pages(fb, config, b) == pages
        assert await rt.flush() > 0
        assert await rt.match_prefix(a) == {"device": 0, "host": 0}
        assert await readmit_ok(rt, "a2", a) == N  # storage -> host -> device, every position right
        st = await rt.stats()
        assert st["storage"]["read_bytes"] == N * config.bytes_per_token
        # plant b's page 2 under a's page 2 key (a valid page file, the wrong prefix's KV, with the
        # unkeyed tag anyone can compute: no storage_key here, so only the fingerprints catch it)
        ident = KVIdentity.from_config(config)
        ka, kb = (page_hashes(t[:N], config.page_size, None, ident) for t in (a, b))
        buf = np.zeros(fb.page_bytes, np.uint8)
        assert list(fb.get_batch([kb[2]], [buf])) == [True]
        assert fb.remove([ka[2]]) == 1 and write_pages(fb, [ka[2]], [buf], PageSeal()) == (True,)
        await rt.flush()
        assert await readmit(rt, "a3", a) == list(range(2 * config.page_size, 3 * config.page_size))
        await quiescent(rt)
    fb.close()


@pytest.mark.parametrize("writer, reader", [("float16", "bfloat16"), ("float8_e4m3fn", "float8_e5m2"),
                                            ("float8_e5m2", "float8_e4m3fn")])
async def test_dtypes_of_one_size_never_share_a_storage_page(tmp_path, writer, reader):
    """Same page bytes, same tokens, one directory: only the identity keeps the dtypes apart."""
    wcfg, rcfg = cfg(kv_dtype=writer), cfg(kv_dtype=reader)
    assert wcfg.bytes_per_token == rcfg.bytes_per_token
    a = toks(N + 1, 33)
    async with CacheRuntime.open(wcfg, storage=backend(tmp_path, wcfg)) as rt:
        await serve(rt, "a", a)
        assert stored_pages(rt.storage, wcfg, a) == N // wcfg.page_size
    async with CacheRuntime.open(rcfg, storage=backend(tmp_path, rcfg)) as rt:
        assert stored_pages(rt.storage, rcfg, a) == 0
        assert await readmit_ok(rt, "y", a) == 0
        assert (await rt.stats())["storage"]["hit_tokens"] == 0
        await quiescent(rt)


def test_every_dtype_has_its_own_page_hashes():
    tokens = np.arange(64, dtype=np.int32)
    seen: set[bytes] = set()
    for name in DTYPES:
        keys = page_hashes(tokens, 16, None, KVIdentity.from_config(cfg(kv_dtype=name)))
        assert len(keys) == 4 and not seen & set(keys)
        seen |= set(keys)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_page_bytes_follow_the_dtype(tmp_path, monkeypatch, dtype):
    """The runtime builds its file and Mooncake backends with the dtype's page size, and refuses a
    given backend whose pages are another dtype's size."""
    itemsize = torch.empty((), dtype=KV_DTYPES[dtype]).element_size()
    want = 4 * 2 * 2 * 2 * 8 * itemsize  # page_size 4, K and V, 2 layers, 2 heads, head_dim 8
    config = cfg(kv_dtype=dtype, storage_backend="file", storage_dir=str(tmp_path / "kv"))
    fb, owned = make_storage(config)
    assert owned and fb.page_bytes == want
    fb.close()

    class Recorder:
        def __init__(self, page_bytes, mc_config):
            self.page_bytes = page_bytes

    monkeypatch.setattr(mooncake_backend, "MooncakeBackend", Recorder)
    monkeypatch.setenv("MOONCAKE_MASTER", "127.0.0.1:50051")
    monkeypatch.setenv("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE")
    mc, owned = make_storage(cfg(kv_dtype=dtype, storage_backend="mooncake"))
    assert owned and isinstance(mc, Recorder) and mc.page_bytes == want
    other = "float16" if itemsize != 2 else "float32"
    with pytest.raises(ConfigError, match="pages are"):
        make_storage(config, storage=backend(tmp_path / "other", cfg(kv_dtype=other)))

"""DevicePool / HostPool: geometry, views, slot I/O, canonical page format, sizing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.errors import ConfigError, LengthError
from runtime.memory.pools import DevicePool, HostPool, KVShape

SHAPE = KVShape(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.bfloat16)
LAYOUTS = ["layer_first", "page_first"]


def kv_data(n: int, seed: int = 0, shape: KVShape = SHAPE) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((shape.num_layers, 2, n, shape.num_kv_heads, shape.head_dim), generator=g).to(shape.dtype)


def test_kvshape_bytes_and_validation():
    s = KVShape(30, 3, 64, torch.float16)
    assert s.bytes_per_token == 2 * 30 * 3 * 64 * 2
    assert s.token_elems == 192 and s.itemsize == 2
    assert KVShape(2, 1, 8, torch.float32).bytes_per_token == 2 * 2 * 8 * 4
    for bad in [dict(num_layers=0), dict(num_kv_heads=-1), dict(head_dim=2.0)]:
        kw = dict(num_layers=1, num_kv_heads=1, head_dim=1) | bad
        with pytest.raises(ConfigError):
            KVShape(**kw)
    with pytest.raises(ConfigError):
        KVShape(1, 1, 1, "float16")  # type: ignore[arg-type]


def test_pool_geometry_validation():
    with pytest.raises(ConfigError):
        DevicePool(SHAPE, 30, 16)
    with pytest.raises(ConfigError):
        HostPool(SHAPE, 32, 0)
    with pytest.raises(ConfigError):
        HostPool(SHAPE, 32, 16, layout="head_first")  # type: ignore[arg-type]


def test_device_pool_views_share_one_buffer():
    pool = DevicePool(SHAPE, 32, 8, "cpu")
    assert pool.buffer.shape == (2, 3, 32, 2, 4)
    assert pool.num_pages == 4 and pool.nbytes == 2 * 3 * 32 * 2 * 4 * 2
    assert len(pool.k) == len(pool.v) == 3
    assert pool.k[1].shape == (32, 2, 4)
    pool.k[1][5] = 1.0
    pool.v[2][7] = 2.0
    assert pool.buffer[0, 1, 5].eq(1).all() and pool.buffer[1, 2, 7].eq(2).all()
    assert pool.k[0].untyped_storage().data_ptr() == pool.buffer.untyped_storage().data_ptr()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_host_pool_layouts_and_layer_views(layout):
    ps = 4
    pool = HostPool(SHAPE, 16, ps, layout)
    assert not pool.pinned  # no CUDA here: auto -> not pinned
    expect = (2, 3, 16, 2, 4) if layout == "layer_first" else (4, 3, 2, ps, 2, 4)
    assert tuple(pool.buffer.shape) == expect
    data = kv_data(16)
    pool.write_slots(np.arange(16), data)
    for layer in range(3):
        k, v = pool.layer_k(layer), pool.layer_v(layer)
        for s in (0, 5, 15):
            idx = (s,) if layout == "layer_first" else (s // ps, s % ps)
            assert torch.equal(k[idx], data[layer, 0, s])
            assert torch.equal(v[idx], data[layer, 1, s])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("ps", [1, 4])
def test_slot_io_roundtrip(layout, ps):
    host = HostPool(SHAPE, 8 * ps, ps, layout)
    dev = DevicePool(SHAPE, 8 * ps, ps)
    slots = np.array([3 * ps, 0, 5 * ps + ps - 1, 2], dtype=np.int64) % (8 * ps)
    slots = np.unique(slots)
    data = kv_data(slots.size, seed=ps)
    for pool in (host, dev):
        pool.write_slots(slots, data)
        assert torch.equal(pool.read_slots(slots), data)
        assert torch.equal(pool.read_slots(torch.from_numpy(slots)), data)
        others = np.setdiff1d(np.arange(pool.num_slots), slots)
        assert not pool.read_slots(others).any()
        with pytest.raises(LengthError):
            pool.read_slots(np.array([pool.num_slots]))


def test_read_page_canonical_and_layout_independent():
    ps = 4
    a = HostPool(SHAPE, 16, ps, "layer_first")
    b = HostPool(SHAPE, 16, ps, "page_first")
    data = kv_data(16, seed=3)
    a.write_slots(np.arange(16), data)
    b.write_slots(np.arange(16), data)
    for page in range(4):
        pa, pb = a.read_page(page), b.read_page(page)
        assert pa.shape == (3, 2, ps, 2, 4) and pa.is_contiguous() and pb.is_contiguous()
        assert torch.equal(pa, pb)
        assert torch.equal(pa, data[:, :, page * ps : (page + 1) * ps])
    # page_first: zero-copy view of the pool; layer_first: a copy
    assert b.read_page(2).data_ptr() == b.buffer[2].data_ptr()
    assert a.read_page(2).untyped_storage().data_ptr() != a.buffer.untyped_storage().data_ptr()
    # write_page from the other layout's canonical form
    c = HostPool(SHAPE, 16, ps, "layer_first")
    d = HostPool(SHAPE, 16, ps, "page_first")
    c.write_page(1, b.read_page(3))
    d.write_page(1, a.read_page(3))
    assert torch.equal(c.read_slots(np.arange(4, 8)), data[:, :, 12:16])
    assert torch.equal(d.read_slots(np.arange(4, 8)), data[:, :, 12:16])
    with pytest.raises(LengthError):
        c.write_page(0, torch.zeros(3, 2, ps + 1, 2, 4, dtype=SHAPE.dtype))
    with pytest.raises(LengthError):
        c.read_page(4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_page_rows_zero_copy_view(layout):
    ps = 2
    host = HostPool(SHAPE, 8, ps, layout)
    rows = host.page_rows()
    row_bytes = ps * 2 * 4 * 2
    assert rows.shape[:3] == (2, 3, 4) and rows.shape[3] * rows.itemsize == row_bytes
    data = kv_data(8, seed=9)
    host.write_slots(np.arange(8), data)
    # row [kv, layer, page] holds the bytes of slots page*ps..page*ps+ps of that layer's K/V
    for kv, layer, page in [(0, 0, 0), (1, 2, 3), (0, 1, 2)]:
        want = data[layer, kv, page * ps : (page + 1) * ps].contiguous().view(torch.uint8).numpy().reshape(-1)
        assert np.array_equal(rows[kv, layer, page].view(np.uint8), want)
    rows[1, 0, 1] = 0  # writes through
    assert not host.read_slots(np.arange(2, 4))[0, 1].any()
    dev = DevicePool(SHAPE, 8, ps)
    assert dev.page_rows().shape == rows.shape


def test_host_slots_for():
    assert HostPool.slots_for(1000, 16, ratio=2.0) == 2000
    assert HostPool.slots_for(1000, 16, ratio=1.5) == 1488  # rounded down to pages
    assert HostPool.slots_for(1000, 16, tokens=100) == 96
    shape = KVShape(30, 3, 64, torch.float16)
    assert HostPool.slots_for(0, 16, bytes_budget=1 << 30, shape=shape) == ((1 << 30) // shape.bytes_per_token) // 16 * 16
    for kw in [{}, dict(ratio=1.0, tokens=10), dict(bytes_budget=1 << 20)]:
        with pytest.raises(ConfigError):
            HostPool.slots_for(1000, 16, **kw)
    with pytest.raises(ConfigError):
        HostPool.slots_for(1000, 16, tokens=15)  # less than a page
    with pytest.raises(ConfigError):
        HostPool.slots_for(1000, 16, ratio=0)


def test_host_pool_without_zeroing_and_explicit_pin_flag():
    pool = HostPool(SHAPE, 8, 4, zero=False, pin_memory=False)
    assert not pool.pinned and pool.buffer.shape[2] == 8


@pytest.mark.gpu
def test_pinned_host_and_cuda_device_pool():
    host = HostPool(SHAPE, 8, 4)
    assert host.pinned and host.buffer.is_pinned()
    dev = DevicePool(SHAPE, 8, 4, "cuda")
    data = kv_data(3)
    dev.write_slots(np.array([1, 4, 7]), data)
    assert torch.equal(dev.read_slots(np.array([1, 4, 7])), data)
    with pytest.raises(TypeError):
        dev.page_rows()


ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Compare through the bytes: CPU torch has no equality kernel for the fp8 dtypes."""
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_kv_dtype_slot_and_page_io(dtype):
    """Every pool dtype, fp8 included (CPU torch lacks index_copy_ for fp8: the pools write its
    slots through a uint8 view): slots and canonical pages round-trip bit-exactly."""
    shape = KVShape(num_layers=3, num_kv_heads=2, head_dim=4, dtype=dtype)
    assert shape.bytes_per_token == 2 * 3 * 2 * 4 * shape.itemsize
    ps = 4
    slots = np.array([13, 0, 6, 7], dtype=np.int64)
    data = kv_data(slots.size, seed=11, shape=shape)
    pools = [DevicePool(shape, 16, ps), HostPool(shape, 16, ps, "layer_first"), HostPool(shape, 16, ps, "page_first")]
    for pool in pools:
        assert pool.nbytes == 16 * shape.bytes_per_token
        pool.write_slots(slots, data)
        assert torch.equal(as_bytes(pool.read_slots(slots)), as_bytes(data))
        rest = np.setdiff1d(np.arange(16), slots)
        assert not as_bytes(pool.read_slots(rest)).any()
        rows = pool.page_rows()
        assert rows.shape[3] * rows.itemsize == ps * 2 * 4 * shape.itemsize
    a, b = pools[1], pools[2]
    a.write_page(2, b.read_page(1))  # slots 6, 7 of page 1 -> 10, 11
    assert torch.equal(as_bytes(a.read_slots([10, 11])), as_bytes(data[:, :, 2:4]))

"""Recurrent-state pools and one-part (latent) KV pools: shapes, canonical bytes, validation."""

from __future__ import annotations

import pytest
import torch

from runtime.errors import ConfigError, LengthError
from runtime.memory.pools import DevicePool, HostPool, KVShape
from runtime.memory.state_pool import StateComponent, StatePool, StateShape

STATE = StateShape(3, (StateComponent("conv", (8, 4), torch.bfloat16), StateComponent("ssm", (2, 4, 6))))


def test_state_shape_sizes_and_views():
    pool = StatePool(STATE, 5)
    assert STATE.bytes_per_slot == 3 * (8 * 4 * 2 + 2 * 4 * 6 * 4)
    assert pool.nbytes == 5 * STATE.bytes_per_slot
    assert pool.layer("ssm", 2).shape == (5, 2, 4, 6)
    pool.layer("ssm", 2)[4].fill_(7)  # a view: the model writes the pool itself
    assert pool.buffers["ssm"][2, 4].eq(7).all()


def test_state_slot_canonical_bytes_round_trip_and_fork():
    a, b = StatePool(STATE, 4), StatePool(STATE, 6)
    gen = torch.Generator().manual_seed(1)
    for buf in a.buffers.values():
        buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.dtype))
    b.write_slot(5, a.read_slot(2))
    for name, buf in a.buffers.items():
        assert torch.equal(b.buffers[name][:, 5], buf[:, 2])
        assert not b.buffers[name][:, 4].any()  # nothing else written
    a.copy_slot(2, 0)
    assert torch.equal(a.read_slot(0), a.read_slot(2))


def test_state_pool_rejects_bad_input():
    pool = StatePool(STATE, 4)
    with pytest.raises(LengthError):
        pool.read_slot(4)
    with pytest.raises(LengthError):
        pool.write_slot(0, torch.zeros(STATE.bytes_per_slot - 1, dtype=torch.uint8))
    with pytest.raises(ConfigError):
        StateComponent("conv", (0, 3))
    with pytest.raises(ConfigError):
        StateShape(2, (StateComponent("a", (1,)), StateComponent("a", (2,))))
    with pytest.raises(ConfigError):
        StatePool(STATE, 0)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_latent_pool_has_one_part(layout):
    shape = KVShape(num_layers=2, num_kv_heads=1, head_dim=10, dtype=torch.float32, parts=1)
    assert shape.bytes_per_token == 2 * 10 * 4
    dev, host = DevicePool(shape, 8, 4), HostPool(shape, 8, 4, layout)
    assert dev.buffer.shape == (1, 2, 8, 1, 10) and dev.latent is dev.k and dev.v == []
    data = torch.randn(2, 1, 4, 1, 10)
    host.write_page(1, data)
    assert torch.equal(host.read_page(1), data)
    assert torch.equal(host.read_slots(torch.arange(4, 8)), data)
    assert dev.page_rows().shape[:3] == (1, 2, 2)
    with pytest.raises(ConfigError):
        KVShape(1, 1, 4, parts=3)

"""PagedKVCopier: whole pages between an engine's paged KV layers and the host pool."""

from __future__ import annotations

import pytest
import torch

from runtime.errors import ConfigError, ValidationError
from runtime.messages import Direction, PoolTransfer, TransferPlan
from runtime.transfer.block_copier import PagedKVCopier

BS, BLOCKS, HEADS, DIM, LAYERS = 4, 8, 2, 3, 3


def paged(kv_first: bool, fill: bool) -> dict[str, torch.Tensor]:
    """Old layout (2, blocks, block_size, heads, dim), or vLLM 0.33's (blocks, heads, block_size,
    K|V) as a strided view of a block-token-head buffer (its `LBNHC` memory order)."""
    gen = torch.Generator().manual_seed(0)
    out = {}
    for i in range(LAYERS):
        raw = torch.randn((BLOCKS, BS, HEADS, 2 * DIM), generator=gen) if fill else torch.zeros(BLOCKS, BS, HEADS, 2 * DIM)
        out[f"layer.{i}"] = raw.view(2, BLOCKS, BS, HEADS, DIM) if kv_first else raw.transpose(1, 2)
    return out


def slots(pages: list[int]) -> torch.Tensor:
    return torch.tensor([p * BS + o for p in pages for o in range(BS)], dtype=torch.int64)


def plan(op: int, direction: Direction, device_pages: list[int], host_pages: list[int]) -> TransferPlan:
    dev, host = slots(device_pages), slots(host_pages)
    src, dst = (dev, host) if direction is Direction.BACKUP else (host, dev)
    return TransferPlan(op, direction, (PoolTransfer("kv", src, dst),))


def block(kv: torch.Tensor, b: int, kv_first: bool) -> torch.Tensor:
    return kv[:, b] if kv_first else kv[b]


@pytest.mark.parametrize("kv_first", [True, False])
def test_pages_backed_up_from_one_engine_load_byte_identical_into_other_blocks_of_another(kv_first):
    a, b = paged(kv_first, True), paged(kv_first, False)
    src, dst = PagedKVCopier(a, BS, 6), PagedKVCopier(b, BS, 6)
    src.run(plan(1, Direction.BACKUP, [5, 2, 7], [0, 3, 1]))
    dst.host.copy_(src.host)  # (what storage or a shared host pool carries between them)
    dst.run(plan(2, Direction.LOAD, [0, 1, 6], [0, 3, 1]))
    for name in a:
        for x, y in ((5, 0), (2, 1), (7, 6)):
            assert torch.equal(block(a[name], x, kv_first), block(b[name], y, kv_first))
        untouched = [i for i in range(BLOCKS) if i not in (0, 1, 6)]
        assert all(not block(b[name], i, kv_first).any() for i in untouched)


@pytest.mark.parametrize("bad", [
    lambda: plan(1, Direction.LOAD, [BLOCKS], [0]),  # past the engine's blocks
    lambda: plan(1, Direction.LOAD, [0], [6]),  # past the host pool
    lambda: TransferPlan(1, Direction.LOAD, (PoolTransfer("kv", slots([0])[1:], slots([0])[1:]),)),  # not whole pages
    lambda: TransferPlan(1, Direction.LOAD, (PoolTransfer("kv", slots([0]) + 1, slots([1]) + 1),)),  # misaligned
    lambda: TransferPlan(1, Direction.LOAD, (PoolTransfer("kv", slots([0]), slots([1, 2])),)),
    lambda: plan(1, Direction.LOAD, [2, 2], [0, 1]),  # a destination block twice
])
def test_a_bad_plan_is_refused_before_anything_is_copied(bad):
    kv = paged(True, False)
    copier = PagedKVCopier(kv, BS, 6)
    copier.host.fill_(1.0)
    with pytest.raises(ValidationError):
        copier.run(bad())
    assert all(not t.any() for t in kv.values())


def test_layers_must_share_one_layout_with_the_runtimes_page_size():
    with pytest.raises(ConfigError):
        PagedKVCopier({}, BS, 4)
    mixed = {**paged(True, False), "odd": torch.zeros(2, BLOCKS + 1, BS, HEADS, DIM)}
    with pytest.raises(ConfigError):
        PagedKVCopier(mixed, BS, 4)
    with pytest.raises(ConfigError):
        PagedKVCopier({"x": torch.zeros(3, BLOCKS, BS, HEADS, DIM)}, BS, 4, kv_first=True)
    with pytest.raises(ConfigError):
        PagedKVCopier({"x": torch.zeros(BLOCKS)}, BS, 4)


@pytest.mark.parametrize("kv_first", [True, False])
def test_a_limited_load_copies_the_plans_first_pages_in_the_plans_order(kv_first):
    """`run(plan, limit)` copies the first `limit` pages of the plan as written, whatever order its
    host pages are in (a load whose storage read came back short fills only its leading blocks;
    the rest are reported to vLLM as load errors). Found by the connector fuzzer: the limit was
    applied after the plan was put into host-page order, so a load from host pages [5, 6, 4]
    limited to 2 copied pages 4 and 5 and left the plan's second block unfilled."""
    engine = paged(kv_first, False)
    copier = PagedKVCopier(engine, BS, 6)
    copier.host.copy_(torch.randn(copier.host.shape, generator=torch.Generator().manual_seed(1)))
    copier.run(plan(1, Direction.LOAD, [7, 2, 5], [4, 5, 3]), limit=2)
    for layer, name in enumerate(engine):
        assert torch.equal(block(engine[name], 7, kv_first), copier.host[4, layer])
        assert torch.equal(block(engine[name], 2, kv_first), copier.host[5, layer])
        untouched = [i for i in range(BLOCKS) if i not in (7, 2)]
        assert all(not block(engine[name], i, kv_first).any() for i in untouched)

"""The wire classes against bytes vLLM 0.33 encoded itself (`vllm_batches/`, copied from the
project's shared fixtures: `batchN.msgpack` is `msgspec.msgpack.Encoder().encode(batch)` of
vLLM's own `KVEventBatch`): decode them with ours, and encode the same events to the same bytes."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from runtime.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode, encode

HERE = Path(__file__).parent / "vllm_batches"
H1, H2, H3 = b"\x01" * 16, b"\x02" * 16, b"\x03" * 16

EXPECTED = {
    "batch0.msgpack": KVEventBatch(1764000000.25, [
        BlockStored([H1, H2], None, list(range(32)), 16, None, "GPU", None),
        BlockStored([H3], H2, list(range(32, 48)), 16, None, "CPU", None, extra_keys=[("tenant-a",)]),
    ]),
    "batch1.msgpack": KVEventBatch(1764000001.5, [
        BlockStored([H1], None, list(range(16)), 16, None, "STORAGE", None),
        BlockRemoved([H2, H3], "GPU"),
        AllBlocksCleared(),
    ], data_parallel_rank=1),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_decodes_vllm_bytes(name):
    assert decode((HERE / name).read_bytes()) == EXPECTED[name]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_encodes_the_same_bytes_as_vllm(name):
    assert encode(EXPECTED[name]) == (HERE / name).read_bytes()


def test_defaults_are_omitted_and_tags_named():
    raw = msgspec.msgpack.decode(encode(KVEventBatch(1.0, [BlockRemoved([H1], "CPU"), AllBlocksCleared()])))
    # (vLLM's batch keeps a None data_parallel_rank: its fixtures end with nil too)
    assert raw == [1.0, [{"type": "BlockRemoved", "block_hashes": [H1], "medium": "CPU"}, {"type": "AllBlocksCleared"}],
                   None]


def test_garbage_is_a_validation_error():
    with pytest.raises(msgspec.ValidationError):
        decode(msgspec.msgpack.encode([1.0, [{"type": "Nope"}]]))

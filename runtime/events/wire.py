"""KV cache events in vLLM's wire format (vLLM 0.33 `vllm/distributed/kv_events.py`).

The classes mirror vLLM's field for field, in the same order and with the same msgspec options
(a batch is an array `[ts, events, data_parallel_rank]`; events are maps tagged by class name
under `type`; defaults are omitted), so `encode(batch)` gives the bytes vLLM's own encoder gives
and a consumer written for vLLM or SGLang (NVIDIA Dynamo's KV router, llm-d's KV cache manager,
vLLM's example subscriber) reads ours unchanged. `tests/events/test_wire.py` checks both
directions against batches vLLM 0.33 encoded itself.

Block hashes here are the storage tier's 16-byte page hashes (`runtime.storage.hashing`): the same
page has the same hash in every process of one model, which is what lets a router match a
request's pages against many instances' events.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

GPU = "GPU"  # the runtime's device tier
CPU = "CPU"  # the host tier
STORAGE = "STORAGE"  # the storage tier (after the backend confirmed the write)
MEDIUMS = (GPU, CPU, STORAGE)

BlockHash = Union[bytes, int]


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the event classes (vLLM's name)."""


class BlockStored(KVCacheEvent):
    """Pages that became resident in `medium`: `block_hashes[i]` holds
    `token_ids[i * block_size:(i + 1) * block_size]`; `parent_block_hash` is the page before the
    first one (None: they start a sequence)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[int] | None = None


class BlockRemoved(KVCacheEvent):
    """Pages that left `medium`."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every page of this instance left its device and host tiers (a flush that left nothing)."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One tree-actor turn's events (vLLM's `KVEventBatch`: `ts` in seconds since the epoch)."""

    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(type=KVEventBatch)


def encode(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode(payload: bytes) -> KVEventBatch:
    """A batch from its msgpack bytes; `msgspec.ValidationError` when they are not one."""
    return _decoder.decode(payload)

"""The connector's KV cache events: its host tier (medium CPU) and storage (STORAGE), under vLLM's
own block hashes, handed to vLLM's scheduler through `KVConnectorBase_V1.take_events`.

vLLM 0.33's scheduler collects a connector's events once per step (`Scheduler.update_from_output`,
after `request_finished` and `update_connector_output`) and publishes them in the same
`KVEventBatch` as its own GPU events. A router that reads that stream matches blocks by hash, so
a CPU or STORAGE event must name a block by the hash vLLM gives it (`request.block_hashes`: its
hash function over the block's tokens, parent hash and extra keys), not by the runtime's storage
page hash: our hashes are what the tiers-only core's `KVEventRecorder` records, and this module
renames them.

The names are learned where the connector has both: the request's tokens (hashed the storage
tier's way, `runtime.storage.hashing.page_hashes`) and the request's `block_hashes`, when it
issues a backup (`request_finished`) or a storage read (`update_state_after_alloc`), the only
two ways a page joins the host tier or becomes known stored. A learned name lives while its page
is resident on CPU or STORAGE (a bit per medium, from the events themselves) or an op that
learned it is still in flight; a page that never landed (a failed backup) is forgotten when the
op's ack has been translated.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.distributed.kv_events import AllBlocksCleared as VllmAllBlocksCleared
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm import envs
from vllm.logger import init_logger
from vllm.v1.core.kv_cache_utils import ExternalBlockHash, resolve_block_hashes

from runtime.errors import ArgumentError
from runtime.events.recorder import KVEventRecorder, Record
from runtime.events.wire import CPU, STORAGE
from runtime.storage.hashing import HASH_BYTES, KVIdentity, page_hashes
from runtime.integrations.vllm.core import TiersOnlyCore

logger = init_logger("vllm.hicache.events")  # (under vLLM's logger: VLLM_LOGGING_LEVEL governs it)

__all__ = ["ConnectorEvents"]

_BIT = {CPU: 1, STORAGE: 2}
_GROUP = 0  # the connector supports one KV cache group (vLLM's group_idx of its GPU events)
_U64 = (1 << 64) - 1


@dataclass(slots=True)
class _Page:
    name: ExternalBlockHash  # vLLM's block hash, as its events carry it
    media: int = 0  # _BIT of each medium it is resident on, per the events
    learning: int = 0  # ops in flight that learned it


class ConnectorEvents:
    # -- state -------------------------------------------------------------------
    def __init__(self, core: TiersOnlyCore, identity: KVIdentity, block_size: int, hash_block_size: int) -> None:
        if core.residency.records_events():
            raise ArgumentError("the core records KV events already")
        self.block_size = block_size
        self.hash_block_size = hash_block_size
        self.identity = identity
        self.recorder = KVEventRecorder(block_size, identity)
        core.residency.enable_events(self.recorder)
        self._pages: dict[bytes, _Page] = {}  # our page hash -> vLLM's name of it
        self._learned: dict[int, list[bytes]] = {}  # op id -> our hashes it learned
        self._acked: list[int] = []  # ops acked since the last `take` (forgotten after it)
        self.unnamed = 0  # pages an event named that no op had learned (a fallback to our hash)
        # vLLM's `maybe_convert_block_hash`, with its switch read once (vLLM reads the env var per
        # block: 1.8 us of a page's 3 us here)
        self._as_int = bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)

    # -- the connector's scheduler side --------------------------------------------
    def learn(self, op_id: int, request: Any, ours: Sequence[bytes]) -> None:
        """The op `op_id` (a backup or a storage read of `request`) may make `ours` (our hashes of
        the request's leading pages) resident: keep vLLM's names of them until it is acked."""
        theirs = resolve_block_hashes(request.block_hashes, self.hash_block_size, self.block_size)
        n = min(len(ours), len(theirs))
        pages = self._pages
        for i in range(n):
            page = pages.get(ours[i])
            if page is None:
                h = theirs[i]
                page = pages[ours[i]] = _Page(int.from_bytes(h, "big") & _U64 if self._as_int else h)
            page.learning += 1
        self._learned.setdefault(op_id, []).extend(ours[:n])

    def learn_tokens(self, op_id: int, request: Any, tokens: np.ndarray, extra_key: Hashable, pages: int) -> None:
        """`learn` of the first `pages` pages of `tokens` (hashed here, the storage tier's way)."""
        self.learn(op_id, request, page_hashes(tokens[:pages * self.block_size], self.block_size, extra_key,
                                               self.identity))

    def acked(self, op_ids: Iterable[int]) -> None:
        """These ops' acks were applied: their names go once this step's events are taken."""
        self._acked.extend(op for op in op_ids if op in self._learned)

    def take(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, as vLLM's event objects."""
        out = [self._event(r) for r in self.recorder.take()]
        for op in self._acked:
            self._forget(self._learned.pop(op, ()))
        self._acked.clear()
        return out

    def names(self) -> dict[bytes, ExternalBlockHash]:
        """Our page hash -> vLLM's block hash, for every page the events say is on CPU or STORAGE."""
        return {h: p.name for h, p in self._pages.items() if p.media}

    # -- helpers -------------------------------------------------------------------
    def _event(self, r: Record) -> KVCacheEvent:
        if len(r) == 5:
            medium, blob, parent, tokens, extra_key = r
            ours = _split(blob)
            bit = _BIT[medium]
            names = []
            for h in ours:
                page = self._pages.get(h)
                if page is None:
                    page = self._pages[h] = _Page(self._unnamed(h))
                page.media |= bit
                names.append(page.name)
            lora, salt = _lora_and_salt(extra_key)
            keys: list[tuple[Any, ...] | None] | None = None
            if lora is not None or salt is not None:  # (vLLM's untagged extra keys: LoRA name; salt in block 0)
                keys = [_keys(lora, salt if parent is None and i == 0 else None) for i in range(len(ours))]
            parent_name = None if parent is None else self._name(parent)
            return BlockStored(block_hashes=names, parent_block_hash=parent_name,
                               token_ids=np.frombuffer(tokens, "<i4").tolist(), block_size=self.block_size,
                               lora_id=None, medium=medium, lora_name=lora, extra_keys=keys, group_idx=_GROUP)
        if r:
            medium, blob = r
            return BlockRemoved(block_hashes=self._drop(_split(blob), _BIT[medium]), medium=medium, group_idx=_GROUP)
        # (the tiers-only core never flushes; a clear of device and host is every CPU page gone)
        cpu = [h for h, p in self._pages.items() if p.media & _BIT[CPU]]
        return BlockRemoved(block_hashes=self._drop(cpu, _BIT[CPU]), medium=CPU, group_idx=_GROUP) if cpu \
            else VllmAllBlocksCleared()

    def _drop(self, ours: list[bytes], bit: int) -> list[ExternalBlockHash]:
        names = []
        for h in ours:
            page = self._pages.get(h)
            if page is None:
                names.append(self._unnamed(h))
                continue
            names.append(page.name)
            page.media &= ~bit
            if not page.media and not page.learning:
                del self._pages[h]
        return names

    def _forget(self, ours: Iterable[bytes]) -> None:
        for h in ours:
            page = self._pages[h]
            page.learning -= 1
            if not page.media and not page.learning:
                del self._pages[h]

    def _name(self, h: bytes) -> ExternalBlockHash:
        page = self._pages.get(h)
        return self._unnamed(h) if page is None else page.name

    def _unnamed(self, h: bytes) -> ExternalBlockHash:
        """A page no op learned (not expected: every page joins through a backup or a read):
        our own hash, so its store and removal still pair up."""
        self.unnamed += 1
        logger.warning("HiCache KV event: page %s has no vLLM block hash known (named by its own hash)", h.hex())
        return h


def _split(blob: bytes) -> list[bytes]:
    return [blob[i: i + HASH_BYTES] for i in range(0, len(blob), HASH_BYTES)]


def _lora_and_salt(extra_key: Hashable) -> tuple[str | None, str | None]:
    """The connector's namespace (`runtime.integrations.vllm._namespace`): None or ("vllm", lora, salt)."""
    if extra_key is None:
        return None, None
    _, lora, salt = extra_key  # type: ignore[misc]
    return lora, salt


def _keys(lora: str | None, salt: str | None) -> tuple[Any, ...] | None:
    keys = tuple(k for k in (lora, salt) if k is not None)
    return keys or None

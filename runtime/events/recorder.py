"""`KVEventRecorder`: a tree-actor turn's residency changes, as KV cache events.

`Residency` (device and host pages of tree nodes) and `StorageTier` (pages the backend confirmed)
report each change here as it happens; the tree actor takes the turn's records once, after the
message (`take`), and publishes them as one batch. A record is a plain tuple of bytes (the pages'
hashes, concatenated; their tokens' int32 bytes): the wire objects, one 16-byte `bytes` and one
`int` per page and token, are built by whoever reads the batch (`materialize`: an in-process
subscriber's task, the ZMQ publisher's thread), never in the tree actor's turn. Nothing here touches a ledger or the tree's
shape: it reads nodes' keys and their page hashes (`PageHasher`: kept in each node and shared
with the storage tier's writes, so a page is hashed once while it lives, not once per event).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Union

import numpy as np

from runtime.storage.hashing import HASH_BYTES, KVIdentity
from runtime.tree.nodes import Node
from runtime.tree.page_hasher import PageHasher

from .wire import CPU, GPU, AllBlocksCleared, BlockRemoved, BlockStored

Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]
# (medium, hashes, parent hash, tokens as int32 bytes, namespace) | (medium, hashes) | ()
Record = tuple
CLEARED: Record = ()
_HB = HASH_BYTES


class KVEventRecorder:
    # -- state -------------------------------------------------------------------
    def __init__(self, page_size: int, identity: KVIdentity, hasher: PageHasher | None = None) -> None:
        """`hasher`: the tree's page hashes, shared with its storage tier (else one of its own)."""
        self.page_size = page_size
        self.identity = identity
        self.hasher = hasher if hasher is not None else PageHasher(page_size, identity)
        self._page_bytes = page_size * 4  # a page of int32 tokens in a tree key
        self._hashes = self.hasher.node
        self._parent_hash = self.hasher.parent_hash
        self.pending: list[Record] = []
        self.events_recorded = 0

    # -- residency changes --------------------------------------------------------
    def stored(self, node: Node, medium: str, num_tokens: int | None = None) -> None:
        """The last `num_tokens` (all when None) of `node` became resident in `medium`."""
        blob = self._hashes(node)
        n = node.num_tokens if num_tokens is None else num_tokens
        if n <= 0:
            return
        first = (node.num_tokens - n) // self.page_size
        if first:
            parent: bytes | None = blob[(first - 1) * _HB: first * _HB]
        else:
            parent = self._parent_hash(node)
        self._append((medium, blob[first * _HB:] if first else blob, parent,
                      node.key[first * self._page_bytes:] if first else node.key, node.extra_key))

    def removed(self, node: Node, medium: str) -> None:
        """Every page of `node` left `medium` (call before the tree forgets the node's path)."""
        blob = self._hashes(node)
        if blob:
            self._append((medium, blob))

    def stored_pages(self, hashes: list[bytes], parent: bytes | None, tokens: np.ndarray,
                     extra_key: Hashable, medium: str) -> None:
        """Pages known by hash (a storage write the backend confirmed): `tokens` are theirs."""
        if hashes:
            self._append((medium, b"".join(hashes), parent, tokens.astype("<i4").tobytes(), extra_key))

    def removed_pages(self, hashes: list[bytes], medium: str) -> None:
        if hashes:
            self._append((medium, b"".join(hashes)))

    def on_split(self, lower: Node, upper: Node) -> None:
        """A split moved `lower`'s first pages to the new `upper`: so do their hashes."""
        self.hasher.on_split(lower, upper)

    # -- a flush ---------------------------------------------------------------------
    def mark(self) -> int:
        return len(self.pending)

    def cleared_since(self, mark: int) -> None:
        """What was recorded since `mark` left the device and host tiers empty: one
        `AllBlocksCleared` says it (the removals since `mark` are dropped; events before it stay,
        so a subscriber sees stores then the clear, in order). Storage pages are not cleared by it:
        a subscriber that indexes STORAGE keeps them (docs/EVENTS.md)."""
        self.events_recorded -= len(self.pending) - mark
        del self.pending[mark:]
        self._append(CLEARED)

    # -- the turn's batch --------------------------------------------------------------
    def take(self) -> list[Record]:
        out, self.pending = self.pending, []
        return out

    # -- helpers -------------------------------------------------------------------------
    def _append(self, event: Record) -> None:
        self.pending.append(event)
        self.events_recorded += 1


def materialize(records: list[Record], page_size: int) -> list[Event]:
    """The wire events of a turn's records (`KVEventRecorder.take`)."""
    out: list[Event] = []
    for r in records:
        if len(r) == 5:
            medium, blob, parent, tokens, extra_key = r
            hashes = [blob[i: i + _HB] for i in range(0, len(blob), _HB)]
            # vLLM's `extra_keys`: one tuple per block; ours holds the namespace (None: omitted)
            extra = None if extra_key is None else [(extra_key,)] * len(hashes)
            out.append(BlockStored(hashes, parent, np.frombuffer(tokens, "<i4").tolist(), page_size, None, medium,
                                   None, extra_keys=extra))
        elif r:
            medium, blob = r
            out.append(BlockRemoved([blob[i: i + _HB] for i in range(0, len(blob), _HB)], medium))
        else:
            out.append(AllBlocksCleared())
    return out


__all__ = ["KVEventRecorder", "materialize", "GPU", "CPU"]

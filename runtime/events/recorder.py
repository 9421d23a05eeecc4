"""`KVEventRecorder`: a tree-actor turn's residency changes, as KV cache events.

`Residency` (device and host pages of tree nodes) and `StorageTier` (pages the backend confirmed)
report each change here as it happens; the tree actor takes the turn's events once, after the
message (`take`), and publishes them as one batch. Nothing here touches a ledger or the tree's
shape: it reads nodes' keys and keeps each node's page hashes in the node (`Node.page_hashes`,
16 bytes a page, concatenated), so a page is hashed once while it lives, not once per event.

A node's hashes are the storage tier's page hashes of its path (`runtime.storage.hashing`):
`h(i) = H(h(i-1) || page i's tokens as little-endian int32)`, seeded by the namespace and KV
identity. A tree key is exactly those int32 bytes, so a page's hash reads the key in place.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable
from typing import Union

import numpy as np

from runtime.storage.hashing import HASH_BYTES, KVIdentity, chain_seed
from runtime.tree.nodes import Node

from .wire import CPU, GPU, AllBlocksCleared, BlockRemoved, BlockStored

Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]
_sha256 = hashlib.sha256
_HB = HASH_BYTES


class KVEventRecorder:
    # -- state -------------------------------------------------------------------
    def __init__(self, page_size: int, identity: KVIdentity) -> None:
        self.page_size = page_size
        self.identity = identity
        self._page_bytes = page_size * 4  # a page of int32 tokens in a tree key
        self._seeds: dict[Hashable, bytes] = {}  # namespace -> h(-1)
        self.pending: list[Event] = []
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
        key = node.key
        tokens = np.frombuffer(key, dtype="<i4")[first * self.page_size:].tolist()
        hashes = [blob[i: i + _HB] for i in range(first * _HB, len(blob), _HB)]
        self._append(BlockStored(hashes, parent, tokens, self.page_size, None, medium, None,
                                 extra_keys=_extra_keys(node.extra_key, len(hashes))))

    def removed(self, node: Node, medium: str) -> None:
        """Every page of `node` left `medium` (call before the tree forgets the node's path)."""
        blob = self._hashes(node)
        if blob:
            self._append(BlockRemoved([blob[i: i + _HB] for i in range(0, len(blob), _HB)], medium))

    def stored_pages(self, hashes: list[bytes], parent: bytes | None, tokens: np.ndarray,
                     extra_key: Hashable, medium: str) -> None:
        """Pages known by hash (a storage write the backend confirmed): `tokens` are theirs."""
        if hashes:
            self._append(BlockStored(list(hashes), parent, tokens.tolist(), self.page_size, None, medium, None,
                                     extra_keys=_extra_keys(extra_key, len(hashes))))

    def removed_pages(self, hashes: list[bytes], medium: str) -> None:
        if hashes:
            self._append(BlockRemoved(list(hashes), medium))

    def on_split(self, lower: Node, upper: Node) -> None:
        """A split moved `lower`'s first pages to the new `upper`: so do their hashes."""
        blob = lower.page_hashes
        if blob is not None:
            cut = upper.num_tokens // self.page_size * _HB
            upper.page_hashes, lower.page_hashes = blob[:cut], blob[cut:]

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
        self._append(AllBlocksCleared())

    # -- the turn's batch --------------------------------------------------------------
    def take(self) -> list[Event]:
        out, self.pending = self.pending, []
        return out

    # -- helpers -------------------------------------------------------------------------
    def _append(self, event: Event) -> None:
        self.pending.append(event)
        self.events_recorded += 1

    def _parent_hash(self, node: Node) -> bytes | None:
        parent = node.parent
        if parent is None or parent.parent is None:  # a root: the chain starts here
            return None
        return self._hashes(parent)[-_HB:]

    def _seed(self, extra_key: Hashable) -> bytes:
        seed = self._seeds.get(extra_key)
        if seed is None:
            seed = self._seeds[extra_key] = chain_seed(extra_key, self.identity)
        return seed

    def _hashes(self, node: Node) -> bytes:
        """`node`'s page hashes, computed for the pages not hashed yet (a new node, or a leaf a
        request extended), its ancestors' first."""
        blob = node.page_hashes
        key = node.key
        pb = self._page_bytes
        if blob is not None and len(blob) // _HB * pb == len(key):
            return blob
        chain = []  # node and its ancestors that need hashing, deepest first
        cur: Node | None = node
        while cur is not None and cur.parent is not None:
            b = cur.page_hashes
            if b is not None and len(b) // _HB * pb == len(cur.key):
                break
            chain.append(cur)
            cur = cur.parent
        prev = self._seed(node.extra_key) if cur is None or cur.parent is None else cur.page_hashes[-_HB:]
        sha = _sha256
        for cur in reversed(chain):
            b = cur.page_hashes or b""
            if b:
                prev = b[-_HB:]
            key = cur.key
            parts = [b]
            for off in range(len(b) // _HB * pb, len(key), pb):
                prev = sha(prev + key[off: off + pb]).digest()[:_HB]
                parts.append(prev)
            cur.page_hashes = b"".join(parts)
        return node.page_hashes  # type: ignore[return-value]


def _extra_keys(extra_key: Hashable, pages: int) -> list[tuple] | None:
    """vLLM's `extra_keys`: one tuple per block; ours holds the namespace (None: omitted)."""
    return None if extra_key is None else [(extra_key,)] * pages


__all__ = ["KVEventRecorder", "GPU", "CPU"]

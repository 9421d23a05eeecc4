"""PageHasher: each tree node's page hashes, computed once a page while the node lives.

A node keeps the hashes of its own pages (`Node.page_hashes`, 16 bytes a page, concatenated):
the storage tier's page hashes of its path (`runtime.storage.hashing`), `h(i) = H(h(i-1) || page
i's tokens as little-endian int32)`, seeded by the namespace and KV identity, with the identity's
hash (`KVIdentity.hash_algo`). A tree key is exactly those int32 bytes, so a node's new pages are
hashed from its key in one call. KV events (`KVEventRecorder`) and storage writes (`StorageTier`)
read the same hashes: a page is hashed once, whichever needs it first.
"""

from __future__ import annotations

from collections.abc import Hashable

from runtime.storage.hash_chain import chain_function
from runtime.storage.hashing import HASH_BYTES, KVIdentity, chain_seed
from runtime.tree.nodes import Node

_HB = HASH_BYTES


class PageHasher:
    # -- state -------------------------------------------------------------------
    def __init__(self, page_size: int, identity: KVIdentity) -> None:
        self.page_size = page_size
        self.identity = identity
        self._chain = chain_function(identity.hash_algo)
        self._page_bytes = page_size * 4  # a page of int32 tokens in a tree key
        self._seeds: dict[Hashable, bytes] = {}  # namespace -> h(-1)

    # -- questions ----------------------------------------------------------------
    def node(self, node: Node) -> bytes:
        """`node`'s page hashes, computed for the pages not hashed yet (a new node, or a leaf a
        request extended), its ancestors' first."""
        blob = node.page_hashes
        pb = self._page_bytes
        if blob is not None and len(blob) // _HB * pb == len(node.key):
            return blob
        chain = []  # node and its ancestors that need hashing, deepest first
        cur = node
        while cur.parent is not None:  # (stops at the first ancestor fully hashed, or the root)
            b = cur.page_hashes
            if b is not None and len(b) // _HB * pb == len(cur.key):
                break
            chain.append(cur)
            cur = cur.parent
        prev = self._seed(node.extra_key) if cur.parent is None else cur.page_hashes[-_HB:]  # type: ignore[index]
        hash_chain = self._chain
        for cur in reversed(chain):
            b = cur.page_hashes or b""
            if b:
                prev = b[-_HB:]
            new = hash_chain(prev, cur.key[len(b) // _HB * pb:], pb)
            cur.keep_page_hashes(b + new if b else new)
            prev = cur.page_hashes[-_HB:]
        return node.page_hashes  # type: ignore[return-value]

    def parent_hash(self, node: Node) -> bytes | None:
        """The hash of the page just before `node`'s first (None at a root: the chain starts there)."""
        parent = node.parent
        if parent is None or parent.parent is None:
            return None
        return self.node(parent)[-_HB:]

    def path(self, node: Node) -> list[bytes]:
        """The hashes of every page of `node`'s path, root first."""
        self.node(node)  # (hashes the ancestors that need it too)
        blobs = []
        cur = node
        while cur.parent is not None:
            blobs.append(cur.page_hashes)
            cur = cur.parent
        blob = b"".join(reversed(blobs))  # type: ignore[arg-type]
        return [blob[i: i + _HB] for i in range(0, len(blob), _HB)]

    # -- tree changes -----------------------------------------------------------------
    def on_split(self, lower: Node, upper: Node) -> None:
        """A split moved `lower`'s first pages to the new `upper`: so do their hashes."""
        blob = lower.page_hashes
        if blob is not None:
            cut = upper.num_tokens // self.page_size * _HB
            upper.keep_page_hashes(blob[:cut])
            lower.keep_page_hashes(blob[cut:])

    # -- helpers -------------------------------------------------------------------------
    def _seed(self, extra_key: Hashable) -> bytes:
        seed = self._seeds.get(extra_key)
        if seed is None:
            seed = self._seeds[extra_key] = chain_seed(extra_key, self.identity)
        return seed


__all__ = ["PageHasher"]

"""The radix tree's value types: nodes, match and insert results, the tree's key encoding.

Plain values with no behaviour of their own beyond reading: `RadixTree` (radix.py) is the only
writer of a `Node`'s fields (its user may set `owner`); results are built by its operations.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from runtime.errors import InternalError
from runtime.memory.owners import Owner

_I4 = np.dtype("<i4")


class TreeError(InternalError, ValueError):
    """A tree call with bad arguments or in a state that does not allow it.

    Raised before any change: the tree is exactly as it was. No caller talks to the tree (the
    core checks their input first): inside an actor it fails the runtime.
    """


def encode(tokens) -> bytes:
    """Token ids -> int32 little-endian bytes (4 bytes per token), the tree's key form."""
    if type(tokens) is np.ndarray and tokens.dtype is _I4 and tokens.ndim == 1:
        return tokens.tobytes()  # the common case: an int32 array
    if isinstance(tokens, bytes):
        if len(tokens) & 3:
            raise TreeError(f"encoded tokens must be a multiple of 4 bytes, got {len(tokens)}")
        return tokens
    a = np.asarray(tokens)
    if a.dtype != _I4:
        if a.size == 0:
            return b""
        if a.dtype.kind not in "iu":
            raise TreeError(f"tokens must be integers, got dtype {a.dtype}")
        a = a.astype(_I4)
    if a.ndim != 1:
        raise TreeError(f"tokens must be 1-D, got shape {a.shape}")
    return a.tobytes()


def decode(key: bytes) -> np.ndarray:
    """int32-LE bytes -> a read-only int32 array view of them."""
    return np.frombuffer(key, dtype=_I4)


class Node:
    """One radix-tree node: a run of whole pages of one prefix.

    Fields are public for reading (the invariant checker reads them raw); mutate only
    through the tree.
    """

    __slots__ = (
        "id",
        "parent",
        "children",
        "key",
        "extra_key",
        "device",
        "host",
        "lock_ref",
        "host_protect",
        "hit_count",
        "last_access",
        "priority",
        # children with device slots / with host slots (keep leaf checks O(1))
        "n_dev_children",
        "n_host_children",
        # True while this node has an entry in the device / host eviction heap
        "_dq",
        "_hq",
        # free for the tree's user (the cache core keeps the node's ledger owner here);
        # the tree never reads it
        "owner",
        # the node's page hashes, concatenated (16 bytes a page), kept by the KV event recorder
        # while events are on; the tree never reads it
        "page_hashes",
    )

    def __init__(self, id: int, parent: "Node | None", key: bytes, extra_key: Hashable) -> None:
        self.id = id
        self.parent = parent
        self.children: dict[bytes, Node] = {}
        self.key = key
        self.extra_key = extra_key
        self.device: np.ndarray | None = None
        self.host: np.ndarray | None = None
        self.lock_ref = 0
        self.host_protect = 0
        self.hit_count = 0
        self.last_access = 0
        self.priority = 0
        self.n_dev_children = 0
        self.n_host_children = 0
        self._dq = False
        self._hq = False
        self.owner = None
        self.page_hashes: bytes | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.key) >> 2

    def keep_page_hashes(self, blob: bytes | None) -> None:
        """The hashes of its own pages (`PageHasher`: computed once while it lives, read by KV
        events and storage writes alike)."""
        self.page_hashes = blob

    def ledger_owner(self) -> Owner:
        """Its ledger owner, made at the first ask (`node_owner`)."""
        if self.owner is None:
            self.owner = Owner.node(self.id)
        return self.owner

    @property
    def tokens(self) -> np.ndarray:
        """This node's own token ids (read-only int32 view)."""
        return np.frombuffer(self.key, dtype=_I4)

    @property
    def is_root(self) -> bool:
        return self.parent is None and not self.key

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return (
            f"Node(id={self.id}, tokens={self.num_tokens}, dev={self.device is not None}, "
            f"host={self.host is not None}, lock={self.lock_ref}, prot={self.host_protect})"
        )


def node_owner(node: Node) -> Owner:
    """The ledger owner of a node's slots, made once per node (an `Owner` costs ~1 µs to build,
    and the eviction and split paths name it for every node they touch)."""
    owner = node.owner
    return owner if owner is not None else node.ledger_owner()


class MatchResult:
    """Result of :meth:`RadixTree.match`.

    - ``nodes``: the matched path (root excluded), in order. With ``split=True`` it ends
      exactly at ``matched_len``; with ``split=False`` the last node may be matched only
      partly.
    - ``device_len``: tokens from the start whose nodes all hold device slots.
    - ``host_len``: tokens after ``device_len`` through nodes with host but no device slots.
    - ``device_slots``: a new int64 array with the device slots of the first ``device_len``
      tokens.
    - ``last_device_node``: the deepest node of the device part (the namespace root if
      none); ``last_node``: the deepest node of the device + host part (root if none).
    - ``matched_len``: tokens matched in the tree at all (also through nodes with neither
      device nor host slots, e.g. storage-only ones).
    """

    __slots__ = ("nodes", "device_len", "host_len", "_device_slots", "device_parts", "last_device_node", "last_node",
                 "matched_len", "partial", "num_device_nodes", "extra_key")

    def __init__(self, nodes, device_len, host_len, device_slots, last_device_node, last_node, matched_len,
                 partial=0, num_device_nodes=None, extra_key=None):
        self.nodes: list[Node] = nodes
        self.device_len: int = device_len
        self.host_len: int = host_len
        # ``device_slots`` may be given as the list of per-node arrays (``device_parts``):
        # the concatenation is made on first use, so a caller that concatenates them with
        # more slots (an admission) copies them once
        if isinstance(device_slots, list):
            self.device_parts: list[np.ndarray] = device_slots
            self._device_slots: np.ndarray | None = None
        else:
            self.device_parts = [device_slots] if len(device_slots) else []
            self._device_slots = device_slots
        self.last_device_node: Node = last_device_node
        self.last_node: Node = last_node
        self.matched_len: int = matched_len
        # tokens matched in the last node when it was matched only partly (split=False), else 0
        self.partial: int = partial
        # the leading nodes with device slots (device residency is prefix-closed)
        self.num_device_nodes: int = (
            num_device_nodes if num_device_nodes is not None else sum(1 for nd in nodes if nd.device is not None))
        self.extra_key = extra_key

    @property
    def device_slots(self) -> np.ndarray:
        """A new int64 array: the device slots of the first ``device_len`` tokens."""
        d = self._device_slots
        if d is None:
            parts = self.device_parts
            d = self._device_slots = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        return d

    @property
    def device_nodes(self) -> list[Node]:
        """Nodes of the device part, in order."""
        return self.nodes[: self.num_device_nodes]

    @property
    def host_nodes(self) -> list[Node]:
        """Nodes of the host part (host slots, no device slots), in order."""
        out = []
        for nd in self.nodes:
            if nd.device is not None:
                continue
            if nd.host is None:
                break
            out.append(nd)
        return out

    def __repr__(self) -> str:  # pragma: no cover
        return (
            f"MatchResult(device_len={self.device_len}, host_len={self.host_len}, "
            f"matched_len={self.matched_len}, nodes={[n.id for n in self.nodes]})"
        )


class InsertResult:
    """Result of :meth:`RadixTree.insert`.

    - ``duplicate_slots``: the caller's slots for pages the tree already held on device;
      the caller frees them. Positions where the caller passed the tree's own slot (it
      got them from a match) are not duplicates and are not listed.
    - ``adopted``: ``(node, slots)`` for every node that took caller slots as its device
      copy: new nodes, and existing nodes on the path without device slots. ``slots`` is
      the node's own array (the caller moves those slots to the node's ownership).
    - ``last_node``: the node that ends the inserted key (the root for an empty key).
    - ``prefix_len``: tokens that were already on device before this insert.
    """

    __slots__ = ("duplicate_slots", "adopted", "last_node", "prefix_len", "_prefix_parts")

    def __init__(self, duplicate_slots, adopted, last_node, prefix_len, prefix_parts=()):
        self.duplicate_slots: np.ndarray = duplicate_slots
        self.adopted: list[tuple[Node, np.ndarray]] = adopted
        self.last_node: Node = last_node
        self.prefix_len: int = prefix_len
        self._prefix_parts = prefix_parts

    @property
    def prefix_slots(self) -> np.ndarray:
        """The tree's device slots of the first ``prefix_len`` tokens (a new array): with the
        caller's slots after them, the device slots of the whole inserted path."""
        parts = self._prefix_parts
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def tally_match(nodes: list[Node], root: Node, matched: int, partial: int, extra_key: Hashable) -> MatchResult:
    """The match of the path `nodes` (`partial`: tokens matched in a last node not split): its
    device part (prefix-closed), then the host-only part after it."""
    count = len(nodes)
    i = 0
    dev = []
    while i < count:
        d = nodes[i].device
        if d is None:
            break
        dev.append(d)
        i += 1
    if partial and i == count:
        dev[-1] = dev[-1][:partial]
    device_len = 0
    for d in dev:
        device_len += len(d)
    last_dev = nodes[i - 1] if dev else root
    j = i
    host_len = 0
    while j < count:
        nd = nodes[j]
        if nd.host is None or nd.device is not None:
            break
        host_len += len(nd.key) >> 2
        j += 1
    if partial and j == count and j > i:
        host_len -= (len(nodes[-1].key) >> 2) - partial
    last = nodes[j - 1] if j else root
    return MatchResult(nodes, device_len, host_len, dev, last_dev, last, matched, partial, i, extra_key)

"""Paged radix tree: the synchronous core of the tree actor.

Pure bookkeeping, no event loop, no torch, no slot ledger. Nodes store slot ids (numpy
int64 arrays) for the device and host tiers; every operation that gives slots up
*returns* them and the caller (who owns the ledgers) frees or re-owns them.

Representation (chosen for speed: docs/BENCHMARKS.md, "Tree"):

- a node's tokens are ``bytes`` (int32 little-endian, 4 bytes per token, whole pages), so a
  whole-node match is one ``bytes.startswith``; children are found through a dict keyed by
  the first page's bytes; no per-token Python loop anywhere;
- one root per ``extra_key`` namespace (``None`` included): equal tokens under two keys
  never match or share;
- device residency is prefix-closed: a node with device slots always has a parent with
  device slots (or the root);
- the derived sets (evictable device leaves, evictable host leaves) are maintained
  incrementally, O(1) per touched node, from one definition each (``_is_device_leaf``,
  ``_is_host_leaf``);
- eviction order comes from one lazily updated heap per tier (stale entries are skipped or
  re-keyed when popped; never rebuilt per call).

Tokens may be given as a numpy integer array, any sequence of ints, or ``bytes`` that are
already int32-LE encoded (see :func:`encode`; encode once and reuse for match + insert).
Token ids must fit in int32.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterator
from typing import Any, Callable

import numpy as np

from .nodes import InsertResult, MatchResult, Node, TreeError, decode, encode, tally_match  # noqa: F401 - re-exported
from .policies import EvictionPolicy, LRUPolicy, policy_by_name

_I4 = np.dtype("<i4")
_I8 = np.dtype(np.int64)
_EMPTY_I8 = np.empty(0, dtype=np.int64)
_EMPTY_I8.flags.writeable = False


def _as_slots(slots, n: int | None = None) -> np.ndarray:
    """Validated private int64 copy of a slot id array (never a view of the caller's)."""
    a = np.asarray(slots)
    if a.ndim != 1:
        raise TreeError(f"slots must be 1-D, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise TreeError(f"slots must be integers, got dtype {a.dtype}")
    if n is not None and len(a) != n:
        raise TreeError(f"expected {n} slots, got {len(a)}")
    return np.array(a, dtype=np.int64)  # always a copy


def _detached_root(extra_key: Hashable) -> Node:
    """The root a match of a namespace with nothing cached reports: in no tree (`is_live` is
    False), so nothing can be hung under it or locked through it."""
    return Node(-1, None, b"", extra_key)


class RadixTree:
    """Paged radix tree over token prefixes, one root per ``extra_key``.

    ``on_split(old_lower, new_upper)`` (given at construction, default None) is called after
    every split, once the tree is consistent again, so the owner can move ledger ownership of
    the upper part's slots.
    """

    def __init__(
        self,
        page_size: int = 1,
        policy: EvictionPolicy | str | None = None,
        host_policy: EvictionPolicy | str | None = None,
        on_split: Callable[[Node, Node], None] | None = None,
    ) -> None:
        if not isinstance(page_size, int) or page_size < 1:
            raise TreeError(f"page_size must be a positive int, got {page_size!r}")
        self.page_size = page_size
        self.policy: EvictionPolicy = self._policy(policy)
        self.host_policy: EvictionPolicy = self._policy(host_policy) if host_policy is not None else self.policy
        self._next_id = 0
        self._clock = 0
        self._roots: dict[Hashable, Node] = {}
        self._n_nodes = 0  # live non-root nodes
        self.device_leaves: set[Node] = set()
        self.host_leaves: set[Node] = set()
        self._dheap: list[tuple] = []
        self._hheap: list[tuple] = []
        self.total_device_tokens = 0
        self.total_host_tokens = 0
        self.locked_device_tokens = 0  # device tokens of nodes with lock_ref > 0
        self.on_split: Callable[[Node, Node], None] | None = on_split

    @staticmethod
    def _policy(p) -> EvictionPolicy:
        if p is None:
            return LRUPolicy()
        if isinstance(p, str):
            return policy_by_name(p)
        if not callable(getattr(p, "key", None)):
            raise TreeError(f"not an eviction policy: {p!r}")
        return p

    # ------------------------------------------------------------------ structure
    def root(self, extra_key: Hashable = None) -> Node:
        """The root of a namespace (created on first use)."""
        r = self._roots.get(extra_key)
        if r is None:
            hash(extra_key)
            r = Node(self._next_id, None, b"", extra_key)
            self._next_id += 1
            self._roots[extra_key] = r
        return r

    def roots(self) -> list[Node]:
        return list(self._roots.values())

    def nodes(self) -> Iterator[Node]:
        """Every live node (roots excluded), parents before children."""
        stack = [c for r in self._roots.values() for c in r.children.values()]
        while stack:
            nd = stack.pop()
            yield nd
            stack.extend(nd.children.values())

    @property
    def num_nodes(self) -> int:
        return self._n_nodes

    @property
    def evictable_device_tokens(self) -> int:
        """Device tokens not under any lock (what eviction could free eventually)."""
        return self.total_device_tokens - self.locked_device_tokens

    def is_live(self, node: Node) -> bool:
        """True for a node that is in this tree now (a root counts)."""
        if node.parent is None:
            return self._roots.get(node.extra_key) is node
        return node.parent.children.get(node.key[: (self.page_size << 2)]) is node

    def path_tokens(self, node: Node) -> np.ndarray:
        """Token ids from the namespace root down to ``node`` (a new array)."""
        parts = []
        while node.parent is not None:
            parts.append(node.key)
            node = node.parent
        return np.frombuffer(b"".join(reversed(parts)), dtype=_I4).copy()

    def split_chain(self, node: Node, num_tokens: int) -> list[Node]:
        """The nodes, top-down, that cover the last ``num_tokens`` tokens ending at ``node``.

        Recovers what a node covered before splits (seed 002): record
        ``node.num_tokens`` when an operation starts; if the node was split since, its
        upper parts are its ancestors and this walk finds them. Raises if the walk does
        not land exactly on ``num_tokens``.
        """
        chain = []
        acc = 0
        cur = node
        while acc < num_tokens and cur.parent is not None:
            chain.append(cur)
            acc += len(cur.key) >> 2
            cur = cur.parent
        if acc != num_tokens:
            raise TreeError(f"split chain of node {node.id} covers {acc} tokens, not {num_tokens}")
        chain.reverse()
        return chain

    # ------------------------------------------------------------------ derived sets
    @staticmethod
    def _is_device_leaf(node: Node) -> bool:
        """Evictable device leaf: device slots, unlocked, no child with device slots."""
        return node.device is not None and node.lock_ref == 0 and node.n_dev_children == 0

    @staticmethod
    def _is_host_leaf(node: Node) -> bool:
        """Evictable host leaf (seed 004): off device, host slots, not host-protected, unlocked
        (a failed load leaves its users' locks on nodes without a device copy), and no child
        that *has host slots* (not: no child evicted from device)."""
        return (node.device is None and node.host is not None and node.host_protect == 0 and node.lock_ref == 0
                and node.n_host_children == 0)

    def _refresh(self, node: Node) -> None:
        """Recompute both set memberships of one node (O(1))."""
        if node.parent is None:
            return
        if self._is_device_leaf(node):
            if node not in self.device_leaves:
                self.device_leaves.add(node)
                if not node._dq:
                    self._push_dev(node)
        else:
            self.device_leaves.discard(node)
        if self._is_host_leaf(node):
            if node not in self.host_leaves:
                self.host_leaves.add(node)
                if not node._hq:
                    self._push_host(node)
        else:
            self.host_leaves.discard(node)

    def _push_dev(self, node: Node) -> None:
        node._dq = True
        heapq.heappush(self._dheap, (self.policy.key(node), node.id, node))
        if len(self._dheap) > 2 * self._n_nodes + 1024:
            self._compact(self._dheap, self.device_leaves, "_dq", self.policy)

    def _push_host(self, node: Node) -> None:
        node._hq = True
        heapq.heappush(self._hheap, (self.host_policy.key(node), node.id, node))
        if len(self._hheap) > 2 * self._n_nodes + 1024:
            self._compact(self._hheap, self.host_leaves, "_hq", self.host_policy)

    @staticmethod
    def _compact(heap: list, members: set, flag: str, policy) -> None:
        for _k, _i, nd in heap:
            setattr(nd, flag, False)
        heap[:] = [(policy.key(nd), nd.id, nd) for nd in members]
        heapq.heapify(heap)
        for nd in members:
            setattr(nd, flag, True)

    # ------------------------------------------------------------------ helpers
    def _common_bytes(self, ck: bytes, key: bytes, pos: int, n: int) -> int:
        """Length in bytes (whole pages) of the common prefix of ``ck`` and ``key[pos:n]``.

        The first page is known to be equal. Binary search over page counts, each probe
        one C-level ``startswith``.
        """
        pb = self.page_size << 2  # page size in key bytes
        lo = 1
        hi = min(len(ck), n - pos) // pb
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            if key.startswith(ck[: mid * pb], pos):
                lo = mid
            else:
                hi = mid - 1
        return lo * pb

    def _check_node(self, node: Node) -> None:
        if node.parent is None or node.parent.children.get(node.key[: (self.page_size << 2)]) is not node:
            raise TreeError(f"node {node.id} is a root or not in this tree")

    def _split(self, node: Node, at: int) -> Node:
        pb = self.page_size << 2  # page size in key bytes
        b = at << 2
        parent = node.parent
        key = node.key
        upper = Node(self._next_id, parent, key[:b], node.extra_key)
        self._next_id += 1
        lower_key = key[b:]
        node.key = lower_key
        upper.children[lower_key[:pb]] = node
        parent.children[key[:pb]] = upper
        node.parent = upper
        d = node.device
        if d is not None:
            upper.device = d[:at].copy()
            node.device = d[at:].copy()
            upper.n_dev_children = 1
        h = node.host
        if h is not None:
            upper.host = h[:at].copy()
            node.host = h[at:].copy()
            upper.n_host_children = 1
        upper.lock_ref = node.lock_ref
        upper.host_protect = node.host_protect
        upper.hit_count = node.hit_count
        upper.last_access = node.last_access
        upper.priority = node.priority
        self._n_nodes += 1
        # `upper` has a child with its own tiers, so it is never a leaf of either set, and
        # `node` keeps its fields and children: both memberships are already right.
        cb = self.on_split
        if cb is not None:
            cb(node, upper)
        return upper

    def split(self, node: Node, at_tokens: int) -> Node:
        """Split ``node`` after ``at_tokens`` tokens; returns the new upper node.

        The lower part keeps the node's identity. Slot arrays are split into new arrays;
        locks, protections, hit count, last access and priority apply to both halves.
        """
        self._check_node(node)
        if not isinstance(at_tokens, (int, np.integer)) or at_tokens % self.page_size:
            raise TreeError(f"split point {at_tokens!r} is not a multiple of page_size {self.page_size}")
        if not 0 < at_tokens < node.num_tokens:
            raise TreeError(f"split point {at_tokens} outside (0, {node.num_tokens})")
        return self._split(node, int(at_tokens))

    def _link_child(self, parent: Node, key: bytes) -> Node:
        """A new, empty node for ``key`` hung under ``parent``."""
        nd = Node(self._next_id, parent, key, parent.extra_key)
        self._next_id += 1
        self._n_nodes += 1
        parent.children[key[: (self.page_size << 2)]] = nd
        return nd

    def _new_child(self, parent: Node, key: bytes, device: np.ndarray) -> Node:
        """A new node with device slots under ``parent`` (which is on device or a root)."""
        nd = self._link_child(parent, key)
        nd.device = device
        parent.n_dev_children += 1
        self.total_device_tokens += len(device)
        # nd: unlocked, childless, on device -> an evictable device leaf, not a host leaf.
        self.device_leaves.add(nd)
        self._push_dev(nd)
        # parent: now has a device child -> not a device leaf; it is on device (or a root),
        # so it is not a host leaf either, before or after.
        self.device_leaves.discard(parent)
        return nd

    def add_host_child(self, parent: Node, tokens, host_slots) -> Node:
        """A new host-only node (host slots, no device slots) for ``tokens`` (whole pages)
        under ``parent`` (a root or a live node, on device or not: host residency need not be
        prefix-closed). No child of ``parent`` may start with the same page. Returns it."""
        if parent.parent is not None or self._roots.get(parent.extra_key) is not parent:
            self._check_node(parent)
        key = encode(tokens)
        pb = self.page_size << 2  # page size in key bytes
        if not key or len(key) % pb:
            raise TreeError(f"host child of {len(key) >> 2} tokens is not a positive number of whole pages")
        if key[:pb] in parent.children:
            raise TreeError(f"node {parent.id} already has a child starting with that page")
        s = _as_slots(host_slots, len(key) >> 2)
        nd = self._link_child(parent, key)
        self._clock += 1
        nd.last_access = self._clock
        nd.host = s
        self.total_host_tokens += len(s)
        parent.n_host_children += 1
        self._refresh(nd)
        self._refresh(parent)
        return nd

    def _set_device(self, node: Node, slots: np.ndarray) -> None:
        node.device = slots
        n = len(slots)
        self.total_device_tokens += n
        if node.lock_ref:
            self.locked_device_tokens += n
        node.parent.n_dev_children += 1
        self._refresh(node)
        self._refresh(node.parent)

    # ------------------------------------------------------------------ match
    def match(self, tokens, extra_key: Hashable = None, *, split: bool = True, touch: bool = True) -> MatchResult:
        """Longest cached prefix of ``tokens`` (truncated to whole pages).

        ``split=True`` splits a node the query diverges in (or ends in) so the path ends
        exactly at the matched length, and ``touch`` (only then) updates last access and
        hit count of the matched nodes. ``split=False`` is a read-only look: no split, no
        touch; the lengths still count every matched page.
        """
        key = encode(tokens)
        pb = self.page_size << 2  # page size in key bytes
        n = len(key)
        n -= n % pb
        root = self._roots.get(extra_key)
        if root is None:  # nothing cached in this namespace: a look creates no state
            return MatchResult([], 0, 0, [], _detached_root(extra_key), _detached_root(extra_key), 0, 0, 0,
                               extra_key)
        nodes: list[Node] = []
        pos = 0
        partial = 0  # tokens matched in a last node that was not split
        children = root.children
        while pos < n:
            child = children.get(key[pos : pos + pb])
            if child is None:
                break
            ck = child.key
            end = pos + len(ck)
            if end <= n and key.startswith(ck, pos):
                nodes.append(child)
                pos = end
                children = child.children
                continue
            m = self._common_bytes(ck, key, pos, n)
            if split:
                child = self._split(child, m >> 2)
            else:
                partial = m >> 2
            nodes.append(child)
            pos += m
            break
        if split and touch and nodes:
            self._clock += 1
            c = self._clock
            for nd in nodes:
                nd.last_access = c
                nd.hit_count += 1
        return tally_match(nodes, root, pos >> 2, partial, extra_key)

    def settle(self, look: MatchResult, *, touch: bool = True) -> MatchResult:
        """Turn a read-only look (``match(split=False)``) into ``match(split=True, touch=touch)``.

        Valid only while the tree has not changed since the look: splits the partly matched
        last node (if any) so the path ends exactly at the matched length, and touches the
        path. Saves the second walk of a look-then-commit caller (admission).
        """
        nodes = look.nodes
        if look.partial:
            lower = nodes[-1]
            upper = self._split(lower, look.partial)
            nodes[-1] = upper
            if look.last_device_node is lower:
                look.last_device_node = upper
            if look.last_node is lower:
                look.last_node = upper
            look.partial = 0
        if touch and nodes:
            self._clock += 1
            c = self._clock
            for nd in nodes:
                nd.last_access = c
                nd.hit_count += 1
        return look

    # ------------------------------------------------------------------ insert
    def insert(self, tokens, extra_key: Hashable, device_slots, *, priority: int = 0,
               start: Node | None = None, extend_leaf: int = 0) -> InsertResult:
        """Insert ``tokens`` (whole pages) with the caller's device slots, one per token
        (int64 or int32; the tree keeps its own int64 copies, and the result's
        ``prefix_slots`` reads the caller's array: read it before changing that).

        Pages already on device yield their caller slots as ``duplicate_slots``; nodes on
        the path without device slots adopt the caller's slots (so device residency stays
        prefix-closed), and the rest becomes a new node. ``priority`` raises (never lowers)
        the priority of every node on the path.

        ``start`` (optional): a live node on device in namespace ``extra_key`` whose path is
        exactly the first tokens of ``tokens`` and whose device slots the caller passes
        back as the first ``device_slots`` (it got them from a match or an insert, and holds
        a lock on it, e.g. a request extending its cached prefix). The walk then starts
        there: its ancestors are only touched (last access, priority), not compared again.
        The result is the same as without ``start``.

        ``extend_leaf`` (with ``start``): the locks on ``start`` that are the caller's (its own,
        plus those of copies in flight that follow the node's growth: `CopyTracker`); 0: never
        grow; when ``start`` may grow in place, see ``_insert_rest``.
        """
        if (type(tokens) is np.ndarray and tokens.dtype is _I4 and type(device_slots) is np.ndarray
                and (device_slots.dtype is _I8 or device_slots.dtype is _I4) and tokens.ndim == 1 == device_slots.ndim
                and len(tokens) == len(device_slots) and len(tokens) % self.page_size == 0):
            arr, key, n, slots = tokens, None, len(tokens) << 2, device_slots  # (encoded from where the walk starts)
        else:
            arr, key, n, slots = self._insert_input(tokens, device_slots)
        root = self._roots.get(extra_key)
        if root is None:
            root = self.root(extra_key)
        self._clock += 1
        clock = self._clock
        node = root
        base = 0  # bytes of the key already known to be on the path (from ``start``)
        if start is not None and start is not root:
            base = self._insert_start(start, root, n, priority, clock)
            node = start
        # the rest of the key, from where the walk starts (positions below are relative to it):
        # a request extending its own prefix encodes only its new tokens
        if arr is not None:
            key = arr[base >> 2 :].tobytes()
        elif base:
            key = key[base:]  # type: ignore[index]
        node, pos, prefix, dup_tree, adopted = self._insert_walk(node, key, n - base, base, slots, clock, priority)  # type: ignore[arg-type]
        if pos < n - base:
            node = self._insert_rest(node, start, extend_leaf, key[pos:], slots[(base + pos) >> 2 :],  # type: ignore[index]
                                     clock, priority, adopted)
        if dup_tree:
            c = slots[base >> 2 : prefix >> 2].astype(_I8, copy=False)
            t = dup_tree[0] if len(dup_tree) == 1 else np.concatenate(dup_tree)
            # usually the caller passes the tree's own slots back (they came from a match)
            dup = _EMPTY_I8 if c.tobytes() == t.tobytes() else c[c != t]
        else:
            t = dup = _EMPTY_I8
        parts = (slots[: base >> 2], t) if base else (t,)
        return InsertResult(dup, adopted, node, prefix >> 2, parts)

    def _insert_walk(self, node: Node, key: bytes, rn: int, base: int, slots: np.ndarray, clock: int,
                     priority: int) -> tuple[Node, int, int, list[np.ndarray], list[tuple[Node, np.ndarray]]]:
        """Walk `key` (`rn` bytes, `base` bytes into the whole key) down from `node`, splitting where
        it diverges inside a node: (the node it ends at, bytes walked, bytes of the whole key already
        on device, their device slots per node, the nodes that adopted the caller's slots)."""
        pb = self.page_size << 2  # page size in key bytes
        pos = 0
        dup_tree: list[np.ndarray] = []
        adopted: list[tuple[Node, np.ndarray]] = []
        prefix = base
        while pos < rn:
            child = node.children.get(key[pos : pos + pb])
            if child is None:
                break
            ck = child.key
            end = pos + len(ck)
            if end > rn or not key.startswith(ck, pos):
                end = pos + self._common_bytes(ck, key, pos, rn)
                child = self._split(child, (end - pos) >> 2)
            d = child.device
            if d is not None:
                dup_tree.append(d)
                prefix = base + end
            else:
                s = slots[(base + pos) >> 2 : (base + end) >> 2].astype(_I8)
                self._set_device(child, s)
                adopted.append((child, s))
            child.last_access = clock
            if priority > child.priority:
                child.priority = priority
            node = child
            pos = end
        return node, pos, prefix, dup_tree, adopted

    def _insert_input(self, tokens: Any, device_slots: Any) -> tuple[np.ndarray | None, bytes | None, int, np.ndarray]:
        """An insert's tokens and slots, checked: (the int32 token array, to be encoded from where
        the walk starts, or None; else the encoded key; the key's bytes; the slots)."""
        if type(tokens) is np.ndarray and tokens.dtype is _I4 and tokens.ndim == 1:
            arr, key, n = tokens, None, len(tokens) << 2  # encoded by the caller, from where the walk starts
        else:
            arr, key = None, encode(tokens)
            n = len(key)
        if n % (self.page_size << 2):
            raise TreeError(f"insert of {n >> 2} tokens is not a whole number of pages (page_size {self.page_size})")
        slots = device_slots
        # int32 slots (a view of a request's row in the request table) are taken as they are:
        # every slice the tree keeps is converted to its own int64 array
        if type(slots) is not np.ndarray or (slots.dtype is not _I8 and slots.dtype is not _I4) or slots.ndim != 1:
            slots = np.asarray(slots)
            if slots.ndim != 1 or (slots.size and slots.dtype.kind not in "iu"):
                raise TreeError(f"device_slots must be a 1-D integer array, got {slots.dtype} {slots.shape}")
            slots = slots.astype(np.int64)
        if len(slots) != n >> 2:
            raise TreeError(f"{len(slots)} slots for {n >> 2} tokens")
        return arr, key, n, slots

    def _insert_start(self, start: Node, root: Node, n: int, priority: int, clock: int) -> int:
        """Bytes of the key up to `start` (a live node on device below `root`, within the `n`-byte
        key); its path is touched (last access, priority)."""
        if start.device is None:
            raise TreeError(f"insert start node {start.id} is not on device")
        base = 0
        cur = start
        while cur.parent is not None:
            base += len(cur.key)
            cur = cur.parent
        if cur is not root or base > n:
            raise TreeError(f"insert start node {start.id} is not a live prefix of the key in this namespace")
        cur = start
        while cur.parent is not None:
            cur.last_access = clock
            if priority > cur.priority:
                cur.priority = priority
            cur = cur.parent
        return base

    def _insert_rest(self, node: Node, start: Node | None, extend_leaf: int, key: bytes, slots: np.ndarray,
                     clock: int, priority: int, adopted: list[tuple[Node, np.ndarray]]) -> Node:
        """The insert's new pages (`key`, `slots`) below `node`: a new child, or, with `extend_leaf`
        (the locks on `start` that are the caller's), when the new pages would hang below `start`
        and `start` is a childless node on device, without a host copy and with exactly those
        locks, appended to `start` itself (reported in `adopted` as `(start, new slots)`): a
        request growing its own prefix turn after turn then stays one node, and a match walks one
        node per shared prefix instead of one per turn. Returns the node the insert ends at."""
        if (extend_leaf and node is start and node.lock_ref == extend_leaf and not node.children
                and node.host is None and node.parent is not None):
            node.key += key
            node.device = np.concatenate((node.device, slots))
            s = node.device[len(node.device) - len(slots) :]  # the node's own slots, not the caller's
            k = len(s)
            self.total_device_tokens += k
            self.locked_device_tokens += k
            adopted.append((node, s))
            return node
        s = slots.astype(_I8)
        node = self._new_child(node, key, s)
        node.last_access = clock
        node.priority = priority
        adopted.append((node, s))
        return node

    # ------------------------------------------------------------------ locks
    def lock(self, node: Node) -> None:
        """Count one user on ``node`` and every ancestor (a root: no-op)."""
        if node.parent is None:
            if self._roots.get(node.extra_key) is node:
                return
            raise TreeError(f"lock of node {node.id}, which is not in the tree")
        dl = self.device_leaves
        while node.parent is not None:
            if node.lock_ref == 0:
                node.lock_ref = 1
                if node.device is not None:
                    dl.discard(node)
                    self.locked_device_tokens += len(node.device)
                else:
                    self.host_leaves.discard(node)
            else:
                node.lock_ref += 1
            node = node.parent

    def relock(self, old: Node | None, new: Node) -> None:
        """``lock(new)`` then ``unlock(old)`` (``old`` may be None), in one pass when ``old``
        is an ancestor of ``new`` (a request whose cached prefix grew): only the nodes below
        ``old`` change, the shared ancestors keep their counts."""
        if old is None:
            self.lock(new)
            return
        if old is new:
            return
        path = []
        cur = new
        while cur is not old and cur.parent is not None:
            path.append(cur)
            cur = cur.parent
        if cur is not old or old.lock_ref <= 0 and old.parent is not None:
            self.lock(new)
            self.unlock(old)
            return
        dl = self.device_leaves
        for nd in path:
            if nd.lock_ref == 0:
                nd.lock_ref = 1
                if nd.device is not None:
                    dl.discard(nd)
                    self.locked_device_tokens += len(nd.device)
                else:
                    self.host_leaves.discard(nd)
            else:
                nd.lock_ref += 1

    def unlock(self, node: Node) -> None:
        """Undo one :meth:`lock` of ``node``. Raises (changing nothing) below zero."""
        if node.parent is None:
            if self._roots.get(node.extra_key) is node:
                return
            raise TreeError(f"unlock of node {node.id}, which is not in the tree")
        # one pass; a count that would go below zero (a bug of the caller) undoes the pass
        first = node
        while node.parent is not None:
            r = node.lock_ref - 1
            if r < 0:
                cur = first
                while cur is not node:
                    cur.lock_ref += 1
                    if cur.lock_ref == 1:
                        self.device_leaves.discard(cur)
                        self.host_leaves.discard(cur)
                        if cur.device is not None:
                            self.locked_device_tokens += len(cur.device)
                    cur = cur.parent
                raise TreeError(f"unlock of node {first.id}: lock count of node {node.id} would go below zero")
            node.lock_ref = r
            if r == 0:
                if node.device is not None:
                    self.locked_device_tokens -= len(node.device)
                    # now an evictable device leaf if no child is on device (`_is_device_leaf`;
                    # on device, it cannot be a host leaf)
                    if node.n_dev_children == 0 and node not in self.device_leaves:
                        self.device_leaves.add(node)
                        if not node._dq:
                            self._push_dev(node)
                elif node.host is not None:  # off device (a failed load): maybe a host leaf now
                    self._refresh(node)
            node = node.parent

    # ------------------------------------------------------------------ host protection
    def protect_host(self, node: Node, num_tokens: int | None = None) -> None:
        """Pin the host copy of ``node`` against host eviction (per node, not the path).

        With ``num_tokens`` (the node's length when the pin was taken) the pin applies to
        the whole split chain covering that length, see :meth:`split_chain`.
        """
        self._check_node(node)
        chain = [node] if num_tokens is None else self.split_chain(node, num_tokens)
        for nd in chain:
            nd.host_protect += 1
            if nd.host_protect == 1:
                self.host_leaves.discard(nd)

    def unprotect_host(self, node: Node, num_tokens: int | None = None) -> None:
        """Undo :meth:`protect_host`. A split since the pin was taken copied it to both
        halves: pass the recorded length to release the whole chain. Raises, changing
        nothing, if any count would go below zero."""
        self._check_node(node)
        chain = [node] if num_tokens is None else self.split_chain(node, num_tokens)
        for nd in chain:
            if nd.host_protect <= 0:
                raise TreeError(f"unprotect_host of node {nd.id}: not protected")
        for nd in chain:
            nd.host_protect -= 1
            if nd.host_protect == 0:
                self._refresh(nd)

    # ------------------------------------------------------------------ mutators
    def detach_device(self, node: Node, *, force: bool = False) -> np.ndarray:
        """Drop the device copy of an evictable device leaf; returns its device slots.

        ``force`` also drops it from a locked node (rolling back a failed load: the copy never
        became valid); the node must still have no child on device."""
        self._check_node(node)
        if force and node.device is not None and node.n_dev_children == 0:
            if node.lock_ref > 0:
                self.locked_device_tokens -= len(node.device)
        elif not self._is_device_leaf(node):
            raise TreeError(
                f"detach_device of node {node.id}: not an evictable device leaf "
                f"(device={node.device is not None}, lock_ref={node.lock_ref}, "
                f"device children={node.n_dev_children})"
            )
        d = node.device
        node.device = None
        self.total_device_tokens -= len(d)
        parent = node.parent
        parent.n_dev_children -= 1
        self._refresh(node)
        self._refresh(parent)
        return d

    def detach_host(self, node: Node) -> np.ndarray:
        """Drop the host copy of ``node``; returns its host slots.

        Allowed when it is not host-protected and either the node is on device (a backup
        copy goes) or no child has host slots (an off-device node with host children would
        cut them off from the host part of a match).
        """
        self._check_node(node)
        h = node.host
        if h is None:
            raise TreeError(f"detach_host of node {node.id}: no host copy")
        if node.host_protect:
            raise TreeError(f"detach_host of node {node.id}: host copy is protected")
        if node.device is None and node.n_host_children:
            raise TreeError(f"detach_host of node {node.id}: off device with children on host")
        node.host = None
        self.total_host_tokens -= len(h)
        parent = node.parent
        parent.n_host_children -= 1
        self._refresh(node)
        self._refresh(parent)
        return h

    def attach_device(self, node: Node, slots) -> np.ndarray:
        """Give ``node`` a device copy (a load back); its parent must be on device.

        Returns the node's new array (a private copy of ``slots``)."""
        self._check_node(node)
        if node.device is not None:
            raise TreeError(f"attach_device of node {node.id}: already on device")
        parent = node.parent
        if parent.parent is not None and parent.device is None:
            raise TreeError(f"attach_device of node {node.id}: parent {parent.id} is not on device")
        s = _as_slots(slots, len(node.key) >> 2)
        self._set_device(node, s)
        return s

    def attach_host(self, node: Node, slots) -> np.ndarray:
        """Give ``node`` a host copy (a backup or a prefetch); returns the node's new array."""
        self._check_node(node)
        if node.host is not None:
            raise TreeError(f"attach_host of node {node.id}: already on host")
        s = _as_slots(slots, len(node.key) >> 2)
        node.host = s
        self.total_host_tokens += len(s)
        parent = node.parent
        parent.n_host_children += 1
        self._refresh(node)
        self._refresh(parent)
        return s

    def delete_leaf(self, node: Node) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Remove a childless, unlocked, unprotected node; returns its (device, host) slots."""
        self._check_node(node)
        if node.children:
            raise TreeError(f"delete_leaf of node {node.id}: has children")
        if node.lock_ref:
            raise TreeError(f"delete_leaf of node {node.id}: locked")
        if node.host_protect:
            raise TreeError(f"delete_leaf of node {node.id}: host copy is protected")
        parent = node.parent
        del parent.children[node.key[: (self.page_size << 2)]]
        d = node.device
        h = node.host
        if d is not None:
            parent.n_dev_children -= 1
            self.total_device_tokens -= len(d)
        if h is not None:
            parent.n_host_children -= 1
            self.total_host_tokens -= len(h)
        self.device_leaves.discard(node)
        self.host_leaves.discard(node)
        node.parent = None
        node.device = None
        node.host = None
        self._n_nodes -= 1
        if parent.parent is None:
            if not parent.children:  # a namespace with nothing cached keeps no root
                del self._roots[parent.extra_key]
        else:
            self._refresh(parent)
        return d, h

    # ------------------------------------------------------------------ eviction order
    def device_victims(self) -> Iterator[Node]:
        """Evictable device leaves in policy order.

        The caller detaches / deletes as it goes; parents that become evictable are
        candidates in the same pass. Each node is yielded at most once per pass; one that
        the caller leaves in place goes back to the heap when the pass ends.
        """
        return self._victims(self._dheap, self.device_leaves, "_dq", self.policy)

    def host_victims(self) -> Iterator[Node]:
        """Evictable host leaves in policy order (same protocol as :meth:`device_victims`)."""
        return self._victims(self._hheap, self.host_leaves, "_hq", self.host_policy)

    @staticmethod
    def _victims(heap: list, members: set, flag: str, policy) -> Iterator[Node]:
        keyf = policy.key
        pop = heapq.heappop
        push = heapq.heappush
        yielded: list[Node] = []
        try:
            while heap:
                k, i, nd = pop(heap)
                if nd not in members:
                    setattr(nd, flag, False)
                    continue
                cur = keyf(nd)
                if cur != k:
                    push(heap, (cur, i, nd))
                    continue
                setattr(nd, flag, False)
                # remembered before the yield: a pass closed at this yield must still put
                # a node the caller left in place back into the heap
                yielded.append(nd)
                yield nd
        finally:
            for nd in yielded:
                if nd in members and not getattr(nd, flag):
                    setattr(nd, flag, True)
                    push(heap, (keyf(nd), nd.id, nd))


__all__ = ["RadixTree", "Node", "MatchResult", "InsertResult", "TreeError", "encode", "decode"]

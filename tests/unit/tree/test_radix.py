"""Unit tests of the paged radix tree (runtime/tree/radix.py) with exact expected structures."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.errors import InternalError, ValidationError
from runtime.tree.policies import LFUPolicy, LRUPolicy, PriorityPolicy, policy_by_name
from runtime.tree.radix import RadixTree, TreeError, decode, encode

PAGE_SIZES = [1, 4, 16, 64]


def pages(ps: int, *labels: int) -> np.ndarray:
    """Tokens of whole pages; page `l` holds l*1000, l*1000+1, ... (distinct per label)."""
    if not labels:
        return np.empty(0, dtype=np.int64)
    return np.concatenate([np.arange(ps, dtype=np.int64) + 1000 * lab for lab in labels])


class Slots:
    """Fresh, never repeated slot ids."""

    def __init__(self, start: int = 0) -> None:
        self.next = start

    def __call__(self, n: int) -> np.ndarray:
        out = np.arange(self.next, self.next + n, dtype=np.int64)
        self.next += n
        return out


def path_keys(tree: RadixTree, node) -> list[int]:
    out = []
    while node.parent is not None:
        out.append(node.num_tokens)
        node = node.parent
    return out[::-1]


@pytest.fixture(params=PAGE_SIZES)
def ps(request) -> int:
    return request.param


# ---------------------------------------------------------------------- encode
def test_encode_roundtrip_and_forms():
    t = np.array([1, 2, 3, 70000], dtype=np.int64)
    b = encode(t)
    assert b == np.array([1, 2, 3, 70000], dtype="<i4").tobytes()
    assert encode([1, 2, 3, 70000]) == b
    assert encode(b) is b
    assert list(decode(b)) == [1, 2, 3, 70000]
    assert encode([]) == b""
    with pytest.raises(ValueError):
        encode(np.array([1.5]))
    with pytest.raises(ValueError):
        encode(b"abc")  # not whole int32s


# ---------------------------------------------------------------------- insert / match
def test_insert_into_empty_tree(ps):
    tree = RadixTree(ps)
    toks = pages(ps, 1, 2, 3)
    slots = np.arange(100, 100 + 3 * ps, dtype=np.int64)
    r = tree.insert(toks, None, slots)
    assert r.duplicate_slots.dtype == np.int64 and len(r.duplicate_slots) == 0
    assert r.prefix_len == 0
    assert len(r.adopted) == 1
    node, s = r.adopted[0]
    assert node is r.last_node and node.device is s
    assert np.array_equal(node.device, slots)
    assert not np.shares_memory(node.device, slots)  # a private copy
    assert node.host is None and node.num_tokens == 3 * ps
    assert node.parent is tree.root(None)
    assert tree.device_leaves == {node} and tree.host_leaves == set()
    assert tree.total_device_tokens == 3 * ps and tree.num_nodes == 1
    assert list(node.tokens) == list(toks)


def test_match_exact_prefix_longer_and_miss(ps):
    tree = RadixTree(ps)
    slots = np.arange(3 * ps, dtype=np.int64) + 7
    node = tree.insert(pages(ps, 1, 2, 3), None, slots).last_node
    # exact
    m = tree.match(pages(ps, 1, 2, 3))
    assert m.nodes == [node] and m.device_len == 3 * ps and m.host_len == 0 and m.matched_len == 3 * ps
    assert np.array_equal(m.device_slots, slots)
    assert not np.shares_memory(m.device_slots, node.device)
    assert m.last_device_node is node and m.last_node is node
    # longer query: matches the whole node, nothing more
    m = tree.match(pages(ps, 1, 2, 3, 4))
    assert m.nodes == [node] and m.device_len == 3 * ps
    # miss
    m = tree.match(pages(ps, 9))
    root = tree.root(None)
    assert m.nodes == [] and m.device_len == 0 and len(m.device_slots) == 0
    assert m.last_device_node is root and m.last_node is root
    assert tree.num_nodes == 1


def test_match_inside_node_splits_at_page_boundary(ps):
    tree = RadixTree(ps)
    slots = np.arange(3 * ps, dtype=np.int64) + 50
    lower = tree.insert(pages(ps, 1, 2, 3), None, slots).last_node
    old_dev = lower.device
    m = tree.match(pages(ps, 1, 2, 9))  # diverges on the third page
    assert tree.num_nodes == 2
    upper = m.last_device_node
    assert m.nodes == [upper] and upper is not lower
    assert lower.parent is upper and upper.parent is tree.root(None)
    assert upper.num_tokens == 2 * ps and lower.num_tokens == ps
    assert list(upper.tokens) == list(pages(ps, 1, 2)) and list(lower.tokens) == list(pages(ps, 3))
    assert np.array_equal(upper.device, slots[: 2 * ps]) and np.array_equal(lower.device, slots[2 * ps :])
    assert m.device_len == 2 * ps and np.array_equal(m.device_slots, slots[: 2 * ps])
    for a in (upper.device, lower.device):
        assert not np.shares_memory(a, old_dev)
    assert not np.shares_memory(upper.device, lower.device)
    assert upper.id > lower.id
    assert tree.device_leaves == {lower}
    # query ending inside a node splits too
    m = tree.match(pages(ps, 1))
    assert tree.num_nodes == 3 and m.nodes[-1].num_tokens == ps and m.device_len == ps
    assert path_keys(tree, lower) == [ps, ps, ps]


def test_match_truncates_to_whole_pages():
    tree = RadixTree(4)
    tree.insert(pages(4, 1, 2), None, np.arange(8))
    q = np.concatenate([pages(4, 1, 2), [2000, 2001, 2002]])  # 3-token partial page
    m = tree.match(q)
    assert m.device_len == 8 and m.matched_len == 8
    # a partial page never matches even if its tokens agree
    m = tree.match(pages(4, 1)[:3])
    assert m.device_len == 0 and m.nodes == []


def test_match_readonly_look_does_not_split_or_touch(ps):
    tree = RadixTree(ps)
    node = tree.insert(pages(ps, 1, 2, 3), None, np.arange(3 * ps)).last_node
    before = (node.last_access, node.hit_count)
    m = tree.match(pages(ps, 1, 2, 7), split=False)
    assert tree.num_nodes == 1 and node.num_tokens == 3 * ps
    assert m.nodes == [node] and m.device_len == 2 * ps and m.matched_len == 2 * ps
    assert np.array_equal(m.device_slots, np.arange(2 * ps))
    assert (node.last_access, node.hit_count) == before
    # host part partially matched
    tree.attach_host(node, np.arange(3 * ps) + 500)
    tree.detach_device(node)
    m = tree.match(pages(ps, 1, 9), split=False)
    assert m.device_len == 0 and m.host_len == ps and m.last_node is node


def test_touch_updates_access_and_hits(ps):
    tree = RadixTree(ps)
    a = tree.insert(pages(ps, 1), None, np.arange(ps)).last_node
    b = tree.insert(pages(ps, 1, 2), None, np.arange(2 * ps)).last_node
    t0 = a.last_access
    tree.match(pages(ps, 1, 2))
    assert a.hit_count == 1 and b.hit_count == 1 and a.last_access == b.last_access > t0
    tree.match(pages(ps, 1, 2), touch=False)
    assert a.hit_count == 1
    tree.match(pages(ps, 1))
    assert a.hit_count == 2 and b.hit_count == 1 and a.last_access > b.last_access


def test_insert_duplicates_and_split(ps):
    tree = RadixTree(ps)
    new = Slots(1000)
    s1 = new(3 * ps)
    ab = tree.insert(pages(ps, 1, 2, 3), None, s1).last_node
    s2 = new(3 * ps)
    r = tree.insert(pages(ps, 1, 2, 4), None, s2)
    assert np.array_equal(r.duplicate_slots, s2[: 2 * ps])  # the caller's, not the tree's
    assert r.prefix_len == 2 * ps
    assert len(r.adopted) == 1
    c, cs = r.adopted[0]
    assert c is r.last_node and np.array_equal(cs, s2[2 * ps :])
    upper = ab.parent
    assert upper.num_tokens == 2 * ps and set(upper.children.values()) == {ab, c}
    assert np.array_equal(upper.device, s1[: 2 * ps])
    assert tree.device_leaves == {ab, c}
    assert tree.total_device_tokens == 4 * ps
    # the same again, with fresh slots: all duplicates, nothing adopted
    s3 = new(3 * ps)
    r = tree.insert(pages(ps, 1, 2, 4), None, s3)
    assert np.array_equal(r.duplicate_slots, s3) and r.adopted == [] and r.last_node is c
    # passing the tree's own slots back (from a match) is not a duplicate
    m = tree.match(pages(ps, 1, 2, 4))
    row = np.concatenate([m.device_slots, new(ps)])
    r = tree.insert(pages(ps, 1, 2, 4, 5), None, row)
    assert len(r.duplicate_slots) == 0 and r.prefix_len == 3 * ps
    assert [n.num_tokens for n, _ in r.adopted] == [ps]


def test_insert_validation(ps):
    tree = RadixTree(ps)
    if ps > 1:
        with pytest.raises(ValueError):
            tree.insert(np.arange(ps + 1), None, np.arange(ps + 1))
    with pytest.raises(ValueError):
        tree.insert(pages(ps, 1), None, np.arange(ps - 1) if ps > 1 else np.arange(2))
    with pytest.raises(ValueError):
        tree.insert(pages(ps, 1), None, np.zeros(ps, dtype=np.float32))
    assert tree.num_nodes == 0 and tree.total_device_tokens == 0
    r = tree.insert(np.empty(0, dtype=np.int64), None, np.empty(0, dtype=np.int64))
    assert r.last_node is tree.root(None) and r.adopted == [] and len(r.duplicate_slots) == 0


def test_insert_adopts_host_only_nodes(ps):
    tree = RadixTree(ps)
    new = Slots()
    a = tree.insert(pages(ps, 1), None, new(ps)).last_node
    b = tree.insert(pages(ps, 1, 2), None, new(2 * ps)).last_node
    tree.attach_host(a, np.arange(ps) + 10_000)
    tree.attach_host(b, np.arange(ps) + 20_000)
    tree.detach_device(b)
    tree.detach_device(a)
    assert tree.host_leaves == {b} and tree.device_leaves == set()
    m = tree.match(pages(ps, 1, 2, 3))
    assert m.device_len == 0 and m.host_len == 2 * ps and m.last_node is b and m.host_nodes == [a, b]
    s = new(3 * ps)
    r = tree.insert(pages(ps, 1, 2, 3), None, s)
    assert len(r.duplicate_slots) == 0 and r.prefix_len == 0
    assert [n for n, _ in r.adopted][:2] == [a, b]
    c = r.last_node
    assert r.adopted[2][0] is c and c.parent is b
    assert np.array_equal(a.device, s[:ps]) and np.array_equal(b.device, s[ps : 2 * ps])
    assert np.array_equal(c.device, s[2 * ps :])
    assert tree.device_leaves == {c} and tree.host_leaves == set()
    assert tree.total_device_tokens == 3 * ps and tree.total_host_tokens == 2 * ps


def test_namespaces_never_share(ps):
    tree = RadixTree(ps)
    toks = pages(ps, 1, 2)
    n0 = tree.insert(toks, None, np.arange(2 * ps)).last_node
    assert tree.match(toks, "tenant-a").device_len == 0
    r = tree.insert(toks, "tenant-a", np.arange(2 * ps) + 100)
    assert len(r.duplicate_slots) == 0 and len(r.adopted) == 1
    n1 = r.last_node
    assert n1 is not n0 and n1.extra_key == "tenant-a" and n1.parent is tree.root("tenant-a")
    assert np.array_equal(tree.match(toks, "tenant-a").device_slots, np.arange(2 * ps) + 100)
    assert np.array_equal(tree.match(toks).device_slots, np.arange(2 * ps))
    assert tree.root(None) is not tree.root("tenant-a")
    assert tree.device_leaves == {n0, n1}


# ---------------------------------------------------------------------- split
def test_split_copies_arrays_and_state(ps):
    tree = RadixTree(ps)
    seen = []
    tree.on_split = lambda lower, upper: seen.append((lower, upper))
    node = tree.insert(pages(ps, 1, 2, 3, 4), None, np.arange(4 * ps)).last_node
    tree.attach_host(node, np.arange(4 * ps) + 900)
    tree.lock(node)
    tree.protect_host(node)
    tree.match(pages(ps, 1, 2, 3, 4))
    node.priority = 5
    old_d, old_h = node.device, node.host
    upper = tree.split(node, 3 * ps)
    assert seen == [(node, upper)]
    assert upper.parent is tree.root(None) and node.parent is upper
    assert upper.num_tokens == 3 * ps and node.num_tokens == ps
    for arr in (upper.device, upper.host, node.device, node.host):
        assert not np.shares_memory(arr, old_d) and not np.shares_memory(arr, old_h)
        assert arr.flags.owndata
    assert not np.shares_memory(upper.device, node.device)
    assert np.array_equal(upper.device, np.arange(3 * ps)) and np.array_equal(node.device, np.arange(3 * ps, 4 * ps))
    assert np.array_equal(upper.host, np.arange(3 * ps) + 900)
    for f in ("lock_ref", "host_protect", "hit_count", "last_access", "priority"):
        assert getattr(upper, f) == getattr(node, f), f
    assert upper.lock_ref == 1 and upper.host_protect == 1 and upper.hit_count == 1
    assert tree.locked_device_tokens == 4 * ps
    # one unlock of the lower node releases both halves
    tree.unlock(node)
    assert upper.lock_ref == 0 and node.lock_ref == 0 and tree.locked_device_tokens == 0
    assert tree.device_leaves == {node}
    # the protection is released over the split chain (recorded length: 4 pages)
    tree.unprotect_host(node, 4 * ps)
    assert upper.host_protect == 0 and node.host_protect == 0
    with pytest.raises(ValueError):
        tree.split(node, ps)  # == num_tokens
    with pytest.raises(ValueError):
        tree.split(upper, 0)
    if ps > 1:
        with pytest.raises(ValueError):
            tree.split(upper, 1)
    with pytest.raises(ValueError):
        tree.split(tree.root(None), ps)


def test_split_chain(ps):
    tree = RadixTree(ps)
    node = tree.insert(pages(ps, 1, 2, 3, 4), None, np.arange(4 * ps)).last_node
    tree.match(pages(ps, 1, 2, 3, 9))
    tree.match(pages(ps, 1, 9))
    chain = tree.split_chain(node, 4 * ps)
    assert [n.num_tokens for n in chain] == [ps, 2 * ps, ps] and chain[-1] is node
    assert np.array_equal(np.concatenate([n.device for n in chain]), np.arange(4 * ps))
    assert list(tree.path_tokens(node)) == list(pages(ps, 1, 2, 3, 4))
    with pytest.raises(ValueError):
        tree.split_chain(node, 2 * ps)


# ---------------------------------------------------------------------- locks
def test_lock_unlock(ps):
    tree = RadixTree(ps)
    a = tree.insert(pages(ps, 1), None, np.arange(ps)).last_node
    b = tree.insert(pages(ps, 1, 2), None, np.arange(2 * ps)).last_node
    c = tree.insert(pages(ps, 1, 3), None, np.arange(2 * ps) + 100).last_node
    assert tree.device_leaves == {b, c}
    tree.lock(b)
    assert (a.lock_ref, b.lock_ref, c.lock_ref) == (1, 1, 0)
    assert tree.device_leaves == {c} and tree.locked_device_tokens == 2 * ps
    tree.lock(b)
    tree.lock(c)
    assert (a.lock_ref, b.lock_ref, c.lock_ref) == (3, 2, 1) and tree.device_leaves == set()
    with pytest.raises(ValueError):
        tree.detach_device(c)
    tree.unlock(c)
    tree.unlock(b)
    assert (a.lock_ref, b.lock_ref, c.lock_ref) == (1, 1, 0) and tree.device_leaves == {c}
    tree.unlock(b)
    assert tree.device_leaves == {b, c} and tree.locked_device_tokens == 0
    with pytest.raises(ValueError):
        tree.unlock(b)
    assert (a.lock_ref, b.lock_ref, c.lock_ref) == (0, 0, 0)
    tree.lock(tree.root(None))  # no-op
    tree.unlock(tree.root(None))
    with pytest.raises(TreeError):
        tree.unlock(c)


# ---------------------------------------------------------------------- eviction order
def _three_leaves(tree, ps):
    a = tree.insert(pages(ps, 1), None, np.arange(ps)).last_node
    b = tree.insert(pages(ps, 2), None, np.arange(ps) + 100).last_node
    c = tree.insert(pages(ps, 3), None, np.arange(ps) + 200).last_node
    return a, b, c


def test_lru_order(ps):
    tree = RadixTree(ps)
    a, b, c = _three_leaves(tree, ps)
    tree.match(pages(ps, 1))
    tree.match(pages(ps, 3))
    assert list(tree.device_victims()) == [b, a, c]
    # nothing was evicted: the next pass sees them again, same order
    assert list(tree.device_victims()) == [b, a, c]


def test_lfu_order(ps):
    tree = RadixTree(ps, policy="lfu")
    a, b, c = _three_leaves(tree, ps)
    for _ in range(3):
        tree.match(pages(ps, 1))
    tree.match(pages(ps, 3))
    tree.match(pages(ps, 2))
    # hits: a=3, b=1, c=1 ; b touched last
    assert list(tree.device_victims()) == [c, b, a]


def test_priority_order(ps):
    tree = RadixTree(ps, policy=PriorityPolicy())
    a = tree.insert(pages(ps, 1), None, np.arange(ps), priority=5).last_node
    b = tree.insert(pages(ps, 2), None, np.arange(ps) + 100, priority=1).last_node
    c = tree.insert(pages(ps, 3), None, np.arange(ps) + 200, priority=1).last_node
    tree.match(pages(ps, 2))
    assert list(tree.device_victims()) == [c, b, a]
    # priority is only ever raised
    tree.insert(pages(ps, 3), None, np.arange(ps) + 300, priority=9)
    tree.insert(pages(ps, 3), None, np.arange(ps) + 300, priority=0)
    assert c.priority == 9
    assert list(tree.device_victims()) == [b, a, c]


def test_policies_by_name():
    assert isinstance(policy_by_name("LRU"), LRUPolicy)
    assert isinstance(policy_by_name("lfu"), LFUPolicy)
    assert isinstance(policy_by_name("priority"), PriorityPolicy)
    with pytest.raises(ValueError):
        policy_by_name("fifo")
    with pytest.raises(ValueError):
        RadixTree(1, policy="fifo")


def test_evict_exposes_parent_in_same_pass(ps):
    tree = RadixTree(ps)
    a = tree.insert(pages(ps, 1), None, np.arange(ps)).last_node
    b = tree.insert(pages(ps, 1, 2), None, np.arange(2 * ps)).last_node
    c = tree.insert(pages(ps, 5), None, np.arange(ps) + 10_000).last_node
    tree.match(pages(ps, 5))  # c most recent
    order = []
    freed = []
    for nd in tree.device_victims():
        order.append(nd)
        freed.append(tree.detach_device(nd))
        tree.delete_leaf(nd)
    assert order == [b, a, c]
    assert sorted(np.concatenate(freed).tolist()) == list(range(2 * ps)) + list(range(10_000, 10_000 + ps))
    assert tree.num_nodes == 0 and tree.total_device_tokens == 0 and tree.device_leaves == set()


def test_victims_skip_locked_and_restore_skipped(ps):
    tree = RadixTree(ps)
    a, b, c = _three_leaves(tree, ps)
    tree.lock(a)
    it = tree.device_victims()
    assert next(it) is b  # caller looks but does not evict
    assert next(it) is c
    it.close()
    tree.unlock(a)
    assert list(tree.device_victims()) == [a, b, c]


def test_host_eviction(ps):
    tree = RadixTree(ps)
    a = tree.insert(pages(ps, 1), None, np.arange(ps)).last_node
    b = tree.insert(pages(ps, 1, 2), None, np.arange(2 * ps)).last_node
    c = tree.insert(pages(ps, 1, 3), None, np.arange(2 * ps) + 100).last_node
    for n, base in ((a, 1000), (b, 2000), (c, 3000)):
        tree.attach_host(n, np.arange(ps) + base)
    assert tree.host_leaves == set() and tree.total_host_tokens == 3 * ps
    # write-back style device eviction keeps host copies
    evicted = []
    for nd in tree.device_victims():
        evicted.append(nd)
        tree.detach_device(nd)
    assert evicted == [b, c, a]
    assert tree.host_leaves == {b, c} and tree.total_device_tokens == 0
    tree.match(pages(ps, 1, 2))  # b more recent than c
    tree.protect_host(c)
    assert tree.host_leaves == {b}
    order = []
    for nd in tree.host_victims():
        order.append(nd)
        h = tree.detach_host(nd)
        assert len(h) == ps
        tree.delete_leaf(nd)
    assert order == [b]  # a still has c (host, protected) below it
    assert tree.host_leaves == set()
    tree.unprotect_host(c)
    assert list(tree.host_victims()) == [c]
    assert tree.detach_host(c) is not None
    assert tree.host_leaves == {a}  # c (no copies left, kept e.g. as storage-only) has no host
    tree.delete_leaf(c)
    assert list(tree.host_victims()) == [a]


# ---------------------------------------------------------------------- mutators
def test_attach_detach_rules(ps):
    tree = RadixTree(ps)
    a = tree.insert(pages(ps, 1), None, np.arange(ps)).last_node
    b = tree.insert(pages(ps, 1, 2), None, np.arange(2 * ps)).last_node
    with pytest.raises(ValueError):
        tree.detach_device(a)  # has a device child
    with pytest.raises(ValueError):
        tree.detach_host(a)  # no host copy
    with pytest.raises(ValueError):
        tree.attach_device(a, np.arange(ps))  # already on device
    with pytest.raises(ValueError):
        tree.attach_host(a, np.arange(ps + 1))  # wrong length
    with pytest.raises(ValueError):
        tree.delete_leaf(a)  # has children
    d = tree.detach_device(b)
    assert np.array_equal(d, np.arange(ps, 2 * ps)) and b.device is None
    assert tree.device_leaves == {a} and tree.host_leaves == set()
    tree.detach_device(a)
    with pytest.raises(ValueError):
        tree.attach_device(b, np.arange(ps))  # parent off device
    src = np.arange(ps) + 40
    got = tree.attach_device(a, src)
    assert a.device is got and not np.shares_memory(got, src)
    tree.attach_device(b, np.arange(ps) + 80)
    assert tree.device_leaves == {b}
    tree.attach_host(b, np.arange(ps) + 500)
    tree.protect_host(b)
    with pytest.raises(ValueError):
        tree.detach_host(b)
    with pytest.raises(ValueError):
        tree.delete_leaf(b)
    tree.unprotect_host(b)
    with pytest.raises(ValueError):
        tree.unprotect_host(b)
    tree.lock(b)
    with pytest.raises(ValueError):
        tree.delete_leaf(b)
    tree.unlock(b)
    dev, host = tree.delete_leaf(b)
    assert np.array_equal(dev, np.arange(ps) + 80) and np.array_equal(host, np.arange(ps) + 500)
    assert tree.total_device_tokens == ps and tree.total_host_tokens == 0
    assert not tree.is_live(b) and tree.is_live(a)
    with pytest.raises(ValueError):
        tree.lock(b)  # a deleted node
    with pytest.raises(ValueError):
        tree.detach_device(b)
    assert tree.device_leaves == {a}


def test_detach_host_keeps_host_children_reachable(ps):
    tree = RadixTree(ps)
    a = tree.insert(pages(ps, 1), None, np.arange(ps)).last_node
    b = tree.insert(pages(ps, 1, 2), None, np.arange(2 * ps)).last_node
    tree.attach_host(a, np.arange(ps) + 100)
    tree.attach_host(b, np.arange(ps) + 200)
    tree.detach_device(b)
    # a on device: dropping its backup copy is fine, b stays reachable after a's device part
    tree.detach_host(a)
    tree.attach_host(a, np.arange(ps) + 300)
    tree.detach_device(a)
    with pytest.raises(ValueError):
        tree.detach_host(a)  # off device with a host child
    assert tree.host_leaves == {b}


def test_errors_are_internal_errors():
    """No caller talks to the tree: its errors fail the runtime inside an actor, whatever the phase."""
    assert issubclass(TreeError, ValueError) and issubclass(TreeError, InternalError)
    assert not issubclass(TreeError, ValidationError)
    with pytest.raises(ValueError):
        RadixTree(0)


def test_heap_stays_bounded(ps):
    tree = RadixTree(ps)
    new = Slots()
    base = tree.insert(pages(ps, 0), None, new(ps)).last_node
    for i in range(1, 2000):
        tree.insert(pages(ps, 0, i), None, new(2 * ps)[:2 * ps])
        if i % 2:
            leaf = tree.match(pages(ps, 0, i)).last_node
            tree.detach_device(leaf)
            tree.delete_leaf(leaf)
    assert len(tree._dheap) <= 2 * tree.num_nodes + 1024
    order = list(tree.device_victims())
    assert len(order) == len(tree.device_leaves) == 999 and base not in order


def test_storage_only_child_and_host_prefetch(ps):
    """A node with no copy left stays in the tree (storage only); its parent becomes a
    host leaf, and stops being one when the child gets a host copy back."""
    tree = RadixTree(ps)
    a = tree.insert(pages(ps, 1), None, np.arange(ps)).last_node
    b = tree.insert(pages(ps, 1, 2), None, np.arange(2 * ps)).last_node
    for nd, base in ((b, 2000), (a, 1000)):
        tree.attach_host(nd, np.arange(ps) + base)
        tree.detach_device(nd)
    assert tree.host_leaves == {b}
    tree.detach_host(b)  # b: neither device nor host
    assert tree.host_leaves == {a}
    m = tree.match(pages(ps, 1, 2))
    assert m.host_len == ps and m.last_node is a and m.matched_len == 2 * ps and m.nodes == [a, b]
    tree.attach_host(b, np.arange(ps) + 3000)  # prefetched from storage
    assert tree.host_leaves == {b}
    assert tree.match(pages(ps, 1, 2)).host_len == 2 * ps

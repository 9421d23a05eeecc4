"""Stateful property test of the radix tree, with an invariant checker written here.

The checker recomputes everything from raw node fields (key, parent, children, device,
host, lock_ref, host_protect) with its own code and never calls the tree's own rules, so
a wrong rule in the tree cannot be mirrored in the check (DESIGN "Invariants").
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from runtime.tree.radix import RadixTree

NAMESPACES = [None, "tenant-x"]
DEV_POOL_PAGES = 64
HOST_POOL_PAGES = 64


# ---------------------------------------------------------------------- the checker
class Model:
    """What the test itself knows, independent of the tree's bookkeeping."""

    def __init__(self, ps: int) -> None:
        self.ps = ps
        self.dev_free = list(range(DEV_POOL_PAGES))  # free device pages
        self.host_free = list(range(HOST_POOL_PAGES))
        self.dev_tree: set[int] = set()  # device slots the tree holds (handed over by us)
        self.host_tree: set[int] = set()
        self.locks: list = []  # lock targets, one entry per lock()
        self.protects: list = []  # (node, num_tokens when protected)
        self.inserted: dict = {ns: [] for ns in NAMESPACES}  # namespace -> inserted keys (bytes)

    def alloc(self, free: list[int], ntok: int) -> np.ndarray | None:
        k = ntok // self.ps
        if k > len(free):
            return None
        pages = [free.pop() for _ in range(k)]
        return np.array([p * self.ps + i for p in pages for i in range(self.ps)], dtype=np.int64)

    def free(self, free: list[int], slots: np.ndarray) -> None:
        slots = np.asarray(slots)
        assert len(slots) % self.ps == 0
        for j in range(0, len(slots), self.ps):
            page = slots[j : j + self.ps]
            assert page[0] % self.ps == 0 and np.array_equal(page, page[0] + np.arange(self.ps)), "not a whole page"
            p = int(page[0]) // self.ps
            assert p not in free, f"page {p} freed twice"
            free.append(p)


def _pb(tree: RadixTree) -> int:
    return tree.page_size * 4


def all_nodes_raw(tree: RadixTree):
    """(namespace, node, path bytes) for every non-root node, by walking children dicts."""
    out = []
    for ns, root in tree._roots.items():
        stack = [(root, b"")]
        while stack:
            node, path = stack.pop()
            for ch in node.children.values():
                p = path + ch.key
                out.append((ns, ch, p))
                stack.append((ch, p))
    return out


def check_tree(tree: RadixTree, model: Model | None = None, in_pass: bool = False) -> None:
    """Raise AssertionError if the tree breaks an invariant.

    ``in_pass``: called from inside a victims pass, where the node just yielded is
    legitimately out of the heap until the pass ends."""
    ps = tree.page_size
    pb = _pb(tree)
    nodes = all_nodes_raw(tree)
    live = {id(n) for _, n, _ in nodes}
    ids = set()
    exp_dev_leaves = set()
    exp_host_leaves = set()
    dev_slots: list[int] = []
    host_slots: list[int] = []
    tot_dev = tot_host = locked_dev = 0

    for ns, root in tree._roots.items():
        assert root.parent is None and root.key == b"" and root.extra_key == ns
        assert root.device is None and root.host is None
        for k, ch in root.children.items():
            assert k == ch.key[:pb]

    # expected lock counts: each lock counts on its target and every ancestor
    exp_lock: dict[int, int] = {}
    if model is not None:
        for target in model.locks:
            assert id(target) in live, "a locked node left the tree"
            cur = target
            while cur.parent is not None:
                exp_lock[id(cur)] = exp_lock.get(id(cur), 0) + 1
                cur = cur.parent
    # expected protections: each covers the split chain of its recorded length
    exp_prot: dict[int, int] = {}
    if model is not None:
        for target, ntok in model.protects:
            assert id(target) in live, "a host-protected node left the tree"
            acc = 0
            cur = target
            while acc < ntok:
                assert cur.parent is not None
                exp_prot[id(cur)] = exp_prot.get(id(cur), 0) + 1
                acc += len(cur.key) // 4
                cur = cur.parent
            assert acc == ntok

    for ns, n, path in nodes:
        assert n.id not in ids, "node id reused"
        ids.add(n.id)
        assert n.extra_key == ns
        assert len(n.key) > 0 and len(n.key) % pb == 0, "node key not whole pages"
        ntok = len(n.key) // 4
        for k, ch in n.children.items():
            assert ch.parent is n, "broken parent link"
            assert k == ch.key[:pb], "children dict key is not the child's first page"
        for arr in (n.device, n.host):
            if arr is not None:
                assert isinstance(arr, np.ndarray) and arr.dtype == np.int64 and arr.ndim == 1
                assert len(arr) == ntok, "slot count != token count"
                assert arr.flags.owndata, "node holds a view of another array"
        parent_is_root = n.parent.parent is None
        if n.device is not None:
            assert parent_is_root or n.parent.device is not None, "device residency not prefix-closed"
            dev_slots.extend(n.device.tolist())
            tot_dev += ntok
            if n.lock_ref > 0:
                locked_dev += ntok
        if n.host is not None:
            host_slots.extend(n.host.tolist())
            tot_host += ntok
        assert n.lock_ref >= 0 and n.host_protect >= 0
        if not parent_is_root:
            assert n.parent.lock_ref >= n.lock_ref
        if model is not None:
            assert n.lock_ref == exp_lock.get(id(n), 0), f"lock_ref {n.lock_ref} != {exp_lock.get(id(n), 0)}"
            assert n.host_protect == exp_prot.get(id(n), 0)
            assert any(full.startswith(path) for full in model.inserted[ns]), "path tokens never inserted"
        kids = list(n.children.values())
        if n.device is not None and n.lock_ref == 0 and not any(c.device is not None for c in kids):
            exp_dev_leaves.add(n)
        if (n.device is None and n.host is not None and n.host_protect == 0 and n.lock_ref == 0
                and not any(c.host is not None for c in kids)):
            exp_host_leaves.add(n)

    assert tree.device_leaves == exp_dev_leaves, "evictable device leaves != definition"
    assert tree.host_leaves == exp_host_leaves, "evictable host leaves != definition"
    if not in_pass:
        # every candidate has a heap entry (eviction can never lose one)
        assert exp_dev_leaves <= {e[2] for e in tree._dheap}
        assert exp_host_leaves <= {e[2] for e in tree._hheap}
    assert len(dev_slots) == len(set(dev_slots)), "a device slot held twice"
    assert len(host_slots) == len(set(host_slots)), "a host slot held twice"
    assert tree.total_device_tokens == tot_dev and tree.total_host_tokens == tot_host
    assert tree.locked_device_tokens == locked_dev
    assert tree.num_nodes == len(nodes)
    assert {id(n) for n in tree.nodes()} == live
    if model is not None:
        assert set(dev_slots) == model.dev_tree, "tree's device slots != what was handed over"
        assert set(host_slots) == model.host_tree
        free_d = {p * model.ps + i for p in model.dev_free for i in range(model.ps)}
        assert not (free_d & model.dev_tree), "a free device slot is held by the tree"


# ---------------------------------------------------------------------- state machine
def page_tokens(ps: int, labels) -> np.ndarray:
    if not labels:
        return np.empty(0, dtype=np.int64)
    return np.concatenate([np.arange(ps, dtype=np.int64) * 7 + 100 * lab for lab in labels])


labels_st = st.lists(st.integers(0, 3), min_size=1, max_size=8)
pick = st.integers(0, 10**6)


class RadixMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tree: RadixTree | None = None
        self.m: Model | None = None

    @initialize(ps=st.sampled_from([1, 2, 4]), policy=st.sampled_from(["lru", "lfu", "priority"]))
    def setup(self, ps, policy):
        self.tree = RadixTree(ps, policy=policy)
        self.m = Model(ps)

    # helpers
    def _nodes(self):
        return [n for _, n, _ in all_nodes_raw(self.tree)]

    def _pick(self, nodes, i):
        return nodes[i % len(nodes)] if nodes else None

    # ---- rules
    @rule(ns=st.sampled_from(NAMESPACES), labels=labels_st, use_prefix=st.booleans(), prio=st.integers(0, 3))
    def insert(self, ns, labels, use_prefix, prio):
        t, m, ps = self.tree, self.m, self.m.ps
        toks = page_tokens(ps, labels)
        prefix = np.empty(0, dtype=np.int64)
        if use_prefix:
            prefix = t.match(toks, ns).device_slots
        fresh = m.alloc(m.dev_free, len(toks) - len(prefix))
        if fresh is None:
            return
        m.inserted[ns].append(toks.astype("<i4").tobytes())
        r = t.insert(toks, ns, np.concatenate([prefix, fresh]), priority=prio)
        adopted = [s for _, s in r.adopted]
        got = np.concatenate(adopted + [r.duplicate_slots]) if adopted or len(r.duplicate_slots) else np.empty(0)
        assert sorted(got.tolist()) == sorted(fresh.tolist()), "insert lost or invented slots"
        for nd, s in r.adopted:
            assert nd.device is s
        assert np.array_equal(t.path_tokens(r.last_node), toks)
        m.free(m.dev_free, r.duplicate_slots)
        m.dev_tree |= set(np.concatenate(adopted).tolist()) if adopted else set()

    @rule(labels=labels_st, extra=labels_st)
    def insert_extend(self, labels, extra):
        """Insert a sequence and then an extension of it (the multi-turn pattern)."""
        self.insert(None, labels, True, 0)
        self.insert(None, labels + extra, True, 0)

    @rule(ns=st.sampled_from(NAMESPACES), labels=labels_st, tail=st.integers(0, 3), split=st.booleans())
    def match(self, ns, labels, tail, split):
        t, ps = self.tree, self.m.ps
        toks = np.concatenate([page_tokens(ps, labels), np.arange(tail % ps if ps > 1 else 0) + 5])
        q = toks[: len(toks) // ps * ps].astype("<i4").tobytes()
        before = [(n.id, n.key) for n in self._nodes()]
        r = t.match(toks, ns, split=split)
        if not split:
            assert [(n.id, n.key) for n in self._nodes()] == before, "split=False changed the tree"
        path = b"".join(n.key for n in r.nodes)
        ml = r.matched_len * 4
        assert q[:ml] == path[:ml]
        if split:
            assert len(path) == ml, "split match must end exactly at the matched length"
            last = r.nodes[-1] if r.nodes else t.root(ns)
            if ml < len(q):
                assert q[ml : ml + 4 * ps] not in last.children, "match stopped early"
        # lengths recomputed here
        dev_len, dev_parts, i = 0, [], 0
        remaining = r.matched_len
        for n in r.nodes:
            take = min(n.num_tokens, remaining)
            if n.device is None:
                break
            dev_parts.append(n.device[:take])
            dev_len += take
            remaining -= take
            i += 1
        host_len = 0
        for n in r.nodes[i:]:
            if n.device is not None or n.host is None:
                break
            take = min(n.num_tokens, remaining)
            host_len += take
            remaining -= take
        assert r.device_len == dev_len and r.host_len == host_len
        want = np.concatenate(dev_parts) if dev_parts else np.empty(0, dtype=np.int64)
        assert np.array_equal(r.device_slots, want)
        for n in r.nodes:
            if n.device is not None:
                assert not np.shares_memory(r.device_slots, n.device)

    @rule(i=pick)
    def lock(self, i):
        nd = self._pick(self._nodes(), i)
        if nd is not None:
            self.tree.lock(nd)
            self.m.locks.append(nd)

    @rule(i=pick)
    def unlock(self, i):
        if self.m.locks:
            nd = self.m.locks.pop(i % len(self.m.locks))
            self.tree.unlock(nd)
        else:
            nodes = self._nodes()
            if nodes:
                with pytest.raises(ValueError):
                    self.tree.unlock(self._pick(nodes, i))

    @rule(i=pick)
    def protect(self, i):
        nd = self._pick(self._nodes(), i)
        if nd is not None:
            self.tree.protect_host(nd, nd.num_tokens)
            self.m.protects.append((nd, nd.num_tokens))

    @rule(i=pick)
    def unprotect(self, i):
        if self.m.protects:
            nd, ntok = self.m.protects.pop(i % len(self.m.protects))
            self.tree.unprotect_host(nd, ntok)

    @rule(i=pick, at=pick)
    def split(self, i, at):
        nodes = [n for n in self._nodes() if n.num_tokens > self.m.ps]
        nd = self._pick(nodes, i)
        if nd is not None:
            pages = nd.num_tokens // self.m.ps
            self.tree.split(nd, (1 + at % (pages - 1)) * self.m.ps)

    @rule(pages=st.integers(1, 8), write_back=st.booleans())
    def evict_device(self, pages, write_back):
        t, m = self.tree, self.m
        tokens = pages * m.ps
        got = 0
        for nd in t.device_victims():
            assert nd.device is not None and nd.lock_ref == 0
            assert not any(c.device is not None for c in nd.children.values())
            if write_back and nd.host is None:
                hs = m.alloc(m.host_free, nd.num_tokens)
                if hs is not None:
                    t.attach_host(nd, hs)
                    m.host_tree |= set(hs.tolist())
            d = t.detach_device(nd)
            m.dev_tree -= set(d.tolist())
            m.free(m.dev_free, d)
            got += len(d)
            if nd.host is None and not nd.children and nd.host_protect == 0:
                self._delete(nd)
            if got >= tokens:
                break

    @rule(i=pick)
    def backup(self, i):
        t, m = self.tree, self.m
        nd = self._pick([n for n in self._nodes() if n.host is None], i)
        if nd is not None:
            hs = m.alloc(m.host_free, nd.num_tokens)
            if hs is not None:
                t.attach_host(nd, hs)
                m.host_tree |= set(hs.tolist())

    @rule(pages=st.integers(1, 8), keep=st.booleans())
    def evict_host(self, pages, keep):
        """Host eviction; `keep` keeps a node with no copy left (as if it had a storage copy)."""
        t, m = self.tree, self.m
        tokens = pages * m.ps
        got = 0
        for nd in t.host_victims():
            assert nd.device is None and nd.host is not None and nd.host_protect == 0
            assert not any(c.host is not None for c in nd.children.values())
            h = t.detach_host(nd)
            m.host_tree -= set(h.tolist())
            m.free(m.host_free, h)
            got += len(h)
            if not keep and not nd.children and nd.lock_ref == 0:
                self._delete(nd)
            if got >= tokens:
                break

    @rule(i=pick, protect=st.booleans())
    def reload(self, i, protect):
        """Load a node back to device (from host, or from storage when it has no host)."""
        t, m = self.tree, self.m
        cands = [n for n in self._nodes() if n.device is None and (n.parent.parent is None or n.parent.device is not None)]
        nd = self._pick(cands, i)
        if nd is None:
            return
        ds = m.alloc(m.dev_free, nd.num_tokens)
        if ds is None:
            return
        if protect:
            t.protect_host(nd)
        t.attach_device(nd, ds)
        m.dev_tree |= set(ds.tolist())
        if protect:
            t.unprotect_host(nd)

    @rule(i=pick)
    def prefetch_host(self, i):
        """A node with no copy left (storage only) gets a host copy back."""
        t, m = self.tree, self.m
        nd = self._pick([n for n in self._nodes() if n.host is None and n.device is None], i)
        if nd is not None:
            hs = m.alloc(m.host_free, nd.num_tokens)
            if hs is not None:
                t.attach_host(nd, hs)
                m.host_tree |= set(hs.tolist())

    @rule()
    def write_back_all(self):
        """Back up and evict everything evictable from device (builds host-only chains)."""
        self.evict_device(10**6, True)

    @rule(i=pick)
    def drop_leaf(self, i):
        prot = {id(n) for n, _ in self.m.protects}
        nd = self._pick(
            [n for n in self._nodes() if not n.children and n.lock_ref == 0 and id(n) not in prot and n.host_protect == 0], i
        )
        if nd is not None:
            self._delete(nd)

    def _delete(self, nd):
        m = self.m
        d, h = self.tree.delete_leaf(nd)
        if d is not None:
            m.dev_tree -= set(d.tolist())
            m.free(m.dev_free, d)
        if h is not None:
            m.host_tree -= set(h.tolist())
            m.free(m.host_free, h)

    @rule()
    def victims_in_policy_order(self):
        t = self.tree
        for victims, members, pol in (
            (t.device_victims(), t.device_leaves, t.policy),
            (t.host_victims(), t.host_leaves, t.host_policy),
        ):
            seen = list(victims)
            assert set(seen) == members and len(seen) == len(members)
            keys = [pol.key(n) for n in seen]
            assert keys == sorted(keys)

    @invariant()
    def invariants(self):
        if self.tree is not None:
            check_tree(self.tree, self.m)


TestRadixMachine = RadixMachine.TestCase
TestRadixMachine.settings = settings(
    max_examples=300, stateful_step_count=60, deadline=None, suppress_health_check=list(HealthCheck)
)


# ---------------------------------------------------------------------- seed 004
def _broken_is_host_leaf(node) -> bool:
    """The seed-004 bug: children tested for 'evicted from device' instead of 'has host slots'."""
    return (
        node.device is None
        and node.host is not None
        and node.host_protect == 0
        and not any(c.device is None for c in node.children.values())
    )


def write_back_scenario(tree: RadixTree, check) -> None:
    """Write-back: evict to host, drop host copies under pressure, reload, evict again."""
    ps = tree.page_size
    m = Model(ps)
    a_t, b_t, c_t = page_tokens(ps, [0]), page_tokens(ps, [0, 1]), page_tokens(ps, [0, 1, 2])
    for toks in (a_t, b_t, c_t):
        m.inserted[None].append(toks.astype("<i4").tobytes())
        hit = tree.match(toks).device_slots
        r = tree.insert(toks, None, np.concatenate([hit, m.alloc(m.dev_free, len(toks) - len(hit))]))
        assert len(r.duplicate_slots) == 0
        m.dev_tree |= set(np.concatenate([s for _, s in r.adopted]).tolist())
        check(tree, m)

    def evict_device_all():
        for nd in tree.device_victims():
            if nd.host is None:  # write-back: back up on eviction
                hs = m.alloc(m.host_free, nd.num_tokens)
                tree.attach_host(nd, hs)
                m.host_tree |= set(hs.tolist())
                check(tree, m, in_pass=True)
            d = tree.detach_device(nd)
            m.dev_tree -= set(d.tolist())
            m.free(m.dev_free, d)
            check(tree, m, in_pass=True)
        check(tree, m)

    def drop_host(n_nodes):
        # host pressure: drop host copies; the nodes stay (their pages are in storage)
        for k, nd in enumerate(tree.host_victims()):
            if k == n_nodes:
                break
            h = tree.detach_host(nd)
            m.host_tree -= set(h.tolist())
            m.free(m.host_free, h)
            check(tree, m, in_pass=True)
        check(tree, m)

    def reload_all():
        for toks in (a_t, b_t, c_t):
            nd = tree.match(toks).nodes[-1]
            if nd.device is None:
                ds = m.alloc(m.dev_free, nd.num_tokens)
                tree.attach_device(nd, ds)
                m.dev_tree |= set(ds.tolist())
                check(tree, m)

    evict_device_all()
    drop_host(1)
    reload_all()
    evict_device_all()
    drop_host(3)
    reload_all()
    evict_device_all()


@pytest.mark.parametrize("ps", [1, 4])
def test_seed004_write_back_scenario_correct_rule(ps):
    write_back_scenario(RadixTree(ps), check_tree)


@pytest.mark.parametrize("ps", [1, 4])
def test_seed004_checker_catches_broken_host_leaf_rule(ps, monkeypatch):
    monkeypatch.setattr(RadixTree, "_is_host_leaf", staticmethod(_broken_is_host_leaf))
    with pytest.raises(AssertionError, match="evictable host leaves"):
        write_back_scenario(RadixTree(ps), check_tree)


def test_seed004_state_machine_catches_broken_rule(monkeypatch):
    """The random state machine finds the broken rule by itself too."""
    monkeypatch.setattr(RadixTree, "_is_host_leaf", staticmethod(_broken_is_host_leaf))
    with pytest.raises(AssertionError, match="evictable host leaves"):
        run_state_machine_as_test(
            RadixMachine,
            settings=settings(
                max_examples=300,
                stateful_step_count=40,
                deadline=None,
                derandomize=True,
                database=None,
                suppress_health_check=list(HealthCheck),
                phases=[p for p in Phase if p is not Phase.shrink],
            ),
        )

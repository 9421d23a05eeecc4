"""What both cores' invariant checks share: raw recomputation helpers (owners claimed per page,
ledgers compared with them, lock and host-protection counts, derived leaf sets, storage ops)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from runtime.errors import InvariantViolation
from runtime.memory.owners import Owner

if TYPE_CHECKING:
    from runtime.memory.ledger import LedgerSnapshot, SlotLedger
    from runtime.tree.cache import CacheCore
    from runtime.tree.radix import Node, RadixTree
    from runtime.tree.tiers.storage import StorageTier
    from runtime.integrations.vllm.core import TiersOnlyCore


def _fail(msg: str) -> None:
    raise InvariantViolation(msg)


def _pages(slots: np.ndarray, page_size: int) -> list[int]:
    if len(slots) % page_size:
        _fail(f"slot array of length {len(slots)} is not whole pages")
    pages = np.asarray(slots, dtype=np.int64).reshape(-1, page_size)
    if not np.all(pages == pages[:, :1] + np.arange(page_size)) or np.any(pages[:, 0] % page_size):
        _fail("slot array is not made of whole, aligned pages")
    return (pages[:, 0] // page_size).tolist()


def _all_nodes(core: "CacheCore | TiersOnlyCore") -> list["Node"]:
    out: list[Node] = []
    stack = list(core.residency.tree.roots())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def _path(node: "Node") -> list["Node"]:
    out = []
    while node.parent is not None:
        out.append(node)
        node = node.parent
    return out


def _chain(node: "Node", length: int) -> list["Node"]:
    """The nodes covering the last `length` tokens of `node`'s path, deepest first."""
    out: list["Node"] = []
    covered = 0
    while covered < length and node.parent is not None:
        out.append(node)
        covered += node.num_tokens
        node = node.parent
    return out


def _claim(table: dict[int, Owner], tier: str, ps: int, slots: np.ndarray, owner: Owner, what: str) -> None:
    """Record `owner` as the expected owner of the pages of `slots`; a page two structures
    claim for different owners is a violation (1)."""
    for page in _pages(slots, ps):
        if page in table and table[page] != owner:
            _fail(f"{tier} page {page} claimed by {table[page]} and by {owner} ({what})")
        table[page] = owner


def _check_ledger(tier: str, ledger: "SlotLedger", table: dict[int, Owner], pins: Counter[int]) -> None:
    """The ledger agrees with what the structures hold: every page owned by whom they say, none
    leaked, free and owned apart, pins equal to the in-flight copies touching each page (3)."""
    snap: LedgerSnapshot = ledger.snapshot()
    owned_pages = set(np.flatnonzero(snap.page_codes).tolist())
    free = snap.free_pages.tolist()
    if len(set(free)) != len(free):
        _fail(f"{tier} free list has duplicates")
    if set(free) & owned_pages:
        _fail(f"{tier} pages both free and owned: {sorted(set(free) & owned_pages)[:8]}")
    if len(free) + len(owned_pages) != snap.num_pages:
        _fail(f"{tier}: free ({len(free)}) + owned ({len(owned_pages)}) != all ({snap.num_pages}) pages")
    for page, owner in table.items():
        actual = snap.owner_of_page(page)
        if actual != owner:
            _fail(f"{tier} page {page} should be owned by {owner}, ledger says {actual}")
    leaked = owned_pages - set(table)
    if leaked:
        _fail(f"{tier} pages owned in the ledger but held by nothing: {sorted(leaked)[:8]} "
              f"(owners {[str(snap.owner_of_page(p)) for p in sorted(leaked)[:4]]})")
    nonzero = {int(p): int(snap.pins[p]) for p in np.flatnonzero(snap.pins)}
    if nonzero != dict(pins):
        _fail(f"{tier} pins {dict(list(nonzero.items())[:6])} != in-flight copies {dict(list(pins.items())[:6])}")
    for page in nonzero:
        if page not in owned_pages:
            _fail(f"{tier} page {page} pinned but free")


def _check_locks(nodes: list["Node"], holders: list["Node | None"], roots: set) -> None:
    """4: every node's lock count equals the holders whose locked path runs through it."""
    locks: Counter[int] = Counter()
    for holder in holders:
        node = holder
        while node is not None and node not in roots:
            locks[node.id] += 1
            node = node.parent
    for node in nodes:
        if node.lock_ref < 0:
            _fail(f"node {node.id} has a negative lock count")
        if node.lock_ref != locks.get(node.id, 0):
            _fail(f"node {node.id} lock_ref {node.lock_ref} != holders {locks.get(node.id, 0)}")


def _check_host_leaves(tree: "RadixTree", nodes: list["Node"]) -> None:
    """5 (host): the evictable host leaves equal their definition."""
    host_leaves = {
        n for n in nodes
        if n.device is None and n.host is not None and n.host_protect == 0 and n.lock_ref == 0
        and not any(c.host is not None for c in n.children.values())
    }
    if set(tree.host_leaves) != host_leaves:
        _fail(f"evictable host leaves differ from their definition: tree {sorted(n.id for n in tree.host_leaves)} "
              f"vs {sorted(n.id for n in host_leaves)}")


def _check_storage_ops(storage: "StorageTier", claim, host_pins: Counter[int]) -> None:
    """Every storage op pins its host pages; a read's pages belong to its prefetch; a write's
    chain is host-protected; a registered prefetch has its read in flight."""
    for sop in storage.ops.values():
        for page in _pages(sop.host, storage.residency.page_size):
            host_pins[page] += 1
        pf = sop.prefetch
        if pf is not None:
            if pf.op_id != sop.op_id or not np.array_equal(pf.host, sop.host):
                _fail(f"storage read {sop.op_id} does not match its prefetch of {pf.rid!r}")
            claim(pf.host, pf.owner, f"prefetch {pf.rid!r}")
            if not pf.cancelled and not pf.detached and storage.prefetches.get(pf.rid) is not pf:
                _fail(f"prefetch of {pf.rid!r} is in flight but not registered")
        elif sop.node is not None and sop.node.host_protect <= 0:
            _fail(f"storage write {sop.op_id}: node {sop.node.id} host copy not protected")
    for rid, pf in storage.prefetches.items():
        if pf.rid != rid or storage.ops.get(pf.op_id) is None or pf.cancelled:
            _fail(f"prefetch of {rid!r} has no storage read in flight")


def _check_host_protects(nodes: list[Node], roots: set, spans: list[tuple[Node, int]]) -> None:
    """Each node's host protection count equals the (node, length) spans that cover it."""
    protects: Counter[int] = Counter()
    for node, length in spans:
        covered = 0
        while covered < length and node is not None and node not in roots:
            protects[node.id] += 1
            covered += len(node.key) // 4
            node = node.parent
        if covered != length:
            _fail(f"a host protection over {length} tokens covers {covered}")
    for node in nodes:
        if node.host_protect != protects.get(node.id, 0):
            _fail(f"node {node.id} host_protect {node.host_protect} != holders {protects.get(node.id, 0)}")


def _check_cached_prefix(rec, held: np.ndarray, what: str) -> None:
    """The slot contract: a request's cached prefix maps its locked path's device slots, except
    where it still holds its own duplicates of them (`dups`, freed only at its release)."""
    n = rec.cached_len
    if len(held) < n:
        _fail(f"{what}: cached prefix of {n} tokens but its locked path holds {len(held)}")
    mine = rec.slots[:n]
    differ = mine[held[:n] != mine]
    if sorted(differ.tolist()) != sorted(rec.dups.tolist()):
        _fail(f"{what}: cached prefix maps slots {sorted(differ.tolist())[:8]} that are neither its locked "
              f"path's nor its duplicates {sorted(rec.dups.tolist())[:8]}")

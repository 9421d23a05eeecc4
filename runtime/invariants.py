"""The invariant checker, run over a `CacheCore` (docs/ARCHITECTURE.md, "Rules").

It recomputes every expected owner, pin count, lock count and derived set from raw fields
(node slots and counters, request records, in-flight copy snapshots, ledger arrays) with
its own code, never with the functions the tree or the ledgers use to maintain them, so a
wrong rule there cannot be mirrored here.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from runtime.errors import InvariantViolation
from runtime.memory.owners import Owner
from runtime.messages import Direction

if TYPE_CHECKING:
    from runtime.integrations.vllm.core import TiersOnlyCore
    from runtime.memory.ledger import LedgerSnapshot, SlotLedger
    from runtime.tree.cache import CacheCore
    from runtime.tree.radix import Node, RadixTree
    from runtime.tree.records import CopyOp, RequestRecord
    from runtime.tree.recurrent import RecurrentStates
    from runtime.tree.storage_tier import StorageTier


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


def _check_request_table(core: "CacheCore") -> None:
    """Each live request has its own row, filed under its rid, naming its owner by a code the
    device ledger holds for it; free rows map nothing."""
    table = core.table
    rows = table.live_rows()
    if set(rows) != set(core.requests):
        _fail(f"request table rows {sorted(map(repr, rows))[:5]} != live requests {sorted(map(repr, core.requests))[:5]}")
    if len(set(rows.values())) != len(rows):
        _fail("two live requests share a request table row")
    free = table.free_rows()
    if set(free) & set(rows.values()) or len(set(free)) != len(free):
        _fail("a live request's row is on the free list, or a free row is listed twice")
    if len(free) + len(rows) != len(table.seq_len):
        _fail(f"request table rows leaked: {len(free)} free + {len(rows)} live of {len(table.seq_len)}")
    if free and table.num_slots[free].any():
        _fail("a free request table row still maps pages")
    device = core.residency.device
    for rid, row in rows.items():
        rec = core.requests[rid]
        if rec.table is not table or rec.row != row:
            _fail(f"request {rid!r} reads row {rec.row} of {'another' if rec.table is not table else 'its'} "
                  f"table, filed under row {row}")
        code = int(table.codes[row])
        if code and device.held_code(rec.owner) != code:
            _fail(f"request {rid!r}'s row names owner code {code}, the device ledger holds "
                  f"{device.held_code(rec.owner)} for it")
        if table.record_at[row] is not rec:
            _fail(f"request table row {row} does not point back at request {rid!r}")
    # a hold outlives no row: the device ledger holds exactly the owners of rows that name a code
    named = {core.requests[rid].owner for rid, row in rows.items() if table.codes[row]}
    if device.held_owners() != named:
        _fail(f"device ledger holds {sorted(map(str, device.held_owners()))[:5]}, request table rows name "
              f"{sorted(map(str, named))[:5]}")


def check_invariants(core: "CacheCore", *, quiescent: bool = False) -> None:
    """Raise `InvariantViolation` when any of invariants 1-5 (and 7 when `quiescent`) fails."""
    ps = core.page_size
    tree = core.residency.tree
    copy_ops = core.copies.ops
    storage_ops = core.storage.ops if core.storage is not None else {}
    prefetch_table = core.storage.prefetches if core.storage is not None else {}
    roots = set(tree.roots())
    nodes = [n for n in _all_nodes(core) if n not in roots]
    expected = {"device": {}, "host": {}}  # page -> owner expected by the structures
    pins = {"device": Counter(), "host": Counter()}

    def claim(tier: str, slots: np.ndarray, owner: Owner, what: str) -> None:
        _claim(expected[tier], tier, ps, slots, owner, what)

    # 1-2: what the tree holds, what requests map, what copies write, each with one owner
    for node in nodes:
        owner = Owner.node(node.id)
        if node.device is not None:
            if len(node.device) != len(node.key) // 4:
                _fail(f"node {node.id} device slots do not match its tokens")
            claim("device", node.device, owner, f"node {node.id} device")
        if node.host is not None:
            if len(node.host) != len(node.key) // 4:
                _fail(f"node {node.id} host slots do not match its tokens")
            claim("host", node.host, owner, f"node {node.id} host")
        parent = node.parent
        if node.device is not None and parent is not None and parent not in roots and parent.device is None:
            _fail(f"node {node.id} is on device but its parent {parent.id} is not (residency not prefix-closed)")
        # tier closure (seed 004 class): a node never loses its last copy while it is in the
        # tree, so every node a match can walk through holds its KV in some tier
        if node.device is None and node.host is None:
            _fail(f"node {node.id} holds no copy ({len(node.children)} children)")
    _check_request_table(core)
    for rec in core.requests.values():
        if not (rec.cached_len <= rec.seq_len <= rec.num_slots) or rec.cached_len % ps or rec.num_slots % ps:
            _fail(f"request {rec.rid!r} lengths inconsistent: cached {rec.cached_len}, seq {rec.seq_len}, "
                  f"slots {rec.num_slots}")
        if not (rec.cached_len <= rec.committed_len <= rec.seq_len) and rec.committed_len > rec.seq_len:
            _fail(f"request {rec.rid!r} committed {rec.committed_len} beyond seq {rec.seq_len}")
        claim("device", rec.slots[rec.own_start:], rec.owner, f"request {rec.rid!r}")
        claim("device", rec.dups, rec.owner, f"request {rec.rid!r} duplicates")
        if rec.session is not None:
            sess = core.sessions.get(rec.session)
            if sess is None or sess.turn != rec.rid:
                _fail(f"turn {rec.rid!r} names session {rec.session!r} that does not run it")
            if not np.array_equal(rec.slots[: rec.session_len], sess.slots):
                _fail(f"turn {rec.rid!r} does not map its session's slots")
        # the cached prefix must be exactly the slots of the locked path
        path: list[Node] = []
        node = rec.last_node
        while node is not None and node not in roots:
            path.append(node)
            node = node.parent
        path.reverse()
        parts = [n.device for n in path if n.device is not None]
        held = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        if rec.failed is not None:
            continue  # its load failed and was rolled back: it maps nothing valid until released
        _check_cached_prefix(rec, held, f"request {rec.rid!r}")
    for sess in core.sessions.values():
        # seed 003: a session holds exactly the whole pages its tokens need, nothing past them
        if len(sess.slots) != -(-sess.kv_len // ps) * ps:
            _fail(f"session {sess.sid!r} holds {len(sess.slots)} slots for {sess.kv_len} tokens")
        claim("device", sess.slots, sess.owner, f"session {sess.sid!r}")
    _check_offload(core, claim, roots, quiescent)
    unissued = core.copies.unissued()  # this turn's backups: pinned when their batch leaves
    for op in copy_ops.values():
        if op.direction is Direction.BACKUP:
            claim("host", op.host, op.host_owner, f"backup op {op.op_id} destination")
        elif op.orphaned:  # its nodes were rolled back: its slots wait for its ack
            claim("device", op.device, Owner.node(op.node.id), f"orphaned load {op.op_id}")
        if op.op_id in unissued:
            continue
        for page in _pages(op.device, ps):
            pins["device"][page] += 1
        for page in _pages(op.host, ps):
            pins["host"][page] += 1
    for op in (core.offload.ops.values() if core.offload is not None else ()):  # decode offload copies
        claim("host", op.host, op.host_owner, f"offload op {op.op_id} destination")
        for page in _pages(op.device, ps):
            pins["device"][page] += 1
        for page in _pages(op.host, ps):
            pins["host"][page] += 1
    if core.storage is not None:
        _check_storage_ops(core.storage, lambda slots, owner, what: claim("host", slots, owner, what), pins["host"])

    for tier, ledger in (("device", core.residency.device), ("host", core.residency.host)):
        if ledger is not None:
            _check_ledger(tier, ledger, expected[tier], pins[tier])

    if core.residency.states is not None:
        _check_states(core, nodes)
    if core.residency.sliding is not None:
        _check_sliding(core, nodes)

    # 4: lock counts from who holds locks (requests' last nodes, in-flight copies' nodes)
    holders = [rec.last_node for rec in core.requests.values()] + [op.node for op in copy_ops.values()]
    if core.offload is not None:  # decode offload: retired requests
        holders += [z.rec.last_node for z in core.offload.retired.values()]
    prefetches = [sop.prefetch for sop in storage_ops.values() if sop.prefetch is not None]
    holders += [pf.anchor_lock for pf in prefetches]  # storage prefetch: the prefix it will hang under
    _check_locks(nodes, holders, roots)

    # host protection counts from who holds them: storage writes (the chain they write) and
    # prefetch anchors (their host-only part), each over the length recorded when taken
    spans = [(sop.node, sop.length) for sop in storage_ops.values() if sop.write]
    spans += [(pf.anchor_host, pf.anchor_host_len) for pf in prefetches if pf.anchor_host is not None]
    _check_host_protects(nodes, roots, spans)

    # 5: derived eviction sets equal their definitions
    device_leaves = {
        n for n in nodes
        if n.device is not None and n.lock_ref == 0 and not any(c.device is not None for c in n.children.values())
    }
    if set(tree.device_leaves) != device_leaves:
        _fail(f"evictable device leaves differ from their definition: tree {sorted(n.id for n in tree.device_leaves)} "
              f"vs {sorted(n.id for n in device_leaves)}")
    _check_host_leaves(tree, nodes)

    # 7: at quiescence nothing is in flight and only tree nodes own slots
    if quiescent:
        if copy_ops:
            _fail(f"{len(copy_ops)} copies still in flight at quiescence")
        if storage_ops or prefetch_table:
            _fail("storage ops or prefetches still in flight at quiescence")
        if core.requests:
            _fail(f"requests still live at quiescence: {list(core.requests)[:5]}")
        for tier in ("device", "host"):
            if pins[tier]:
                _fail(f"{tier} pins left at quiescence")


def _path(node: "Node") -> list["Node"]:
    out = []
    while node.parent is not None:
        out.append(node)
        node = node.parent
    return out


def _check_states(core: "CacheCore", nodes: list["Node"]) -> None:
    """Recurrent state (docs/ARCHITECTURE.md, "Recurrent state"): every state slot is a live
    request's running slot, one of its pending snapshots (past its cached prefix), or the snapshot
    of a live node that holds device KV, each slot held once; the ledger agrees, nothing leaks, pins
    are the copies' and each copy's state slots are its nodes' snapshots."""
    states = core.residency.states
    assert states is not None
    table: dict[int, Owner] = {}
    holders: dict[str, dict[int, str]] = {"state": {}, "host state": {}}

    def hold(want: dict[int, Owner], tier: str, slot: int, owner: Owner, what: str) -> None:
        """A state slot has one holder: one request's running state or one of its snapshots, or one
        node's snapshot (by owner alone, a request's slot held twice would pass)."""
        seen = holders[tier]
        if slot in seen:
            _fail(f"{tier} slot {slot} held twice: as the {seen[slot]} and as the {what}")
        seen[slot] = what
        _claim(want, tier, 1, np.array([slot]), owner, what)

    if set(states.running) != set(core.requests):
        _fail(f"running state slots {sorted(map(repr, states.running))[:5]} != live requests "
              f"{sorted(map(repr, core.requests))[:5]}")
    for rid, slot in states.running.items():
        hold(table, "state", slot, core.requests[rid].owner, f"running state of {rid!r}")
    for rid, mine in states.pending.items():
        rec = core.requests.get(rid)
        if rec is None:
            _fail(f"pending snapshots of {rid!r}, which is not live")
        for position, slot in mine.items():
            if position % core.page_size or not rec.cached_len < position <= rec.seq_len:
                _fail(f"{rid!r}: pending snapshot at {position} outside ({rec.cached_len}, {rec.seq_len}] or unaligned")
            hold(table, "state", slot, rec.owner, f"snapshot of {rid!r} at {position}")
    live = set(nodes)
    host_table: dict[int, Owner] = {}
    pins: Counter[int] = Counter()
    host_pins: Counter[int] = Counter()
    for op in core.copies.ops.values():  # a copy's state slots: pinned, the orphaned load's still owned
        copy = op.state
        if copy is not None:
            backup = op.direction is Direction.BACKUP
            devs, hosts = (copy.src, copy.dst) if backup else (copy.dst, copy.src)
            for node, dev, host in zip(copy.nodes, devs.tolist(), hosts.tolist(), strict=True):
                pins[dev] += 1
                host_pins[host] += 1
                if op.orphaned:
                    hold(table, "state", dev, Owner.node(node.id), f"orphaned load {op.op_id}")
                if backup:  # the host copy joins the node at the ack
                    hold(host_table, "host state", host, Owner.node(node.id), f"backup {op.op_id}")
            if not op.orphaned:
                _check_state_copy(states, op, backup)
    for sop in (core.storage.ops.values() if core.storage is not None else ()):
        # a storage write reads its chain's host snapshots (held by their nodes, pinned by it); a
        # storage read fills a host slot its prefetch holds (pinned) until a node adopts it at the ack
        for blob in sop.states:
            if blob.slot < 0:
                continue
            host_pins[blob.slot] += 1
            if sop.write:
                if sop.node is None or blob.slot not in _chain_host_states(states, sop.node, sop.length):
                    _fail(f"storage write {sop.op_id} reads host state slot {blob.slot}, not a snapshot of its chain")
            else:
                assert sop.prefetch is not None
                hold(host_table, "host state", blob.slot, sop.prefetch.owner, f"storage read {sop.op_id}")
    for held, positions, tier, want, kv in ((states.node_state, states.position, "state", table, "device"),
                                            (states.host_state, states.host_position, "host state", host_table, "host")):
        for node, slot in held.items():
            if node not in live:
                _fail(f"{tier} snapshot {slot} held by node {node.id}, which is not in the tree")
            if getattr(node, kv) is None:
                _fail(f"node {node.id} holds a {tier} snapshot but no {kv} KV (a hit would restore state alone)")
            end = sum(n.num_tokens for n in _path(node))
            if positions.get(slot) != end:
                _fail(f"node {node.id} ends at {end} but holds the {tier} snapshot taken at {positions.get(slot)}")
            hold(want, tier, slot, Owner.node(node.id), f"{tier} snapshot of node {node.id}")
    _check_ledger("state", states.ledger, table, pins)
    if states.host_ledger is not None:
        _check_ledger("host state", states.host_ledger, host_table, host_pins)


def _check_sliding(core: "CacheCore", nodes: list["Node"]) -> None:
    """Sliding-window layers (docs/ARCHITECTURE.md, "Pool groups"): the sliding ledger and the
    full -> sliding map agree (each sliding page held by exactly one allocated full page); only
    tree nodes' pages and live requests' pages before their read start lack sliding KV, in each
    node a prefix of its pages (what the drop rule drops and a split hands on), of a request's
    own pages a leading run; no live request's window reads a dropped page: from
    `committed_len - W + 1` on, everything it maps has sliding KV; host copies' missing prefixes
    belong to live host copies, and every backup in flight has its record."""
    sliding = core.residency.sliding
    assert sliding is not None
    swa, ps, window = sliding.swa, core.page_size, sliding.window
    allocated = core.residency.device.allocated()  # type: ignore[attr-defined]
    swa.check(allocated)
    # every slot array below was checked whole, aligned pages by the claims: page ids by slicing
    present = swa.map[::ps] >= 0
    in_nodes = np.zeros(len(present), dtype=bool)
    for node in nodes:
        if node.device is None:
            continue
        pages = node.device[::ps] // ps
        in_nodes[pages] = True
        _check_leading(present[pages], f"node {node.id}: its pages")
    for op in core.copies.ops.values():  # (an orphaned load's pages left their nodes)
        in_nodes[op.device[::ps] // ps] = True
    for rec in core.requests.values():  # pages a request reads no more (duplicates included)
        if rec.failed is None:
            in_nodes[rec.slot_range(0, _read_start(rec, window, ps))[::ps] // ps] = True
    lost = np.flatnonzero(allocated & ~present & ~in_nodes)
    if len(lost):
        _fail(f"swa: full pages {lost[:8].tolist()} held outside the tree lack sliding KV")
    for node, k in sliding.host_missing.items():
        if node.host is None or node not in nodes or not 0 < k <= len(node.host) // ps:
            _fail(f"swa: node {node.id} records {k} host pages without sliding KV but holds "
                  f"{None if node.host is None else len(node.host) // ps} host pages")
    backups = {op.op_id for op in core.copies.ops.values() if op.direction is Direction.BACKUP}
    if set(sliding.backups) != backups:
        _fail(f"swa: backups recorded {sorted(sliding.backups)} != in flight {sorted(backups)}")
    for rec in core.requests.values():
        if rec.failed is not None:
            continue  # its load failed and was rolled back: its cached pages are freed, it reads none
        lo = _read_start(rec, window, ps)
        pages = rec.slot_range(lo, rec.num_slots)[::ps] // ps
        if len(pages) and not present[pages].all():
            at = lo + int(np.flatnonzero(~present[pages])[0]) * ps
            _fail(f"request {rec.rid!r} (committed {rec.committed_len}) reads positions {at}..{at + ps - 1} in "
                  f"its sliding window, whose sliding KV was dropped")
        own = rec.slot_range(rec.own_start, rec.num_slots)[::ps] // ps
        _check_leading(present[own], f"request {rec.rid!r}: its own pages")


def _check_leading(flags: np.ndarray, what: str) -> None:
    """Pages without sliding KV (`flags` False) come first: the drop rules drop leading runs."""
    dropped = int(np.count_nonzero(~flags))
    if dropped and flags[:dropped].any():
        _fail(f"{what} without sliding KV are not a prefix of them ({(~flags).astype(int).tolist()})")


def _read_start(rec: "RequestRecord", window: int, ps: int) -> int:
    """The page boundary a live request's next read starts at or after: its forwards compute from
    `committed_len` on (a rewind below refuses a dropped window), reading W - 1 positions back."""
    return max(0, rec.committed_len - window + 1) // ps * ps


def _chain_host_states(states: "RecurrentStates", node: "Node", length: int) -> set[int]:
    """The host snapshots of the nodes covering the last `length` tokens of `node`'s path."""
    return {states.host_state[n] for n in _chain(node, length) if n in states.host_state}


def _chain(node: "Node", length: int) -> list["Node"]:
    """The nodes covering the last `length` tokens of `node`'s path, deepest first."""
    out: list["Node"] = []
    covered = 0
    while covered < length and node.parent is not None:
        out.append(node)
        covered += node.num_tokens
        node = node.parent
    return out


def _check_state_copy(states: "RecurrentStates", op: "CopyOp", backup: bool) -> None:
    """An in-flight copy's state slots are the snapshots of the nodes it copies for, nodes of its own
    chain (deepest first): a backup reads its node's device snapshot into a host slot taken at that
    position, a load reads each node's host snapshot into that node's device snapshot. Positions alone
    do not show a load that brings back another node's snapshot."""
    copy = op.state
    chain = _chain(op.node, op.length)
    if not copy.nodes or copy.nodes[0] is not op.node or any(n not in chain for n in copy.nodes):
        _fail(f"copy {op.op_id} carries state for nodes {[n.id for n in copy.nodes]}, not its chain's "
              f"{[n.id for n in chain]} from its node {op.node.id}")
    for node, src, dst in zip(copy.nodes, copy.src.tolist(), copy.dst.tolist(), strict=True):
        if backup:
            ok = states.node_state.get(node) == src and states.host_position.get(dst) == states.position.get(src)
        else:
            ok = states.host_state.get(node) == src and states.node_state.get(node) == dst
        if not ok:
            _fail(f"copy {op.op_id} copies state slot {src} -> {dst} for node {node.id}, which is not that "
                  f"node's snapshot (device {states.node_state.get(node)}, host {states.host_state.get(node)})")


# -- shared by both cores -------------------------------------------------------------------


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


# -- tiers-only mode ----------------------------------------------------------------------------


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


# -- decode offload ---------------------------------------------------------------------------


def _check_offload(core: "CacheCore", claim, roots: set, quiescent: bool) -> None:
    """Seed 000: a retired request (finished or aborted, device slots not yet released) keeps
    owning its device slots and its prefix lock; every offload copy in flight reads slots
    that its request, live or retired, still maps (so nothing it reads was freed); landed
    host chunks belong to their request; the ranges of one request never overlap."""
    offload = core.offload
    if offload is None:
        return
    retired = offload.retired
    offload_ops = list(offload.ops.values())
    if not (retired or offload_ops or offload.landed or offload.inflight):
        return
    ps = core.page_size
    records = {(rec.rid, rec.generation): rec for rec in core.requests.values()}
    for key, z in retired.items():
        rec = z.rec
        if key != (rec.rid, rec.generation):
            _fail(f"retired request filed under {key!r} is {rec.rid!r}#{rec.generation}")
        if key in records:
            _fail(f"request {rec.rid!r}#{rec.generation} is both live and retired")
        newer = core.requests.get(rec.rid)
        if newer is not None and newer.generation <= rec.generation:
            _fail(f"request {rec.rid!r} admitted again without a newer generation")
        if rec.session is not None:
            _fail(f"session turn {rec.rid!r} was retired for offload")
        if rec.table is core.table:
            _fail(f"retired request {rec.rid!r}#{rec.generation} still reads a row of the live table")
        if not (rec.cached_len <= rec.seq_len <= rec.num_slots) or rec.cached_len % ps:
            _fail(f"retired request {rec.rid!r}#{rec.generation} lengths inconsistent")
        if z.final_len is not None and not 0 <= z.final_len <= rec.seq_len:
            _fail(f"retired request {rec.rid!r}#{rec.generation} final length {z.final_len} beyond {rec.seq_len}")
        claim("device", rec.slots[rec.own_start:], rec.owner, f"retired request {rec.rid!r}#{rec.generation}")
        claim("device", rec.dups, rec.owner, f"retired request {rec.rid!r}#{rec.generation} duplicates")
        path: list = []
        node = rec.last_node
        while node is not None and node not in roots:
            path.append(node)
            node = node.parent
        parts = [n.device for n in reversed(path) if n.device is not None]
        held = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        if rec.failed is None:
            _check_cached_prefix(rec, held, f"retired request {rec.rid!r}#{rec.generation}")
        records[key] = rec
    ranges: dict = {}
    inflight: dict = {}
    for op in offload_ops:
        key = (op.rid, op.generation)
        rec = records.get(key)
        if rec is None:
            _fail(f"offload op {op.op_id} reads the device slots of {op.rid!r}#{op.generation}, which was "
                  "released while the copy is in flight (seed 000)")
        if op.host_owner != rec.owner:
            _fail(f"offload op {op.op_id} host slots are not owned by its request")
        if op.start % ps or op.length % ps or op.start + op.length > rec.num_slots:
            _fail(f"offload op {op.op_id} range [{op.start}, {op.start + op.length}) is not whole pages of its request")
        if not np.array_equal(rec.slots[op.start: op.start + op.length], op.device):
            _fail(f"offload op {op.op_id} reads slots that {op.rid!r}#{op.generation} no longer maps")
        inflight.setdefault(key, set()).add(op.op_id)
        ranges.setdefault(key, []).append((op.start, op.start + op.length))
    if inflight != {k: set(v) for k, v in offload.inflight.items()}:
        _fail(f"offloads in flight per request {offload.inflight!r} != offload ops {inflight!r}")
    for key, chunks in offload.landed.items():
        rec = records.get(key)
        if rec is None:
            _fail(f"landed offload chunks of {key!r}, which is neither live nor retired")
        for start, end, host in chunks:
            if len(host) != end - start:
                _fail(f"landed chunk [{start}, {end}) of {key!r} holds {len(host)} host slots")
            claim("host", host, rec.owner, f"landed offload of {key!r}")
            ranges.setdefault(key, []).append((start, end))
    for key, spans in ranges.items():
        spans.sort()
        for (_, e0), (s1, _) in zip(spans, spans[1:]):
            if s1 < e0:
                _fail(f"offload ranges of {key!r} overlap: {spans}")
    if quiescent and (retired or offload.landed or offload.inflight):
        _fail(f"offload state left at quiescence: retired {list(retired)[:5]}, landed {list(offload.landed)[:5]}")

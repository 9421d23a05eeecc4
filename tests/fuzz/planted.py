"""Planted bugs: deliberately broken variants of the tree core that the API fuzzer must find.

Each plant wraps or replaces one function of the core the way a regression would:

- `remap_duplicates`: `cache`/`finish` of a prefix another request cached first frees the
  request's own duplicate pages and remaps its slots to the tree's (the behaviour before the
  slot contract). The invariant checker is content with that state; only a caller's view can
  see its slots change.
- `shorten_record`: a `cache` with fewer tokens than the request's record shortens the record.
- `host_leaf_ignores_children`: the tree's evictable-host-leaf rule forgets "no child with host
  slots" (seed 004).
- `decode_swaps_slots`: `decode_step` hands each request another request's new slot.
- `failed_load_keeps_loads_below`: a load that fails leaves the loads started under it (by
  later admissions of longer prompts) in place, as if its chain were alone.
- `split_keeps_page_hashes`: a split leaves the nodes' page hashes (`PageHasher`, shared by KV
  events and storage writes) with the lower part (events then name pages by the wrong hashes).
- `stale_batch_rows`: the request table keeps reusing a decode batch's rows after one of its
  requests ended (its row freed, perhaps reused by another request).
- `clear_leaves_pages`: `clear_storage` forgets the pages known stored (and says so in KV
  events) but hands none of them to the backend's removal: the pages stay, and a later lookup
  finds them (only the fuzzer's model of what storage may hold can tell).
- `detach_forgets_stored`: `detach_storage` keeps none of the page hashes known stored for a
  re-attach of the same backend: the KV events still announce them, a later clear leaves them.
- `attach_resets_counters`: the storage counters live in the `StorageTier` that `attach_storage`
  creates, so they restart from zero after a detach and attach (found by the oracle that every
  counter of stats() only grows over an episode).
- `gone_forgets_doubtful`: a lookup or read that stops at a missing page forgets it and the pages
  after it outright, holding none in doubt (the behaviour before `StorageTier.doubtful`): those
  after it stay on disk, and a clear leaves them (found with the fuzzer's `evict_pages`).

- `internal_error_as_validation`: the device ledger's `alloc` refuses a two-page allocation with
  a `LengthError` (an internal misuse check gone wrong: a `ValidationError` raised half-way through
  an admit or extend, after the call locked its cached prefix and held its ledger code). Errors
  are classified by origin (`runtime.phase`): raised after the call's checks passed, it fails the
  runtime whole instead of reaching the caller as a refusal.

Recurrent state (hybrid episodes only: these plants run just the episodes with state slots):

- `state_match_not_cut`: `RecurrentStates.usable_end` returns the whole device match, so a hit's
  KV is not cut back to the deepest snapshot; the hit resumes from the deepest snapshot on its
  path (state of a shorter prefix with longer KV), or from none.
- `state_leaf_grows`: a request's leaf holding a snapshot grows in place at its next insert
  (`RequestKV.insert` without `RecurrentStates.grows_in_place`'s no): the snapshot
  then sits at the leaf's new end. The invariant checker, run by the tree actor after every
  message (`debug_invariants`), sees it first ("node 1 ends at 12 but holds the state snapshot
  taken at 4") and the runtime fails; so
- `state_leaf_grows_unchecked`: the same with the checker's state part off, for the fingerprint
  oracle alone (a node's snapshot does not hold the state after its path, or a hit resumes from
  a state that is not its prefix's).
- `state_load_other_snapshot`: a load through host-only nodes brings back another node's host
  snapshot for its deepest node (host-tier hybrid episodes); the invariant checker sees the copy's
  source is not its node's snapshot; `state_load_other_snapshot_unchecked`: the same with the
  checker's state part off, for the fingerprint oracles alone.

Sliding-window layers (sliding episodes only):

- `swa_drop_inside_window`: the drop rule keeps one page less than the W - 1 tokens before each
  node end (`SlidingWindow.limit` one page larger), so a running request's window, or a hit's,
  reads a dropped sliding page. The invariant checker sees a live request's window dropped first;
  `swa_drop_inside_window_unchecked`: the same with the checker's sliding part off, for the
  harness's sliding oracles alone (the forward's window reads through `rt.swa_map`).
- `swa_no_cut`: a match is not cut back where its window's sliding KV is dropped
  (`SlidingWindow.usable_end` returns the whole match). The checker runs after the admit has
  answered, so the harness's cut oracle (the admitted hit's window maps a dropped slot) sees it
  first: no unchecked twin, and only the sliding oracles' kinds count as finding it.
- `swa_backup_skips_sliding`: a backup copies no sliding rows (its host record still says they
  are there): host copies' sliding parts hold stale KV, and a load brings it back. Only the
  fingerprint oracles see it (tree host copies, or the loaded request's window).

Peer episodes (a decode runtime on a fake prefill peer, `harness.peer_episode`; `PEER_PLANTS`,
asserted by tests/fuzz/test_peer_fuzz.py, not test_planted.py: their episodes are another stream):

- `overdue_read_released`: a storage read past its deadline (`StorageTier.mark_overdue`: nobody
  waits for it any more) gives its host pages back at once, unpinned and freed, as if its call
  could no longer write them; its ack, which still comes, releases them again (and a late fill
  lands in pages that may belong to someone else by then). Only a backend slower than
  `storage_timeout_s` reaches it: the fake peer's long delays.

    .venv/bin/python -m tests.fuzz.planted remap_duplicates --seed 1 --calls 20000

prints the reproduction to stderr and one JSON line (found, seed, episode, calls to find...) last.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Plant:
    install: Callable[[], Callable[[], None]]  # returns the undo
    kinds: frozenset[str]  # violation kinds that show this bug
    detail: str = ""  # ...whose detail holds this text
    # the episodes it can show in, by their config's kind: "hybrid" (recurrent state), "storage"; None: all
    # ("peer": the peer episodes' own stream, `PEER_PLANTS`)
    episodes: str | None = None

    def wanted(self, v: "object") -> bool:
        return getattr(v, "kind", None) in self.kinds and self.detail in getattr(v, "detail", "")


def _remap_duplicates() -> Callable[[], None]:
    from runtime.tree.request_kv import RequestKV

    insert = RequestKV.insert

    def broken(self: RequestKV, rec, tokens) -> None:
        insert(self, rec, tokens)
        if len(rec.dups):
            # the old way: free the request's duplicates now and map the tree's pages instead
            self.residency.device.free(rec.dups, rec.owner, rid=rec.rid, reason="duplicate")
            parts, node = [], rec.last_node
            while node is not None and node.parent is not None:
                parts.append(node.device)
                node = node.parent
            held = np.concatenate(parts[::-1])[: rec.cached_len]
            remapped = np.concatenate((held, rec.slots[rec.cached_len:]))
            rec.truncate_slots(0)
            rec.append_slots(remapped)
            rec.dups = rec.dups[:0]

    RequestKV.insert = broken
    return lambda: setattr(RequestKV, "insert", insert)


def _shorten_record() -> Callable[[], None]:
    from runtime.tree.request_kv import RequestKV

    insert = RequestKV.insert

    def broken(self: RequestKV, rec, tokens) -> None:
        insert(self, rec, tokens)
        if len(tokens) < len(rec.tokens):
            rec.tokens = tokens

    RequestKV.insert = broken
    return lambda: setattr(RequestKV, "insert", insert)


def _host_leaf_ignores_children() -> Callable[[], None]:
    from runtime.tree.radix import RadixTree

    rule = RadixTree.__dict__["_is_host_leaf"]
    RadixTree._is_host_leaf = staticmethod(
        lambda node: node.device is None and node.host is not None and node.host_protect == 0 and node.lock_ref == 0)
    return lambda: setattr(RadixTree, "_is_host_leaf", rule)


def _decode_swaps_slots() -> Callable[[], None]:
    from runtime.tree.cache import CacheCore

    step = CacheCore.decode_step

    def broken(self: CacheCore, rids):
        # each request gets another request's new slot (an index mix-up in the batch)
        return step(self, rids).roll(1)

    CacheCore.decode_step = broken
    return lambda: setattr(CacheCore, "decode_step", step)


def _failed_load_keeps_loads_below() -> Callable[[], None]:
    from runtime.tree.tiers.copies import CopyTracker

    orphan = CopyTracker._orphan_loads_below
    CopyTracker._orphan_loads_below = lambda self, failed, top, users: None
    return lambda: setattr(CopyTracker, "_orphan_loads_below", orphan)


def _stale_batch_rows() -> Callable[[], None]:
    from runtime.tree.request_table import RequestTable

    free = RequestTable._free

    def broken(self: RequestTable, rec):
        last = self._last_batch
        code = free(self, rec)
        self._last_batch = last  # the rows of a batch outlive its requests
        return code

    RequestTable._free = broken
    return lambda: setattr(RequestTable, "_free", free)


def _split_keeps_page_hashes() -> Callable[[], None]:
    from runtime.tree.page_hasher import PageHasher

    on_split = PageHasher.on_split
    PageHasher.on_split = lambda self, lower, upper: None  # the lower part keeps all its hashes
    return lambda: setattr(PageHasher, "on_split", on_split)


def _clear_leaves_pages() -> Callable[[], None]:
    from runtime.tree.tiers.storage import StorageTier

    forget = StorageTier.forget_stored

    def broken(self: StorageTier) -> list[bytes]:
        forget(self)
        return []  # nothing to remove: the hints are gone, the pages are not

    StorageTier.forget_stored = broken
    return lambda: setattr(StorageTier, "forget_stored", forget)


def _detach_forgets_stored() -> Callable[[], None]:
    from runtime.tree.cache import CacheCore
    from runtime.tree.records import StoredPages

    disable = CacheCore.disable_storage
    CacheCore.disable_storage = lambda self: disable(self) and StoredPages(set(), set())
    return lambda: setattr(CacheCore, "disable_storage", disable)


def _attach_resets_counters() -> Callable[[], None]:
    from runtime.tree.cache import CacheCore
    from runtime.tree.tiers.storage import COUNTERS

    enable = CacheCore.enable_storage

    def broken(self: CacheCore, kept=None, read_only: bool = False) -> None:
        enable(self, kept, read_only)
        # the old way: the counters belong to the tier, and a new tier starts them from zero
        self.storage.stats = self._storage_stats = dict.fromkeys(COUNTERS, 0)

    CacheCore.enable_storage = broken
    return lambda: setattr(CacheCore, "enable_storage", enable)


def _gone_forgets_doubtful() -> Callable[[], None]:
    from runtime.tree.tiers.storage import StorageTier

    gone = StorageTier._gone

    def broken(self: StorageTier, keys: list[bytes]) -> None:
        gone(self, keys)
        self.doubtful.difference_update(keys)  # forgotten: a clear removes none of them

    StorageTier._gone = broken
    return lambda: setattr(StorageTier, "_gone", gone)


def _internal_error_as_validation() -> Callable[[], None]:
    from runtime.errors import LengthError
    from runtime.memory.ledger import SlotLedger
    from runtime.memory.owners import Tier

    alloc = SlotLedger.alloc

    def broken(self: SlotLedger, num_pages: int, owner, **ctx):
        if self.tier is Tier.DEVICE and num_pages == 2:
            raise LengthError(f"{self.tier.value}: {num_pages} pages is not a whole allocation unit")
        return alloc(self, num_pages, owner, **ctx)

    SlotLedger.alloc = broken
    return lambda: setattr(SlotLedger, "alloc", alloc)


def _state_match_not_cut() -> Callable[[], None]:
    from runtime.tree.groups.recurrent import RecurrentStates

    usable_end, hit_state = RecurrentStates.usable_end, RecurrentStates.hit_state

    def deepest_on_path(self: RecurrentStates, node):
        # the hit ends where the KV match ends; the state comes from the deepest snapshot above it
        while node is not None and node not in self.node_state:
            node = node.parent
        return hit_state(self, node)

    RecurrentStates.usable_end = lambda self, look, host_len: look.device_len + host_len
    RecurrentStates.hit_state = deepest_on_path

    def undo() -> None:
        RecurrentStates.usable_end, RecurrentStates.hit_state = usable_end, hit_state

    return undo


def _state_load_other_snapshot() -> Callable[[], None]:
    from runtime.tree.groups.recurrent import RecurrentStates

    start_load = RecurrentStates._load_copy

    def broken(self: RecurrentStates, host_nodes, slot, op_id):
        # the load of a host-only chain brings back another node's host snapshot for its deepest node
        deepest = host_nodes[-1]
        other = next((n for n in self.host_state if n is not deepest), None)
        if other is None:
            return start_load(self, host_nodes, slot, op_id)
        mine = self.host_state[deepest]
        self.host_state[deepest], self.host_state[other] = self.host_state[other], mine
        try:
            return start_load(self, host_nodes, slot, op_id)
        finally:
            self.host_state[deepest], self.host_state[other] = mine, self.host_state[deepest]

    RecurrentStates._load_copy = broken
    return lambda: setattr(RecurrentStates, "_load_copy", start_load)


def _state_leaf_grows() -> Callable[[], None]:
    from runtime.tree.groups.recurrent import RecurrentStates
    from runtime.tree.residency import Residency

    insert = Residency.insert

    def broken(self: Residency, tokens, extra_key, slots, owner, start=None, extend_leaf=False, *args, **kw):
        # `RequestKV.insert` asks for growth in place except where `start` holds a snapshot (no copy
        # is ever busy without a host tier): ask for it there too
        states = next((g for g in self.groups if isinstance(g, RecurrentStates)), None)
        if start is not None and states is not None and start in states.node_state:
            extend_leaf = True
        return insert(self, tokens, extra_key, slots, owner, start, extend_leaf, *args, **kw)

    Residency.insert = broken
    return lambda: setattr(Residency, "insert", insert)


def _swa_drop_inside_window() -> Callable[[], None]:
    from runtime.tree.groups.sliding import SlidingWindow

    limit = SlidingWindow.limit
    SlidingWindow.limit = lambda self, n: max(0, (n - self.window + 1 + self.page_size) // self.page_size)
    return lambda: setattr(SlidingWindow, "limit", limit)


def _swa_no_cut() -> Callable[[], None]:
    from runtime.tree.groups.sliding import SlidingWindow

    usable_end = SlidingWindow.usable_end
    SlidingWindow.usable_end = lambda self, look, host_len=0: look.device_len + host_len
    return lambda: setattr(SlidingWindow, "usable_end", usable_end)


def _swa_backup_skips_sliding() -> Callable[[], None]:
    from runtime.tree.groups.sliding import SlidingWindow

    start_backup = SlidingWindow.start_backup

    def broken(self: SlidingWindow, op_id, node, device, host):
        start_backup(self, op_id, node, device, host)  # records the backup (and its missing pages)
        return ()  # ...but its plan copies only the full layers

    SlidingWindow.start_backup = broken
    return lambda: setattr(SlidingWindow, "start_backup", start_backup)


def _overdue_read_released() -> Callable[[], None]:
    from runtime.tree.tiers.storage import StorageTier

    mark_overdue = StorageTier.mark_overdue

    def broken(self: StorageTier, op_id: int):
        sop = self.ops.get(op_id)
        out = mark_overdue(self, op_id)
        if sop is not None and not sop.write and len(sop.host) and sop.prefetch is not None:
            # nobody waits for the read any more: its host pages go back now (its ack frees them again)
            pf = sop.prefetch
            self.residency.host.unpin(sop.host, op_id, trusted=True)
            self.residency.free_host(sop.host, pf.owner, trusted=True, rid=pf.rid, reason="prefetch_overdue")
        return out

    StorageTier.mark_overdue = broken
    return lambda: setattr(StorageTier, "mark_overdue", mark_overdue)


def _unchecked(plant: Callable[[], Callable[[], None]], check: str) -> Callable[[], Callable[[], None]]:
    """`plant` with the invariant checker's part `check` (`runtime.invariants.groups._check_states`,
    `_check_sliding`) off: the fingerprint oracles alone must find it."""
    def install() -> Callable[[], None]:
        import runtime.invariants.groups as invariants

        undo_plant, checker = plant(), getattr(invariants, check)
        setattr(invariants, check, lambda core, group, nodes: None)

        def undo() -> None:
            undo_plant()
            setattr(invariants, check, checker)

        return undo

    return install


# the storage plants search only the episodes on file storage (the storage-content oracle's), the
# state plants those with recurrent state: each is found in the same episode as by the whole run,
# in less time (calls of the episodes skipped are not counted: test_planted bounds the episode)
EPISODES: dict[str, Callable[[object], bool]] = {
    "hybrid": lambda cfg: cfg.hybrid,  # type: ignore[attr-defined]
    "storage": lambda cfg: cfg.storage != "none",  # type: ignore[attr-defined]
    "file": lambda cfg: cfg.storage == "file",  # type: ignore[attr-defined]
    "swa": lambda cfg: cfg.sliding,  # type: ignore[attr-defined]
}

PLANTS: dict[str, Plant] = {
    "remap_duplicates": Plant(_remap_duplicates, frozenset({"slots-changed", "slot-shared", "kv-content"})),
    "shorten_record": Plant(_shorten_record, frozenset({"token-record"})),
    "decode_swaps_slots": Plant(_decode_swaps_slots, frozenset({"extend-result", "slot-shared", "slots-changed",
                                                                 "kv-content"})),
    "failed_load_keeps_loads_below": Plant(_failed_load_keeps_loads_below,
                                           frozenset({"invariant", "runtime-failed", "kv-content", "leak"})),
    "stale_batch_rows": Plant(_stale_batch_rows, frozenset({"accepted-invalid", "decode-result", "extend-result",
                                                             "slot-shared", "slots-changed", "kv-content", "invariant",
                                                             "runtime-failed"})),
    "host_leaf_ignores_children": Plant(_host_leaf_ignores_children, frozenset({"invariant", "runtime-failed"}),
                                        "evictable host leaves"),
    "internal_error_as_validation": Plant(_internal_error_as_validation, frozenset({"runtime-failed"}), "LengthError"),
    "split_keeps_page_hashes": Plant(_split_keeps_page_hashes, frozenset({"kv-events"})),
    "clear_leaves_pages": Plant(_clear_leaves_pages, frozenset({"storage-content"}), episodes="file"),
    "detach_forgets_stored": Plant(_detach_forgets_stored, frozenset({"kv-events", "storage-content"}), episodes="storage"),
    "attach_resets_counters": Plant(_attach_resets_counters, frozenset({"counter-decreased"}), episodes="storage"),
    "gone_forgets_doubtful": Plant(_gone_forgets_doubtful, frozenset({"storage-content"}), episodes="file"),
    "state_match_not_cut": Plant(_state_match_not_cut, frozenset({"state-hit", "state-content"}), episodes="hybrid"),
    "state_leaf_grows": Plant(_state_leaf_grows, frozenset({"invariant", "runtime-failed"}),
                              "holds the state snapshot taken at", episodes="hybrid"),
    "state_leaf_grows_unchecked": Plant(_unchecked(_state_leaf_grows, "_check_states"),
                                        frozenset({"state-content", "tree-state-content"}), episodes="hybrid"),
    "state_load_other_snapshot": Plant(_state_load_other_snapshot, frozenset({"invariant", "runtime-failed"}),
                                       "not that node's snapshot", episodes="hybrid"),
    "state_load_other_snapshot_unchecked": Plant(_unchecked(_state_load_other_snapshot, "_check_states"),
                                                 frozenset({"state-content", "tree-state-content"}), episodes="hybrid"),
    "swa_drop_inside_window": Plant(_swa_drop_inside_window, frozenset({"invariant", "runtime-failed"}),
                                    "whose sliding KV was dropped", episodes="swa"),
    "swa_drop_inside_window_unchecked": Plant(_unchecked(_swa_drop_inside_window, "_check_sliding"),
                                              frozenset({"swa-window", "swa-content"}), episodes="swa"),
    "swa_no_cut": Plant(_swa_no_cut, frozenset({"swa-cut", "swa-window"}), episodes="swa"),
    "swa_backup_skips_sliding": Plant(_swa_backup_skips_sliding, frozenset({"tree-kv-content", "swa-content"}),
                                      episodes="swa"),
}

# searched in the peer episodes (`harness.peer_episode`), a stream of their own
PEER_PLANTS: dict[str, Plant] = {
    "overdue_read_released": Plant(_overdue_read_released,
                                   frozenset({"runtime-failed", "invariant", "leak", "kv-content", "tree-kv-content"}),
                                   episodes="peer"),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plants", nargs="+", choices=sorted(PLANTS | PEER_PLANTS), metavar="plant",
                    help="one or more, each searched alone in turn (one JSON line each)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--calls", type=int, default=20_000, help="give up after this many API calls")
    ap.add_argument("--shrink-s", type=float, default=30.0)
    args = ap.parse_args(argv)

    from runtime.trace import configure_logging
    from tests.fuzz import harness

    configure_logging()
    for name in args.plants:
        print(json.dumps(search(harness, name, args.seed, args.calls, args.shrink_s)), flush=True)
    return 0


def search(harness, name: str, seed: int, calls: int, shrink_s: float) -> dict:  # noqa: ANN001 - the module
    """Search for plant `name` (installed for the search only); what `main` prints for it."""
    peer = name in PEER_PLANTS
    plant = PEER_PLANTS[name] if peer else PLANTS[name]
    undo = plant.install()
    try:
        if peer:
            report = harness.fuzz(seed, calls, shrink_s=shrink_s, want=plant.wanted, episodes=harness.peer_episode)
        else:
            report = harness.fuzz(seed, calls, shrink_s=shrink_s, want=plant.wanted,
                                  only=EPISODES[plant.episodes] if plant.episodes else None)
    finally:
        undo()
    out = {"plant": name, "seed": seed, "found": report.failure is not None,
           "episodes": report.episodes, "calls": report.calls, "seconds": round(report.seconds, 1),
           "passed_over": [f"episode {ep}: {v.kind}" for ep, v in report.passed_over]}
    if report.failure is not None:
        v = report.failure.violation
        assert v is not None and report.shrunk is not None
        print(harness.reproduction(report), file=sys.stderr)
        out.update(kind=v.kind, detail=v.detail[:300], episode=report.failed_episode,
                   calls_to_find=report.calls_to_find, steps_in_episode=(v.step or 0) + 1,
                   shrunk_steps=len(report.shrunk), deterministic=report.failure.cfg.deterministic)
    return out


if __name__ == "__main__":
    sys.exit(main())

"""SlidingWindow: the tree's rule for the sliding-window layers' KV (docs/ARCHITECTURE.md, "Pool groups").

A sliding layer at position p reads positions max(0, p-W+1)..p, so a hit ending at e needs the
sliding KV of [e-W+1, e) only; full layers need all of [0, e). The rule, by construction:

- **cut**: a match ending at e is usable only if every page over [max(0, e-W+1), e) still has
  its sliding page; otherwise it is cut back to the deepest page boundary where that holds
  (or 0). `usable_end`, in `Residency.usable_match`: admit, can_admit and match_prefix alike.
  (This class is the sliding layers' `PoolGroup`: `runtime/tree/groups/base.py` names its hooks.)
- **drop**: a node's page may give back its sliding page only if it ends at or before
  `end - W + 1` of the node's own end (`limit` leading pages): every descendant's end lies
  after the node's end, so its window starts later, and keeping each node's last W-1 tokens
  (page-rounded) keeps every node end matchable. Dropped pages are a prefix of the node's
  pages (a split hands each half a prefix), and pinned pages (a copy reads them) never drop.
  A running request's window never reads a dropped page: its reads start at or after
  `committed_len - W + 1`, inside the window of its locked node's end, or in pages of its own.
- **running requests**: a live request's own pages wholly before its read start
  (`committed_len - W + 1`) are never read again by it; they drop after the tree's (`read_past`,
  over the records `CacheCore` hands in), a leading run of its own pages. Inserted later, they are a prefix of the
  new node, as the tree's drop leaves one; an insert end whose window they were is cut, as a
  split's.
- **eviction**: when the sliding pool is short, droppable pages go first, nodes in the tree's
  eviction order (`drop`), then whole nodes (`Residency.evict_device`).
- **split**: a split at q makes q a node end; if pages of q's window were dropped already,
  matches at q are cut (correct, just a shorter hit).
- **host copies** keep every layer: a backup copies the sliding rows of the pages that have them
  and records how many leading pages do not (`host_missing`, a prefix like the device's); the
  cut reads it for a match's host-only part, and a load gives back the sliding pages of those.

Owns the host copies' missing prefixes and the backups' in flight, counters and the cut of the
admission in progress; for device copies which pages are dropped is `SwaSlots.map` (-1), read
through the node's full slots, so splits, adoption and eviction need nothing here.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from runtime.errors import LengthError
from runtime.memory.groups import GroupSpec
from runtime.memory.swa import SWA_POOL, PairedLedger, SwaSlots
from runtime.messages import PoolTransfer
from runtime.tree.groups.base import DryRun, PoolGroup
from runtime.tree.nodes import MatchResult, Node
from runtime.tree.radix import RadixTree
from runtime.tree.records import RequestRecord

__all__ = ["SlidingWindow", "COUNTERS"]

COUNTERS = ("swa_pages_dropped", "swa_cut_backs", "swa_cut_tokens")


class SlidingWindow(PoolGroup):
    COUNTERS = COUNTERS
    COUNTS = ("swa_free_slots",)

    # -- state -------------------------------------------------------------------
    def __init__(self, spec: GroupSpec, window: int, swa: SwaSlots, ledger: PairedLedger, tree: RadixTree,
                 requests: Mapping[Hashable, RequestRecord]) -> None:
        """`requests`: the live request records, by rid (the request table's, only read here:
        `read_past`)."""
        self.spec = spec
        self.window = window
        self.page_size = swa.page_size
        self.swa = swa
        self.ledger = ledger
        self.tree = tree
        self.stats: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._cut = 0  # tokens the current admission's look was cut by (note_cut, admitted)
        # host copies: leading pages of a node's host copy without sliding KV (absent: none), and
        # those of each backup in flight (op id -> pages), given to its chain at the ack
        self.host_missing: dict[Node, int] = {}
        self.backups: dict[int, int] = {}
        self.requests = requests

    # -- live requests (their records are CacheCore's: read here, never written) --
    def read_past(self) -> Iterator[np.ndarray]:
        """Per live request, its own full pages wholly before its read start: its next forward
        computes from `committed_len` on, reading from `committed_len - W + 1`, and its inserts
        end past its cached prefix, so none of its reads needs their sliding KV (a rewind into
        their window is refused: `check_rewind`). Session turns keep theirs: the session's next
        turn reads them."""
        ps, window = self.page_size, self.window
        for rec in self.requests.values():
            if rec.session is not None:
                continue
            end = max(0, rec.committed_len - window + 1) // ps * ps
            if end > rec.cached_len:
                yield rec.slot_range(rec.cached_len, end)[::ps] // ps

    def check_rewind(self, rec: RequestRecord, new_len: int) -> None:
        """A rewind recomputes from `new_len`, reading [new_len - W + 1, new_len): LengthError,
        nothing changed, if a page there gave back its sliding KV (`read_past` dropped it)."""
        if new_len >= rec.committed_len:
            return
        ps = self.page_size
        lo = max(0, new_len - self.window + 1) // ps * ps
        gone = ~self.swa.present(rec.slot_range(lo, new_len)[::ps] // ps)
        if gone.any():
            last = lo + (int(np.flatnonzero(gone)[-1]) + 1) * ps  # the end of the last dropped page
            raise LengthError(f"rewind of {rec.rid!r} to {new_len} would read positions before {last} whose "
                              f"sliding KV was dropped; rewind to at least {last + self.window - 1}")

    # -- matching ----------------------------------------------------------------
    def usable_end(self, look: MatchResult, host_len: int = 0) -> int:
        """The deepest page boundary e <= `look.device_len + host_len` whose window [e-W+1, e)
        has every sliding page present, on device for the device part and in the host copy for
        the host-only part after it (0: none)."""
        ps = self.page_size
        flags = [self.swa.present(node.device[::ps] // ps) for node in look.device_nodes]
        if host_len:
            flags += [np.arange(node.num_tokens // ps) >= self.host_missing.get(node, 0) for node in look.host_nodes]
        if not flags:
            return 0
        present = np.concatenate(flags)[: (look.device_len + host_len) // ps]
        gone = np.concatenate(([0], np.cumsum(~present)))
        ends = np.arange(1, len(present) + 1)
        lo = np.maximum(0, ends * ps - self.window + 1) // ps
        ok = np.flatnonzero(gone[ends] == gone[lo])
        return int(ok[-1] + 1) * ps if len(ok) else 0

    def note_cut(self, cut: int) -> None:
        """An admission's look was cut by `cut` tokens (0: not cut); counted by `admitted` once
        the admission succeeds (a refused admit, retried, would count again)."""
        self._cut = cut

    def admitted(self) -> None:
        if self._cut:
            self.stats["swa_cut_backs"] += 1
            self.stats["swa_cut_tokens"] += self._cut
            self._cut = 0

    # -- the drop rule -----------------------------------------------------------------
    def limit(self, num_tokens: int) -> int:
        """Leading pages of a node of `num_tokens` that lie outside its end's window."""
        return max(0, (num_tokens - self.window + 1) // self.page_size)

    def droppable(self, node: Node, start: int = 0, end: int | None = None) -> np.ndarray:
        """Full pages of `node` whose sliding page may drop now: present, in the first `limit`
        pages, up to the first pinned one (dropped pages stay a prefix). `start`, `end`: the
        node's tokens [start, end) only, as if splits made them a node of their own."""
        if node.device is None:
            return np.empty(0, dtype=np.int64)
        end = node.num_tokens if end is None else end
        n = self.limit(end - start)
        if n == 0:
            return np.empty(0, dtype=np.int64)
        ps = self.page_size
        return self._leading(node.device[start: start + n * ps: ps] // ps)

    def _leading(self, pages: np.ndarray) -> np.ndarray:
        """Of candidate `pages` (a leading run of a node's or a request's own), those present,
        up to the first pinned one (a copy reads it): dropping them keeps the dropped a prefix."""
        pages = pages[self.swa.present(pages)]
        pinned = np.flatnonzero(self.ledger.pins_of(pages))
        return pages[: pinned[0]] if len(pinned) else pages

    def drop(self, need: int) -> int:
        """Give back up to `need` droppable sliding pages, nodes in the tree's eviction order,
        then running requests' pages they read no more; returns how many. O(nodes log nodes):
        only when the sliding pool is short."""
        if need <= 0:
            return 0
        key = self.tree.policy.key
        dropped = 0
        for node in sorted((n for n in self.tree.nodes() if n.device is not None), key=key):
            dropped += self.swa.give_back(self.droppable(node)[: need - dropped])
            if dropped >= need:
                break
        else:
            for pages in self.read_past():
                dropped += self.swa.give_back(self._leading(pages)[: need - dropped])
                if dropped >= need:
                    break
        self.stats["swa_pages_dropped"] += dropped
        return dropped

    def before_evict(self, target_free: int) -> None:
        """Sliding pages dropped first, as many as the sliding pool is short of `target_free`."""
        self.drop(target_free - self.swa.num_free_pages())

    def grows_in_place(self, node: Node, first_slot: int) -> bool:
        """Own pages whose sliding KV dropped must start a node (dropped pages are a node's
        prefix): a leaf grows in place only if the first new page still has its sliding page."""
        return bool(self.swa.map[first_slot] >= 0)

    def counts(self) -> dict[str, int]:
        return {"swa_free_slots": self.swa.num_free_pages() * self.page_size}

    # -- host copies (CopyTracker, Residency) -------------------------------------------
    def start_backup(self, op_id: int, node: Node, device: np.ndarray, host: np.ndarray) -> tuple[PoolTransfer, ...]:
        """A backup of `device` pages into `host` pages (pinned by the copy, so none drops while
        it runs) copies the sliding rows of the pages that have them; the leading pages that do
        not are recorded for its host copy (`end_backup`)."""
        ps = self.page_size
        present = self.swa.present(device[::ps] // ps)
        self.backups[op_id] = int(np.count_nonzero(~present))
        return self._transfer(self.swa.map[device], host, np.repeat(present, ps))

    def end_backup(self, op_id: int, chain: list[Node], ok: bool) -> None:
        """The backup's ack: its missing pages go to its chain's host copies, first nodes first
        (none if it failed)."""
        missing = self.backups.pop(op_id)
        for node in chain if ok else ():
            if missing <= 0:
                break
            self.host_missing[node] = min(missing, node.num_tokens // self.page_size)
            missing -= node.num_tokens // self.page_size

    def start_load(self, op_id: int, host_nodes: list[Node], reserved: Any = None) -> tuple[PoolTransfer, ...]:
        """A load into the host-only chain's fresh device copies: pages whose host copy lacks
        sliding KV give back their new sliding page (a prefix of each node, as a drop leaves
        it); the others' sliding rows are copied."""
        ps = self.page_size
        for node in host_nodes:
            k = self.host_missing.get(node, 0)
            if k:
                assert node.device is not None
                self.swa.give_back(node.device[: k * ps: ps] // ps)
        device = np.concatenate([node.device for node in host_nodes])  # type: ignore[misc]
        host = np.concatenate([node.host for node in host_nodes])  # type: ignore[misc]
        dst = self.swa.map[device]
        return self._transfer(host, dst, dst >= 0)

    def on_split(self, lower: Node, upper: Node) -> None:
        """A split hands the host copy's missing prefix to the upper half first."""
        k = self.host_missing.pop(lower, 0)
        if k:
            up = upper.num_tokens // self.page_size
            self.host_missing[upper] = min(k, up)
            if k > up:
                self.host_missing[lower] = k - up

    def drop_host(self, node: Node) -> None:
        self.host_missing.pop(node, None)

    @staticmethod
    def _transfer(src: np.ndarray, dst: np.ndarray, keep: np.ndarray) -> tuple[PoolTransfer, ...]:
        """One `PoolTransfer` of the sliding pool copying `src[keep]` -> `dst[keep]` (none if empty)."""
        if not keep.any():
            return ()
        return (PoolTransfer(SWA_POOL, torch.from_numpy(src[keep].copy()), torch.from_numpy(dst[keep].copy())),)

    # -- dry runs (room_for) ---------------------------------------------------------------
    def room(self, pages: int, look: MatchResult | None, dry_run: DryRun) -> bool:
        """The sliding pool reaches `pages` free by drops first, then by the node evictions that
        free the token pool's pages too (`Residency.evict_device`), weighed in sliding pages."""
        need = pages - self.swa.num_free_pages() - self.droppable_total(look)
        return need <= 0 or dry_run(need, self.kept_pages) >= need

    def droppable_total(self, look: MatchResult | None) -> int:
        """Pages `drop` could give back now. An admission's partly matched last node is split at
        its match end first, which becomes a node end: its upper part keeps that end's window."""
        split = look.nodes[-1] if look is not None and look.partial and look.num_device_nodes == len(look.nodes) \
            else None
        total = 0
        for node in self.tree.nodes():
            if node.device is None:
                continue
            if node is split:
                assert look is not None
                total += len(self.droppable(node, 0, look.partial)) + len(self.droppable(node, look.partial))
            else:
                total += len(self.droppable(node))
        return total + sum(len(self._leading(pages)) for pages in self.read_past())

    def kept_pages(self, node: Node, tail: int = 0) -> int:
        """Sliding pages evicting `node` gives back beyond what `drop` would: its present pages
        that are not droppable (`tail` > 0: of its last `tail` tokens, as if split off)."""
        ps = self.page_size
        assert node.device is not None
        start = len(node.device) - tail if tail else 0
        present = int(np.count_nonzero(self.swa.present(node.device[start::ps] // ps)))
        return present - len(self.droppable(node, start))

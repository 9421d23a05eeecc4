"""StorageTier: the tree side of the storage tier (made by `CacheCore.enable_storage`).

Every host backup that lands is written through to storage by page hash (a write `StorageOp`),
and `prepare`/`admit` look up what storage holds beyond the device + host hit and read it into
fresh host pages (a read `StorageOp`, owned by a `Prefetch` until it lands), which become
host-only tree nodes; the normal host -> device load follows. A storage op pins its host pages
(ledger pin keyed by the op id) and a write protects its chain's host copies (`protect_host`
over the recorded length, so a split keeps both halves protected). A write's keys and host
pages are a snapshot taken at issue: a split during the write never shrinks what is written
(seed 002, storage variant).

It owns the storage ops, the prefetch records and their waiting policy (an admit waits for its
request's prefetch under `wait`/`timeout`), the ops past their deadline, the KV identity the
page hashes encode and the page hashes known stored (written, or found by a lookup or read): what
`clear_storage` removes. No op starts while a storage control drains (`paused`) or the backend is
`down`; an overdue lookup ends its prefetch (it has no pages in flight), a skipped op teaches nothing.

A hybrid model's host snapshots go with their node's KV (docs/ARCHITECTURE.md, "Recurrent state";
keys and chunking: `runtime.storage.state_blobs`): a write carries the host snapshots of its chain
(their slots pinned by the op), a lookup asks for the snapshots at its page boundaries and the
prefetch is cut to the deepest one stored (none: no hit), and the read brings that snapshot into a
host state slot of its own, which the node ending there adopts when the read lands; KV whose state
did not land is not adopted.
"""

from __future__ import annotations

from collections.abc import Container, Hashable, Iterator, Sequence
from typing import Any

import numpy as np

from runtime.config import RuntimeConfig
from runtime.errors import ArgumentError, InternalError, LengthError
from runtime.memory.owners import Owner
from runtime.events.wire import STORAGE
from runtime.messages import StateBlob
from runtime.storage.hashing import KVIdentity, page_hashes, rank_identities, rank_page_keys
from runtime.trace import get_logger
from runtime.tree.radix import MatchResult, Node
from runtime.tree.records import (EMPTY, Prefetch, PrefetchWait, StorageOp, StorageRequest, StoredPages, aligned,
                                  written_runs)
from runtime.tree.residency import Residency

_log = get_logger("hicache.storage")
# Memory is bounded by live state: records of rids that were prepared but never admitted or
# aborted are capped (past the cap a prepared rid's abort is an unknown rid: harmless). The record
# of page hashes known stored is not: `clear_storage` removes exactly those pages, so it must
# name every one (about 100 bytes per stored page, a page being KBs to MBs of KV).
_PREPARED_CAP = 4096
COUNTERS = ("storage_writes_issued", "storage_pages_written", "storage_write_failures", "storage_lookups_issued",
            "storage_reads_issued", "storage_pages_read", "storage_read_misses", "storage_read_failures",
            "tokens_storage_hit", "prefetch_skipped", "prefetch_aborted", "storage_writes_skipped",
            # a hybrid model's state snapshots (the `state` stats group)
            "state_storage_writes", "state_storage_write_failures", "state_storage_hits", "state_storage_misses")


def storage_key_ok(extra_key: Hashable) -> bool:
    """Namespaces the page hash encodes (the façade accepts only these)."""
    if extra_key is None or type(extra_key) in (str, bytes, int):
        return True
    return type(extra_key) is tuple and all(storage_key_ok(k) for k in extra_key)


class StorageTier:
    attached = True  # (`NoStorage`: none)

    # -- state -------------------------------------------------------------------
    def __init__(self, config: RuntimeConfig, residency: Residency, op_ids: Iterator[int],
                 identity: KVIdentity, stats: dict[str, int] | None = None, writes: bool = True) -> None:
        """`stats`: the counters to add to (`COUNTERS`), kept by the owner so that they outlive this
        tier (a detach and attach replaces the tier, never the counters: they only grow);
        `writes`: False for a backend that stores nothing (`read_only`: a prefill peer)."""
        self.config = config  # (its prefetch policy; tiers-only mode issues its own reads: `read`)
        self.residency = residency
        self._op_ids = op_ids
        # one control plane over tensor-parallel ranks: every rank's identity, its keys its own (the
        # tree's own records, `known` and KV events, name a page by rank 0's key); one with one list
        self.identities = rank_identities(identity, config.tp_ranks) or (identity,)
        # an admit with a waiter may wait for its prefetch (policy not `best_effort`)
        self.may_wait = config.prefetch_policy != "best_effort"
        residency.use_hasher(identity)  # nodes' page hashes (the residency's), shared with KV events
        self.ops: dict[int, StorageOp] = {}
        self.overdue: set[int] = set()  # ops past their deadline: in flight until their ack, awaited by nobody
        self.prefetches: dict[Hashable, Prefetch] = {}
        self.prefetched: set[Hashable] = set()  # rids whose prefetch landed, not yet admitted or aborted
        self.prefetch_landed: dict[Hashable, int] = {}  # rid -> tokens its prefetch brought to host
        # what it knows of the backend's pages (`StoredPages`): those this runtime wrote or found
        # stored (skip rewriting them), those in doubt (a clear removes them too), a known page's
        # other ranks' keys, and a hybrid model's snapshots known stored, by the hash of the page each
        # follows, with their chunk keys (no KV events: they are not pages of a prefix)
        self.stored = StoredPages(set(), set())
        self.states = residency.snapshots  # a hybrid model's host snapshots (none: `NoSnapshots`)
        # why no op starts now: "control" (a clear or detach drains the ops), "down" (the backend is,
        # `StorageHealthChanged`, until it is back); "writes": no write starts (a read-only backend)
        self.held: set[str] = set() if writes else {"writes"}
        self._requests: list[StorageRequest] = []
        self.stats: dict[str, int] = stats if stats is not None else dict.fromkeys(COUNTERS, 0)

    def pause(self, paused: bool) -> None:
        """A storage control (clear, detach) drains the ops: no op starts while paused."""
        (self.held.add if paused else self.held.discard)("control")

    def mark_down(self, down: bool) -> None:
        (self.held.add if down else self.held.discard)("down")

    @property
    def paused(self) -> bool:
        return "control" in self.held

    def restore(self, kept: StoredPages) -> None:
        """What this runtime knew of the backend's pages when it detached the same backend."""
        self.stored = kept

    @property
    def identity(self) -> KVIdentity:
        """The identity the page hashes encode (rank 0's)."""
        return self.identities[0]

    @property
    def ranks(self) -> tuple[KVIdentity, ...]:
        """Every rank's identity when each rank has keys of its own; () when one key list serves all."""
        return self.identities if len(self.identities) > 1 else ()

    @property
    def known(self) -> set[bytes]:
        return self.stored.known

    @property
    def doubtful(self) -> set[bytes]:
        return self.stored.doubtful

    @property
    def rank_keys(self) -> dict[bytes, tuple[bytes, ...]]:
        return self.stored.rank_keys

    @property
    def known_states(self) -> dict[bytes, tuple[bytes, ...]]:
        return self.stored.states

    # -- writes ------------------------------------------------------------------
    def write(self, node: Node, length: int, host: np.ndarray) -> None:
        """Write the pages of the last `length` tokens of `node`'s path, held in host slots `host`
        (a landed backup's or offload's snapshot), to storage: those not known stored yet."""
        res = self.residency
        if self.held or not storage_key_ok(node.extra_key):
            return
        ps = res.page_size
        path = res.tree.path_tokens(node)
        first = (len(path) - length) // ps
        every = res.hasher.path(node)  # type: ignore[union-attr] (made at this tier's start)
        hashes = every[first:]
        pick = [i for i, h in enumerate(hashes) if h not in self.known]
        blobs = self.states.blobs_to_write(res.tree.split_chain(node, length), every, self.known_states)
        if not pick and not blobs:
            return
        keys = [hashes[i] for i in pick]
        rank_keys = self.keys_per_rank(path, node.extra_key, keys, [first + i for i in pick])
        host = host.reshape(-1, ps)[pick].reshape(-1)
        op_id = next(self._op_ids)
        res.host.pin(host, op_id, trusted=True)  # (whole pages of host copies the ledger allocated)
        res.tree.protect_host(node, length)
        for blob in blobs:  # (read by the write: pinned until its ack, its node's host copy protected)
            self.states.pin_host(blob.slot, op_id)  # type: ignore[union-attr] (blobs: a recurrent store's)
        # (tokens and parents: what a STORAGE event of the written pages says)
        self.ops[op_id] = StorageOp(op_id, True, host, keys, node=node, length=length, rank_keys=rank_keys,
                                    states=blobs, tokens=path[first * ps:].reshape(-1, ps)[pick].reshape(-1),
                                    parents=[every[first + i - 1] if first + i else None for i in pick])
        self._requests.append(StorageRequest(op_id, True, tuple(keys), self._host_pages(host), rank_keys, blobs))
        self.stats["storage_writes_issued"] += 1

    def write_chain(self, node: Node, length: int) -> None:
        """Write the last `length` tokens of `node`'s path, just handed to the tree as host copies,
        to storage (skipped while a node of it has no host copy yet: its backup's ack writes it)."""
        chain = self.residency.tree.split_chain(node, length)
        if all(n.host is not None for n in chain):
            self.write(node, length, np.concatenate([n.host for n in chain]))

    # -- prefetch ----------------------------------------------------------------
    def prepare(self, rid: Hashable, tokens: np.ndarray, extra_key: Hashable) -> int:
        """Start looking up in storage the pages of `tokens` (checked by the caller; `rid` not
        live) beyond the device + host hit; the read of what it finds follows (`_read`). Returns
        the tokens looked up (0: nothing started)."""
        res = self.residency
        if "control" in self.held or "down" in self.held or rid in self.prefetches or not storage_key_ok(extra_key):
            return 0
        ps = res.page_size
        match_len = aligned(len(tokens) - 1, ps)
        look = res.tree.match(tokens[:match_len], extra_key, split=False, touch=False)
        start = look.device_len + look.host_len
        if match_len - start < max(ps, self.config.prefetch_threshold):
            return 0
        every = self._hashes(tokens[:match_len], extra_key)
        keys = every[start // ps:]
        blobs = self.states.blobs_to_look_up(keys)
        # first a lookup (no host pages): host pages are taken, evicting host copies if need be,
        # only for what storage holds (`_read`)
        op_id = next(self._op_ids)
        pf = Prefetch(rid, Owner.prefetch(rid, next(self._op_ids)), extra_key, tokens[:match_len], start,
                      op_id, EMPTY)
        if start:
            self._hold_anchor(pf, res.tree.settle(look, touch=False))
            pf.link = every[start // ps - 1]
        rank_keys = self.keys_per_rank(tokens[:match_len], extra_key, keys, range(start // ps, match_len // ps))
        self.prefetches[rid] = pf
        self.ops[op_id] = StorageOp(op_id, False, EMPTY, keys, prefetch=pf, rank_keys=rank_keys, states=blobs)
        self._requests.append(StorageRequest(op_id, False, tuple(keys), (), rank_keys, blobs))
        self.stats["storage_lookups_issued"] += 1
        return len(keys) * ps

    def read(self, rid: Hashable, tokens: np.ndarray, extra_key: Hashable, start: int,
             keys: list[bytes], link: bytes | None = None,
             reserved: tuple[np.ndarray, Owner] | None = None) -> tuple[Prefetch, StorageRequest] | None:
        """Tiers-only mode: read `keys`, the pages of `tokens` from `start` on, into fresh host
        pages now (the engine's scheduler asked storage itself: no lookup, no waiting policy); the
        caller keeps [0, start) in the tree until the read's ack. `link`: the hash of the page
        before `start` (a STORAGE event's parent). Returns the prefetch and its storage request
        (not queued in `take_requests`); None: no host room. `reserved`: host pages (one per key)
        and their owner, taken beforehand: the read takes them over."""
        if (link is None) != (start == 0):
            raise ArgumentError(f"a read from token {start} needs the hash of the page before it, and only then")
        if reserved is not None and len(reserved[0]) != len(keys) * self.residency.page_size:
            raise LengthError(f"a read of {len(keys)} pages given {len(reserved[0])} reserved host slots")
        pf = Prefetch(rid, Owner.prefetch(rid, next(self._op_ids)), extra_key, tokens, start, 0, EMPTY,
                      detached=True, by_prepare=False)  # (detached: lands into the tree for whoever comes next)
        pf.link = link
        if reserved is not None:
            self.residency.assign_host(reserved[0], reserved[1], pf.owner, trusted=True)
        request = self._issue_read(pf, keys, host=None if reserved is None else reserved[0])
        return None if request is None else (pf, request)  # (the caller carries the request to its worker)

    def wait_for(self, rid: Hashable, tokens: np.ndarray, extra_key: Hashable, waiter: Any) -> PrefetchWait | None:
        """The prefetch an admit of `rid` (not live; `may_wait`, a `waiter`) waits for, with `waiter`
        appended to it; None: admit now (nothing to fetch)."""
        pf = self.prefetches.get(rid)
        if pf is None and self.prepare(rid, tokens, extra_key):
            pf = self.prefetches[rid]
            pf.by_prepare = False  # the admit's own: its rid is not one the caller prepared
        if pf is None:
            return None
        pf.wait(waiter)
        timeout = self.config.prefetch_timeout(len(tokens)) if self.config.prefetch_policy == "timeout" else None
        return PrefetchWait(pf, timeout)

    def detach(self, pf: Prefetch) -> None:
        """The request stops waiting (best_effort admit, timeout): the read goes on and lands into
        the tree; an abort of the request no longer cancels it."""
        if self.prefetches.get(pf.rid) is pf:
            del self.prefetches[pf.rid]
            pf.detached = True

    def mark_overdue(self, op_id: int) -> Prefetch | None:
        """A storage call ran past its deadline: nothing waits for it any more. Returns its
        prefetch, detached, when admits wait on it (they go on without it)."""
        sop = self.ops.get(op_id)
        if sop is None:  # its ack came first
            return None
        self.overdue.add(op_id)
        pf = sop.prefetch
        if pf is not None and not sop.write and not len(sop.host):
            # a lookup holds no pages in flight: its prefetch ends here, a miss (the late answer is dropped)
            self._end_lookup(pf)
            pf.cancelled = pf.detached = True
            return pf if pf.waiters else None
        if pf is not None and pf.waiters:
            self.detach(pf)
            return pf
        return None

    def cancel(self, rid: Hashable) -> Prefetch | None:
        """Abort of a prepared rid: its prefetch is cancelled (host pages freed at its ack)."""
        pf = self.prefetches.pop(rid, None)
        if pf is None:
            return None
        pf.cancelled = True
        self.stats["prefetch_aborted"] += 1
        return pf

    def forget(self, rid: Hashable) -> bool:
        """Forget that `rid` was prepared (its landed pages are the tree's, nothing to release);
        True if it was."""
        self.prefetch_landed.pop(rid, None)
        was = rid in self.prefetched
        self.prefetched.discard(rid)
        return was

    def admitted(self, rid: Hashable, host_len: int) -> int:
        """`rid` was admitted with `host_len` tokens loaded from host: it is no longer a prepared
        rid, and a prefetch still running goes on without it (`detach`); returns how many of those
        tokens its prefetch brought from storage."""
        pf = self.prefetches.get(rid)
        if pf is not None:
            self.detach(pf)
        self.prefetched.discard(rid)
        return min(self.prefetch_landed.pop(rid, 0), host_len)

    # -- acks ---------------------------------------------------------------------
    def apply_ack(self, op_id: int, pages: int, error: str | None, ok: tuple[bool, ...],
                  busy: Container[int], states_ok: tuple[bool, ...] = (), skipped: bool = False) -> Prefetch | None:
        """A storage op finished. A write marks its stored pages known; a lookup starts the read of
        what it found; a read's leading `pages` become host copies in the tree (the rest is freed;
        `busy`: node ids with a backup in flight, which take none). `states_ok`: per state snapshot
        the op carried, whether it was written, found or read whole. `skipped`: the call was not
        made (no news of what storage holds): the op ends as if it found and stored nothing. Returns
        the prefetch when it ended here (its waiting admits can run), else None."""
        res = self.residency
        sop = self.ops.pop(op_id)
        if skipped and sop.prefetch is not None:  # (it ends with nothing landed or learnt)
            self._prepared(sop.prefetch)
            sop.prefetch.cancelled = True
        self.overdue.discard(op_id)
        if len(sop.host):  # a lookup pinned nothing
            res.host.unpin(sop.host, op_id, trusted=True)
        states_ok = states_ok if error is None and len(states_ok) == len(sop.states) else (False,) * len(sop.states)
        for blob in sop.states:
            if blob.slot >= 0:
                self.states.unpin_host(blob.slot, op_id)  # type: ignore[union-attr]
        if sop.write:
            self._write_landed(sop, error, ok, skipped)
            if not skipped:
                self._states_written(sop, states_ok)
            return None
        pf = sop.prefetch
        assert pf is not None
        if not len(sop.host):
            return self._lookup_landed(sop, pf, pages, error, states_ok)
        return self._read_landed(sop, pf, pages, error, busy, states_ok)

    def _read_landed(self, sop: StorageOp, pf: Prefetch, pages: int, error: str | None, busy: Container[int],
                     states_ok: tuple[bool, ...]) -> Prefetch:
        """A read's leading `pages` (with the snapshot after them, for a hybrid model) become host
        copies in the tree; the rest is freed. The prefetch ends here."""
        res = self.residency
        op_id = sop.op_id
        if self.prefetches.get(pf.rid) is pf:
            del self.prefetches[pf.rid]
        ps = res.page_size
        if error is not None:
            self.stats["storage_read_failures"] += 1
            _log.warning("storage_read_failed", op=op_id, rid=str(pf.rid), error=error)
            pages = 0
        self._prepared(pf)
        if pf.cancelled:
            pages = 0
        else:
            self._gone(sop.keys[pages:])  # (evicted elsewhere): rewrite it next time
            self._found(pf, sop, pages)
            self.stats["storage_read_misses"] += len(sop.keys) - pages
            self.stats["storage_pages_read"] += pages
        if sop.states and pages and not states_ok[0]:
            # KV without its state is no usable end: adopt none of it (rewrite the state next time)
            self.stats["state_storage_misses"] += 1
            self.stored.doubt_state(sop.states[0].page)
            pages = 0
        rest = pf.host[pages * ps:]
        if len(rest):
            res.free_host(rest, pf.owner, trusted=True, rid=pf.rid, reason="prefetch_unused")
        if pages:
            # the read pages become host copies in the tree (the same hand-over as decode offload's)
            taken, end = res.adopt_host_run(pf.tokens[:pf.start + pages * ps], pf.extra_key, pf.start,
                                            pf.host[:pages * ps], pf.owner, pf.rid, busy)
            self.stats["tokens_storage_hit"] += taken
            if not pf.detached and not pf.cancelled and len(self.prefetch_landed) < _PREPARED_CAP:
                self.prefetch_landed[pf.rid] = taken
            if sop.states:  # the node ending where the KV ends takes the state read with it
                if self.states.adopt_host(end, sop.states[0].slot, pf.owner,  # type: ignore[union-attr]
                                          pf.start + pages * ps):
                    self.stats["state_storage_hits"] += 1
        elif sop.states:
            self.states.free_host(sop.states[0].slot, pf.owner, rid=pf.rid, reason="prefetch_unused")  # type: ignore[union-attr]
        self._release_anchor(pf)  # from here the landed pages keep their anchor in the tree
        return pf

    def kept(self) -> StoredPages:
        """What it knows stored or in doubt, for a re-attach of the same backend (no op in flight)."""
        if self.ops:
            raise InternalError("storage detached with storage ops in flight")
        return self.stored

    def forget_stored(self) -> list[bytes]:
        """`clear_storage`, with no op in flight: the page hashes known stored, forgotten (the
        caller removes them from the backend; KV events report them removed)."""
        if self.ops:
            raise InternalError(f"storage clear with {len(self.ops)} storage ops in flight")
        # (the doubtful ones were reported removed when doubted)
        self.residency.events.removed_pages(sorted(self.known), STORAGE)
        pages = self.known | self.doubtful
        out = sorted(pages | {k for page in pages for k in self.rank_keys.get(page, ())}
                     | {k for keys in self.known_states.values() for k in keys})
        self.known.clear()
        self.doubtful.clear()
        self.rank_keys.clear()
        self.known_states.clear()
        return out

    def take_requests(self) -> list[StorageRequest]:
        """The storage calls issued since the last call, for the transfer actor."""
        out, self._requests = self._requests, []
        return out

    def all_overdue(self) -> bool:
        """Every storage op in flight is past its deadline (or none is in flight)."""
        return len(self.ops) == len(self.overdue)

    # -- helpers -------------------------------------------------------------------
    def _write_landed(self, sop: StorageOp, error: str | None, ok: tuple[bool, ...], skipped: bool) -> None:
        assert sop.node is not None
        self.residency.tree.unprotect_host(sop.node, sop.length)
        if skipped:  # (not stored, not a failure: the backend was down or busy)
            self.stats["storage_writes_skipped"] += 1
            return
        # (debug, not a warning per write: they are counted, `storage_write_failures`, and a failing
        # backend's state is what is worth a log line, `runtime.storage.health`)
        if error is not None:
            ok = ()
            _log.debug("storage_write_failed", op=sop.op_id, pages=len(sop.keys), error=error)
        stored = [k for k, good in zip(sop.keys, ok) if good]
        if error is None and len(stored) < len(sop.keys):
            _log.debug("storage_pages_not_written", op=sop.op_id, failed=len(sop.keys) - len(stored))
        self.known.update(stored)
        self.stored.remember_ranks(sop.keys, sop.rank_keys, [i for i, good in enumerate(ok) if good])
        if stored:
            self._announce(sop, ok)
        self.stats["storage_pages_written"] += len(stored)
        self.stats["storage_write_failures"] += len(sop.keys) - len(stored)

    def _states_written(self, sop: StorageOp, states_ok: tuple[bool, ...]) -> None:
        for blob, good in zip(sop.states, states_ok, strict=True):
            if good:
                self.known_states[blob.page] = blob.keys
            else:
                _log.warning("storage_state_not_written", op=sop.op_id, slot=blob.slot)
        written = sum(states_ok)
        self.stats["state_storage_writes"] += written
        self.stats["state_storage_write_failures"] += len(sop.states) - written

    def _announce(self, sop: StorageOp, ok: tuple[bool, ...]) -> None:
        """STORAGE events of a write's stored pages: one per run of consecutive written pages."""
        assert sop.tokens is not None and sop.parents is not None and sop.node is not None
        ps = self.residency.page_size
        for i, j in written_runs(sop.keys, ok, sop.parents):
            self.residency.events.stored_pages(sop.keys[i:j], sop.parents[i], sop.tokens[i * ps: j * ps],
                                               sop.node.extra_key, STORAGE)

    def _found(self, pf: Prefetch, sop: StorageOp, pages: int) -> None:
        """Storage holds the leading `pages` of `sop`'s keys (a lookup or read of `pf` found them on
        every rank): known stored, and a STORAGE event for those not known before (from the first
        such page on)."""
        keys = sop.keys[:pages]
        self.stored.remember_ranks(sop.keys, sop.rank_keys, range(pages))
        known = self.stored.known
        new = next((i for i, k in enumerate(keys) if k not in known), len(keys))
        if new < len(keys):
            ps = self.residency.page_size
            lo = pf.start + new * ps
            self.residency.events.stored_pages(keys[new:], keys[new - 1] if new else pf.link,
                                               pf.tokens[lo: pf.start + len(keys) * ps], pf.extra_key, STORAGE)
        known.update(keys)

    def missing(self, keys: list[bytes]) -> None:
        """The engine's own lookup (tiers-only mode) found `keys[0]` missing. When it was known
        stored, storage lost pages behind our back (evicted by another writer, or the directory
        wiped): nothing known is trusted any more, so every page is written again with the next
        write of a path holding it (`write` skips only known pages); else as `_gone`."""
        self._gone(list(self.known) if keys and keys[0] in self.known else keys)

    def _gone(self, keys: list[bytes]) -> None:
        """A lookup or read stopped at `keys[0]`, missing: it and the pages after it (likely evicted
        with it; written again next time) are no longer known stored (a STORAGE removal of those that
        were); those after it may still be there, so a clear still removes them (`doubtful`)."""
        known = self.known
        was = [k for k in keys if k in known]
        if was:
            self.residency.events.removed_pages(was, STORAGE)
            known.difference_update(was)
            self.doubtful.update(was)

    def _lookup_landed(self, sop: StorageOp, pf: Prefetch, pages: int, error: str | None,
                       states_ok: tuple[bool, ...]) -> Prefetch | None:
        """A lookup found the leading `pages` of its keys: read them, or end the prefetch here. A
        hybrid model's read ends at the deepest of them whose state snapshot is stored (none: none)."""
        found = pages if error is None and not pf.cancelled else 0
        if error is not None:
            self.stats["storage_read_failures"] += 1
            _log.warning("storage_lookup_failed", op=sop.op_id, rid=str(pf.rid), error=error)
        elif not pf.cancelled:
            self.stats["storage_read_misses"] += len(sop.keys) - found
            self._gone(sop.keys[found:])
            self._found(pf, sop, found)
        blob = None
        if sop.states:
            cut = [b for b, good in zip(sop.states, states_ok, strict=True) if good and b.after <= found]
            blob = max(cut, key=lambda b: b.after) if cut else None
            if found and blob is None:
                self.stats["state_storage_misses"] += 1
            for b in sop.states:  # asked for and not found whole (deeper than the one found): rewrite them
                if b.after <= found and (blob is None or b.after > blob.after):
                    self.stored.doubt_state(b.page)
            found = blob.after if blob is not None else 0
            if blob is not None:  # found stored, as the KV before it (`_found`): a clear removes it
                self.known_states[blob.page] = self.states.blob_keys(blob.page)  # type: ignore[union-attr]
        if found and self._read(pf, sop.keys[:found], blob):
            return None  # its waiters wait for the read
        self._end_lookup(pf)
        return pf

    def _end_lookup(self, pf: Prefetch) -> None:
        """`pf` ends at its lookup (nothing to read): its anchor released, its rid no longer fetching."""
        self._release_anchor(pf)
        self._prepared(pf)
        if self.prefetches.get(pf.rid) is pf:
            del self.prefetches[pf.rid]

    def _prepared(self, pf: Prefetch) -> None:
        """`pf` ends, or lands: a prepared rid's is remembered (a later abort of it is no unknown rid)."""
        if pf.by_prepare and not pf.cancelled and not pf.detached and len(self.prefetched) < _PREPARED_CAP:
            self.prefetched.add(pf.rid)

    def _read(self, pf: Prefetch, keys: list[bytes], blob: StateBlob | None = None) -> bool:
        """After a lookup found `keys` (the leading ones it looked up): take host pages for them and
        read them, with the state snapshot `blob` after the last one (a hybrid model's). False when
        nothing was started (the prefetch ends)."""
        res = self.residency
        ps = res.page_size
        # a cap on host memory held by prefetches: half the host pool
        held = sum(len(p.host) for p in self.prefetches.values()) // ps
        room = max(0, res.host.num_pages // 2 - held)
        if blob is not None and room < len(keys):  # (cut short, the read would end at no stored state)
            self.stats["prefetch_skipped"] += 1
            return False
        request = self._issue_read(pf, keys[:room], blob)
        if request is None:
            return False
        self._requests.append(request)
        return True

    def _issue_read(self, pf: Prefetch, keys: list[bytes], blob: StateBlob | None = None,
                    host: np.ndarray | None = None) -> StorageRequest | None:
        """Read `keys` (pages of tokens from `pf.start` on) into host pages taken for `pf` (`host`:
        pages `pf` owns already), and the state snapshot `blob` into a host state slot taken for
        `pf`; returns the read's storage request (None: no host room)."""
        res = self.residency
        slot = None
        if blob is not None:  # (a blob comes from a recurrent store's lookup)
            slot = self.states.take_host(pf.owner, rid=pf.rid)  # type: ignore[union-attr]
        if host is None:
            host = res.alloc_host(len(keys), pf.owner, rid=pf.rid, reason="prefetch") if keys and \
                (blob is None or slot is not None) else None
        if host is None:
            if slot is not None:
                self.states.free_host(slot, pf.owner, rid=pf.rid, reason="prefetch_skipped")  # type: ignore[union-attr]
            self.stats["prefetch_skipped"] += 1
            return None
        op_id = next(self._op_ids)
        res.host.pin(host, op_id, trusted=True)  # (the ledger's own alloc)
        states: tuple[StateBlob, ...] = ()
        if blob is not None and slot is not None:
            self.states.pin_host(slot, op_id)  # type: ignore[union-attr]
            # (its chunk keys: known since the lookup found it, `_lookup_landed`)
            states = (StateBlob(slot, self.known_states[blob.page], blob.after, page=blob.page),)
        pf.op_id, pf.host = op_id, host
        pf.tokens = pf.tokens[:pf.start + len(keys) * res.page_size]
        first = pf.start // res.page_size
        rank_keys = self.keys_per_rank(pf.tokens, pf.extra_key, keys, range(first, first + len(keys)))
        self.ops[op_id] = StorageOp(op_id, False, host, keys, prefetch=pf, rank_keys=rank_keys, states=states)
        self.stats["storage_reads_issued"] += 1
        return StorageRequest(op_id, False, tuple(keys), self._host_pages(host), rank_keys, states)

    def _hold_anchor(self, pf: Prefetch, m: MatchResult) -> None:
        """Keep the prefetch's anchor (the matched prefix `m`, ending exactly at `pf.start`) in the
        tree until the prefetch ends: its device part locked, its host-only part host-protected."""
        tree = self.residency.tree
        if m.num_device_nodes:
            pf.anchor_lock = m.last_device_node
            tree.lock(pf.anchor_lock)
        if m.host_len:
            pf.anchor_host, pf.anchor_host_len = m.last_node, m.host_len
            tree.protect_host(m.last_node, m.host_len)

    def _release_anchor(self, pf: Prefetch) -> None:
        tree = self.residency.tree
        if pf.anchor_lock is not None:
            tree.unlock(pf.anchor_lock)
            pf.anchor_lock = None
        if pf.anchor_host is not None:
            tree.unprotect_host(pf.anchor_host, pf.anchor_host_len)
            pf.anchor_host = None

    def _hashes(self, tokens: np.ndarray, extra_key: Hashable) -> list[bytes]:
        return page_hashes(tokens, self.residency.page_size, extra_key, self.identity)

    def keys_per_rank(self, tokens: np.ndarray, extra_key: Hashable, keys: list[bytes],
                       pages: Sequence[int]) -> tuple[tuple[bytes, ...], ...]:
        if len(self.identities) == 1:  # (one key list serves every rank)
            return ()
        return rank_page_keys(tokens, self.residency.page_size, extra_key, self.identities, keys, pages)

    def _host_pages(self, host: np.ndarray) -> tuple[int, ...]:
        ps = self.residency.page_size
        return tuple((host[::ps] // ps).tolist())

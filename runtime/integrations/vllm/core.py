"""TiersOnlyCore: the host tier for an engine that owns device memory (tiers-only mode).

The engine (vLLM through `runtime.integrations.vllm`) owns the device KV blocks and the request
lifecycle; this core owns the host tier: a radix tree of host copies by page (a page is one of
the engine's blocks) over the host slot ledger, through a host-only `Residency`. It says how
many tokens past the engine's own device hit the host tier holds (`lookup`; `reserve` also holds
them for the request until its load: a hit reported to the engine is one the tiers can load),
turns a hit into a load into the blocks the engine allocated (`load`), and a request's computed
blocks into a backup of the pages the tier lacks (`backup`). Plans are full mode's immutable `TransferPlan`s
whose device slots are ``block_id * page_size + offset`` in the engine's KV tensors; acks come
back through `apply_ack`. Synchronous and loop-free: the engine's scheduler drives it directly.

With storage (`enable_storage`), full mode's `StorageTier` sits behind the host tier: a landed
backup is written through to storage by page hash, `lookup` also asks storage (through the
backend's `exists_prefix`) for the pages after the host hit. `reserve(stage=True)` reads those
into host pages first (a staging read, `TierStage`), reporting nothing of them until they joined
the tree; `load` can also read them into fresh host pages that the same load then copies to the
engine's blocks (the read's pages join the tree at its ack, after the load's).

Ownership, as in full mode:
- a host page has one owner: a tree node, or the backup that fills it until its ack;
- a copy pins the host pages it touches until its ack; a load locks the tree path it reads, a
  backup the cached prefix it extends, so neither is evicted under it;
- a reported hit (`reserve`) holds what its load needs until the load, `release` or `finish`:
  the host path it reads locked, and host pages for its storage part, owned by the hold (a part
  no host room can be had for is cut from the hit, and counted);
- a staging read owns its host pages until its ack (then the tree's, or freed) and locks the
  prefix they hang under; landed, it locks their path for its request until the request's next
  `reserve` or `finish`;
- the engine's blocks are the engine's: it must not free a block a backup still reads or a
  load still writes (a request aborted mid-load). `finish(rid)` says whether one is in flight
  (vLLM's ``delay_free_blocks``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runtime.config import RuntimeConfig
from runtime.errors import ArgumentError, LengthError, StateError, UnknownRequestError
from runtime.memory.owners import Owner
from runtime.messages import Direction, TransferPlan
from runtime.storage.backend import checked_count
from runtime.storage.hashing import KVIdentity, page_hashes
from runtime.trace import SlotTracer, get_logger
from runtime.tree.radix import Node
from runtime.tree.records import aligned, make_plan
from runtime.tree.residency import Residency
from runtime.tree.tiers.storage import StorageRequest, StorageTier, storage_key_ok
from runtime.validation import tokens as checked_tokens

log = get_logger("hicache.tiers_only")


@dataclass(slots=True)
class TierCopy:
    """An in-flight load or backup: a snapshot of what it covers, taken when issued."""

    op_id: int
    rid: Hashable
    direction: Direction
    host: np.ndarray  # host slots it reads (load) or fills (backup), pinned
    node: Node | None  # locked: the path a load reads, or the prefix a backup extends (None: no prefix)
    tokens: np.ndarray | None = None  # backup: the tokens whose pages [start, len) it copies
    start: int = 0
    extra_key: Hashable = None
    owner: Owner | None = None  # backup: the owner of its host pages until its ack
    read: int = 0  # load: the storage read it copies from first (an asynchronous load), else 0


@dataclass(frozen=True, slots=True)
class TierHit:
    """Tokens past the engine's own hit that the tiers hold: the host tier's, then storage's
    (those need a storage read first: an asynchronous load)."""

    host: int = 0
    storage: int = 0
    staging: bool = False  # the storage part is being read into host pages (`reserve(stage=True)`): not a hit yet

    @property
    def total(self) -> int:
        return self.host + self.storage


@dataclass(frozen=True, slots=True)
class TierLoad:
    """What `load` started: the host -> device plan (None: nothing), the tokens it covers, and the
    storage read it depends on. A read of ``k`` pages fills plan pages ``[read_at, read_at + k -
    read_skip)`` from its page ``read_skip`` on; a read cut short leaves the plan's later pages
    unfilled (the engine recomputes them)."""

    plan: TransferPlan | None = None
    tokens: int = 0
    read: StorageRequest | None = None
    read_at: int = 0
    read_skip: int = 0
    from_storage: int = 0  # of its tokens, those storage brought (read now, or staged for the request)


NO_HIT, NO_LOAD = TierHit(), TierLoad()
_NO_SLOTS = np.empty(0, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class TierHold:
    """A hit reported to the engine, held for its request until its load: the host path the
    load reads, locked (nothing evicts it), and host pages taken for its storage read of tokens
    [start, start + len(host)), owned by `owner`."""

    rid: Hashable
    start: int  # where its storage read starts: the end of the host path
    node: Node | None  # locked (None: nothing to lock, or a namespace root)
    host: np.ndarray = field(default_factory=lambda: _NO_SLOTS)
    owner: Owner | None = None
    staged: tuple[int, int] = (0, 0)  # the tokens [from, to) its request's staging brought to the host tier


@dataclass(slots=True)
class TierStage:
    """A storage hit of `rid`'s being staged: read into host pages before anything is reported to
    the engine. While the read runs (`read`: its op id) it locks the prefix the read's pages will
    hang under; once they joined the tree (`read` 0) it locks the path they landed on, for `rid`,
    until its next `reserve` (which locks what it reports) or `finish`. A read the request stopped
    waiting for (`detached`) still locks its prefix until its ack."""

    rid: Hashable
    read: int
    node: Node | None
    tokens: np.ndarray  # the request's tokens the read covers the end of
    extra_key: Hashable
    start: int  # the read's first token
    detached: bool = False
    landed: int = 0  # the end of the tokens it brought to the host tier (once landed)

    def detach(self) -> None:
        self.detached = True

    def land(self, node: Node | None, landed: int) -> None:
        """Its read's ack was applied: `node` (the path its pages landed on) is locked for it now."""
        self.read, self.node, self.landed = 0, node, landed


@dataclass(slots=True)
class TierRequest:
    """A request of the engine's with copies in flight; gone once it is finished and they acked."""

    rid: Hashable
    copies: set[int] = field(default_factory=set)
    finished: bool = False


class TiersOnlyCore:
    # -- state -------------------------------------------------------------------
    def __init__(self, page_size: int, host_slots: int, num_device_blocks: int, *, eviction_policy: str = "lru",
                 tracer: SlotTracer | None = None) -> None:
        for name, v in (("page_size", page_size), ("host_slots", host_slots), ("num_device_blocks", num_device_blocks)):
            if type(v) is not int or v <= 0:
                raise ArgumentError(f"{name} must be a positive int, got {v!r}")
        if host_slots % page_size:
            raise LengthError(f"host_slots ({host_slots}) must be a multiple of page_size ({page_size})")
        self.page_size = page_size
        self.num_device_blocks = num_device_blocks
        self.residency = Residency(page_size, 0, host_slots, eviction_policy=eviction_policy, tracer=tracer)
        self.residency.tree.on_split = self.residency.on_split  # a split hands the upper part's pages over
        self.requests: dict[Hashable, TierRequest] = {}
        self.copies: dict[int, TierCopy] = {}
        self._reads_copied: set[int] = set()  # storage reads whose loads are in flight (they pin the reads' pages)
        self.holds: dict[Hashable, TierHold] = {}  # reported hits not loaded yet, by request
        self.stages: dict[Hashable, TierStage] = {}  # storage hits being staged, or staged, by request
        self.stage_reads: dict[int, TierStage] = {}  # the staging reads in flight, by storage op
        self._stage_requests: list[StorageRequest] = []  # staging reads issued, not taken yet
        self._op_ids = itertools.count(1)
        self._generations = itertools.count(1)
        self._offsets = np.arange(page_size, dtype=np.int64)
        self.storage: StorageTier | None = None  # enable_storage()
        self._exists: Callable[[list[bytes]], int] | None = None
        self.stats: dict[str, int] = dict.fromkeys(
            ("lookups", "tokens_host_hit", "tokens_storage_hit", "tokens_loaded", "tokens_storage_loaded",
             "tokens_backed_up", "tokens_backup_skipped", "load_errors", "backup_errors", "storage_lookup_errors",
             # hits cut at their report to the host room their load could have (never promised); loads
             # that covered less than the hit reported (the tiers lost its pages since: none while
             # hits are held); storage reads that came back short (their loads' later blocks unfilled)
             "hits_cut", "tokens_hit_cut", "loads_short", "storage_reads_short",
             # storage hits staged into host pages before their report; those that came back
             # short (pages gone from storage since the lookup: a shorter hit); tokens staged
             "stagings", "stagings_short", "tokens_staged"), 0)

    def enable_storage(self, identity: KVIdentity, exists_prefix: Callable[[list[bytes]], int],
                       tp_ranks: int = 1, *, evicts_tails_first: bool = False) -> None:
        """A storage tier behind the host tier: pages addressed by `identity`'s page hashes;
        `exists_prefix` (the backend's) answers lookups on the scheduler's thread. `tp_ranks` > 1:
        the engine's tensor-parallel ranks, each storing its own shard under its own keys
        (`identity` is rank 0's; a storage op carries every rank's, `StorageRequest.rank_keys`,
        and a lookup counts the pages every rank has). `evicts_tails_first`: the backend evicts a
        stored chain from its end (the file backend's LRU stamps a chain's earlier pages newer),
        so a lookup asks for only the last of the leading pages known stored (written and acked,
        or found), and the pages after them: that page there, the ones before it are too."""
        if self.storage is not None:
            raise StateError("storage is enabled already")
        config = RuntimeConfig(page_size=self.page_size, tp_ranks=tp_ranks, tp_size=tp_ranks)
        self.storage = StorageTier(config, self.residency, self._op_ids, identity)
        self._exists = exists_prefix
        self._tails_first = evicts_tails_first
        # the page hash is compiled code (`runtime.storage.hash_chain`): compiled, or loaded from
        # numba's cache, at its first call, a quarter to a whole second of CPU; here, at the
        # engine's start, rather than inside the scheduler step of the first request it serves
        self._page_keys(np.zeros(self.page_size + 1, dtype=np.int32), None)

    def page_keys(self, tokens: Any, extra_key: Hashable, known: list[bytes] | None = None) -> list[bytes]:
        """Storage addresses of the whole pages of `tokens` but the last token's (what a lookup
        and a load of them ask storage for); the engine's scheduler may keep them per request.
        `known`: this call's answer for a prefix of `tokens` (a request's tokens only grow): only
        the pages after it are hashed, chained from its last key."""
        tokens = _tokens(tokens)
        if not known:
            return self._page_keys(tokens, extra_key)
        return self._more_keys(tokens, extra_key, known, aligned(len(tokens) - 1, self.page_size))

    # -- the engine's scheduler ----------------------------------------------------
    def lookup(self, tokens: Any, extra_key: Hashable, computed: int, keys: list[bytes] | None = None) -> TierHit:
        """Tokens after `computed` (the engine's own device hit, whole pages) that the host tier,
        then storage, hold: whole pages, leaving the last token to compute. Changes nothing
        (`keys`: `page_keys` of the same tokens, if the caller kept them)."""
        tokens = _tokens(tokens)
        self._check_aligned(computed, "computed", len(tokens))
        _, host_end, stored_end = self._probe(tokens, extra_key, computed, keys)
        return self._counted(_hit(computed, host_end, stored_end))

    def reserve(self, rid: Hashable, tokens: Any, extra_key: Hashable, computed: int,
                keys: list[bytes] | None = None, *, stage: bool = False, storage: bool = True) -> TierHit:
        """`lookup`, holding what the hit needs for `rid` until its `load` (or `release`,
        `finish`): the host path locked, and host pages taken for the storage part, evicting
        host copies for them if need be. A storage part no host room can be had for is cut from
        the hit (`hits_cut`, `tokens_hit_cut`). Replaces `rid`'s hold, if any, and ends its
        staging (`TierStage`; a read still in flight goes on, detached).

        `stage`: a storage part is not held but read now into those host pages (a staging read,
        `take_stage_reads`), nothing held: the hit returned says `staging`, and once the read
        landed the pages are the host tier's, kept for `rid` until its next `reserve` (which then
        finds them as a host hit: a page gone from storage meanwhile is a shorter hit, never a
        failed load). `storage=False`: storage is not asked (the host tier's hit only)."""
        tokens = _tokens(tokens)
        self._check_aligned(computed, "computed", len(tokens))
        self._check_open(rid)
        if stage and self.storage is None:
            raise StateError("staging needs a storage tier")
        self.release(rid)
        ended = self.stages.get(rid)
        staged = (ended.start, ended.landed) if ended is not None and not ended.read else (0, 0)
        lock = self._end_stage(rid)  # (its landed path stays locked until the new hold locked its own)
        try:
            return self._reserve(rid, tokens, extra_key, computed, keys, stage, storage, staged)
        finally:
            if lock is not None:
                self.residency.tree.unlock(lock)

    def _reserve(self, rid: Hashable, tokens: np.ndarray, extra_key: Hashable, computed: int,
                 keys: list[bytes] | None, stage: bool, storage: bool, staged: tuple[int, int]) -> TierHit:
        m, host_end, stored_end = self._probe(tokens, extra_key, computed, keys if storage else None, storage)
        if m is None or stored_end <= computed:
            return self._counted(NO_HIT)
        res = self.residency
        assert res.host is not None
        node = _lockable(m.last_node)
        if node is not None:
            res.tree.lock(node)  # (first: the host room taken next must not evict the path it reads)
        want = (stored_end - host_end) // self.page_size
        owner, got = None, _NO_SLOTS
        if want > 0:
            owner = Owner.request(rid, next(self._generations))
            got = self._take_host(want, owner, rid)
            end = host_end + len(got)
            if end <= computed:  # (the pages it got would all be read only to be skipped)
                res.host.free(got, owner, rid=rid, reason="hold_cut")
                got, end = _NO_SLOTS, host_end
            if end < stored_end:
                self.stats["hits_cut"] += 1
                self.stats["tokens_hit_cut"] += stored_end - max(end, computed)
                stored_end = end
        hold = TierHold(rid, host_end, node, got, owner, staged)
        hit = _hit(computed, host_end, stored_end)
        if hit.total == 0:
            self._drop_hold(hold, 0)
            return self._counted(NO_HIT)
        if stage and len(got):
            return self._stage(hold, tokens[:stored_end], extra_key, keys, hit)
        self.holds[rid] = hold
        return self._counted(hit)

    def _stage(self, hold: TierHold, tokens: np.ndarray, extra_key: Hashable, keys: list[bytes] | None,
               hit: TierHit) -> TierHit:
        """Turn `hold`'s storage part into a staging read now (its pages the read's, its prefix
        lock the stage's until the read's ack)."""
        assert self.storage is not None and hold.owner is not None
        ps = self.page_size
        first = hold.start // ps
        every = keys if keys is not None else self._page_keys(tokens, extra_key)
        wanted = every[first:first + len(hold.host) // ps]
        link = every[first - 1] if first else None
        issued = self.storage.read(hold.rid, tokens, extra_key, hold.start, wanted, link, (hold.host, hold.owner))
        assert issued is not None  # (its host pages are given: no room to find)
        pf, request = issued
        stage = TierStage(hold.rid, request.op_id, hold.node, pf.tokens, extra_key, hold.start)
        self.stages[hold.rid] = self.stage_reads[request.op_id] = stage
        self._stage_requests.append(request)
        self.stats["stagings"] += 1
        return TierHit(hit.host, hit.storage, staging=True)

    def staging(self, rid: Hashable) -> bool:
        """A staging read of `rid`'s is in flight (its hit is not known yet)."""
        stage = self.stages.get(rid)
        return stage is not None and stage.read != 0

    def take_stage_reads(self) -> list[StorageRequest]:
        """The staging reads issued since the last call (the workers run them)."""
        out, self._stage_requests = self._stage_requests, []
        return out

    def _end_stage(self, rid: Hashable) -> Node | None:
        """`rid` stops waiting for its staging: a read in flight goes on detached (its prefix
        lock is its own until its ack); returns the landed path's lock, for the caller to drop."""
        stage = self.stages.pop(rid, None)
        if stage is None:
            return None
        if stage.read:
            stage.detach()
            return None
        return stage.node

    def _stage_landed(self, stage: TierStage, pages: int) -> None:
        """A staging read's ack was applied (its leading `pages` joined the tree): its prefix lock
        is dropped; a stage still waited for locks the path its pages landed on instead."""
        res = self.residency
        if not stage.detached and pages:
            m = res.tree.match(stage.tokens[:stage.start + pages * self.page_size], stage.extra_key,
                               split=False, touch=False)
            landed = _lockable(m.last_node)
            if landed is not None:
                res.tree.lock(landed)  # (first: the prefix lock it replaces covers its path's top)
        else:
            landed = None
        if stage.node is not None:
            res.tree.unlock(stage.node)
        stage.land(landed, stage.start + pages * self.page_size)
        if stage.detached:
            return
        self.stats["tokens_staged"] += pages * self.page_size

    def release(self, rid: Hashable) -> None:
        """Drop `rid`'s hold, if any (the engine did not load the hit it was told of)."""
        hold = self.holds.pop(rid, None)
        if hold is not None:
            self._drop_hold(hold, 0)

    def load(self, rid: Hashable, tokens: Any, extra_key: Hashable, computed: int, count: int,
             block_ids: Sequence[int], keys: list[bytes] | None = None) -> TierLoad:
        """Load `count` tokens after `computed` into the request's blocks (`block_ids`: all of
        them, in order): from the host tier, and what it lacks read from storage first (into host
        pages taken now). Covers fewer than `count` tokens only when the tiers lost pages since
        `lookup` (the engine recomputes the rest). Validates everything before it changes anything."""
        tokens = _tokens(tokens)
        self._check_aligned(computed, "computed", len(tokens))
        self._check_aligned(count, "count", len(tokens) - 1 - computed)
        end = computed + count
        device = self._device_slots(block_ids, computed, end)
        self._check_open(rid)
        hold = self.holds.pop(rid, None)
        used = 0  # pages of the hold's the storage read took over
        try:
            if count == 0:
                return NO_LOAD
            ld, used = self._load(rid, tokens, extra_key, computed, end, device, keys, hold)
        finally:
            if hold is not None:  # (after the load locked its own path)
                self._drop_hold(hold, used)
        if ld.tokens < count:  # the tiers lost pages since the hit was reported: its last blocks stay unfilled
            self.stats["loads_short"] += 1
        return ld

    def _load(self, rid: Hashable, tokens: np.ndarray, extra_key: Hashable, computed: int, end: int,
              device: np.ndarray, keys: list[bytes] | None, hold: TierHold | None) -> tuple[TierLoad, int]:
        """`load`'s work; also returns how many of `hold`'s pages its storage read took over."""
        ps = self.page_size
        res = self.residency
        m = res.tree.match(tokens[:end], extra_key, split=True, touch=True)
        host_end = top = m.host_len
        first = max(host_end, computed)  # the first token the host tier cannot supply
        node = _lockable(m.last_node)
        if node is not None:
            res.tree.lock(node)  # the path it reads stays while host room is made for a read
        parts = [n.host for n in m.nodes]
        read = None
        used = 0
        if self.storage is not None and first < end:
            every = keys if keys is not None else self._page_keys(tokens, extra_key)
            wanted = every[host_end // ps: end // ps]
            link = every[host_end // ps - 1] if host_end and wanted else None  # (a STORAGE event's parent)
            reserved = None
            if hold is not None and hold.start == host_end and 0 < len(wanted) * ps <= len(hold.host):
                assert hold.owner is not None
                reserved = (hold.host[:len(wanted) * ps], hold.owner)  # (the room held since the hit's report)
            issued = self.storage.read(rid, tokens[:end], extra_key, host_end, wanted, link, reserved) \
                if wanted else None
            if issued is not None:
                pf, read = issued
                used = len(wanted) if reserved is not None else 0
                parts.append(pf.host)
                top = end
        if top <= computed:
            if node is not None:
                res.tree.unlock(node)
            return NO_LOAD, used
        host = np.concatenate(parts)[computed:top]
        op = self._issue(rid, Direction.LOAD, host, node, read=read[0] if read else 0)
        # what storage brought: read now, or staged for this request (the part of it loaded)
        lo, hi = (first, end) if read else (hold.staged if hold is not None else (0, 0))
        from_storage = max(0, min(hi, top) - max(lo, computed))
        self.stats["tokens_loaded"] += top - computed
        self.stats["tokens_storage_loaded"] += from_storage
        plan = make_plan(op.op_id, Direction.LOAD, host, device[:top - computed])
        return TierLoad(plan, top - computed, read, (first - computed) // ps, (first - host_end) // ps,
                        from_storage), used

    def backup(self, rid: Hashable, tokens: Any, extra_key: Hashable, computed: int,
               block_ids: Sequence[int]) -> TransferPlan | None:
        """Back up the whole pages of the first `computed` tokens (their KV is in `block_ids`)
        that the host tier lacks, into host pages evicted for them if need be. None when it holds
        them all already, or no host room can be had (nothing changed)."""
        tokens = _tokens(tokens)
        if type(computed) is not int or not 0 <= computed <= len(tokens):
            raise LengthError(f"computed must be an int in [0, {len(tokens)}], got {computed!r}")
        n = aligned(computed, self.page_size)
        device = self._device_slots(block_ids, 0, n)
        self._check_open(rid)
        if n == 0 or self.loading(rid):  # (its blocks do not hold their KV yet: an abort mid-load)
            return None
        res = self.residency
        res.tree.root(extra_key)  # (a namespace's root made here: its copies hang under it)
        m = res.tree.match(tokens[:n], extra_key, split=True, touch=True)
        start = m.host_len
        if start >= n:
            return None
        prefix = _lockable(m.last_node)
        if prefix is not None:
            res.tree.lock(prefix)  # the prefix it extends stays while host room is made
        owner = Owner.request(rid, next(self._generations))
        host = res.alloc_host((n - start) // self.page_size, owner, rid=rid)
        if host is None:
            if prefix is not None:
                res.tree.unlock(prefix)
            self.stats["tokens_backup_skipped"] += n - start
            return None
        op = self._issue(rid, Direction.BACKUP, host, prefix, tokens=tokens[:n], start=start,
                         extra_key=extra_key, owner=owner)
        self.stats["tokens_backed_up"] += n - start
        return make_plan(op.op_id, Direction.BACKUP, device[start:], host)

    def finish(self, rid: Hashable) -> bool:
        """The engine is done with `rid`: returns whether a copy still reads or writes its blocks
        (a backup, or a load when it was aborted mid-load): the engine keeps them until its ack."""
        self.release(rid)
        staged = self._end_stage(rid)
        if staged is not None:
            self.residency.tree.unlock(staged)
        rec = self.requests.get(rid)
        if rec is None:
            return False
        rec.finished = True
        if not rec.copies:
            del self.requests[rid]
            return False
        return True

    def backing_up(self, rid: Hashable) -> bool:
        rec = self.requests.get(rid)
        return rec is not None and any(self.copies[op].direction is Direction.BACKUP for op in rec.copies)

    def loading(self, rid: Hashable) -> bool:
        """A load into `rid`'s blocks is in flight (they do not hold the loaded KV yet)."""
        rec = self.requests.get(rid)
        return rec is not None and any(self.copies[op].direction is Direction.LOAD for op in rec.copies)

    def apply_ack(self, op_id: int, error: str | None) -> TierCopy:
        """A copy ended: unpin and unlock; a backup's pages join the tree (or are freed when it
        failed), a failed load is only counted (the engine recomputes its blocks)."""
        op = self.copies.pop(op_id, None)
        if op is None:
            raise UnknownRequestError(f"ack of unknown copy {op_id}")
        res = self.residency
        assert res.host is not None
        res.host.unpin(op.host, op_id, trusted=True)
        self._reads_copied.discard(op.read)
        if op.direction is Direction.BACKUP:
            assert op.tokens is not None and op.owner is not None
            if error is None:  # (under its lock: the prefix it extends is still there)
                _, node = res.adopt_host_run(op.tokens, op.extra_key, op.start, op.host, op.owner, op.rid, ())
                if self.storage is not None and node is not None:  # write-through of the path's
                    self.storage.write_chain(node, len(op.tokens))  # pages not known stored (healing)
            else:
                self.stats["backup_errors"] += 1
                res.host.free(op.host, op.owner, rid=op.rid, reason="backup_failed")
        elif error is not None:
            self.stats["load_errors"] += 1
        if op.node is not None:
            res.tree.unlock(op.node)
        if error is not None:
            log.warning("tiers_copy_failed", op=op_id, rid=op.rid, direction=op.direction.value, error=error)
        rec = self.requests[op.rid]
        rec.copies.discard(op_id)
        if rec.finished and not rec.copies:
            del self.requests[op.rid]
        return op

    def apply_storage_ack(self, op_id: int, pages: int, error: str | None, ok: tuple[bool, ...]) -> None:
        """A storage op ended: a write's stored pages are known; a read's leading `pages` join the
        tree as host copies (the rest is freed). A read's load is acked first (it pins the read's
        pages)."""
        if self.storage is None or op_id not in self.storage.ops:
            raise UnknownRequestError(f"ack of unknown storage op {op_id}")
        sop = self.storage.ops[op_id]
        if sop.write:
            if error is None and len(ok) != len(sop.keys):
                raise ArgumentError(f"storage write {op_id} of {len(sop.keys)} pages acked with {len(ok)} flags")
        else:
            pages = checked_count("storage read", pages, len(sop.keys))
            if op_id in self._reads_copied:  # (its load pins its pages)
                raise StateError(f"storage read {op_id} acked before the load that copies from it")
        self.storage.apply_ack(op_id, pages, error, ok, ())
        stage = self.stage_reads.pop(op_id, None)
        if stage is not None:  # (a short one is a shorter hit: nothing was promised)
            self._stage_landed(stage, 0 if error is not None else pages)
            if pages < len(sop.keys):
                self.stats["stagings_short"] += 1
        elif not sop.write and pages < len(sop.keys):  # (its load left the blocks after them unfilled)
            self.stats["storage_reads_short"] += 1

    def take_storage_writes(self) -> list[StorageRequest]:
        """The storage writes issued since the last call (a read travels with its load)."""
        return [] if self.storage is None else self.storage.take_requests()

    def busy(self) -> bool:
        """Copies or storage ops are in flight."""
        return bool(self.copies) or (self.storage is not None and bool(self.storage.ops))

    def counts(self) -> dict[str, int]:
        host = self.residency.host
        assert host is not None
        return {"host_free_pages": host.num_free_pages(), "host_cached_tokens": self.residency.tree.total_host_tokens,
                "copies_in_flight": len(self.copies), "requests_tracked": len(self.requests),
                "hits_held": len(self.holds),
                "host_pages_held": sum(len(h.host) for h in self.holds.values()) // self.page_size,
                "stagings": len(self.stages), "staging_reads_in_flight": len(self.stage_reads),
                "storage_ops_in_flight": len(self.storage.ops) if self.storage is not None else 0}

    # -- helpers -------------------------------------------------------------------
    def _issue(self, rid: Hashable, direction: Direction, host: np.ndarray, node: Node | None,
               **backup: Any) -> TierCopy:
        """File a copy that pins `host` and holds `node`'s lock (taken by the caller)."""
        res = self.residency
        assert res.host is not None
        op_id = next(self._op_ids)
        res.host.pin(host, op_id, trusted=True)  # (tree nodes' and the ledger's own page arrays)
        op = self.copies[op_id] = TierCopy(op_id, rid, direction, host, node, **backup)
        if op.read:
            self._reads_copied.add(op.read)
        rec = self.requests.get(rid)
        if rec is None:
            rec = self.requests[rid] = TierRequest(rid)
        rec.copies.add(op_id)
        return op

    def _probe(self, tokens: np.ndarray, extra_key: Hashable, computed: int,
               keys: list[bytes] | None, storage: bool = True) -> tuple[Any, int, int]:
        """(the host match, where the host tier's hit ends, where storage's ends) past `computed`
        (storage asked only with `storage`); (None, 0, 0) when nothing past it can be a hit.
        Changes nothing."""
        self.stats["lookups"] += 1
        ps = self.page_size
        n = aligned(len(tokens) - 1, ps)
        if n <= computed:
            return None, 0, 0
        look = self.residency.tree.match(tokens[:n], extra_key, split=False, touch=False)
        host_end = look.host_len
        stored_end = host_end
        if storage and self._exists is not None and max(host_end, computed) < n:
            wanted = (keys if keys is not None else self._page_keys(tokens, extra_key))[host_end // ps: n // ps]
            if wanted:
                try:
                    stored_end += self._stored_pages(tokens[:n], extra_key, wanted, host_end // ps) * ps
                except Exception as exc:  # noqa: BLE001 - a failing backend is a miss, never a crashed scheduler
                    self.stats["storage_lookup_errors"] += 1  # (counted; the backend's health is what is logged)
                    log.debug("tiers_storage_lookup_failed", error=repr(exc))
        return look, host_end, stored_end

    def _counted(self, hit: TierHit) -> TierHit:
        self.stats["tokens_host_hit"] += hit.host
        self.stats["tokens_storage_hit"] += hit.storage
        return hit

    def _take_host(self, pages: int, owner: Owner, rid: Hashable) -> np.ndarray:
        """Up to `pages` host pages for `owner`, evicting host copies for them: as many as can be had."""
        host = self.residency.host
        assert host is not None
        short = pages - host.num_free_pages()
        if short > 0:
            self.residency.evict_host(short)
        return host.alloc(min(pages, host.num_free_pages()), owner, rid=rid, reason="hold")

    def _drop_hold(self, hold: TierHold, used: int) -> None:
        """Unlock a hold's path and free its pages but the first `used` (a read took them over)."""
        if hold.node is not None:
            self.residency.tree.unlock(hold.node)
        rest = hold.host[used * self.page_size:]
        if len(rest):
            assert hold.owner is not None and self.residency.host is not None
            self.residency.host.free(rest, hold.owner, rid=hold.rid, reason="hold_released")

    def _page_keys(self, tokens: np.ndarray, extra_key: Hashable) -> list[bytes]:
        """`page_keys` of checked tokens."""
        if self.storage is None or not storage_key_ok(extra_key):
            return []
        return page_hashes(tokens[:aligned(len(tokens) - 1, self.page_size)], self.page_size, extra_key,
                           self.storage.identity)

    def _more_keys(self, tokens: np.ndarray, extra_key: Hashable, known: list[bytes], n: int) -> list[bytes]:
        """The page keys of `tokens[:n]` (whole pages), `known` being those of a prefix: the rest
        hashed on from its last key (none hashed when it covers them)."""
        ps = self.page_size
        have = min(len(known), n // ps)
        if have * ps >= n:
            return known[:have]
        if self.storage is None or not storage_key_ok(extra_key):
            return []
        return known[:have] + page_hashes(tokens[have * ps:n], ps, extra_key, self.storage.identity,
                                          parent=known[have - 1] if have else None)

    def _stored_pages(self, tokens: np.ndarray, extra_key: Hashable, wanted: list[bytes], first: int) -> int:
        """The leading pages of `wanted` (the keys of pages `first`.. of `tokens`) that storage
        holds for every rank (each rank's own keys; a later rank is asked only that far)."""
        assert self._exists is not None and self.storage is not None
        every = self.storage.keys_per_rank(tokens, extra_key, wanted, range(first, first + len(wanted))) or (wanted,)
        if self._tails_first and len(every) == 1:
            known = self.storage.known
            k = 0
            while k < len(wanted) and wanted[k] in known:
                k += 1
            if k > 1:  # (the last known page missing: nothing known is trusted, all are asked below)
                found = checked_count("exists_prefix", self._exists(wanted[k - 1:]), len(wanted) - k + 1)
                if found:
                    if k - 1 + found < len(wanted):
                        self.storage.missing(wanted[k - 1 + found:])
                    return k - 1 + found
                self.storage.missing(wanted[k - 1:])
        found = len(wanted)
        for keys in every:
            if found == 0:
                break
            found = checked_count("exists_prefix", self._exists(list(keys[:found])), found)
        if found < len(wanted):  # (known stored, now missing: written again with their next backup)
            self.storage.missing(wanted[found:])
        return found

    def _check_open(self, rid: Hashable) -> None:
        rec = self.requests.get(rid)
        if rec is not None and rec.finished:
            raise StateError(f"request {rid!r} is finished: no copy may start for it")

    def _check_aligned(self, n: Any, what: str, limit: int) -> None:
        if type(n) is not int or n < 0 or n % self.page_size or n > limit:
            raise LengthError(f"{what} must be a whole number of pages ({self.page_size} tokens) in [0, {limit}], "
                              f"got {n!r}")

    def _device_slots(self, block_ids: Sequence[int], start: int, end: int) -> np.ndarray:
        """The engine's device slots of tokens [start, end) of a request holding `block_ids`."""
        ps = self.page_size
        try:
            blocks = np.asarray(block_ids, dtype=np.int64)[start // ps: -(-end // ps)]
        except (TypeError, ValueError, OverflowError):
            raise ArgumentError(f"block ids must be ints, got {block_ids!r:.80}") from None
        # (argmin/argmax: C methods with a fraction of min/max's ufunc overhead)
        if len(blocks) * ps < end - start or (len(blocks) and (blocks[blocks.argmin()] < 0 or
                                                               blocks[blocks.argmax()] >= self.num_device_blocks)):
            raise ArgumentError(f"block ids must cover tokens [{start}, {end}) with blocks in "
                                f"[0, {self.num_device_blocks}), got {len(blocks)} blocks")
        return (blocks[:, None] * ps + self._offsets).reshape(-1)


def _hit(computed: int, host_end: int, stored_end: int) -> TierHit:
    return TierHit(max(0, host_end - computed), max(0, stored_end - max(host_end, computed)))


def _lockable(node: Node) -> Node | None:
    """The node to lock, None for a namespace root: a root needs no lock, and the tree may drop
    an emptied namespace's root and make a new one while a copy runs (found by the tiers-only
    property test: the ack's unlock named a root no longer in the tree)."""
    return None if node.parent is None else node



def _tokens(tokens: Any) -> np.ndarray:
    """The façade's token check (`runtime.validation.tokens`) over any sequence of ints (vLLM
    hands a read-only list view)."""
    return checked_tokens(tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens))

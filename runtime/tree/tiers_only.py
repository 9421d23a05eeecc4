"""TiersOnlyCore: the host tier for an engine that owns device memory (tiers-only mode).

The engine (vLLM through `runtime.integrations.vllm`) owns the device KV blocks and the request
lifecycle; this core owns the host tier: a radix tree of host copies by page (a page is one of
the engine's blocks) over the host slot ledger, through a host-only `Residency`. It says how
many tokens past the engine's own device hit the host tier holds (`lookup`), turns a hit into a
load into the blocks the engine allocated (`load`), and a request's computed blocks into a
backup of the pages the tier lacks (`backup`). Plans are full mode's immutable `TransferPlan`s
whose device slots are ``block_id * page_size + offset`` in the engine's KV tensors; acks come
back through `apply_ack`. Synchronous and loop-free: the engine's scheduler drives it directly.

Ownership, as in full mode:
- a host page has one owner: a tree node, or the backup that fills it until its ack;
- a copy pins the host pages it touches until its ack; a load locks the tree path it reads, a
  backup the cached prefix it extends, so neither is evicted under it;
- the engine's blocks are the engine's: it must not free a block a backup still reads.
  `backing_up(rid)` says whether one is in flight (vLLM's ``delay_free_blocks``).
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runtime.errors import ArgumentError, LengthError, StateError, UnknownRequestError
from runtime.memory.owners import Owner
from runtime.messages import Direction, TransferPlan
from runtime.trace import SlotTracer, get_logger
from runtime.tree.radix import Node
from runtime.tree.records import aligned, make_plan
from runtime.tree.residency import Residency
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
        self._op_ids = itertools.count(1)
        self._generations = itertools.count(1)
        self._offsets = np.arange(page_size, dtype=np.int64)
        self.stats: dict[str, int] = dict.fromkeys(
            ("lookups", "tokens_host_hit", "tokens_loaded", "tokens_backed_up", "tokens_backup_skipped",
             "load_errors", "backup_errors"), 0)

    # -- the engine's scheduler ----------------------------------------------------
    def lookup(self, tokens: Any, extra_key: Hashable, computed: int) -> int:
        """Tokens after `computed` (the engine's own device hit, whole pages) that the host tier
        holds: whole pages, leaving the last token to compute. Read-only."""
        tokens = _tokens(tokens)
        self._check_aligned(computed, "computed", len(tokens))
        self.stats["lookups"] += 1
        n = aligned(len(tokens) - 1, self.page_size)
        if n <= computed:
            return 0
        look = self.residency.tree.match(tokens[:n], extra_key, split=False, touch=False)
        hit = max(0, look.host_len - computed)
        self.stats["tokens_host_hit"] += hit
        return hit

    def load(self, rid: Hashable, tokens: Any, extra_key: Hashable, computed: int, count: int,
             block_ids: Sequence[int]) -> tuple[TransferPlan | None, int]:
        """Load `count` tokens after `computed` from the host tier into the request's blocks
        (`block_ids`: all of them, in order). Returns the plan and the tokens it covers: fewer
        than `count` only when the tier lost pages since `lookup` (the engine recomputes the
        rest). Validates everything before it changes anything."""
        tokens = _tokens(tokens)
        self._check_aligned(computed, "computed", len(tokens))
        self._check_aligned(count, "count", len(tokens) - 1 - computed)
        end = computed + count
        device = self._device_slots(block_ids, computed, end)
        self._check_open(rid)
        if count == 0:
            return None, 0
        m = self.residency.tree.match(tokens[:end], extra_key, split=True, touch=True)
        got = m.host_len - computed
        if got <= 0:
            return None, 0
        host = np.concatenate([n.host for n in m.nodes])[computed:computed + got]
        op = self._issue(rid, Direction.LOAD, host, _lockable(m.last_node))
        self.stats["tokens_loaded"] += got
        return make_plan(op.op_id, Direction.LOAD, host, device[:got]), got

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
        if n == 0:
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
        op = self._issue(rid, Direction.BACKUP, host, prefix, locked=True, tokens=tokens[:n], start=start,
                         extra_key=extra_key, owner=owner)
        self.stats["tokens_backed_up"] += n - start
        return make_plan(op.op_id, Direction.BACKUP, device[start:], host)

    def finish(self, rid: Hashable) -> bool:
        """The engine is done with `rid`: returns whether a backup still reads its blocks (the
        engine keeps them until that backup's ack)."""
        rec = self.requests.get(rid)
        if rec is None:
            return False
        rec.finished = True
        if not rec.copies:
            del self.requests[rid]
        return self.backing_up(rid)

    def backing_up(self, rid: Hashable) -> bool:
        rec = self.requests.get(rid)
        return rec is not None and any(self.copies[op].direction is Direction.BACKUP for op in rec.copies)

    def apply_ack(self, op_id: int, error: str | None) -> TierCopy:
        """A copy ended: unpin and unlock; a backup's pages join the tree (or are freed when it
        failed), a failed load is only counted (the engine recomputes its blocks)."""
        op = self.copies.pop(op_id, None)
        if op is None:
            raise UnknownRequestError(f"ack of unknown copy {op_id}")
        res = self.residency
        assert res.host is not None
        res.host.unpin(op.host, op_id)
        if op.direction is Direction.BACKUP:
            assert op.tokens is not None and op.owner is not None
            if error is None:  # (under its lock: the prefix it extends is still there)
                res.adopt_host_run(op.tokens, op.extra_key, op.start, op.host, op.owner, op.rid, ())
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

    def counts(self) -> dict[str, int]:
        host = self.residency.host
        assert host is not None
        return {"host_free_pages": host.num_free_pages(), "host_cached_tokens": self.residency.tree.total_host_tokens,
                "copies_in_flight": len(self.copies), "requests_tracked": len(self.requests)}

    # -- helpers -------------------------------------------------------------------
    def _issue(self, rid: Hashable, direction: Direction, host: np.ndarray, node: Node | None, *,
               locked: bool = False, **backup: Any) -> TierCopy:
        res = self.residency
        assert res.host is not None
        op_id = next(self._op_ids)
        if not locked and node is not None:
            res.tree.lock(node)
        res.host.pin(host, op_id)
        op = self.copies[op_id] = TierCopy(op_id, rid, direction, host, node, **backup)
        rec = self.requests.get(rid)
        if rec is None:
            rec = self.requests[rid] = TierRequest(rid)
        rec.copies.add(op_id)
        return op

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
        if len(blocks) * ps < end - start or (len(blocks) and (blocks.min() < 0 or blocks.max() >= self.num_device_blocks)):
            raise ArgumentError(f"block ids must cover tokens [{start}, {end}) with blocks in "
                                f"[0, {self.num_device_blocks}), got {len(blocks)} blocks")
        return (blocks[:, None] * ps + self._offsets).reshape(-1)


def _lockable(node: Node) -> Node | None:
    """The node to lock, None for a namespace root: a root needs no lock, and the tree may drop
    an emptied namespace's root and make a new one while a copy runs (found by the tiers-only
    property test: the ack's unlock named a root no longer in the tree)."""
    return None if node.parent is None else node



def _tokens(tokens: Any) -> np.ndarray:
    """The façade's token check (`runtime.validation.tokens`) over any sequence of ints (vLLM
    hands a read-only list view)."""
    return checked_tokens(tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens))

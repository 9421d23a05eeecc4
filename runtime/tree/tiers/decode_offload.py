"""DecodeOffload: the tree side of decode offload (the decode node of a disaggregated setup).

With `config.decode_offload` the offload actor asks for each running request's newly committed
pages to be copied to host (`start`). A finishing or aborted request is *retired*: it leaves the
request table (its rid may be admitted again, under a new generation) but keeps its device slots
and its prefix lock here until the offload actor, told by the ack of its last offload that it is
idle, sends ReleaseOffloaded (`release`, idempotent). Only then are its device slots freed, once
(seed 000); its landed host chunks become host-only tree nodes under its prefix (finish) or are
freed (abort).

It owns the retired requests, the landed chunks, the offload copies in flight (`ops`: what each
covers; the offload actor keeps per request its progress and the op ids it waits for) and the
notes for the offload actor.
An offload's host slots belong to the request (its generation's owner) until that release.
"""

from __future__ import annotations

from collections.abc import Container, Hashable, Iterable, Iterator
from typing import Any

import numpy as np

from runtime.errors import InternalError, StateError
from runtime.memory.owners import Tier
from runtime.messages import Direction, OffloadAck, OffloadCommit, OffloadFinish, OffloadStarted, TransferPlan
from runtime.trace import get_logger
from runtime.tree.radix import Node
from runtime.tree.records import OffloadOp, RequestRecord, RetiredRequest, aligned, make_plan
from runtime.tree.residency import Residency

_log = get_logger("hicache.offload")
Key = tuple[Hashable, int]  # (rid, generation)
COUNTERS = ("offloads_issued", "offloads_skipped", "offloaded_tokens", "offload_releases", "offload_host_tokens_kept",
            "offload_copy_failures")


class DecodeOffload:
    # a released request (not a session turn: its KV stays with its session) is retired until its
    # offloads land
    retires = True

    # -- state -------------------------------------------------------------------
    def __init__(self, residency: Residency, op_ids: Iterator[int]) -> None:
        self.residency = residency
        self._op_ids = op_ids
        self.retired: dict[Key, RetiredRequest] = {}
        self.landed: dict[Key, list[tuple[int, int, np.ndarray]]] = {}  # (start, end, host) per chunk
        self.ops: dict[int, OffloadOp] = {}
        self.inflight: dict[Key, set[int]] = {}  # op ids per request (an index over `ops`)
        self._notes: list[Any] = []  # OffloadCommit / OffloadFinish / OffloadAck for the offload actor
        self._plans: list[TransferPlan] = []
        self.stats: dict[str, int] = dict.fromkeys(COUNTERS, 0)

    # -- the request's life ------------------------------------------------------------

    def note_commits(self, recs: Iterable[RequestRecord]) -> None:
        """The requests `recs` committed tokens (a decode step's, a commit's)."""
        for rec in recs:
            self.note_commit(rec)

    def note_commit(self, rec: RequestRecord) -> None:
        if rec.session is None:
            self._notes.append(OffloadCommit(rec.rid, rec.generation, rec.committed_len, rec.cached_len))

    def retire(self, rec: RequestRecord, final_len: int | None) -> None:
        """The request ended (finish: `final_len` tokens of valid KV; abort: None) and left the
        request table; its device slots and prefix lock stay until `release`."""
        self.retired[(rec.rid, rec.generation)] = RetiredRequest(rec, final_len)
        self._notes.append(OffloadFinish(rec.rid, rec.generation, final_len, rec.cached_len))

    def check_rewind(self, rec: RequestRecord, new_len: int) -> None:
        """Before a rewind: refuse one that would cut an offload in flight (StateError, nothing
        changed); then drop landed chunks that reach past the kept whole pages (their tokens
        will be regenerated)."""
        key = (rec.rid, rec.generation)
        keep = aligned(new_len, self.residency.page_size)
        for op_id in self.inflight.get(key, ()):
            op = self.ops[op_id]
            if op.start + op.length > keep:
                raise StateError(f"rewind of {rec.rid!r} to {new_len}: its offload of tokens "
                                 f"[{op.start}, {op.start + op.length}) is in flight")
        landed = self.landed.get(key)
        if landed:
            for chunk in [c for c in landed if c[1] > keep]:
                landed.remove(chunk)
                self._free_host(chunk[2], rec, "rewound")

    # -- offload copies -------------------------------------------------------------------
    def start(self, rid: Hashable, generation: int, start: int, end: int,
              live: RequestRecord | None) -> OffloadStarted | None:
        """Copy tokens [start, end) of the request (`live` if it is still running, else retired)
        to fresh host slots owned by it. None, with nothing changed, when the request is gone or
        cannot offload that far any more (abort, trim), or the host pool is full after host
        eviction."""
        res = self.residency
        ps = res.page_size
        if start % ps or end % ps or not 0 <= start < end:
            raise InternalError(f"offload range [{start}, {end}) of {rid!r}#{generation} is not whole pages")
        rec, limit = self._record(rid, generation, live)
        reason = None
        host = None
        if rec is None:
            reason = "request released"
        elif end > limit:
            reason = f"only {limit} tokens may be offloaded"
        elif not res.has_host:
            reason = "no host tier"
        else:
            host = res.alloc_host((end - start) // ps, rec.owner, rid=rid, reason="offload")
            if host is None:
                reason = "host pool full"
        if reason is not None:
            self.stats["offloads_skipped"] += 1
            _log.info("offload_skipped", rid=str(rid), generation=generation, start=start, end=end, reason=reason)
            return None
        assert rec is not None and host is not None
        op_id = next(self._op_ids)
        device = rec.slot_range(start, end)
        res.device.pin(device, op_id)
        res.host.pin(host, op_id)
        self.ops[op_id] = OffloadOp(op_id, rid, generation, start, end - start, device, host, rec.owner)
        self.inflight.setdefault((rid, generation), set()).add(op_id)
        res.emit("offload", Tier.HOST, host, rid=rid, op=op_id)
        self._plans.append(make_plan(op_id, Direction.BACKUP, device, host))
        self.stats["offloads_issued"] += 1
        self.stats["offloaded_tokens"] += end - start
        return OffloadStarted(op_id, start, end)

    def owns(self, op_id: int) -> bool:
        return op_id in self.ops

    def apply_ack(self, op_id: int, error: str | None) -> None:
        res = self.residency
        op = self.ops.pop(op_id)
        key = (op.rid, op.generation)
        res.device.unpin(op.device, op_id)
        res.host.unpin(op.host, op_id)
        inflight = self.inflight[key]
        inflight.discard(op_id)
        if not inflight:
            del self.inflight[key]
        if error is None:
            self.landed.setdefault(key, []).append((op.start, op.start + op.length, op.host))
        else:
            res.free_host(op.host, op.host_owner, op=op_id, rid=op.rid, reason="offload_failed")
            self.stats["offload_copy_failures"] += 1
        self._notes.append(OffloadAck(op.rid, op.generation, op_id, error is None))

    def release(self, rid: Hashable, generation: int, busy: Container[int]) -> tuple[Node, int] | None | bool:
        """Release a retired request once: its landed host chunks become tree nodes (finish) or
        are freed (abort), its own device slots are freed and its prefix unlocked. Returns
        False when there was nothing to release (a second call changes nothing); else the
        (node, length) of the host run the tree took (for the storage tier to write) or None.
        Called with an offload in flight it raises: that is a bug of the caller, and the
        runtime fails rather than free a slot a copy reads. `busy`: node ids with a backup in
        flight (they take no host copy from here)."""
        key = (rid, generation)
        z = self.retired.get(key)
        if z is None:
            return False
        self._check_idle(key)
        del self.retired[key]
        rec = z.rec
        res = self.residency
        landed = sorted(self.landed.pop(key, []), key=lambda chunk: chunk[0])
        taken = None
        if z.final_len is not None:
            taken = self._insert_host(rec, z.final_len, landed, busy)
        else:
            for _, _, host in landed:
                self._free_host(host, rec, "aborted")
        own = rec.slots[rec.own_start:]
        if len(own):
            res.free_device(own, rec.owner, rid=rid, reason="offload_release")
        if len(rec.dups):
            res.free_device(rec.dups, rec.owner, rid=rid, reason="duplicate")
        if rec.last_node is not None:
            res.tree.unlock(rec.last_node)
        res.emit("release", Tier.DEVICE, own, rid=rid, generation=generation)
        self.stats["offload_releases"] += 1
        return taken

    def take_plans(self) -> list[TransferPlan]:
        plans, self._plans = self._plans, []
        return plans

    def take_notes(self) -> list[Any]:
        """The messages for the offload actor since the last call."""
        notes, self._notes = self._notes, []
        return notes

    def counts(self) -> dict[str, int]:
        return {"inflight_offloads": len(self.ops), "offload_retired_requests": len(self.retired)}

    # -- helpers -------------------------------------------------------------------
    def retired_record(self, rid: Hashable, generation: int) -> RequestRecord | None:
        """The record of (rid, generation) if it is a retired request."""
        z = self.retired.get((rid, generation))
        return None if z is None else z.rec

    def _record(self, rid: Hashable, generation: int, live: RequestRecord | None) -> tuple[RequestRecord | None, int]:
        """The record of (rid, generation), live or retired, and how far it may be offloaded."""
        if live is not None and live.generation == generation:
            return live, min(live.committed_len, live.seq_len)
        z = self.retired.get((rid, generation))
        if z is None:
            return None, 0
        return z.rec, min(z.final_len or 0, z.rec.seq_len)

    def _check_idle(self, key: Key) -> None:
        if self.inflight.get(key):
            raise InternalError(f"release of {key[0]!r}#{key[1]} with offloads {sorted(self.inflight[key])} in flight")

    def _free_host(self, host: np.ndarray, rec: RequestRecord, reason: str) -> None:
        if len(host):
            self.residency.free_host(host, rec.owner, rid=rec.rid, reason=reason)

    def _insert_host(self, rec: RequestRecord, final_len: int, landed: list[tuple[int, int, np.ndarray]],
                     busy: Container[int]) -> tuple[Node, int] | None:
        """Hand the contiguous run of landed chunks (up to the whole pages of `final_len`) to the
        tree as host copies: nodes on the path without one adopt theirs, the rest becomes a new
        host-only node under the request's prefix. Everything else is freed."""
        end_all = aligned(final_len, self.residency.page_size)
        parts: list[np.ndarray] = []
        start = pos = landed[0][0] if landed else 0
        for s, e, host in landed:
            if s == pos and s < end_all:
                take = min(e, end_all) - s
                parts.append(host[:take])
                self._free_host(host[take:], rec, "beyond_finish")
                pos = s + take
            else:
                self._free_host(host, rec, "not_contiguous")
        if not parts:
            return None
        kept, last = self.residency.adopt_host_run(rec.tokens[:pos], rec.extra_key, start, np.concatenate(parts),
                                                   rec.owner, rec.rid, busy)
        self.stats["offload_host_tokens_kept"] += kept
        if not kept or last is None:
            return None
        return last, pos - start

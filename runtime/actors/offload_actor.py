"""OffloadActor: incremental decode-side KV offload, and the one release of each request.

It owns only its own bookkeeping per running request, keyed by (rid, generation) so that
a rid reused while copies of its previous holder are in flight is never confused with it:
how far the request has been offloaded, the op ids of its offloads in flight, and whether
the tree actor has reported it finished. The request record (slots, lengths, tokens)
stays the tree actor's alone; this actor learns commits, finishes and acks from the tree
actor's messages (`OffloadCommit`, `OffloadFinish`, `OffloadAck`).

- When a request's committed length has grown by `stride` tokens (a page multiple) past
  what was offloaded, it asks the tree actor (`StartOffload`, with a reply) to copy the
  new page-aligned chunk to host. The tree actor allocates the host slots (owned by the
  request), pins both sides and hands the plan to the transfer actor; the ack comes back
  through the tree actor. State for a request is created only once an offload of it has
  started: a full host pool makes the offload a no-op (logged by the tree actor).
- At finish, the whole pages not yet offloaded are offloaded too (any length), so the
  next turn finds all of them in host memory.
- Release rule (seed 000): when the request has finished (or was aborted) *and* none of
  its offloads is in flight, it sends `ReleaseOffloaded` exactly once and forgets the
  request; the tree actor then frees its device slots. A request with no state is
  released as soon as it finishes. The tree side is idempotent too.

It never awaits anything but the tree actor's replies, and the tree actor never awaits
it: no cycle of blocking sends.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from runtime.actors.base import DEFERRED, Actor, Mailbox, Reply
from runtime.errors import CallerError, InternalError
from runtime.messages import (
    DrainOffload,
    OffloadAck,
    OffloadCommit,
    OffloadFinish,
    OffloadMessage,
    OffloadStarted,
    OffloadStats,
    ReleaseOffloaded,
    StartOffload,
    TreeMessage,
)
from runtime.trace import get_logger

log = get_logger("hicache.offload")

Key = tuple[Hashable, int]


@dataclass(slots=True)
class OffloadState:
    """What this actor knows of one running request."""

    offloaded: int  # tokens [base, offloaded) have been issued (landed or in flight)
    inflight: set[int] = field(default_factory=set)
    finished: bool = False


class OffloadActor(Actor[OffloadMessage]):
    name = "offload"

    def __init__(self, tree_mailbox: Mailbox[TreeMessage], *, page_size: int, stride: int,
                 mailbox_capacity: int, mailbox: Mailbox[OffloadMessage] | None = None) -> None:
        super().__init__(mailbox_capacity, mailbox)
        if stride <= 0 or stride % page_size:
            raise ValueError(f"offload stride {stride} is not a positive multiple of page_size {page_size}")
        self.tree_mailbox = tree_mailbox
        self.page_size = page_size
        self.stride = stride
        self.requests: dict[Key, OffloadState] = {}
        self.closing = False
        self.drain_waiters: list[Reply[None]] = []
        self.counters = {"offloads_started": 0, "offloads_not_started": 0, "offloads_landed": 0,
                         "offloads_failed": 0, "offload_releases_sent": 0}
        self.handlers = {
            OffloadCommit: self.on_commit,
            OffloadFinish: self.on_finish,
            OffloadAck: self.on_ack,
            DrainOffload: self.on_drain,
            OffloadStats: self.on_stats,
        }

    # -- handlers ----------------------------------------------------------------
    async def on_commit(self, msg: OffloadCommit) -> None:
        key = (msg.rid, msg.generation)
        await self._offload(key, msg.committed_len, msg.base, self.stride)

    async def on_finish(self, msg: OffloadFinish) -> None:
        key = (msg.rid, msg.generation)
        if msg.final_len is not None:  # finished, not aborted: offload the last whole pages too
            await self._offload(key, msg.final_len, msg.base, self.page_size)
        progress = self.requests.get(key)
        if progress is None:
            self._release(key)  # nothing of it was ever offloaded: release at once
            return
        progress.finished = True
        self._maybe_release(key, progress)

    def on_ack(self, msg: OffloadAck) -> None:
        key = (msg.rid, msg.generation)
        progress = self.requests.get(key)
        if progress is None or msg.op_id not in progress.inflight:
            raise InternalError(f"offload ack {msg.op_id} for {msg.rid!r}#{msg.generation}, which has no such copy")
        progress.inflight.discard(msg.op_id)
        self.counters["offloads_landed" if msg.ok else "offloads_failed"] += 1
        if not msg.ok:
            # no retry: the host run of this request now has a hole; what follows it is not
            # inserted at release (only a contiguous run from its prefix is)
            log.warning("offload_failed", rid=str(msg.rid), generation=msg.generation, op=msg.op_id)
        self._maybe_release(key, progress)
        self._maybe_drained()

    def on_drain(self, msg: DrainOffload) -> Any:
        self.closing = True
        if msg.reply is not None:
            self.drain_waiters.append(msg.reply)
        self._maybe_drained()
        return DEFERRED

    def on_stats(self, msg: OffloadStats) -> dict[str, int]:
        return {
            **self.counters,
            "offload_tracked_requests": len(self.requests),
            "offload_inflight_ops": sum(len(s.inflight) for s in self.requests.values()),
            "offload_mailbox_depth": self.mailbox.depth,
        }

    # -- helpers -----------------------------------------------------------------
    async def _offload(self, key: Key, committed: int, base: int, min_chunk: int) -> None:
        """Offload [offloaded, aligned(committed)) when it is at least `min_chunk` tokens."""
        if self.closing:
            return
        progress = self.requests.get(key)
        start = progress.offloaded if progress is not None else base
        end = committed - committed % self.page_size
        if end - start < min_chunk or end <= start:
            return
        assert self.tree_mailbox is not None
        reply: Reply[OffloadStarted | None] = Reply()
        self.tree_mailbox.put_internal(StartOffload(key[0], key[1], start, end, reply))
        try:
            started = await reply.wait()
        except CallerError as exc:  # internal call: a refusal here is a bug, not bad input
            raise InternalError(f"offload of {key[0]!r}#{key[1]} refused: {exc}") from exc
        if started is None:  # host pool full, request gone or trimmed: nothing changed anywhere
            self.counters["offloads_not_started"] += 1
            return
        if progress is None:  # a record only once a host allocation has succeeded
            progress = self.requests[key] = OffloadState(offloaded=start)
        progress.offloaded = started.end
        progress.inflight.add(started.op_id)
        self.counters["offloads_started"] += 1

    def _maybe_release(self, key: Key, progress: OffloadState) -> None:
        if progress.finished and not progress.inflight:
            del self.requests[key]
            self._release(key)

    def _release(self, key: Key) -> None:
        mailbox = self.tree_mailbox
        if mailbox is None or mailbox.closed:
            return
        mailbox.put_internal(ReleaseOffloaded(key[0], key[1]))
        self.counters["offload_releases_sent"] += 1

    def _maybe_drained(self) -> None:
        if self.drain_waiters and not any(s.inflight for s in self.requests.values()):
            for reply in self.drain_waiters:
                reply.set_result(None)
            self.drain_waiters.clear()

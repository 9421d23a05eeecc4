"""Every message type of the runtime: frozen, slotted `msgspec.Struct`s (`Message`).

Index tensors in a message belong to that message (never a view of a node's or a request's
array: seed 001). An operation that must keep its meaning while the tree changes carries a
snapshot of what it covers (seed 002). Acks carry an op id and an outcome, never a live object
of the tree (a node, a record); `StorageCleared` carries the clear's caller `Reply` back to the
tree actor, which completes it.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import torch

if TYPE_CHECKING:
    from runtime.actors.base import Mailbox, Reply
    from runtime.completion import LayerReadiness


class Message(msgspec.Struct, frozen=True):
    """Base of every message type: a frozen, slotted `msgspec.Struct` (msgspec builds `__init__`
    in C: several messages are built per request on the hot path). Equality, hash and repr cover
    every field (the reply too: no message is compared on the hot path)."""


class Direction(str, Enum):
    BACKUP = "device_to_host"
    LOAD = "host_to_device"


class PoolTransfer(Message):
    """One pool's part of a copy: slot indices (int64, CPU, page-aligned, equal length) owned by this message."""

    pool: str
    src: torch.Tensor
    dst: torch.Tensor


class TransferPlan(Message):
    """A device->host backup or host->device load of whole pages, one `PoolTransfer` per pool."""

    op_id: int
    direction: Direction
    transfers: tuple[PoolTransfer, ...]

    @property
    def num_slots(self) -> int:
        return int(self.transfers[0].src.numel()) if self.transfers else 0


class TransferAck(Message):
    """Outcome of one copy: `error` is None when it succeeded (a description otherwise)."""

    op_id: int
    direction: Direction
    error: str | None = None
    reply: None = None

    @property
    def ok(self) -> bool:
        return self.error is None


# -- results returned to the framework ---------------------------------------------------


class AdmitResult(Message):
    """What `admit` gives the framework; `slots` is a new tensor owned by the caller."""

    rid: Hashable
    generation: int
    slots: torch.Tensor  # device slot of every token of the request
    cached_device: int  # tokens whose KV was already on device
    loaded_host: int  # tokens being loaded from host (ready per layer through `readiness`)
    readiness: tuple["LayerReadiness", ...]  # every load the cached prefix waits on
    loaded_storage: int = 0  # of `loaded_host`: tokens this request's prefetch brought from storage
    # recurrent state (state_layers > 0): the request's running state slot, and the snapshot slot
    # its hit resumes from (copy it into `state_slot` before the first forward; None: start at zero)
    state_slot: int | None = None
    state_from: int | None = None

    @property
    def cached(self) -> int:
        return self.cached_device + self.loaded_host


# -- tree actor mailbox -----------------------------------------------------------------
# Items of a `Batch` carry reply=None; single asks carry their own reply.


class Admit(Message):
    rid: Hashable
    tokens: np.ndarray
    extra_key: Hashable = None
    session: Hashable = None
    priority: int = 0  # raised onto the tree nodes the request inserts (eviction_policy="priority")
    reply: "Reply[AdmitResult] | None" = None


class Extend(Message):
    rid: Hashable
    num_tokens: int
    reply: "Reply[torch.Tensor] | None" = None


class DecodeStep(Message):
    """One decode step of running requests: each commits what it has and gets one new slot."""

    rids: tuple
    reply: "Reply[torch.Tensor] | None" = None


class Commit(Message):
    rid: Hashable
    committed_len: int
    reply: "Reply[int] | None" = None


class Cache(Message):
    rid: Hashable
    tokens: np.ndarray
    reply: "Reply[int] | None" = None


class Finish(Message):
    rid: Hashable
    tokens: np.ndarray
    finished_len: int | None = None
    reply: "Reply[int] | None" = None


class Abort(Message):
    rid: Hashable
    reply: "Reply[None] | None" = None


class Rewind(Message):
    rid: Hashable
    new_len: int
    reply: "Reply[int] | None" = None


class Snapshot(Message):
    rid: Hashable
    position: int
    reply: "Reply[int] | None" = None


class OpenSession(Message):
    sid: Hashable
    extra_key: Hashable = None
    reply: "Reply[None] | None" = None


class CloseSession(Message):
    sid: Hashable
    insert: bool = False
    reply: "Reply[int] | None" = None


class ReleaseAbandoned(Message):
    """Internal: a caller was cancelled after its admit took effect; release that admission."""

    rid: Hashable
    generation: int
    reply: None = None


class Query(Message):
    """A read of the tree actor's state: `fn(core)` runs in the actor's turn and its result is the
    reply (`match_prefix`, `can_admit`, `available`, `inspect`; the façade checked the arguments
    `fn` closes over). Changes nothing a caller sees (an `inspect` from tests may)."""

    fn: Any
    reply: "Reply[Any] | None" = None


class Flush(Message):
    reply: "Reply[int] | None" = None


class ObservePrefill(Message):
    """A prefill the model ran: `tokens` computed in `seconds` (for the load-cost model)."""

    tokens: int
    seconds: float
    reply: "Reply[None] | None" = None


class TreeStats(Message):
    reply: "Reply[dict[str, Any]] | None" = None


class DrainTree(Message):
    """Reply once no copy issued by the tree actor is in flight (close waits on it)."""

    reply: "Reply[None] | None" = None


class Prepare(Message):
    """Start reading from storage what it holds of `tokens` beyond the device and host hit."""

    rid: Hashable
    tokens: np.ndarray
    extra_key: Hashable = None
    reply: "Reply[int] | None" = None


class ControlAction(str, Enum):
    ATTACH = "attach"  # `attach_storage`: put a storage tier behind the host tier, on `backend`
    DETACH = "detach"  # `detach_storage`: drain the storage ops, then turn the tier off
    CLEAR = "clear"  # `clear_storage`: drain, forget the known-stored hints, remove those pages


class StorageControl(Message):
    """A storage control (run one at a time, in arrival order). Replies with: nothing (attach),
    the detached backend (detach), the pages removed (clear). `backend`: attach's (checked by
    the façade)."""

    action: ControlAction
    backend: Any = None
    reply: "Reply[Any] | None" = None


class StorageCleared(Message):
    """The transfer actor removed a clear's pages (`removed`; `error`: the backend call failed)."""

    removed: int
    error: BaseException | None
    caller: "Reply[int]"
    reply: None = None


class StorageAck(Message):
    """Outcome of one storage op: `pages` leading pages written or read (0 on `error`)."""

    op_id: int
    pages: int
    error: str | None = None
    ok: tuple[bool, ...] = ()  # a write: per page, stored or not
    # per `SubmitStorage.states` entry: written whole, present whole (a lookup: the deepest one
    # within the KV found, the rest False) or read whole into its slot
    states_ok: tuple[bool, ...] = ()
    # not made: its backend is down (no probe due), or overdue ops hold their share of host pages,
    # or it waited past its deadline behind other calls. A skip says nothing of what storage holds
    skipped: bool = False
    reply: None = None


class StorageHealthChanged(Message):
    """The storage backend's health changed (`runtime.storage.health`): while it is down the
    requester starts no storage op (the transfer actor probes it and tells when it is back)."""

    state: str
    down: bool
    reply: None = None


class StorageOverdue(Message):
    """A storage op's backend call has run past `storage_timeout_s` (sent once). The op is still in
    flight: its worker may still write into the op's pinned host pages, so its `StorageAck` follows
    when the call returns; until then nothing of it may be freed."""

    op_id: int
    reply: None = None


# -- decode offload (tree actor <-> offload actor) ----------------------------------------
# Every request is named by (rid, generation): a rid reused while copies of its previous
# holder are in flight is never confused with it.


class OffloadCommit(Message):
    """Tree -> offload: a running request's committed length grew (decode_offload on).

    `base` is where its offload starts (its cached prefix, page-aligned)."""

    rid: Hashable
    generation: int
    committed_len: int
    base: int
    reply: None = None


class OffloadFinish(Message):
    """Tree -> offload: the request finished (`final_len` = tokens with valid KV) or was
    aborted (`final_len` None). Its device slots wait for `ReleaseOffloaded`."""

    rid: Hashable
    generation: int
    final_len: int | None
    base: int = 0
    reply: None = None


class OffloadStarted(Message):
    """Reply to `StartOffload`: the copy of tokens [start, end) is in flight as `op_id`."""

    op_id: int
    start: int
    end: int


class StartOffload(Message):
    """Offload -> tree: copy the page-aligned tokens [start, end) of the request to host.

    Reply: `OffloadStarted`, or None when nothing was started (host pool full, request gone)."""

    rid: Hashable
    generation: int
    start: int
    end: int
    reply: "Reply[OffloadStarted | None] | None" = None


class OffloadAck(Message):
    """Tree -> offload: the offload copy `op_id` completed (its pins are released)."""

    rid: Hashable
    generation: int
    op_id: int
    ok: bool
    reply: None = None


class ReleaseOffloaded(Message):
    """Offload -> tree: the request finished and has no offload in flight: free its device
    slots now (idempotent: a second one changes nothing)."""

    rid: Hashable
    generation: int
    reply: None = None


class DrainOffload(Message):
    """Façade -> offload (close): start no more offloads; reply once none is in flight."""

    reply: "Reply[None] | None" = None


class OffloadStats(Message):
    reply: "Reply[dict[str, int]] | None" = None


OffloadMessage = OffloadCommit | OffloadFinish | OffloadAck | DrainOffload | OffloadStats


# -- transfer actor (tree -> transfer, and its own completions) --------------------------------

class SubmitCopy(Message):
    """Run `plan`; ack to `ack_to`. A load's `readiness` resolves layer by layer."""

    plan: "TransferPlan"
    ack_to: "Mailbox[Any]"
    readiness: "LayerReadiness | None" = None
    reply: None = None


class DrainTransfer(Message):
    """Reply once no copy is queued or in flight and every storage op still in flight is overdue
    (used by close: a backend call that never returns must not hold close forever)."""

    reply: "Reply[None] | None" = None


class TransferStats(Message):
    reply: "Reply[dict[str, int]] | None" = None


class CopyDone(Message):
    op_id: int
    error: str | None
    reply: None = None


class SubmitStorage(Message):
    """A storage op: write host pages the requester pinned under `keys`; read the leading `keys`
    that storage holds into them; or, a lookup (a read with no `pages`), count the leading `keys`
    storage holds. Acked to `ack_to` with a `StorageAck` (`pages`: written, read or found)."""

    op_id: int
    write: bool
    keys: tuple[bytes, ...]
    pages: tuple[int, ...]  # host page indices, one per key
    ack_to: "Mailbox[Any] | None"  # (None: the transfer actor's own probe of a down backend)
    states: "tuple[StateBlob, ...]" = ()  # a hybrid model's state snapshots written, looked up or read with it
    reply: None = None
    # one control plane over tensor-parallel ranks: rank r's keys (rank 0's are `keys`), each rank
    # writing or reading its own host pool's `pages`; the ack counts a page only when every rank's
    # shard of it is stored. (): `keys` serve every rank (one rank; a replicated shard: rank 0
    # writes the one copy, every rank reads it)
    rank_keys: tuple[tuple[bytes, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class StateBlob:
    """A recurrent-state snapshot a storage op carries beside its KV pages (`StateBlobFormat`):
    stored as page-sized chunks under `keys`, from or into host state slot `slot` (-1: a lookup,
    which only asks whether every chunk is there). `after`: how many of the op's leading KV keys
    the snapshot follows (a lookup or read: it counts only if those pages are there; a write: 0).
    A lookup's blobs give `page`, the hash of the page the snapshot follows, and no keys: the
    worker derives the keys of those it checks (deepest first, usually one)."""

    slot: int
    keys: tuple[bytes, ...]
    after: int = 0
    page: bytes = b""


class StorageDone(Message):
    """A storage op's worker call returned (`future`: its concurrent future): the transfer actor's
    own completion, through its mailbox like `CopyDone`."""

    op_id: int
    future: Any
    reply: None = None


class StorageDeadline(Message):
    """Storage op `op_id` reached its deadline (`storage_timeout_s`): the transfer actor's timer."""

    op_id: int
    reply: None = None


class StorageProbe(Message):
    """Time to probe the down storage backend (the transfer actor's timer): one lookup."""

    reply: None = None


class StorageWatch(Message):
    """Storage calls have run a while (the transfer actor's timer: `reachable` None): ask the
    backend whether it is still there; or its answer (`reachable` True / False)."""

    reachable: bool | None = None
    reply: None = None


class StorageRemoved(Message):
    """`clear_storage`'s removal returned (`future`: the worker's concurrent future)."""

    request: "RemoveStoragePages"
    future: Any
    reply: None = None


class SetStorageBackend(Message):
    """Storage controls: from now on storage ops go to `backend` (None: no storage tier). Sent by the
    tree actor with no storage op in flight; the reply (the caller's) gets the previous backend."""

    backend: Any
    reply: "Reply[Any] | None" = None


class RemoveStoragePages(Message):
    """`clear_storage`: remove `keys` from the backend (in a worker thread); `StorageCleared` to
    `ack_to`, carrying the caller's reply."""

    keys: tuple[bytes, ...]
    ack_to: "Mailbox[Any]"
    caller: "Reply[int]"
    reply: None = None


TransferMessage = (SubmitCopy | DrainTransfer | TransferStats | CopyDone | SubmitStorage | StorageDone
                   | StorageDeadline | StorageProbe | StorageWatch | StorageRemoved | SetStorageBackend
                   | RemoveStoragePages)


# -- tree actor: a batch of requests (one scheduling step), the prefetch deadline ----------------

class Batch(Message):
    """Many requests in one message (a scheduling step); the reply is a tuple with, per item,
    its result or its `ValidationError` (a failed item changes nothing)."""

    items: tuple[Any, ...]
    reply: "Reply[tuple[Any, ...]] | None" = None


class PrefetchDeadline(Message):
    """The `timeout` policy's deadline for the admits waiting on `prefetch`."""

    prefetch: Any  # the tree core's Prefetch record
    reply: None = None


TreeMessage = (Admit | Extend | DecodeStep | Commit | Cache | Finish | Abort | Rewind | Snapshot | OpenSession | CloseSession | ReleaseAbandoned
               | Query | Flush | ObservePrefill | TreeStats | DrainTree | TransferAck | Prepare
               | StorageAck | StorageOverdue | StorageHealthChanged | StartOffload | ReleaseOffloaded | Batch | PrefetchDeadline
               | StorageControl | StorageCleared)

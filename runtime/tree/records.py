"""The records the tree core keeps: requests, sessions, in-flight copies and storage operations.

Plain data: each record is written only by the part that owns it (`CacheCore`: requests and
sessions; `CopyTracker`: `CopyOp`; `DecodeOffload`: `OffloadOp`, `RetiredRequest`;
`StorageTier`: `Prefetch`, `StorageOp`). An in-flight operation's record is a snapshot taken
when it was issued (deepest node + length + slot copies), so a split of its nodes never changes
what it means (seed 002).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from runtime.memory.owners import Owner
from runtime.messages import Direction, PoolTransfer, StateBlob, TransferPlan
from runtime.tree.radix import Node
from runtime.tree.readiness import LoadReadiness

if TYPE_CHECKING:
    from runtime.tree.request_table import RequestTable

EMPTY = np.zeros(0, dtype=np.int64)


def aligned(n: int, page_size: int) -> int:
    """`n` rounded down to whole pages."""
    return n - n % page_size


def make_plan(op_id: int, direction: Direction, src: np.ndarray, dst: np.ndarray,
              more: tuple[PoolTransfer, ...] = ()) -> TransferPlan:
    """A copy's plan owns fresh copies of its indices (seed 001): never views of tree state.
    `more`: the other pool groups' transfers of the same operation (a recurrent state's)."""
    return TransferPlan(op_id, direction, (PoolTransfer("kv", torch.from_numpy(np.array(src, dtype=np.int64)),
                                                        torch.from_numpy(np.array(dst, dtype=np.int64))), *more))


@dataclass(slots=True, eq=False)
class RequestRecord:
    """The one record of a live request. Its lengths and slots live in its row of the
    `RequestTable` (`table`, `row`), so that a decode step updates a batch of them at once;
    the properties below read and write that row."""

    rid: Hashable
    generation: int
    owner: Owner
    extra_key: Hashable
    tokens: np.ndarray  # int32 token ids the request has so far
    cached_len: int  # prefix held by tree nodes, locked through last_node
    last_node: Node | None
    prompt_len: int
    readiness: tuple[LoadReadiness, ...] = ()
    failed: str | None = None
    session: Hashable = None  # the streaming session this turn belongs to
    session_len: int = 0  # leading slots the session owns (its whole pages)
    # slots of its own inside the cached prefix that duplicate tree pages (another request
    # cached the same prefix first): still the caller's until release (the slot contract)
    dups: np.ndarray = field(default_factory=lambda: EMPTY)
    priority: int = 0  # raised onto the nodes it inserts (the admit's `priority`)
    # set by RequestTable.add; None once released, a private one-row table once retired (detach)
    table: RequestTable | None = None
    row: int = -1

    @property
    def seq_len(self) -> int:
        """Token positions in use (prompt + extended), <= num_slots."""
        return self.table.seq_len_at[self.row]

    @seq_len.setter
    def seq_len(self, value: int) -> None:
        self.table.seq_len_at[self.row] = value

    @property
    def committed_len(self) -> int:
        return self.table.committed_at[self.row]

    @committed_len.setter
    def committed_len(self, value: int) -> None:
        self.table.committed_at[self.row] = value

    @property
    def num_slots(self) -> int:
        """Slots mapped: whole pages, the cached prefix's and its own."""
        return self.table.num_slots_at[self.row]

    @property
    def slots(self) -> np.ndarray:
        """A fresh int64 copy of its slots (a view could change once its row is reused)."""
        table, row = self.table, self.row
        return table.slot_map[row, :table.num_slots_at[row]].astype(np.int64)

    def slot_range(self, start: int, end: int) -> np.ndarray:
        """A fresh int64 copy of its slots [start, end), 0 <= start <= end <= num_slots."""
        return self.table.slot_map[self.row, start:end].astype(np.int64)

    def slot_view(self, start: int, end: int) -> np.ndarray:
        """Its slots [start, end) as an int32 view of its row: for a callee that copies what it
        keeps (the tree's insert) before the row changes."""
        return self.table.slot_map[self.row, start:end]

    @property
    def own_start(self) -> int:
        """Slots before this index belong to the tree (cached prefix) or to the session."""
        return self.session_len if self.session is not None else self.cached_len

    def append_slots(self, new: np.ndarray) -> None:
        """Map `new` (whole pages) after its slots."""
        self.table.append(self.row, new)

    def truncate_slots(self, num_slots: int) -> None:
        """Unmap its slots from `num_slots` (a page boundary) on."""
        self.table.num_slots_at[self.row] = num_slots

    def fail(self, why: str) -> None:
        """Its cached prefix was lost (a load under it failed): it can only be released now."""
        self.failed = why

    def grow(self, tokens: np.ndarray) -> None:
        """The token record only grows (the caller checked `tokens` extend it)."""
        if len(tokens) > len(self.tokens):
            self.tokens = tokens

    def inserted(self, last_node: Node, cached_len: int, computed: int) -> None:
        """An insert covered `cached_len` tokens, ending at `last_node` (now locked by it); KV of
        `computed` tokens was computed (`committed_len` never goes back)."""
        self.last_node, self.cached_len = last_node, cached_len
        self.committed_len = max(self.committed_len, min(computed, self.seq_len))

    def keep_duplicates(self, slots: np.ndarray) -> None:
        """Its own slots that duplicate tree pages (new ones only): still its own until release."""
        if len(self.dups):
            slots = slots[~np.isin(slots, self.dups)]
        self.dups = np.concatenate((self.dups, slots))

    def rewound(self, new_len: int) -> None:
        """Its tokens past `new_len` are forgotten (its slots past them: `truncate_slots`)."""
        self.seq_len = new_len
        self.committed_len = min(self.committed_len, new_len)
        self.tokens = self.tokens[:new_len].copy()


@dataclass(slots=True)
class SessionRecord:
    """A streaming session's KV across turns: `kv_len` tokens in whole pages it owns."""

    sid: Hashable
    owner: Owner
    extra_key: Hashable
    tokens: np.ndarray
    slots: np.ndarray
    turn: Hashable = None  # rid of the running turn, if any

    @property
    def kv_len(self) -> int:
        return len(self.tokens)

    def run(self, rid: Hashable) -> None:
        """Turn `rid` runs now (None: no turn runs)."""
        self.turn = rid

    def keep(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        """A turn ended keeping exactly `tokens` of KV in `slots` (whole pages)."""
        self.slots, self.tokens, self.turn = slots, tokens, None


@dataclass(slots=True)
class CopyOp:
    """An in-flight backup or load: a snapshot of what it covers, taken when issued."""

    op_id: int
    direction: Direction
    node: Node  # deepest node covered (the lower half after any split)
    length: int  # tokens covered, ending at `node`'s end
    device: np.ndarray
    host: np.ndarray
    host_owner: Owner  # owner of `host` until the ack hands it to the nodes
    readiness: LoadReadiness | None = None
    evict_after: bool = False
    issued_at: float = 0.0  # a load's `time.perf_counter()` when issued (the load-cost model's sample)
    users: set[Hashable] = field(default_factory=set)
    # a load issued under another load that failed first: its nodes lost their device copies, and
    # its device slots stay with it (owner: its deepest node's id) until its ack frees them
    orphaned: bool = False


@dataclass(slots=True)
class OffloadOp:
    """An in-flight decode offload: tokens [start, start + length) of (rid, generation), device
    slots snapshotted at issue, host slots owned by the request until its release."""

    op_id: int
    rid: Hashable
    generation: int
    start: int
    length: int
    device: np.ndarray
    host: np.ndarray
    host_owner: Owner


@dataclass(slots=True)
class RetiredRequest:
    """A finished (`final_len` tokens of valid KV) or aborted (None) request whose device
    slots wait for its offloads to land (decode offload)."""

    rec: RequestRecord
    final_len: int | None


@dataclass(slots=True)
class Prefetch:
    """A storage read for request `rid`: tokens [start, start + len(keys) * page_size)."""

    rid: Hashable
    owner: Owner  # Owner.prefetch(rid, generation): holds `host` until it lands
    extra_key: Hashable
    tokens: np.ndarray
    start: int
    op_id: int
    host: np.ndarray
    cancelled: bool = False
    detached: bool = False  # admitted without waiting for it: it lands into the tree for whoever comes next
    link: bytes | None = None  # the page hash just before `start` (None: it starts at 0 or is unknown)
    by_prepare: bool = True  # started by the caller's prepare (False: by an admit that waits for it)
    waiters: list[Any] = field(default_factory=list)  # admits deferred until it lands (tree actor's)
    # the anchor: the cached prefix [0, start) the read pages will hang under, kept in the tree
    # until the prefetch ends (else making host room for the read could evict it)
    anchor_lock: Node | None = None  # deepest device node of it, locked
    anchor_host: Node | None = None  # deepest host-only node of it, host-protected over...
    anchor_host_len: int = 0  # ...this many tokens (its host-only part)

    def wait(self, waiter: Any) -> None:
        """An admit waits for this prefetch (the tree actor's opaque token)."""
        self.waiters.append(waiter)

    def take_waiters(self) -> list[Any]:
        """The admits that waited for it (they go on now, or fail); none wait any more."""
        waiters, self.waiters = self.waiters, []
        return waiters


@dataclass(frozen=True, slots=True)
class StoredPages:
    """What a storage tier knows of its backend's pages, kept across a detach for a re-attach:
    `known` stored (written, or found by a lookup or read), and `doubtful` ones: known once, put
    in doubt by a lookup or read that stopped at an earlier missing page (not known any more, so
    they are written again, but a clear removes them too)."""

    known: set[bytes]
    doubtful: set[bytes]
    rank_keys: dict[bytes, tuple[bytes, ...]] = field(default_factory=dict)  # `StorageTier.rank_keys`
    # state snapshots known stored: the hash of the page each follows -> its chunk keys
    states: dict[bytes, tuple[bytes, ...]] = field(default_factory=dict)

    def remember_ranks(self, keys: Sequence[bytes], rank_keys: Sequence[Sequence[bytes]], stored: Iterable[int]) -> None:
        """The other ranks' keys (`rank_keys[1:]`) of pages `stored` of `keys`, now known stored: a
        clear removes them too."""
        if rank_keys:
            for i in stored:
                self.rank_keys[keys[i]] = tuple(other[i] for other in rank_keys[1:])

    def doubt_state(self, page: bytes) -> None:
        """The snapshot after `page`, found missing or unreadable: no longer known stored (written
        again next time), its chunks held in doubt (a clear still removes those that are there)."""
        keys = self.states.pop(page, None)
        if keys is not None:
            self.doubtful.update(keys)


@dataclass(slots=True)
class StorageOp:
    op_id: int
    write: bool
    host: np.ndarray  # pinned host slots (whole pages), one page per key
    keys: list[bytes]
    node: Node | None = None  # a write: deepest node of the backed-up chain
    length: int = 0  # a write: tokens of that chain (its protect_host length)
    prefetch: Prefetch | None = None  # a read
    # a write: the written pages' tokens (whole pages, one per key, in key order) and the hash of
    # the page before each key (None: it starts its sequence), what its STORAGE events say
    tokens: np.ndarray | None = None
    parents: list[bytes | None] | None = None
    # under one control plane over tensor-parallel ranks: every rank's keys (rank 0's are `keys`),
    # one list per rank; () when `keys` serve every rank (one rank, a replicated shard)
    rank_keys: tuple[tuple[bytes, ...], ...] = ()
    # a hybrid model's state snapshots written, looked up or read with the pages (`StateBlob`)
    states: tuple[StateBlob, ...] = ()


@dataclass(frozen=True, slots=True)
class PrefetchWait:
    """An admit that waits for its request's prefetch (storage tier, policy `wait`/`timeout`):
    it runs when the prefetch lands, fails, or after `timeout_s` (None: no deadline)."""

    prefetch: Prefetch
    timeout_s: float | None


class StorageRequest(NamedTuple):
    """A storage op for the transfer side: write, read or (a read with no pages) look up `keys`."""

    op_id: int
    write: bool
    keys: tuple[bytes, ...]
    pages: tuple[int, ...]  # host pages, one per key
    # under one control plane over tensor-parallel ranks: rank r's keys are rank_keys[r] (rank 0's
    # are `keys`); (): `keys` serve every rank (one rank; a replicated shard, written by rank 0)
    rank_keys: tuple[tuple[bytes, ...], ...] = ()
    # a hybrid model's state snapshots written, looked up or read with the pages (the op's own)
    states: tuple[StateBlob, ...] = ()


def written_runs(keys: Sequence[bytes], ok: Sequence[bool], parents: Sequence[bytes | None]) -> Iterator[tuple[int, int]]:
    """The runs [i, j) of a write's pages that were stored and chain on each other (each page's
    parent the key before it): one STORAGE event each."""
    i, n = 0, len(keys)
    while i < n:
        if not ok[i]:
            i += 1
            continue
        j = i + 1
        while j < n and ok[j] and parents[j] == keys[j - 1]:
            j += 1
        yield i, j
        i = j


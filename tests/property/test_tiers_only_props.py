"""Random operation sequences through the tiers-only core, with the fingerprint oracle.

A model engine drives `TiersOnlyCore` as vLLM's scheduler would (lookups, loads into fresh
blocks, backups at finish, acks that succeed or fail, in any order) over prompts that share and
diverge at random. The oracle keeps a model of host memory: a backup's pages hold, once it
acked, the fingerprint of each token's prefix; every page a load plan reads must hold the
fingerprint of the prefix the request asked for (never another request's KV), and the
invariant checker runs after every call. Seeded; `--runslow` runs longer sequences.

Checked failing (400 calls, seeds 0-5) against: the split hand-over not registered (6 of 6
seeds), a load reading the host pages one page off (6 of 6, the fingerprint oracle), and a
copy locking a namespace root that the tree replaced before its ack (1 of 6: the bug this test
found first, a `TreeError` in `apply_ack`).

The storage variant puts a model storage behind the host tier (page content by page key, losing
keys at random, so reads come back short; writes and reads that fail or store only some pages)
and drives it as the vLLM connector does: a load with a storage read is asynchronous, the worker
reads the leading stored pages into the read's host pages and copies the plan's leading pages
they filled, copy acks are applied before storage acks, writes are taken after every call. Its
oracle adds: every plan page the worker copies holds the requested prefix once the read filled
it, every page a storage write stores holds the KV its key names, every tree node's host pages
hold its path's KV (after every call), and `TierLoad.read_at`/`read_skip` place the read.

Half the storage variant's hits are held (`reserve`, as the connector reports them) with other
requests' work between the report and the load, or released unloaded; a held hit must load in
full. Checked failing against no hold at all (`reserve` as `lookup`, what the connector did
before: 4 of 6 seeds) and a hold that does not lock its host path (1 of 6 with the invariant
checker told of no lock; 6 of 6 with it).

Storage variant checked failing (400 calls, seeds 0-5) against: `read_skip` always 0 (5 of 6,
the placement check; the fingerprint oracle alone 1 of 6, it needs a short read with a skip),
the read's host pages concatenated before the host path's (6 of 6; the oracle alone 6 of 6),
`read_at` always 0 (6 of 6, the placement check; the oracle alone 0 of 6: copying too little is
no wrong KV), a write skipping known pages but taking the host pages of the first ones (6 of 6,
the write oracle), a short read's count ignored at its ack (6 of 6, the tree check; the load
oracle alone 3 of 6), the read handed to the tree from the engine's hit instead of the host
tier's (2 of 6, the invariant checker: leaked prefetch pages; mostly the read is dropped as
prefix_gone, a lost hit rather than wrong KV), and, model side, storage acks applied before
their loads' (6 of 6: `PinnedSlotError` or the checker).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from runtime.integrations.vllm.invariants import check_tiers_only
from runtime.messages import Direction
from runtime.storage.hashing import KVIdentity, page_hashes
from runtime.tree.tiers.storage import StorageRequest
from runtime.integrations.vllm.core import TierLoad, TiersOnlyCore


def loaded(ld: TierLoad):
    """(plan, tokens) of a load."""
    return ld.plan, ld.tokens

PS, BLOCKS = 4, 64


def fingerprint(tokens: np.ndarray, pos: int) -> int:
    return hash(tokens[: pos + 1].tobytes())


class ModelEngine:
    def __init__(self, seed: int, host_pages: int) -> None:
        self.rng = random.Random(seed)
        self.core = TiersOnlyCore(PS, host_pages * PS, BLOCKS)
        self.host: dict[int, int] = {}  # host slot -> fingerprint it holds (acked backups only)
        self.pending: dict[int, tuple[str, np.ndarray, np.ndarray, int]] = {}  # op -> (rid, tokens, host slots, start)
        self.loads: set[int] = set()
        self.live: dict[str, tuple[np.ndarray, list[int]]] = {}  # rid -> (tokens, blocks)
        self.next_rid = 0
        self.stems = [np.asarray([self.rng.randrange(50) for _ in range(12)], np.int32) for _ in range(3)]

    stem_cuts, tail_max = (0, 4, 8, 12), 14  # a prompt: a stem cut at one of these, a tail shorter than this

    def prompt(self) -> np.ndarray:
        stem = self.rng.choice(self.stems)[: self.rng.choice(self.stem_cuts)]
        tail = [self.rng.randrange(3) for _ in range(self.rng.randrange(1, self.tail_max))]
        return np.concatenate((stem, np.asarray(tail, np.int32)))

    def op(self) -> None:
        r = self.rng.random()
        if r < 0.35 or not self.live:
            self.admit()
        elif r < 0.6:
            self.finish(self.rng.choice(list(self.live)))
        elif self.pending or self.loads:
            self.ack(self.rng.choice(sorted(set(self.pending) | self.loads)))
        check_tiers_only(self.core)

    def admit(self) -> None:
        rid, tokens = f"r{self.next_rid}", self.prompt()
        self.next_rid += 1
        local = PS * self.rng.randrange(0, (len(tokens) - 1) // PS + 1)  # what "vLLM's own cache" had
        hit = self.core.lookup(tokens, None, local).host
        check_tiers_only(self.core)
        blocks = self.rng.sample(range(BLOCKS), -(-len(tokens) // PS))
        plan, got = loaded(self.core.load(rid, tokens, None, local, hit, blocks))
        assert got == hit, "nothing changed between the lookup and the load"
        if plan is not None:
            for slot, pos in zip(plan.transfers[0].src.tolist(), range(local, local + got)):
                assert self.host.get(slot) == fingerprint(tokens, pos), \
                    f"load of {rid} reads host slot {slot} that does not hold its prefix at {pos}"
            self.loads.add(plan.op_id)
        self.live[rid] = (tokens, blocks)

    def finish(self, rid: str) -> None:
        tokens, blocks = self.live.pop(rid)
        computed = max(0, len(tokens) - self.rng.choice([0, 0, 1, 3]))
        loading = self.core.loading(rid)  # (finished mid-load: an abort; nothing is backed up)
        plan = self.core.backup(rid, tokens, None, computed, blocks)
        assert plan is None or not loading
        if plan is not None:
            start = computed // PS * PS - plan.num_slots
            self.pending[plan.op_id] = (rid, tokens, plan.transfers[0].dst.numpy().copy(), start)
        # the engine keeps the blocks while a copy still reads or writes them
        assert self.core.finish(rid) == (plan is not None or self.core.backing_up(rid) or loading)

    def ack(self, op_id: int) -> None:
        error = "copy fault" if self.rng.random() < 0.15 else None
        op = self.core.apply_ack(op_id, error)
        if op.direction is Direction.BACKUP:
            rid, tokens, host, start = self.pending.pop(op_id)
            if error is None:
                for i, slot in enumerate(host.tolist()):
                    self.host[slot] = fingerprint(tokens, start + i)
        else:
            self.loads.discard(op_id)

    def drain(self) -> None:
        for rid in list(self.live):
            self.finish(rid)
        for op_id in sorted(set(self.pending) | self.loads):
            self.ack(op_id)
        check_tiers_only(self.core, quiescent=True)


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_never_loads_another_prefixes_kv(seed, request):
    ops = 3000 if request.config.getoption("--runslow", default=False) else 400
    m = ModelEngine(seed, host_pages=6 + seed * 3)
    for _ in range(ops):
        m.op()
    m.drain()
    assert m.core.stats["tokens_loaded"] > 0 and m.core.stats["tokens_backed_up"] > 0


# -- with a storage tier behind the host tier -------------------------------------------------

IDENTITY = KVIdentity("m", "0", "float32", 2, 2, 8, "test")


class StorageModelEngine(ModelEngine):
    """The model engine with a model storage behind the host tier, driven as the vLLM connector
    drives it: a load with a storage read is asynchronous (the worker reads, then copies the
    plan's leading pages the read filled, and reports both together); acks come in batches, the
    copies' before the storage ops', each sorted by op id; storage writes are taken after every
    call and land later. Storage keeps each page's content (its tokens' fingerprints) by key and
    loses keys at random (eviction), so reads come back short."""

    def __init__(self, seed: int, host_pages: int) -> None:
        super().__init__(seed, host_pages)
        self.stems = [np.asarray([self.rng.randrange(50) for _ in range(16)], np.int32) for _ in range(12)]
        self.store: dict[bytes, tuple[int, ...]] = {}  # key -> the page's content
        self.expected: dict[bytes, tuple[int, ...]] = {}  # key -> the content of the prefix's page it names
        self.reads: dict[int, tuple[np.ndarray, int, TierLoad]] = {}  # load op -> (tokens, local, load)
        self.writes: dict[int, StorageRequest] = {}
        self.core.enable_storage(IDENTITY, self.exists_prefix)

    def exists_prefix(self, keys: list[bytes]) -> int:
        if self.rng.random() < 0.03:
            raise OSError("storage backend down")  # a lookup error: a miss
        return self.stored_prefix(keys)

    def stored_prefix(self, keys) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.store:
            n += 1
        return n

    stem_cuts, tail_max = (0, 4, 8, 12, 16), 10

    def op(self) -> None:
        r = self.rng.random()
        if r < 0.33 or not self.live:
            self.admit()
        elif r < 0.55:
            self.finish(self.rng.choice(list(self.live)))
        elif r < 0.58:
            self.evict()
        else:
            self.ack_batch()
        self.checked()

    def evict(self) -> None:
        """Storage drops a page: often one a read in flight wants (the read comes back short)."""
        wanted = [k for _, _, ld in self.reads.values() if ld.read for k in ld.read[2] if k in self.store]
        if wanted and self.rng.random() < 0.5:
            del self.store[self.rng.choice(wanted)]
        elif self.store:
            del self.store[self.rng.choice(sorted(self.store))]

    def checked(self) -> None:
        """The invariants, and every tree node's host pages hold its path's KV (a page in the
        wrong place in the tree is caught at once, not only when a load reads it)."""
        check_tiers_only(self.core)
        tree = self.core.residency.tree
        for node in tree.nodes():
            path = tree.path_tokens(node)
            start = len(path) - node.num_tokens
            for i, slot in enumerate(node.host.tolist()):
                assert self.host.get(slot) == fingerprint(path, start + i), \
                    f"tree node {node.id} holds host slot {slot} that does not hold its path at {start + i}"
        for req in self.core.take_storage_writes():
            assert req[1] and len(req[2]) == len(req[3]) > 0
            self.writes[req[0]] = req

    def admit(self, depth: int = 0) -> None:
        rid, tokens = f"r{self.next_rid}", self.prompt()
        self.next_rid += 1
        full = page_hashes(tokens[: len(tokens) // PS * PS], PS, None, IDENTITY)
        for i, key in enumerate(full):
            page = tuple(fingerprint(tokens, i * PS + o) for o in range(PS))
            assert self.expected.setdefault(key, page) == page, "two prefixes' pages share a storage key"
        keys = self.core.page_keys(tokens, None)
        assert keys == full[: (len(tokens) - 1) // PS]
        local = PS * self.rng.randrange(0, (len(tokens) - 1) // PS + 1) * (self.rng.random() < 0.5)
        # half the hits are reported as vLLM's connector reports them: held until the load, with
        # other requests' work in between (their held hits and loads, as a load vLLM defers to a
        # later step; backups that evict; acks), or dropped unloaded
        reserving = self.rng.random() < 0.5
        hit = (self.core.reserve(rid, tokens, None, local, keys) if reserving
               else self.core.lookup(tokens, None, local, keys))
        self.checked()
        if reserving:
            for _ in range(self.rng.randrange(3)):
                if depth == 0 and self.rng.random() < 0.4:
                    self.admit(depth + 1)
                elif self.live and self.rng.random() < 0.6:
                    self.finish(self.rng.choice(list(self.live)))
                else:
                    self.ack_batch()
                self.checked()
            if self.rng.random() < 0.2:  # (vLLM did not allocate for it)
                self.core.release(rid)
                return
        blocks = self.rng.sample(range(BLOCKS), -(-len(tokens) // PS))
        ld = self.core.load(rid, tokens, None, local, hit.total, blocks, keys)
        if reserving:
            assert ld.tokens == hit.total, "a held hit loads in full"
        elif ld.read is None and hit.storage > 0:
            assert ld.tokens == hit.host, "a load whose read found no host room covers the host hit"
        else:
            assert ld.tokens == hit.total, "nothing changed between the lookup and the load"
        if ld.plan is not None:
            assert len(ld.plan.transfers[0].src) == ld.tokens
            if ld.read is None:
                self.check_plan(rid, tokens, local, ld, ld.tokens // PS)
                self.loads.add(ld.plan.op_id)
            else:
                self.check_read(tokens, local, keys, ld)
                self.reads[ld.plan.op_id] = (tokens, local, ld)
        else:
            assert ld.read is None
        self.live[rid] = (tokens, blocks)

    def check_read(self, tokens: np.ndarray, local: int, keys: list[bytes], ld: TierLoad) -> None:
        """A load's read (`TierLoad`'s contract): it reads the pages the host tier lacks up to the
        load's end, and the plan's pages from `read_at` on are the read's pages from `read_skip` on
        (the engine's own hit may cover the read's first pages)."""
        assert ld.plan is not None and ld.read is not None
        write, keys_read, pages = ld.read.write, ld.read.keys, ld.read.pages
        end = (local + ld.tokens) // PS
        host_end = end - len(pages)  # (in pages: where the host tier's hit ended)
        assert not write and len(keys_read) == len(pages) > 0 and host_end >= 0
        assert list(keys_read) == keys[host_end:end], "the read's keys are not the pages it fills"
        first = max(host_end, local // PS)  # the read's first page the plan copies
        assert (ld.read_at, ld.read_skip) == (first - local // PS, first - host_end), \
            "read_at/read_skip do not place the read"
        src = (ld.plan.transfers[0].src[::PS] // PS).tolist()
        assert src[ld.read_at:] == list(pages[ld.read_skip:]), "the plan does not copy the read's pages"
        assert not set(src[:ld.read_at]) & set(pages)

    def check_plan(self, rid: str, tokens: np.ndarray, local: int, ld: TierLoad, pages: int) -> None:
        """The plan's first `pages` pages read host slots holding the request's prefix."""
        assert ld.plan is not None
        src = ld.plan.transfers[0].src.tolist()[: pages * PS]
        for slot, pos in zip(src, range(local, local + len(src))):
            assert self.host.get(slot) == fingerprint(tokens, pos), \
                f"load of {rid} reads host slot {slot} that does not hold its prefix at {pos}"

    def pending_ops(self) -> list[int]:
        return sorted(set(self.pending) | self.loads | set(self.reads) | set(self.writes))

    def ack_batch(self) -> None:
        """Some ops end on the worker (in any order); their acks come back together, the copies'
        first, then the storage ops', each by op id (`update_connector_output`)."""
        ops = self.pending_ops()
        if not ops:
            return
        copies: dict[int, str | None] = {}
        storage: dict[int, tuple[int, str | None, tuple[bool, ...]]] = {}
        for op_id in self.rng.sample(ops, min(len(ops), self.rng.randint(1, 3))):
            self.work(op_id, copies, storage)
        for op_id, error in sorted(copies.items()):
            backup = op_id in self.pending
            if backup:  # its host pages hold what it copied (before its ack)
                rid, tokens, host, start = self.pending.pop(op_id)
                if error is None:
                    for i, slot in enumerate(host.tolist()):
                        self.host[slot] = fingerprint(tokens, start + i)
            self.loads.discard(op_id)
            op = self.core.apply_ack(op_id, error)
            assert op.direction is (Direction.BACKUP if backup else Direction.LOAD)
            self.checked()
        for op_id, (pages, error, ok) in sorted(storage.items()):
            self.core.apply_storage_ack(op_id, pages, error, ok)
            self.checked()

    def work(self, op_id: int, copies: dict, storage: dict) -> None:
        """What the worker does for op `op_id` (a backup's host pages are filled at its ack)."""
        fault = self.rng.random() < 0.1
        if op_id in self.writes:
            write = self.writes.pop(op_id)
            keys, pages = write.keys, write.pages
            ok = []
            for key, page in zip(keys, pages):
                content = tuple(self.host.get(page * PS + o) for o in range(PS))
                assert content == self.expected.get(key), f"storage write {op_id} puts another prefix's KV under a key"
                ok.append(self.rng.random() >= 0.1)
                if ok[-1] and not fault:
                    self.store[key] = content
            storage[op_id] = (0, "write fault", ()) if fault else (0, None, tuple(ok))
        elif op_id in self.reads:
            tokens, local, ld = self.reads.pop(op_id)
            assert ld.read is not None
            read_op, keys, pages = ld.read.op_id, ld.read.keys, ld.read.pages
            got = 0 if fault else self.stored_prefix(keys)
            if got and self.rng.random() < 0.2:
                got = self.rng.randrange(got)  # a page found unreadable ends the prefix read
            for key, page in zip(keys[:got], pages):
                for o in range(PS):
                    self.host[page * PS + o] = self.store[key][o]
            usable = ld.read_at + max(0, got - ld.read_skip)
            self.check_plan(f"load {op_id}", tokens, local, ld, usable)
            storage[read_op] = (got, "read fault" if fault else None, ())
            copies[op_id] = "copy fault" if self.rng.random() < 0.05 else None
        else:
            copies[op_id] = "copy fault" if fault else None

    def drain(self) -> None:
        for rid in list(self.live):
            self.finish(rid)
        self.checked()
        while self.pending_ops():
            self.ack_batch()
        check_tiers_only(self.core, quiescent=True)


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_with_storage_never_loads_another_prefixes_kv(seed, request):
    ops = 3000 if request.config.getoption("--runslow", default=False) else 400
    m = StorageModelEngine(seed, host_pages=8 + 2 * seed)
    for _ in range(ops):
        m.op()
    m.drain()
    storage = m.core.storage
    assert storage is not None
    stats = (m.core.stats, storage.stats)
    assert m.core.stats["tokens_storage_loaded"] > 0 and storage.stats["storage_pages_read"] > 0, stats
    assert storage.stats["storage_pages_written"] > 0 and m.core.stats["tokens_backed_up"] > 0, stats

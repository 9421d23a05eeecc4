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
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from runtime.invariants import check_tiers_only
from runtime.messages import Direction
from runtime.tree.tiers_only import TierLoad, TiersOnlyCore


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

    def prompt(self) -> np.ndarray:
        stem = self.rng.choice(self.stems)[: self.rng.choice([0, 4, 8, 12])]
        tail = [self.rng.randrange(3) for _ in range(self.rng.randrange(1, 14))]
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
        plan = self.core.backup(rid, tokens, None, computed, blocks)
        if plan is not None:
            start = computed // PS * PS - plan.num_slots
            self.pending[plan.op_id] = (rid, tokens, plan.transfers[0].dst.numpy().copy(), start)
        assert self.core.finish(rid) == (plan is not None or self.core.backing_up(rid))

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

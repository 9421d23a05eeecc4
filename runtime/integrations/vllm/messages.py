"""What the connector's scheduler side and its workers send each other (`runtime.integrations.vllm`).

Scheduler -> workers: a step's `TieredMeta` (vLLM's connector metadata: immutable, picklable).
Workers -> scheduler: `CopyAcks` through vLLM's worker-metadata channel, merged over workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from runtime.messages import TransferPlan
from runtime.tree.tiers.storage import StorageRequest
from runtime.integrations.vllm.core import TierLoad

__all__ = ["LoadJob", "TieredMeta", "CopyAcks", "StorageOutcome", "JobResult"]


@dataclass(frozen=True)
class LoadJob:
    """A load into one request's blocks: what the core started (`TierLoad`: the plan and the
    storage read it needs first, if any) and the blocks promised to vLLM that nothing will fill
    (load errors)."""

    rid: str
    load: TierLoad
    unloadable: tuple[int, ...] = ()


@dataclass(frozen=True)
class TieredMeta(KVConnectorMetadata):
    """One step's work for the workers: loads (asynchronous, reported through `get_finished`),
    backups of finished requests, storage writes, staging reads (acked through `CopyAcks`)."""

    loads: tuple[LoadJob, ...] = ()
    backups: tuple[tuple[str, TransferPlan], ...] = ()  # (request id, plan)
    storage_writes: tuple[StorageRequest, ...] = ()
    stages: tuple[StorageRequest, ...] = ()  # staging reads: storage pages into host pages, before a hit is reported


StorageOutcome = tuple[int, str | None, tuple[bool, ...]]  # pages read, error, pages written
# a worker job's outcome: copies' outcomes, storage ops' outcomes, blocks a load left unfilled
JobResult = tuple[dict[int, str | None], dict[int, StorageOutcome], set[int]]


@dataclass
class CopyAcks(KVConnectorWorkerMetadata):
    """Workers -> scheduler: each copy's outcome (None: done; else what failed) and each storage
    op's. An op failed on any worker failed (each worker holds its own shard of every page); a
    storage op's pages are the minimum over workers, a write's per-page flags the AND.
    `reports`: per op, how many workers' outcomes this holds (workers finish an op at different
    steps; the scheduler applies it once every worker reported it)."""

    outcomes: dict[int, str | None] = field(default_factory=dict)
    storage: dict[int, StorageOutcome] = field(default_factory=dict)
    reports: dict[int, int] = field(default_factory=dict)

    @classmethod
    def of_worker(cls, outcomes: dict[int, str | None], storage: dict[int, StorageOutcome]) -> "CopyAcks":
        return cls(outcomes, storage, dict.fromkeys([*outcomes, *storage], 1))

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, CopyAcks)
        merged = dict(self.outcomes)
        for op, err in other.outcomes.items():
            merged[op] = merged.get(op) or err
        stored = dict(self.storage)
        for op, (pages, err, ok) in other.storage.items():
            if op in stored:
                p0, e0, ok0 = stored[op]
                pages, err, ok = min(p0, pages), e0 or err, tuple(a and b for a, b in zip(ok0, ok))
            stored[op] = (pages, err, ok)
        reports = dict(self.reports)
        for op, n in other.reports.items():
            reports[op] = reports.get(op, 0) + n
        return CopyAcks(merged, stored, reports)

    def split(self, workers: int) -> tuple["CopyAcks", "CopyAcks"]:
        """(the ops every one of `workers` reported, the rest)."""
        done = {op for op, n in self.reports.items() if n >= workers}
        parts = tuple(CopyAcks({op: e for op, e in self.outcomes.items() if (op in done) == whole},
                               {op: o for op, o in self.storage.items() if (op in done) == whole},
                               {op: n for op, n in self.reports.items() if (op in done) == whole})
                      for whole in (True, False))
        return parts[0], parts[1]

